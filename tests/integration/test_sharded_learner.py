"""The sharded learner (2 CPU ranks over gloo, FSDP2) against the one-process learner: the same
loss at every step and the same weights after several, and a resume across rank counts."""

from __future__ import annotations

import functools

import pytest
import torch

from palaestra.recipes import Recipe
from palaestra.train.learner import Learner
from palaestra.train.lora import apply_lora
from palaestra.train.scoring import score_logprobs
from palaestra.train.sharded import RankParts
from palaestra.train.sharded_driver import ShardedLearner
from palaestra.types import Sample
from tests.support.tiny_models import build_tiny_model, build_tokenizer

PROMPTS = ["Say sun", "Name a sea"]
RESPONSES = [["abc", "xyz", "sun sun", "Qq"], ["blue", "red sea", "a", "Baltic"]]
REWARDS = [[0.0, 0.0, 1.0, 0.5], [1.0, 0.0, 0.25, 0.75]]


def recipe_of(lora: bool, kl: bool, **fields) -> Recipe:
    defaults = dict(
        precision="float32",  # the comparison is float32's, on every kind of CPU
        lr=1e-3,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        kl_loss_coef=0.1 if kl else 0.0,
        lora_rank=4 if lora else 0,
    )
    return Recipe(**(defaults | fields))


def policy_of(tokenizer, recipe: Recipe) -> torch.nn.Module:
    model = build_tiny_model(tokenizer)
    if recipe.lora_rank:
        torch.manual_seed(1)  # the adapters' initialisation, alike in every process
        model = apply_lora(model, recipe)
    return model


def build_parts(recipe: Recipe) -> RankParts:
    """What each rank builds: the same policy (and KL reference) as the one-process learner."""
    tokenizer = build_tokenizer()
    policy = policy_of(tokenizer, recipe)
    with_copy = recipe.kl_loss_coef > 0 and not recipe.lora_rank
    return RankParts(policy, build_tiny_model(tokenizer) if with_copy else None, tokenizer)


def one_process_learner(recipe: Recipe) -> Learner:
    tokenizer = build_tokenizer()
    policy = policy_of(tokenizer, recipe)
    reference = None
    if recipe.kl_loss_coef > 0 and recipe.lora_rank:

        def reference(batch):
            with policy.disable_adapter():
                return score_logprobs(policy, batch, recipe)

    elif recipe.kl_loss_coef > 0:
        frozen = build_tiny_model(tokenizer).requires_grad_(False)

        def reference(batch):
            return score_logprobs(frozen, batch, recipe)

    return Learner(policy, recipe, reference, tokenizer)


def step_samples(step: int) -> tuple[list[Sample], list[float]]:
    """Two groups of four answers, the second group's rewards shifting with the step."""
    tokenizer = build_tokenizer()
    samples, advantages = [], []
    for index, (prompt, responses) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        rewards = torch.tensor(REWARDS[index]) + (0.1 * step if index else 0.0)
        rewards[step % 4] += 1.0
        advantages += ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
        for g, text in enumerate(responses):
            samples.append(
                Sample(
                    prompt=prompt,
                    response=text,
                    label=None,
                    metadata={},
                    index=index,
                    group_index=g,
                    prompt_token_ids=tokenizer(prompt).input_ids,
                    response_token_ids=tokenizer(text).input_ids + [tokenizer.eos_token_id],
                    step=step,
                )
            )
    return samples, advantages


