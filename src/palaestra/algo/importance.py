"""Importance correction for samples drawn by another policy than the one being updated.

When the sampler runs ahead of the learner (``Recipe.max_staleness``), or samples in another
precision, the sampler's log-probs ``log pi_sampler`` differ from the learner's own before the
update, ``log pi_old``. PPO's clipped ratio is then taken against ``pi_old`` (the proximal
policy, scored by the learner) and each token's loss is weighted by the detached ratio
``r = pi_old / pi_sampler``:

- TIS (truncated importance sampling): weight ``min(r, cap)``, so one unlikely token cannot
  dominate the step.
- MIS (masked importance sampling): weight 1 where ``1 / cap <= r <= cap``, else 0: tokens the
  two policies disagree on too much leave the loss instead of being down-weighted.

At ``level="sequence"`` a sequence's ratio is the geometric mean of its token ratios,
``exp(mean_t log r)``, broadcast over its tokens, so a whole sequence is capped or masked.
Pure tensor functions: no I/O, nothing learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Correction = Literal["none", "tis", "mis"]
Level = Literal["token", "sequence"]


@dataclass
class ImportanceWeights:
    """Per-token weights of the loss and what they did."""

    weight_B_T: torch.Tensor
    """Multiplies each token's loss; detached."""
    ratio_B_T: torch.Tensor
    """``pi_old / pi_sampler`` per token (per sequence, broadcast, at the sequence level)."""
    out_B_T: torch.Tensor
    """1 where the cap bound the weight (TIS) or the token was masked out (MIS)."""


def importance_ratio(
    old_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    level: Level = "token",
) -> torch.Tensor:
    """``exp(log pi_old - log pi_sampler)`` per token, detached; at ``level="sequence"`` the
    geometric mean over each sequence's masked tokens, broadcast over its tokens. Outside the
    mask the ratio is 1 (those tokens carry no loss)."""
    mask_B_T = mask_B_T.to(old_logprobs_B_T.dtype)
    log_ratio_B_T = (old_logprobs_B_T - sampler_logprobs_B_T).detach() * mask_B_T
    if level == "sequence":
        mean_B = log_ratio_B_T.sum(-1) / mask_B_T.sum(-1).clamp(min=1)
        log_ratio_B_T = mean_B.unsqueeze(-1).expand_as(log_ratio_B_T) * mask_B_T
    elif level != "token":
        raise ValueError(f"importance_level must be 'token' or 'sequence', got {level!r}")
    return torch.exp(log_ratio_B_T)


def truncated_weights(ratio_B_T: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: ``min(ratio, cap)`` and 1 where the cap bound it."""
    return ratio_B_T.clamp(max=cap), (ratio_B_T > cap).to(ratio_B_T.dtype)


def masked_weights(ratio_B_T: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: 1 where ``1 / cap <= ratio <= cap``, else 0; and 1 where a token was masked out."""
    inside_B_T = (ratio_B_T >= 1 / cap) & (ratio_B_T <= cap)
    keep_B_T = inside_B_T.to(ratio_B_T.dtype)
    return keep_B_T, 1 - keep_B_T


def importance_weights(
    old_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    correction: Correction,
    cap: float,
    level: Level = "token",
) -> ImportanceWeights:
    """The loss weights of ``correction`` (``"tis"`` or ``"mis"``) with ``cap`` (> 1)."""
    if cap <= 1:
        raise ValueError(f"tis_cap must be above 1, got {cap}")
    ratio_B_T = importance_ratio(old_logprobs_B_T, sampler_logprobs_B_T, mask_B_T, level)
    if correction == "tis":
        weight_B_T, out_B_T = truncated_weights(ratio_B_T, cap)
    elif correction == "mis":
        weight_B_T, out_B_T = masked_weights(ratio_B_T, cap)
    else:
        raise ValueError(f"off_policy_correction must be 'tis' or 'mis' here, got {correction!r}")
    return ImportanceWeights(weight_B_T, ratio_B_T, out_B_T * mask_B_T.to(out_B_T.dtype))


def ratio_sums(weights: ImportanceWeights, mask_B_T: torch.Tensor) -> dict[str, float]:
    """The ratio over the masked tokens as sums that add up across micro-batches
    (``add_ratio_sums``): its sum, token count, least and greatest, and how many tokens were
    capped or masked. Empty where no token is masked in."""
    selected = mask_B_T > 0
    ratios = weights.ratio_B_T[selected]
    if ratios.numel() == 0:
        return {}
    return {
        "ratio_sum": float(ratios.sum()),
        "ratio_tokens": float(ratios.numel()),
        "ratio_out": float(weights.out_B_T[selected].sum()),
        "ratio_min": float(ratios.min()),
        "ratio_max": float(ratios.max()),
    }


def add_ratio_sums(total: dict[str, float], part: dict[str, float]) -> None:
    """``part``'s ratio sums added into ``total`` (least and greatest combined)."""
    for key, value in part.items():
        if key not in total:
            total[key] = value
        elif key == "ratio_min":
            total[key] = min(total[key], value)
        elif key == "ratio_max":
            total[key] = max(total[key], value)
        else:
            total[key] += value


def ratio_metrics_of(sums: dict[str, float], correction: str) -> dict[str, float]:
    """The ratio's spread and the share of tokens capped or masked, from ``ratio_sums``:
    ``importance_ratio_mean/min/max`` and ``importance_capped_fraction`` (TIS) or
    ``importance_masked_fraction`` (MIS); empty without tokens."""
    if not sums.get("ratio_tokens"):
        return {}
    count = sums["ratio_tokens"]
    name = "importance_capped_fraction" if correction == "tis" else "importance_masked_fraction"
    return {
        "importance_ratio_mean": sums["ratio_sum"] / count,
        "importance_ratio_min": sums["ratio_min"],
        "importance_ratio_max": sums["ratio_max"],
        name: sums["ratio_out"] / count,
    }


def ratio_metrics(weights: ImportanceWeights, mask_B_T: torch.Tensor, correction: str) -> dict:
    """``ratio_metrics_of`` one batch's weights."""
    return ratio_metrics_of(ratio_sums(weights, mask_B_T), correction)
