"""Advantage estimators: turn each group's rewards into per-sample learning signals.

Every estimator takes ``rewards_P_G`` (one row per prompt, one column per sample) and returns
``advantages_P_G`` of the same shape. Standard deviations use Bessel's correction (divide by
n - 1) and are offset by ``eps`` = 1e-4 before dividing, as TRL's GRPOTrainer does, so a set of
equal rewards gives exactly zero advantage instead of 0/0.
"""

from __future__ import annotations

from typing import Literal

import torch

EPS = 1e-4
ScaleRewards = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo"]


def _checked(rewards_P_G: torch.Tensor) -> torch.Tensor:
    if rewards_P_G.ndim != 2:
        raise ValueError(
            f"rewards_P_G must be 2-D (prompts, samples), got shape {tuple(rewards_P_G.shape)}"
        )
    return rewards_P_G.to(torch.float32)


def _std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std; zero where fewer than two values (no spread to measure)."""
    count = values.numel() if dim is None else values.shape[dim]
    if count < 2:
        return torch.zeros(()) if dim is None else torch.zeros_like(values.mean(dim, True))
    return values.std(correction=1) if dim is None else values.std(dim, keepdim=True, correction=1)


def group_normalized_advantages(
    rewards_P_G: torch.Tensor, eps: float = EPS, scale_rewards: ScaleRewards = "group"
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over a standard deviation.

    ``scale_rewards`` picks the deviation: ``"group"`` the group's own (GRPO), ``"batch"`` the
    std of every reward of the step, ``"none"`` no division at all (Dr. GRPO). A group of one
    sample has no baseline to compare against, so its advantage is zero.
    """
    rewards_P_G = _checked(rewards_P_G)
    if rewards_P_G.shape[1] < 2:
        return torch.zeros_like(rewards_P_G)
    centred_P_G = rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        return centred_P_G / (_std(rewards_P_G, dim=1) + eps)
    if scale_rewards == "batch":
        return centred_P_G / (_std(rewards_P_G) + eps)
    if scale_rewards == "none":
        return centred_P_G
    raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")


def rloo_advantages(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """RLOO: each reward minus the mean of the *other* samples of its group.

    ``r_i - (sum_j r_j - r_i) / (G - 1)`` equals ``G / (G - 1) * (r_i - mean)``; no std
    scaling. A group of one has no other samples, so its advantage is zero.
    """
    rewards_P_G = _checked(rewards_P_G)
    G = rewards_P_G.shape[1]
    if G < 2:
        return torch.zeros_like(rewards_P_G)
    others_P_G = (rewards_P_G.sum(dim=1, keepdim=True) - rewards_P_G) / (G - 1)
    return rewards_P_G - others_P_G


def whitened(values_P_G: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Batch whitening: minus the mean of every value of the step, over their Bessel std.

    Each sample counts once (OpenRLHF whitens over tokens, which weighs a sample by its length;
    with one advantage per sequence this is the per-sample version of the same idea).
    """
    values_P_G = _checked(values_P_G)
    if values_P_G.numel() < 2:
        return torch.zeros_like(values_P_G)
    return (values_P_G - values_P_G.mean()) / (_std(values_P_G) + eps)


def compute_advantages(
    rewards_P_G: torch.Tensor,
    estimator: Estimator = "grpo",
    scale_rewards: ScaleRewards = "group",
    eps: float = EPS,
) -> torch.Tensor:
    """``advantages_P_G`` by the named estimator (see ``Recipe.advantage_estimator``)."""
    if estimator in ("grpo", "gspo"):  # GSPO changes the importance ratio, not the advantage
        return group_normalized_advantages(rewards_P_G, eps, scale_rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards_P_G)
    if estimator == "reinforce_plus_plus":
        return whitened(rewards_P_G, eps)
    if estimator == "reinforce_plus_plus_baseline":
        rewards_P_G = _checked(rewards_P_G)
        return whitened(rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True), eps)
    raise ValueError(f"unknown advantage_estimator {estimator!r}")


def informative_groups(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """``keep_P``: True for groups whose rewards differ (DAPO's dynamic sampling keeps these).

    A group whose rewards all agree has zero group-relative advantage, so it adds no gradient,
    only noise to the loss's normaliser.
    """
    rewards_P_G = _checked(rewards_P_G)
    return (rewards_P_G.max(dim=1).values - rewards_P_G.min(dim=1).values) > 0
