"""The RL math, checked against values worked out by hand in the comments."""

import math

import pytest
import torch

from palaestra.algo.advantages import (
    compute_advantages,
    group_normalized_advantages,
    informative_groups,
    rloo_advantages,
)
from palaestra.algo.losses import (
    LossScale,
    aggregate,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    token_entropy,
    token_logprobs,
)


def scale(num_tokens, num_sequences, num_micro_batches=1, max_response_len=5):
    return LossScale(num_tokens, num_sequences, num_micro_batches, max_response_len)


# --- advantages -------------------------------------------------------------------------------


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
    # The estimator's default is exactly this.
    assert torch.equal(compute_advantages(rewards_P_G), advantages)


def test_batch_scaled_advantages_by_hand():
    rewards_P_G = torch.tensor([[1.0, 2.0, 3.0], [0.0, 4.0, 4.0]])
    # Centred on each group's mean: (-1, 0, 1) and (-8/3, 4/3, 4/3). The std is of all six
    # rewards: mean 14/6 = 2.3333, squared deviations 1.7778 + 0.1111 + 0.4444 + 5.4444
    # + 2.7778 + 2.7778 = 13.3333, Bessel var 13.3333 / 5 = 2.6667, std 1.632993.
    # Divided by 1.633093: (-0.612335, 0, 0.612335), (-1.632893, 0.816447, 0.816447).
    advantages = compute_advantages(rewards_P_G, "grpo", scale_rewards="batch")
    assert advantages.view(-1).tolist() == pytest.approx(
        [-0.612335, 0.0, 0.612335, -1.632893, 0.816447, 0.816447], abs=1e-5
    )


def test_dr_grpo_advantages_are_only_centred():
    # scale_rewards="none": reward minus group mean, no division (Dr. GRPO).
    advantages = compute_advantages(
        torch.tensor([[1.0, 2.0, 3.0], [0.0, 4.0, 4.0]]), "grpo", "none"
    )
    assert advantages.view(-1).tolist() == pytest.approx([-1, 0, 1, -8 / 3, 4 / 3, 4 / 3])


def test_rloo_by_hand():
    # Leave-one-out means: (2 + 3) / 2 = 2.5, (1 + 3) / 2 = 2, (1 + 2) / 2 = 1.5;
    # advantages 1 - 2.5, 2 - 2, 3 - 1.5 = (-1.5, 0, 1.5) = 3/2 * (r - mean).
    rewards_P_G = torch.tensor([[1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
    assert rloo_advantages(rewards_P_G).tolist() == [[-1.5, 0.0, 1.5], [0.0, 0.0, 0.0]]
    assert torch.equal(compute_advantages(rewards_P_G, "rloo"), rloo_advantages(rewards_P_G))
    assert rloo_advantages(torch.tensor([[4.0]])).tolist() == [[0.0]]


def test_reinforce_plus_plus_whitens_over_the_step():
    # No group baseline: all four rewards (1, 2, 3, 6) have mean 3; squared deviations
    # 4 + 1 + 0 + 9 = 14, Bessel var 14 / 3, std 2.160247; divided by 2.160347:
    # (-0.925777, -0.462889, 0, 1.388666).
    advantages = compute_advantages(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), "reinforce_plus_plus")
    assert advantages.view(-1).tolist() == pytest.approx(
        [-0.925777, -0.462889, 0.0, 1.388666], abs=1e-5
    )


def test_reinforce_plus_plus_baseline_centres_groups_then_whitens():
    # Group means 2 and 4: centred (-1, 1, -2, 2), mean 0; Bessel var (1 + 1 + 4 + 4) / 3
    # = 10/3, std 1.825742; divided by 1.825842: (-0.547693, 0.547693, -1.095385, 1.095385).
    advantages = compute_advantages(
        torch.tensor([[1.0, 3.0], [2.0, 6.0]]), "reinforce_plus_plus_baseline"
    )
    assert advantages.view(-1).tolist() == pytest.approx(
        [-0.547693, 0.547693, -1.095385, 1.095385], abs=1e-5
    )


def test_gspo_uses_grpo_advantages():
    rewards_P_G = torch.tensor([[0.0, 1.0, 1.0, 3.0]])
    assert torch.equal(compute_advantages(rewards_P_G, "gspo"), compute_advantages(rewards_P_G))


def test_group_of_one_has_no_baseline():
    assert group_normalized_advantages(torch.tensor([[3.0], [-1.0]])).tolist() == [[0.0], [0.0]]


def test_advantages_reject_flat_input():
    with pytest.raises(ValueError, match="2-D"):
        group_normalized_advantages(torch.tensor([1.0, 2.0]))


def test_informative_groups_are_those_whose_rewards_differ():
    rewards_P_G = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    assert informative_groups(rewards_P_G).tolist() == [False, True, False]


# --- per-token quantities ---------------------------------------------------------------------


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


def test_kl_estimators_by_hand():
    # d = logprob - ref = +0.5 and -0.5.
    # k1 = d: 0.5, -0.5.  k2 = d^2 / 2: 0.125, 0.125.
    # k3 = exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.106531; e^0.5 - 1.5 = 0.148721.
    logprobs, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -0.5]])
    assert kl_penalty(logprobs, ref, "k1").tolist() == [[0.5, -0.5]]
    assert kl_penalty(logprobs, ref, "k2").tolist() == [[0.125, 0.125]]
    assert kl_penalty(logprobs, ref, "k3")[0].tolist() == pytest.approx(
        [0.106531, 0.148721], abs=1e-6
    )
    # Identical policies: every estimator is 0.
    for kind in ("k1", "k2", "k3"):
        assert kl_penalty(ref, ref, kind).abs().max() == 0


