"""The local backend with a sharded learner (``Recipe.actor_num_gpus_per_node`` above 1): the
learner's ranks in processes of their own (``train.sharded_driver``), the engine in the run's
process over a copy of the policy, loaded with the ranks' gathered weights after each step and
attested against them (``engine.attest``; ``CheckedSampler``, which the one-process learner's
backend uses too wherever its engine samples from a copy).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from palaestra.checkpoints import has_optimizer_state, is_adapter_checkpoint
from palaestra.engine.attest import Attestation, attest_engine
from palaestra.models.loading import compute_dtype, load_causal_lm
from palaestra.train.sharded import RankParts
from palaestra.train.sharded_driver import ShardedLearner
from palaestra.train.state import Start


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


class CheckedSampler:
    """``sampler`` whose engine (in this process) is attested after each ``update_weights``
    against what was sent (``engine.attest``): a mismatch is a ``WeightSyncError`` naming the
    version and the tensors. Closing it stops ``learner``'s ranks too, if given (the loop closes
    the sampler when the run ends)."""

    def __init__(
        self,
        sampler,
        engine,
        learner: ShardedLearner | None = None,
        rest: bool = False,
        rest_weights: bool = False,
    ) -> None:
        self.sampler = sampler
        self.engine = engine
        self.learner = learner
        self.rest = rest
        """Whether the engine sleeps after each rollout (``TorchEngine.sleep``: its packed
        copy of the weights goes). In a synchronous run the learner's update comes next, then
        new weights, which the engine packs again anyway; meanwhile the copy (256 MiB for
        SmolLM2-135M in bfloat16) would sit beside the update's gradients and optimiser."""
        self.rest_weights = rest_weights
        """Whether its own copy of the policy goes too (``sleep(weights=True)``), for a
        learner that sends every parameter at each sync (``Learner.weights``): the copy
        (another 256 MiB there) is overwritten whole after the update anyway."""

    def sample(self, step: int, cursor: int):
        rollout = self.sampler.sample(step, cursor)
        if self.rest:
            self.engine.sleep(weights=self.rest_weights)
        return rollout

    def evaluate(self, step: int) -> dict[str, float]:
        return self.sampler.evaluate(step)

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            if self.learner is not None:
                self.learner.close()

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Attestation:
        self.sampler.update_weights(weights, version)
        started = time.monotonic()
        compared = attest_engine(self.engine, weights, version, f"the engine (pid {os.getpid()})")
        return Attestation(engines=int(compared > 0), seconds=time.monotonic() - started)
