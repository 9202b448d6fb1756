"""Losses over token log-probs: policy objectives, KL estimators, and how tokens are averaged.

Each objective returns a per-token loss ``loss_B_T``; ``aggregate`` turns it into a scalar by
``Recipe.loss_type``. Aggregation is split from the objective so the same KL and entropy terms
add to any of them, and so a micro-batch's share of the step's loss is exact (``LossScale``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sft_loss"]
KLType = Literal["k1", "k2", "k3"]


def token_logprobs(logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target token: ``logits[target] - logsumexp(logits)``.

    Gathering one logit and subtracting the log-normaliser avoids keeping a second
    vocabulary-sized tensor (the full log-softmax) alive for the backward pass.
    """
    logits_B_T_V = logits_B_T_V.float()
    picked_B_T = logits_B_T_V.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    return picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution, in nats."""
    logits_B_T_V = logits_B_T_V.float()
    log_z_B_T = torch.logsumexp(logits_B_T_V, dim=-1)
    probs_B_T_V = torch.softmax(logits_B_T_V, dim=-1)
    return log_z_B_T - (probs_B_T_V * logits_B_T_V).sum(dim=-1)


def ppo_clip_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``
    with ``r = exp(logprob - old_logprob)``.

    Returns ``loss_B_T`` and ``clipped_B_T``, 1 where clipping removed the token's gradient.
    """
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    return _clipped_surrogate(ratio_B_T, advantages_B.unsqueeze(-1), eps_low, eps_high)


def gspo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped surrogate with one importance ratio per sequence, the geometric mean
    of its token ratios ``s = exp(mean_t(logprob - old_logprob))``, broadcast over its tokens.

    Clipping a whole sequence at once keeps one off-policy token from being clipped alone while
    its neighbours still push; the GSPO paper uses far smaller ranges (3e-4 / 4e-4) than PPO.
    """
    mask_B_T = mask_B_T.to(logprobs_B_T.dtype)
    log_ratio_B = ((logprobs_B_T - old_logprobs_B_T) * mask_B_T).sum(-1) / mask_B_T.sum(-1).clamp(
        min=1
    )
    ratio_B_1 = torch.exp(log_ratio_B).unsqueeze(-1)
    loss_B_1, clipped_B_1 = _clipped_surrogate(
        ratio_B_1, advantages_B.unsqueeze(-1), eps_low, eps_high
    )
    return loss_B_1.expand_as(logprobs_B_T), clipped_B_1.expand_as(logprobs_B_T)


def cispo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): ``-sg(min(r, 1 + eps_high)) * A * logprob``.

    The importance weight is capped and detached, so no token loses its gradient to clipping
    (PPO drops the gradient of clipped tokens); the cap only bounds how much one token weighs.
    There is no floor, as in the paper. TRL's ``epsilon_high`` for cispo is the cap itself;
    here the cap is ``1 + eps_high``, consistent with the clip range elsewhere.

    Returns ``loss_B_T`` and ``clipped_B_T``, 1 where the cap bound the weight.
    """
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T).detach()
    weight_B_T = torch.clamp(ratio_B_T, max=1 + eps_high)
    loss_B_T = -weight_B_T * advantages_B.unsqueeze(-1) * logprobs_B_T
    return loss_B_T, (ratio_B_T > 1 + eps_high).to(logprobs_B_T.dtype)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    # Clipping is active (the gradient is zero) where the clipped term is the minimum.
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).to(ratio.dtype).detach()


def kl_penalty(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor, kind: KLType):
    """Per-token estimate of KL(policy || reference) from the sampled token, after Schulman's
    "Approximating KL divergence": with ``d = logprob - ref_logprob``,

    k1 = d (unbiased, high variance, can be negative); k2 = d^2 / 2 (biased, low variance);
    k3 = exp(-d) - 1 + d (unbiased, low variance, never negative: GRPO's and TRL's choice).
    """
    d_B_T = logprobs_B_T - ref_logprobs_B_T
    if kind == "k1":
        return d_B_T
    if kind == "k2":
        return 0.5 * d_B_T.square()
    if kind == "k3":
        return torch.exp(-d_B_T) - 1 + d_B_T
    raise ValueError(f"kl_loss_type must be k1, k2 or k3, got {kind!r}")


@dataclass(frozen=True)
class LossScale:
    """Counts over one optimiser step's batch that give a micro-batch its exact share of the
    step's loss: summing ``aggregate`` over the micro-batches gives the loss of the whole."""

    num_tokens: float
    """Masked (response) tokens of the step's batch: dapo, cispo and sft_loss divide by it."""
    num_sequences: int
    """Sequences of the step's batch: grpo and dr_grpo divide by it."""
    num_micro_batches: int
    """bnpo averages the micro-batches' own token means, as TRL does over accumulation steps."""
    max_response_len: int
    """dr_grpo's constant per-sequence length (``rollout_max_response_len``)."""


def aggregate(
    loss_B_T: torch.Tensor, mask_B_T: torch.Tensor, loss_type: LossType, scale: LossScale
) -> torch.Tensor:
    """One micro-batch's share of the step's loss, by ``loss_type``:

    grpo:    each sequence's token mean, averaged over sequences (long answers weigh less)
    bnpo:    token mean over the micro-batch, averaged over micro-batches
    dr_grpo: token sum over (sequences x max_response_len), a constant normaliser
    dapo, cispo, sft_loss: token sum over the step's token count (every token weighs the same)
    """
    mask_B_T = mask_B_T.to(loss_B_T.dtype)
    masked_B_T = loss_B_T * mask_B_T
    if loss_type == "grpo":
        per_sequence_B = masked_B_T.sum(-1) / mask_B_T.sum(-1).clamp(min=1)
        return per_sequence_B.sum() / scale.num_sequences
    if loss_type == "bnpo":
        return masked_B_T.sum() / mask_B_T.sum().clamp(min=1) / scale.num_micro_batches
    if loss_type == "dr_grpo":
        return masked_B_T.sum() / (scale.num_sequences * scale.max_response_len)
    if loss_type in ("dapo", "cispo", "sft_loss"):
        return masked_B_T.sum() / max(scale.num_tokens, 1)
    raise ValueError(f"unknown loss_type {loss_type!r}")
