"""The local backend with a sharded learner (``Recipe.actor_num_gpus_per_node`` above 1): the
learner's ranks in processes of their own (``train.sharded_driver``), the engine in the run's
process over a copy of the policy, loaded with the ranks' gathered weights after each step and
checked against them.

The check matters because a stale engine fails silently: it samples, the loss goes down for a
while, and nothing says the samples came from old weights. After each sync a digest of a few of
the tensors sent is compared with the same tensors in the engine; a mismatch fails the run,
naming the version and the tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from palaestra.checkpoints import has_optimizer_state, is_adapter_checkpoint
from palaestra.models.loading import compute_dtype, load_causal_lm
from palaestra.train.sharded import RankParts
from palaestra.train.sharded_driver import ShardedLearner
from palaestra.train.state import Start

CHECKED_TENSORS = 3
"""Tensors of each sync whose digest is compared with the engine's: the first, the middle and
the last sent (embeddings, a block, the last layer's)."""


@dataclass
class ShardedBuild:
    """What each rank runs to build its part: the policy as the one-process learner loads it
    (LoRA adapters seeded alike in every rank) and, for a full fine-tune's KL term, a frozen
    copy of the model's own weights."""

    config: Any
    start: Start

    def __call__(self) -> RankParts:
        from palaestra.backends.building import load_trainable_policy, tokenizer_of

        config, recipe = self.config, self.config.recipe
        tokenizer = tokenizer_of(config, self.start)
        policy, _ = load_trainable_policy(config, self.start, "cpu")
        reference = None
        if recipe.kl_loss_coef > 0 and not recipe.lora_rank:
            model = config.model
            reference = load_causal_lm(
                model.weights_path(), torch.float32, "cpu", model.revision, model.trust_remote_code
            )
        return RankParts(policy, reference, tokenizer)


def make_sharded_learner(config, start: Start) -> ShardedLearner:
    """The run's learner over ``recipe.learner_ranks`` processes, its optimiser state loaded
    from the starting checkpoint when that state fits (as ``make_learner`` does)."""
    from palaestra.backends.building import without_reward  # the reward stays in this process

    recipe = config.recipe
    dtype = compute_dtype(recipe.precision, torch.device("cpu"))
    learner = ShardedLearner(ShardedBuild(without_reward(config), start), recipe, dtype)
    checkpoint = start.checkpoint
    # A LoRA run from a full checkpoint starts fresh adapters: that optimiser is not theirs.
    fits = not recipe.lora_rank or checkpoint is None or is_adapter_checkpoint(checkpoint)
    if checkpoint is not None and fits and has_optimizer_state(checkpoint):
        learner.load(checkpoint)
    return learner


def digest(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    data = tensor.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


class CheckedSampler:
    """``sampler`` whose engine is checked after each ``update_weights`` against what was
    sent: a mismatch is a RuntimeError naming the weight version and the tensor. Closing it
    stops ``learner``'s ranks too (the loop closes the sampler when the run ends)."""

    def __init__(self, sampler, engine, learner: ShardedLearner | None = None) -> None:
        self.sampler = sampler
        self.engine = engine
        self.learner = learner

    def sample(self, step: int, cursor: int):
        return self.sampler.sample(step, cursor)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.sampler.evaluate(step)

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            if self.learner is not None:
                self.learner.close()

    def update_weights(self, weights: Mapping[str, Any], version: int) -> None:
        self.sampler.update_weights(weights, version)
        check_engine_weights(self.engine, weights, version)


def check_engine_weights(engine, weights: Mapping[str, torch.Tensor], version: int) -> None:
    """RuntimeError unless the engine's module holds a few of ``weights`` bit for bit (in the
    engine's dtype)."""
    names = list(weights)
    if not names:
        return
    picks = sorted({0, len(names) // 2, len(names) - 1})[:CHECKED_TENSORS]
    held = dict(engine.model.named_parameters())
    for name in (names[i] for i in picks):
        mine = held[name]
        if digest(weights[name], mine.dtype) != digest(mine, mine.dtype):
            raise RuntimeError(
                f"weight sync to version {version}: the engine's {name} is not what the "
                "learner sent (the engine would sample from stale weights)"
            )
