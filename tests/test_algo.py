"""The GRPO math, checked against values worked out by hand in the comments."""

import math

import pytest
import torch

from palaestra.algo.advantages import group_normalized_advantages
from palaestra.algo.losses import clipped_policy_loss, token_entropy, token_logprobs


def test_group_advantages_by_hand():
    rewards_P_G = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, 4.0, 4.0]])
    advantages = group_normalized_advantages(rewards_P_G, eps=1e-4)
    # Group 0: mean 2; Bessel std = sqrt((1 + 0 + 1) / 2) = 1 -> (-1, 0, 1) / 1.0001.
    assert advantages[0].tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001], abs=1e-6)
    # Group 1: equal rewards -> std 0 -> exactly zero advantage, not 0/0.
    assert advantages[1].tolist() == [0.0, 0.0, 0.0]
    # Group 2: mean 8/3; deviations (-8/3, 4/3, 4/3); Bessel var = (64/9 + 16/9 + 16/9) / 2
    # = 48/9 -> std = 2.3094; advantages = (-1.1547, 0.5774, 0.5774) (over std + 1e-4).
    assert advantages[2].tolist() == pytest.approx([-1.154650, 0.577325, 0.577325], abs=1e-5)


def test_group_of_one_has_no_baseline():
    assert group_normalized_advantages(torch.tensor([[3.0], [-1.0]])).tolist() == [[0.0], [0.0]]


def test_advantages_reject_flat_input():
    with pytest.raises(ValueError, match="2-D"):
        group_normalized_advantages(torch.tensor([1.0, 2.0]))


def test_token_logprobs_by_hand():
    # Logits (0, ln 3): softmax = (1/4, 3/4).
    logits_B_T_V = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    targets_B_T = torch.tensor([[1, 0]])
    logprobs = token_logprobs(logits_B_T_V, targets_B_T)
    assert logprobs[0].tolist() == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)
    # It equals the plain log-softmax route.
    reference = (
        torch.log_softmax(logits_B_T_V, -1).gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    )
    assert torch.allclose(logprobs, reference)


def test_token_entropy_by_hand():
    # Uniform over 4 tokens: ln 4. Distribution (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    assert token_entropy(logits)[0].tolist() == pytest.approx([math.log(4), 0.562335], abs=1e-5)


def test_on_policy_loss_is_minus_mean_advantage_over_tokens():
    # Ratio 1 everywhere. Sequence 0 (A = 2) has 2 response tokens, sequence 1 (A = -1) has 1.
    # Per token -A: -2, -2, +1 -> sum -3 over 3 tokens = -1.
    logprobs = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, clipped = clipped_policy_loss(
        logprobs, logprobs, torch.tensor([2.0, -1.0]), mask, 0.2, 0.2, num_tokens=3
    )
    assert loss.item() == pytest.approx(-1.0)
    assert clipped.item() == 0


def test_clipping_by_hand():
    # Four tokens, ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065, eps 0.2 (range 0.8 .. 1.2):
    #   r=1.6487, A=+1: min(1.6487, 1.2)   = 1.2     -> loss -1.2,    clipped
    #   r=0.6065, A=+1: min(0.6065, 0.8)   = 0.6065  -> loss -0.6065, not clipped
    #   r=0.6065, A=-1: min(-0.6065, -0.8) = -0.8    -> loss +0.8,    clipped
    #   r=1.6487, A=-1: min(-1.6487, -1.2) = -1.6487 -> loss +1.6487, not clipped
    # Sum = -1.2 - 0.6065 + 0.8 + 1.6487 = 0.6422, over 4 tokens = 0.16055.
    old = torch.zeros(4, 1)
    new = torch.tensor([[0.5], [-0.5], [-0.5], [0.5]], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_policy_loss(new, old, advantages, torch.ones(4, 1), 0.2, 0.2, 4)
    assert loss.item() == pytest.approx(0.160549, abs=1e-5)
    assert clipped.item() == 2
    loss.backward()
    # Clipped tokens get no gradient; the others get -A * r / 4.
    assert new.grad[:, 0].tolist() == pytest.approx(
        [0.0, -math.exp(-0.5) / 4, 0.0, math.exp(0.5) / 4], abs=1e-6
    )


def test_clip_higher_raises_the_ceiling_only():
    # r = 1.6487, A = +1 with eps_high 0.28: min(1.6487, 1.28) = 1.28 -> loss -1.28.
    # r = 0.6065, A = -1 keeps the low floor 0.8: loss +0.8.
    old = torch.zeros(2, 1)
    new = torch.tensor([[0.5], [-0.5]])
    loss, _ = clipped_policy_loss(
        new, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), 0.2, 0.28, 2
    )
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2, abs=1e-6)


def test_masked_tokens_do_not_count():
    logprobs = torch.zeros(1, 3)
    loss, _ = clipped_policy_loss(
        logprobs, logprobs, torch.tensor([1.0]), torch.tensor([[0.0, 1.0, 0.0]]), 0.2, 0.2, 1
    )
    assert loss.item() == pytest.approx(-1.0)
