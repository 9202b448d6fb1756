"""The learner on a tiny model: each algorithm moves the policy the way its math says."""

from __future__ import annotations

import pytest
import torch

from palaestra.algo.advantages import compute_advantages
from palaestra.recipes import Recipe
from palaestra.train.batch import build_train_batch
from palaestra.train.learner import Learner
from palaestra.train.reference import load_reference
from palaestra.train.scoring import score_logprobs
from palaestra.types import Sample
from tests.support.tiny_models import build_tiny_model, build_tokenizer

RESPONSES = ["abc", "xyz", "sun sun", "Qq"]
REWARDS = [0.0, 0.0, 1.0, 0.5]  # sample 2 is the best of the group


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def group(tokenizer, responses=RESPONSES, finish="stop"):
    prompt_ids = tokenizer("Say sun").input_ids
    return [
        Sample(
            prompt="Say sun",
            response=text,
            label=None,
            metadata={},
            index=0,
            group_index=g,
            prompt_token_ids=prompt_ids,
            response_token_ids=tokenizer(text).input_ids + [tokenizer.eos_token_id],
            finish_reason=finish,
        )
        for g, text in enumerate(responses)
    ]


def batch_of(samples, recipe, rewards=REWARDS):
    rewards_P_G = torch.tensor([rewards])
    advantages_B = compute_advantages(
        rewards_P_G, recipe.advantage_estimator, recipe.scale_rewards
    ).view(-1)
    return build_train_batch(samples, advantages_B, 0, recipe.mask_truncated_responses)


def sequence_logprobs(model, batch, recipe):
    return (score_logprobs(model, batch, recipe) * batch.mask_B_T).sum(dim=1)


@pytest.mark.parametrize(
    "estimator, loss_type",
    [
        ("grpo", "dapo"),
        ("grpo", "grpo"),
        ("grpo", "bnpo"),
        ("grpo", "dr_grpo"),
        ("grpo", "cispo"),
        ("rloo", "dapo"),
        ("reinforce_plus_plus", "dapo"),
        ("reinforce_plus_plus_baseline", "dapo"),
        ("gspo", "grpo"),
    ],
)
def test_one_step_raises_the_best_samples_logprob(tokenizer, estimator, loss_type):
    recipe = Recipe(
        lr=1e-3, n_samples_per_prompt=4, advantage_estimator=estimator, loss_type=loss_type
    )
    model = build_tiny_model(tokenizer)
    batch = batch_of(group(tokenizer), recipe)
    before_B = sequence_logprobs(model, batch, recipe)
    metrics = Learner(model, recipe).update(batch)
    after_B = sequence_logprobs(model, batch, recipe)
    assert after_B[2] > before_B[2], (before_B, after_B)
    # The zero-reward samples (negative advantage) lose probability.
    assert after_B[0] < before_B[0] and after_B[1] < before_B[1]
    assert metrics["updates"] == 1 and metrics["grad_norm"] > 0


def test_several_updates_per_rollout_score_old_logprobs_once(tokenizer):
    recipe = Recipe(lr=5e-2, n_samples_per_prompt=4, num_steps_per_rollout=2, eps_clip=0.01)
    model = build_tiny_model(tokenizer)
    metrics = Learner(model, recipe).update(batch_of(group(tokenizer), recipe))
    assert metrics["updates"] == 2
    # Update 1 is on-policy (ratio 1, nothing clipped); update 2 follows a large step, so its
    # ratios against the log-probs scored before update 1 leave the 0.99 .. 1.01 range.
    assert metrics["clip_fraction"] > 0


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_sampler_logprobs_are_the_old_logprobs(tokenizer, precision):
    # The sampler's log-probs are 0.1 below the trainer's on every token, so the ratio is
    # e^0.1 = 1.105 everywhere. With eps 0.05 the clip binds on tokens whose advantage is
    # positive (samples 2 and 3: rewards 1 and 0.5 over a mean of 0.375), and only there.
    recipe = Recipe(lr=1e-3, n_samples_per_prompt=4, eps_clip=0.05, precision=precision)
    model = build_tiny_model(tokenizer)
    samples = group(tokenizer)
    true_B_T = score_logprobs(model, batch_of(samples, recipe), recipe)
    for b, sample in enumerate(samples):
        start = len(sample.prompt_token_ids) - 1
        n = len(sample.response_token_ids)
        sample.response_logprobs = (true_B_T[b, start : start + n] - 0.1).tolist()
    metrics = Learner(model, recipe).update(batch_of(samples, recipe))
    assert metrics["sampler_logprob_abs_diff"] == pytest.approx(0.1, abs=1e-5)
    lengths = [len(s.response_token_ids) for s in samples]
    assert metrics["clip_fraction"] == pytest.approx((lengths[2] + lengths[3]) / sum(lengths))


def test_truncated_responses_can_be_left_out_of_the_loss(tokenizer):
    samples = group(tokenizer)
    samples[1].finish_reason = "length"
    recipe = Recipe(n_samples_per_prompt=4, mask_truncated_responses=True)
    batch = batch_of(samples, recipe)
    assert batch.mask_B_T[1].sum() == 0
    assert all(batch.mask_B_T[b].sum() == len(samples[b].response_token_ids) for b in (0, 2, 3))
    kept = batch_of(samples, Recipe(n_samples_per_prompt=4))
    assert kept.mask_B_T[1].sum() == len(samples[1].response_token_ids)


def test_entropy_bonus_alone_raises_entropy(tokenizer):
    # Equal rewards: every advantage is 0, so the entropy term is the only gradient.
    recipe = Recipe(lr=1e-2, n_samples_per_prompt=4, entropy_coef=1.0)
    model = build_tiny_model(tokenizer)
    batch = batch_of(group(tokenizer), recipe, rewards=[1.0] * 4)
    learner = Learner(model, recipe)
    first = learner.update(batch)["entropy"]
    second = learner.update(batch)["entropy"]
    assert second > first


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_kl_pulls_back_towards_the_reference(tokenizer, precision):
    # Equal rewards (no policy gradient) on a policy moved away from its reference: the KL
    # term alone must shrink the KL.
    recipe = Recipe(
        lr=1e-3, n_samples_per_prompt=4, kl_loss_coef=1.0, kl_loss_type="k3", precision=precision
    )
    reference_model = build_tiny_model(tokenizer)
    policy = build_tiny_model(tokenizer, seed=1)

    def reference(batch):
        return score_logprobs(reference_model, batch, recipe)

    learner = Learner(policy, recipe, reference)
    batch = batch_of(group(tokenizer), recipe, rewards=[1.0] * 4)
    kl = [learner.update(batch)["kl"] for _ in range(3)]
    assert kl[0] > 1e-3 and kl[2] < kl[1] < kl[0]


def test_no_reference_without_a_kl_coefficient(tokenizer):
    # Coefficient 0: nothing is loaded (the weights path does not even exist).
    model = build_tiny_model(tokenizer)
    assert load_reference(Recipe(), model, "/nonexistent", None) is None
