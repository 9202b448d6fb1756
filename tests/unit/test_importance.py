"""Importance correction (TIS, MIS): the weights by hand, and what they do to an update."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from palaestra.algo.advantages import compute_advantages
from palaestra.algo.importance import (
    importance_ratio,
    importance_weights,
    masked_weights,
    ratio_metrics,
    truncated_weights,
)
from palaestra.recipes import Recipe
from palaestra.train.batch import build_train_batch
from palaestra.train.learner import Learner
from palaestra.train.scoring import score_logprobs
from palaestra.types import Sample
from tests.support.tiny_models import build_tiny_model, build_tokenizer

LOG = math.log


def test_token_ratio_is_old_over_sampler_and_one_off_the_mask():
    old = torch.tensor([[LOG(0.5), LOG(0.2), LOG(0.9)]])
    sampler = torch.tensor([[LOG(0.25), LOG(0.4), LOG(0.1)]])
    mask = torch.tensor([[1, 1, 0]])
    ratio = importance_ratio(old, sampler, mask)
    # 0.5 / 0.25 = 2; 0.2 / 0.4 = 0.5; the third token is off the mask: 1.
    assert ratio[0].tolist() == pytest.approx([2.0, 0.5, 1.0])


def test_sequence_ratio_is_the_geometric_mean_of_its_tokens():
    old = torch.tensor([[LOG(2.0), LOG(0.5), 0.0], [LOG(4.0), 0.0, 0.0]])
    sampler = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ratio = importance_ratio(old, sampler, mask, level="sequence")
    # Row 0: exp((log 2 + log 0.5) / 2) = 1 on its two tokens, 1 off the mask.
    # Row 1: exp((log 4 + 0 + 0) / 3) = 4 ** (1/3) = 1.5874 on all three.
    assert ratio[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert ratio[1].tolist() == pytest.approx([1.5874] * 3, abs=1e-4)


def test_truncated_weights_cap_the_ratio():
    ratio = torch.tensor([[2.0, 0.5, 1.2]])
    weight, capped = truncated_weights(ratio, cap=1.5)
    # min(2, 1.5) = 1.5 (capped); 0.5 and 1.2 stay as they are: TIS has no floor.
    assert weight[0].tolist() == pytest.approx([1.5, 0.5, 1.2])
    assert capped.tolist() == [[1.0, 0.0, 0.0]]


def test_masked_weights_keep_the_band_only():
    ratio = torch.tensor([[2.0, 0.5, 1.2, 0.7, 1.5]])
    keep, masked = masked_weights(ratio, cap=1.5)
    # Band [1/1.5, 1.5] = [0.667, 1.5]: 2 and 0.5 fall outside; 1.2, 0.7 and 1.5 (edge) stay.
    assert keep.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]
    assert masked.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]


def test_metrics_spread_and_share_over_masked_tokens():
    old = torch.tensor([[LOG(3.0), 0.0, LOG(0.5), LOG(9.0)]])
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = importance_weights(old, sampler, mask, "tis", cap=2.0)
    assert weights.weight_B_T[0].tolist() == pytest.approx([2.0, 1.0, 0.5, 1.0])
    metrics = ratio_metrics(weights, mask, "tis")
    # Ratios on the mask: 3, 1, 0.5 -> mean 1.5, min 0.5, max 3; one of three capped.
    assert metrics == pytest.approx(
        {
            "importance_ratio_mean": 1.5,
            "importance_ratio_min": 0.5,
            "importance_ratio_max": 3.0,
            "importance_capped_fraction": 1 / 3,
        }
    )
    masked = ratio_metrics(importance_weights(old, sampler, mask, "mis", 2.0), mask, "mis")
    # Band [0.5, 2]: 3 is out, 1 and 0.5 in -> one of three masked.
    assert masked["importance_masked_fraction"] == pytest.approx(1 / 3)


def test_cap_at_or_below_one_is_refused():
    with pytest.raises(ValueError, match="tis_cap"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "tis", 1.0)


# -- In the learner.

RESPONSES = ["abc", "xyz", "sun sun", "Qq"]
REWARDS = [0.0, 0.0, 1.0, 0.5]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def scored_batch(tokenizer, model, recipe, shift_B=(0.0, 0.0, 0.0, 0.0)):
    """The group's batch with sampler log-probs: the model's own, minus ``shift_B[b]`` per
    token of sample b (so the ratio pi_old / pi_sampler is exp(shift) on its tokens)."""
    prompt_ids = tokenizer("Say sun").input_ids
    samples = [
        Sample(
            prompt="Say sun",
            response=text,
            label=None,
            metadata={},
            index=0,
            group_index=g,
            prompt_token_ids=prompt_ids,
            response_token_ids=tokenizer(text).input_ids + [tokenizer.eos_token_id],
        )
        for g, text in enumerate(RESPONSES)
    ]
    advantages_B = compute_advantages(torch.tensor([REWARDS]), "grpo", "group").view(-1)
    batch = build_train_batch(samples, advantages_B, 0)
    own_B_T = score_logprobs(model, batch, recipe)
    shifted_B_T = own_B_T - torch.tensor(shift_B).unsqueeze(-1) * batch.mask_B_T
    return dataclasses.replace(batch, sampler_logprobs_B_T=shifted_B_T)


def test_tis_on_policy_changes_nothing(tokenizer):
    """Sampler log-probs equal to the learner's: every ratio is 1, none capped, and the update
    is the uncorrected one."""
    plain = Recipe(lr=1e-3, n_samples_per_prompt=4, precision="float32")
    tis = plain.model_copy(update={"off_policy_correction": "tis"})
    model_a = build_tiny_model(tokenizer)
    model_b = copy.deepcopy(model_a)
    batch = scored_batch(tokenizer, model_a, plain)
    Learner(model_a, plain).update(batch)
    metrics = Learner(model_b, tis).update(batch)
    assert metrics["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["importance_capped_fraction"] == 0.0
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_mis_masks_every_token_out_of_band_and_leaves_the_weights(tokenizer):
    """Every sample's ratio is e^1 = 2.72, outside [1/2, 2]: all tokens masked, no gradient,
    the weights stay (AdamW with zero gradients and no weight decay moves nothing)."""
    recipe = Recipe(
        lr=1e-3, n_samples_per_prompt=4, precision="float32", off_policy_correction="mis"
    )
    model = build_tiny_model(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    batch = scored_batch(tokenizer, model, recipe, shift_B=(1.0, 1.0, 1.0, 1.0))
    metrics = Learner(model, recipe).update(batch)
    assert metrics["importance_masked_fraction"] == 1.0
    assert metrics["importance_ratio_min"] == pytest.approx(math.e, rel=1e-4)
    for b, a in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_tis_caps_one_sample_and_counts_its_share(tokenizer):
    recipe = Recipe(
        lr=1e-3, n_samples_per_prompt=4, precision="float32", off_policy_correction="tis"
    )
    model = build_tiny_model(tokenizer)
    batch = scored_batch(tokenizer, model, recipe, shift_B=(0.0, 0.0, 2.0, 0.0))
    metrics = Learner(model, recipe).update(batch)
    tokens_B = batch.mask_B_T.sum(-1)
    # Sample 2's ratio is e^2 = 7.39 > cap 2 on each of its tokens; the rest are 1.
    assert metrics["importance_capped_fraction"] == pytest.approx(
        float(tokens_B[2] / tokens_B.sum())
    )
    assert metrics["importance_ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-4)
    assert metrics["importance_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert "sampler_logprob_abs_diff" in metrics


def test_correction_without_sampler_logprobs_names_the_field(tokenizer):
    recipe = Recipe(
        lr=1e-3, n_samples_per_prompt=4, precision="float32", off_policy_correction="tis"
    )
    model = build_tiny_model(tokenizer)
    batch = dataclasses.replace(scored_batch(tokenizer, model, recipe), sampler_logprobs_B_T=None)
    with pytest.raises(ValueError, match="off_policy_correction='tis' needs the sampler's"):
        Learner(model, recipe).update(batch)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_pi_old_from_the_updates_own_pass_equals_a_pass_before_it(tokenizer, correction):
    """With one optimiser step, the learner takes pi_old from the update's own forward pass
    (no second pass): over micro-batches of one sample, the same weights and the same ratio
    figures as scoring pi_old first."""
    recipe = Recipe(
        lr=1e-3,
        n_samples_per_prompt=4,
        precision="float32",
        off_policy_correction=correction,
        train_micro_batch_size=1,
    )
    model_a = build_tiny_model(tokenizer)
    model_b = copy.deepcopy(model_a)
    # Ratios e^0.3, 1, e^-0.9 = 0.41 (below MIS's band [1/2, 2]), e^1 = 2.72 (TIS caps it,
    # MIS masks it).
    batch = scored_batch(tokenizer, model_a, recipe, shift_B=(0.3, 0.0, -0.9, 1.0))
    before = Learner(model_a, recipe)
    before.old_from_the_update = False
    scored_first = before.update(batch)
    calls = []
    in_update = Learner(model_b, recipe)
    in_update._policy_logprobs = lambda b: calls.append(b)  # must not be called
    in_pass = in_update.update(batch)
    assert calls == []
    tokens_B = batch.mask_B_T.sum(-1)
    out = "importance_capped_fraction" if correction == "tis" else "importance_masked_fraction"
    outside = [3] if correction == "tis" else [2, 3]
    assert in_pass[out] == pytest.approx(float(tokens_B[outside].sum() / tokens_B.sum()))
    assert in_pass["importance_ratio_max"] == pytest.approx(math.exp(1.0), rel=1e-4)
    assert in_pass["importance_ratio_min"] == pytest.approx(math.exp(-0.9), rel=1e-4)
    for key, value in scored_first.items():
        assert in_pass[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b)