# --- objectives -------------------------------------------------------------------------------


def test_on_policy_loss_is_minus_mean_advantage_over_tokens():
    # Ratio 1 everywhere. Sequence 0 (A = 2) has 2 response tokens, sequence 1 (A = -1) has 1.
    # Per token -A: -2, -2, +1 -> sum -3 over 3 tokens = -1.
    logprobs = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss_B_T, clipped = ppo_clip_loss(logprobs, logprobs, torch.tensor([2.0, -1.0]), 0.2, 0.2)
    assert aggregate(loss_B_T, mask, "dapo", scale(3, 2)).item() == pytest.approx(-1.0)
    assert clipped.sum().item() == 0


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
    loss_B_T, clipped = ppo_clip_loss(new, old, advantages, 0.2, 0.2)
    loss = aggregate(loss_B_T, torch.ones(4, 1), "dapo", scale(4, 4))
    assert loss.item() == pytest.approx(0.160549, abs=1e-5)
    assert clipped[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    loss.backward()
    # Clipped tokens get no gradient; the others get -A * r / 4.
    assert new.grad[:, 0].tolist() == pytest.approx(
        [0.0, -math.exp(-0.5) / 4, 0.0, math.exp(0.5) / 4], abs=1e-6
    )


def test_clip_higher_raises_the_ceiling_only():
    # r = 1.6487, A = +1 with eps_high 0.28: min(1.6487, 1.28) = 1.28 -> loss -1.28.
    # r = 0.6065, A = -1 keeps the low floor 0.8: loss +0.8.
    loss_B_T, _ = ppo_clip_loss(
        torch.tensor([[0.5], [-0.5]]), torch.zeros(2, 1), torch.tensor([1.0, -1.0]), 0.2, 0.28
    )
    assert loss_B_T[:, 0].tolist() == pytest.approx([-1.28, 0.8], abs=1e-6)


def test_gspo_clips_whole_sequences_by_hand():
    # Sequence 0: token log-ratios (0.2, 0.4), mean 0.3, s = e^0.3 = 1.3499; A = +1:
    #   min(1.3499, 1.2) = 1.2 -> loss -1.2 on both tokens, both clipped, no gradient.
    # Sequence 1: log-ratios (-0.1, +0.1) and a masked third token (log-ratio 5, ignored):
    #   s = e^0 = 1, A = -1 -> loss +1 on each token, not clipped.
    new = torch.tensor([[0.2, 0.4, 0.0], [-0.1, 0.1, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss_B_T, clipped = gspo_loss(new, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.2, 0.2)
    assert (loss_B_T * mask).view(-1).tolist() == pytest.approx([-1.2, -1.2, 0, 1, 1, 0])
    assert (clipped * mask).view(-1).tolist() == [1, 1, 0, 0, 0, 0]
    # Sequence 1's token mean is -s * A; its gradient through s = exp(mean log-ratio) is
    # -A * s * 1/2 = 0.5 on each real token, 0 on the masked one; sequence 0 is clipped: 0.
    aggregate(loss_B_T, mask, "grpo", scale(4, 1)).backward()
    assert new.grad.view(-1).tolist() == pytest.approx([0, 0, 0, 0.5, 0.5, 0])


def test_cispo_keeps_the_gradient_of_capped_tokens():
    # old = 0; new = +0.5 (r = 1.6487) and -0.5 (r = 0.6065); A = +1; eps_high 0.2:
    #   weight min(1.6487, 1.2) = 1.2 (capped):   loss -1.2 * 0.5 = -0.6,      grad -1.2
    #   weight 0.6065 (no floor):               loss -0.6065 * -0.5 = 0.3033, grad -0.6065
    # PPO would give the first token no gradient at all.
    new = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    loss_B_T, capped = cispo_loss(new, torch.zeros(2, 1), torch.tensor([1.0, 1.0]), 0.2)
    assert loss_B_T[:, 0].tolist() == pytest.approx([-0.6, 0.303265], abs=1e-6)
    assert capped[:, 0].tolist() == [1.0, 0.0]
    loss_B_T.sum().backward()
    assert new.grad[:, 0].tolist() == pytest.approx([-1.2, -math.exp(-0.5)], abs=1e-6)


# --- aggregation ------------------------------------------------------------------------------

LOSS_B_T = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK_B_T = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 3 tokens, then 1 (9s are padding)


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", 3.0),  # token means 6/3 = 2 and 4/1 = 4; their mean 3
        ("bnpo", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("dr_grpo", 1.0),  # 10 / (2 sequences x max_response_len 5)
        ("dapo", 2.5),  # 10 / the step's 4 tokens
        ("cispo", 2.5),  # aggregated as dapo
        ("sft_loss", 2.5),  # token mean too
    ],
)
def test_aggregation_by_hand(loss_type, expected):
    assert aggregate(LOSS_B_T, MASK_B_T, loss_type, scale(4, 2)).item() == pytest.approx(expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_whole(loss_type):
    whole = aggregate(LOSS_B_T, MASK_B_T, loss_type, scale(4, 2))
    parts = sum(
        aggregate(LOSS_B_T[b : b + 1], MASK_B_T[b : b + 1], loss_type, scale(4, 2, 2))
        for b in range(2)
    )
    assert parts.item() == pytest.approx(whole.item())


def test_bnpo_averages_micro_batch_token_means():
    # Micro-batch 0: 6 / 3 = 2; micro-batch 1: 4 / 1 = 4; averaged: 3 (one batch: 2.5).
    parts = sum(
        aggregate(LOSS_B_T[b : b + 1], MASK_B_T[b : b + 1], "bnpo", scale(4, 2, 2))
        for b in range(2)
    )
    assert parts.item() == pytest.approx(3.0)


# --- cross-check against TRL's GRPOTrainer formulas -------------------------------------------


def trl_reference_loss(logp, old, ref, adv, mask, loss_type, eps_low, eps_high, beta, max_len):
    """TRL's ``GRPOTrainer._compute_loss`` re-derived (trl/trainer/grpo_trainer.py, one process,
    no gradient accumulation, token-level importance sampling):

        coef_1 = exp(logp - old);  coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -min(coef_1 * A, coef_2 * A)
        cispo:  per_token_loss = -clamp(coef_1, max=epsilon_high).detach() * A * logp
        per_token_kl = exp(ref - logp) - (ref - logp) - 1;  per_token_loss += beta * per_token_kl
        grpo:    ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        bnpo:    (per_token_loss * mask).sum() / mask.sum().clamp(min=1)
        dr_grpo: (per_token_loss * mask).sum() / (B * max_completion_length)
        dapo, cispo: (per_token_loss * mask).sum() / num_items_in_batch (the batch's tokens)

    TRL's cispo cap is ``epsilon_high`` itself; palaestra's is ``1 + eps_clip_high``.
    """
    coef_1 = torch.exp(logp - old)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=1 + eps_high).detach() * a * logp
    else:
        per_token = -torch.min(coef_1 * a, torch.clamp(coef_1, 1 - eps_low, 1 + eps_high) * a)
    per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_losses_and_gradients_match_trl(loss_type):
    generator = torch.Generator().manual_seed(0)
    B, T, max_len = 4, 6, 8
    logp = (-torch.rand(B, T, generator=generator) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=generator)  # ratios well past 1.2
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=generator)
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1] * 5 + [0]])
    mask = mask.float()
    eps_low, eps_high, beta = 0.2, 0.28, 0.04

    expected = trl_reference_loss(
        logp, old, ref, adv, mask, loss_type, eps_low, eps_high, beta, max_len
    )
    (expected_grad,) = torch.autograd.grad(expected, logp)

    if loss_type == "cispo":
        per_token, _ = cispo_loss(logp, old, adv, eps_high)
    else:
        per_token, _ = ppo_clip_loss(logp, old, adv, eps_low, eps_high)
    s = scale(float(mask.sum()), B, 1, max_len)
    ours = aggregate(per_token, mask, loss_type, s) + beta * aggregate(
        kl_penalty(logp, ref, "k3"), mask, loss_type, s
    )
    (grad,) = torch.autograd.grad(ours, logp)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    assert grad.abs().sum() > 0
