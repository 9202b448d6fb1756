"""The engine interface: token ids in, sampled completions out. The torch engine
(``engine/torch_engine.py``) and the vLLM engine (``engine/vllm_engine.py``) implement it;
importing this module loads neither, nor torch.

An engine has three methods, so a backend can put it on another process or machine (a Ray actor,
a vLLM engine) without the sampler noticing: ``generate_requests``, ``update_weights``, which
takes weights (a name -> tensor mapping) and their version, never a module, and ``close``. A
colocated layout also calls ``sleep`` and ``wake`` around each update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)
    """Once set (from any thread), the request's rows end at their next token with finish
    reason ``"abort"``, and the rest of the batch goes on: a server's client that went away."""


class RolloutEngine(Protocol):
    weight_version: int
    """The version of the weights it samples from (0: the ones it was built with)."""

    def generate_requests(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """``request.n`` completions of each request, as ``completions_P_G``."""
        ...

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Any:
        """Sample from ``weights`` (parameter name -> tensor) from the next request on. An
        engine that attests the sync itself (a pool of remote engines) returns its
        ``engine.attest.Attestation``; one in the caller's process returns None and answers
        ``weight_digests`` (name -> shape in, name -> (dtype, digest) out) for the caller's."""
        ...

    def close(self) -> None:
        """Free what the engine holds beyond this process (remote workers); may be a no-op."""
        ...

    def sleep(self) -> int:
        """Free the device memory the engine can rebuild (KV cache, buffers) while a learner
        trains on its device (a colocated layout); bytes freed, as far as it can tell. (The
        torch engine also takes ``weights=True``: its own copy of the policy goes too.)"""
        ...

    def wake(self) -> None:
        """Ready to take weights and sample again after ``sleep``."""
        ...


__all__ = ["GenerationRequest", "RolloutEngine", "SamplingParams"]
