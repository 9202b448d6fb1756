"""Policy-gradient losses over token log-probs, and the per-token statistics we log."""

from __future__ import annotations

import torch


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


def clipped_policy_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    eps_low: float,
    eps_high: float,
    num_tokens: int | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate with token-level aggregation.

    Per response token: ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` with
    ``r = exp(logprob - old_logprob)``. The loss is the sum over masked tokens divided by
    ``num_tokens``, the response-token count of the whole step, so micro-batches add up to the
    step's token mean and a long response weighs as many tokens as it has (DAPO's aggregation).

    Returns the loss and the count of masked tokens where clipping removed the gradient.
    """
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    advantages_B_1 = advantages_B.unsqueeze(-1)
    unclipped_B_T = ratio_B_T * advantages_B_1
    clipped_B_T = torch.clamp(ratio_B_T, 1 - eps_low, 1 + eps_high) * advantages_B_1
    per_token_B_T = -torch.minimum(unclipped_B_T, clipped_B_T)
    mask_B_T = mask_B_T.to(per_token_B_T.dtype)
    loss = (per_token_B_T * mask_B_T).sum() / num_tokens
    # Clipping is active (the token's gradient is zero) where the clipped term is the minimum.
    was_clipped_B_T = (clipped_B_T < unclipped_B_T).to(mask_B_T.dtype) * mask_B_T
    return loss, was_clipped_B_T.sum().detach()
