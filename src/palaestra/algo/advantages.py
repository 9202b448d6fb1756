"""Advantage estimators: turn each group's rewards into per-sample learning signals."""

from __future__ import annotations

import torch


def group_normalized_advantages(rewards_P_G: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation.

    The standard deviation uses Bessel's correction (divides by G - 1), as TRL's GRPOTrainer
    does, and ``eps`` keeps a group of equal rewards at exactly zero advantage instead of 0/0.
    A group of one sample has no baseline to compare against, so its advantage is zero.
    """
    if rewards_P_G.ndim != 2:
        raise ValueError(
            f"rewards_P_G must be 2-D (prompts, samples), got shape {tuple(rewards_P_G.shape)}"
        )
    rewards_P_G = rewards_P_G.to(torch.float32)
    if rewards_P_G.shape[1] < 2:
        return torch.zeros_like(rewards_P_G)
    mean_P_1 = rewards_P_G.mean(dim=1, keepdim=True)
    std_P_1 = rewards_P_G.std(dim=1, keepdim=True, correction=1)
    return (rewards_P_G - mean_P_1) / (std_P_1 + eps)
