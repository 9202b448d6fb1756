"""Rollout engines: prompts in, sampled completions out.

An engine has two methods, so a backend can put it on another process or machine (a Ray actor,
a vLLM server) without the training loop noticing: ``generate`` and ``sync_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from palaestra.types import Completion


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    """Seeds this call's sampling so a step (and a resumed step) draws the same samples."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion; the text stops before the first one found."""


@dataclass(frozen=True)
class GenerationRequest:
    """``n`` completions of one prompt, sampled with ``params`` (a server's request, say)."""

    token_ids: list[int]
    n: int
    params: SamplingParams
    on_token: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)
    """Called from the generating thread as each token is sampled, with (which of the ``n``
    completions, token id): how a server streams. It must return quickly."""


class RolloutEngine(Protocol):
    def generate(
        self, prompts_P: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids), as ``completions_P_G``."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the next ``generate`` sample from ``model``'s current weights."""
        ...


from palaestra.rollout.torch_engine import TorchEngine  # noqa: E402

__all__ = ["GenerationRequest", "RolloutEngine", "SamplingParams", "TorchEngine"]