CASES = {
    # micro-batch sizes 2 and 3: 4 micro-batches (2 a rank), 3 (one rank pads a pass)
    "full": dict(lora=False, kl=False, train_micro_batch_size=2),
    "full-kl": dict(lora=False, kl=True, train_micro_batch_size=3, num_steps_per_rollout=2),
    "lora": dict(lora=True, kl=False, train_micro_batch_size=3),
    "lora-kl": dict(lora=True, kl=True, train_micro_batch_size=2),
    # recomputing each block's activations in the backward changes no number
    "full-recompute": dict(lora=False, kl=False, activation_checkpointing=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(case):
    recipe = recipe_of(**CASES[case], actor_num_gpus_per_node=2)
    single = one_process_learner(recipe)
    sharded = ShardedLearner(functools.partial(build_parts, recipe), recipe)
    try:
        for step in (1, 2, 3):
            samples, advantages = step_samples(step)
            expected = single.train_step(samples, advantages)
            got = sharded.train_step(samples, advantages)
            for key in ("loss", "entropy", "grad_norm", "kl", "clip_fraction"):
                if key in expected:
                    assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (
                        step,
                        key,
                    )
        weights = sharded.weights(everything=True)
    finally:
        sharded.close()
    own = dict(single.model.named_parameters())
    assert set(weights) == set(own)
    for name, tensor in weights.items():
        # float32 sums in another order: a few ulps of drift per step
        torch.testing.assert_close(tensor, own[name].detach(), rtol=1e-4, atol=1e-6, msg=name)


def parts_from(folder, recipe: Recipe) -> RankParts:
    """A rank's part continued from the checkpoint ``folder``."""
    from transformers import AutoModelForCausalLM

    return RankParts(AutoModelForCausalLM.from_pretrained(folder), None, build_tokenizer())


def learner_on(ranks: int, recipe: Recipe, build) -> Learner | ShardedLearner:
    """The one-process learner, or the sharded one over ``ranks`` ranks, from ``build``."""
    if ranks == 1:
        return Learner(build().policy, recipe)
    return ShardedLearner(build, recipe.model_copy(update={"actor_num_gpus_per_node": ranks}))


def weights_of(learner) -> dict[str, torch.Tensor]:
    if isinstance(learner, ShardedLearner):
        return learner.weights(everything=True)
    return {name: p.detach().clone() for name, p in learner.model.named_parameters()}


@pytest.mark.parametrize("ranks_before, ranks_after", [(2, 1), (1, 2)])
def test_resume_with_another_rank_count(tmp_path, ranks_before, ranks_after):
    """Two steps on one rank count, a checkpoint, a third step on the other: the same loss
    and weights as the third step of the learner that saved it (Adam's moments carried)."""
    recipe = recipe_of(lora=False, kl=False, train_micro_batch_size=3)
    folder = tmp_path / "step_2"
    learners = []
    try:
        first = learner_on(ranks_before, recipe, functools.partial(build_parts, recipe))
        learners.append(first)
        for step in (1, 2):
            first.train_step(*step_samples(step))
        first.save(folder)
        expected = first.train_step(*step_samples(3))["loss"]
        expected_weights = weights_of(first)

        second = learner_on(ranks_after, recipe, functools.partial(parts_from, folder, recipe))
        learners.append(second)
        second.load(folder)
        got = second.train_step(*step_samples(3))["loss"]
        got_weights = weights_of(second)
    finally:
        for learner in learners:
            if isinstance(learner, ShardedLearner):
                learner.close()
    assert got == pytest.approx(expected, rel=1e-5)
    assert set(got_weights) == set(expected_weights)
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(got_weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_bfloat16_passes_stay_close_to_one_process():
    """With bfloat16 precision the ranks gather bfloat16 weights for the passes (FSDP2's
    mixed precision) where one process autocasts from float32: close, not equal."""
    recipe = recipe_of(lora=False, kl=False, train_micro_batch_size=3, precision="bfloat16")
    single = one_process_learner(recipe)
    sharded_recipe = recipe.model_copy(update={"actor_num_gpus_per_node": 2})
    build = functools.partial(build_parts, recipe)
    sharded = ShardedLearner(build, sharded_recipe, sync_dtype=torch.bfloat16)
    try:
        for step in (1, 2):
            samples, advantages = step_samples(step)
            expected, got = (
                single.train_step(samples, advantages),
                sharded.train_step(samples, advantages),
            )
            # bfloat16 keeps 8 bits of mantissa: a few parts in a thousand per product
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=5e-2)
            assert got["entropy"] == pytest.approx(expected["entropy"], rel=1e-2)
        weights = sharded.weights(everything=True)
    finally:
        sharded.close()
    # Sent in the engine's dtype: the float32 masters rounded to bfloat16 (atol: Adam moves a
    # weight by up to lr a step either way where bfloat16 flips a tiny gradient's sign).
    own = dict(single.model.named_parameters())
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor.float(), own[name].detach(), rtol=2e-2, atol=5e-3)


@pytest.mark.parametrize("found", ["before the call", "after its peer failed"])
def test_a_killed_rank_fails_the_call_naming_it(found, monkeypatch):
    """A rank that dies fails the learner's next call with the rank and its pid, and the other
    rank is stopped rather than left waiting in a collective. Where the survivor's collective
    failed first ("connection reset"), the driver still names the rank that died."""
    import os
    import signal

    from palaestra.train import sharded_driver
    from palaestra.train.sharded_driver import LearnerRankError

    monkeypatch.setattr(sharded_driver, "DEATH_GRACE_S", 0.5)
    recipe = recipe_of(lora=False, kl=False, actor_num_gpus_per_node=2)
    sharded = ShardedLearner(functools.partial(build_parts, recipe), recipe)
    victim, survivor = sharded.processes[1], sharded.processes[0]
    try:
        if found == "after its peer failed":
            assert sharded._name_the_dead([0, 1]) is None  # both alive: the grace runs out
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        with pytest.raises(LearnerRankError, match=rf"learner rank 1 \(pid {victim.pid}\) died"):
            if found == "before the call":
                sharded.train_step(*step_samples(1))
            else:
                sharded._name_the_dead([0, 1])
        assert not survivor.is_alive()
    finally:
        sharded.close()
