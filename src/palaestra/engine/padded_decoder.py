"""The padded decoder: the ``Decoder`` interface over a function that generates whole batches
in padded passes (models whose layers are not all plain attention, which the slot cache cannot
hold)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from palaestra.types import Completion


class PassDecoder:
    """The ``Decoder`` interface over a function that generates whole batches: each ``step``
    generates every waiting request (up to ``max_batch`` rows) in one call."""

    def __init__(self, generate: Callable[[list], list[list[Completion]]], max_batch: int = 64):
        self.generate = generate
        self.max_batch = max_batch
        self.waiting: deque[tuple[object, Future]] = deque()
        self.steps = 0
        self.rows = 0
        self.prefix_tokens = 0
        """Always 0: padded passes share no prompt prefixes."""
        self.last_step_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def add(self, request, index: int = 0) -> Future:
        future: Future = Future()
        self.waiting.append((request, future))
        return future

    def close(self) -> None:
        """Nothing held between passes."""

    def fail(self, error: BaseException) -> None:
        while self.waiting:
            _, future = self.waiting.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def step(self) -> None:
        batch, rows = [], 0
        while self.waiting:
            request, future = self.waiting[0]
            if batch and rows + request.n > self.max_batch:
                break
            self.waiting.popleft()
            if future.set_running_or_notify_cancel():
                batch.append((request, future))
                rows += request.n
        if not batch:
            return
        started = time.monotonic()
        try:
            results = self.generate([request for request, _ in batch])
        except BaseException as error:  # noqa: BLE001 - handed to every request of the pass
            for _, future in batch:
                future.set_exception(error)
            return
        self.last_step_s = time.monotonic() - started
        self.steps += 1
        self.rows += rows
        for (_, future), completions in zip(batch, results, strict=True):
            future.set_result(completions)
