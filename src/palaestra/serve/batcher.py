"""Dynamic batching: requests that arrive together share one generation pass.

HTTP handlers run on the event loop and must not block it; generation runs on one worker thread.
Each handler submits a ``GenerationRequest`` and awaits its future. The worker takes everything
queued when it becomes free (after a short window for stragglers to arrive), runs one
``engine.generate_requests`` over all of it, and answers each future. Requests that arrive during
a pass queue for the next one, so under load every pass is full.

A handler that is cancelled (its client went away) frees its place at once: a request still
waiting is never generated, and one in the middle of its pass stops at its next token (its
``cancel`` event), while the rest of the pass goes on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from palaestra.rollout import GenerationRequest
from palaestra.types import Completion

Generate = Callable[[list[GenerationRequest]], list[list[Completion]]]


class Batcher:
    """Runs ``generate`` on a worker thread over whatever requests are waiting."""

    def __init__(self, generate: Generate, max_rows: int = 64, window_s: float = 0.01) -> None:
        self.generate = generate
        self.max_rows = max_rows
        """Most sequences (requests times ``n``) in one pass; the rest wait for the next."""
        self.window_s = window_s
        """How long the worker waits after the first request for others to join its pass."""
        self._queue: queue.Queue[tuple[GenerationRequest, Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="palaestra-batcher", daemon=True)
        self.passes = 0
        """Generation passes run so far; with ``rows`` it shows how well requests batch."""
        self.rows = 0
        self.in_flight = 0
        """Requests submitted and not yet answered (waiting or generating)."""
        self.last_pass_s = 0.0
        """How long the latest generation pass took."""
        self.cancelled = 0
        """Requests whose handler was cancelled (client gone) before they were answered."""
        self._closed = False
        self._thread.start()

    async def submit(self, request: GenerationRequest) -> list[Completion]:
        """The request's ``n`` completions, generated with whatever else is waiting."""
        if self._closed:
            raise RuntimeError("the server is shutting down")
        if request.cancel is None:
            request = replace(request, cancel=threading.Event())
        future: Future = Future()
        self.in_flight += 1  # on the event loop only, so no lock
        try:
            self._queue.put((request, future))
            # Cancelling this await cancels ``future`` too, if its pass has not begun.
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            request.cancel.set()  # its pass has begun: its rows end at their next token
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=60)

    def _work(self) -> None:
        waiting: list[tuple[GenerationRequest, Future]] = []
        while not self._closed:
            if not waiting:
                try:
                    waiting.append(self._queue.get(timeout=0.2))
                except queue.Empty:
                    continue
                time.sleep(self.window_s)  # requests sent together arrive a moment apart
            waiting += self._drain()
            batch, waiting = self._take(waiting)
            self._run(batch)
        self._fail(waiting + self._drain(), RuntimeError("the server is shutting down"))

    def _drain(self) -> list[tuple[GenerationRequest, Future]]:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _take(self, waiting: list[tuple[GenerationRequest, Future]]):
        """Requests for one pass, oldest first, up to ``max_rows`` sequences (at least one)."""
        waiting = [item for item in waiting if not item[1].cancelled()]
        rows = 0
        for count, (request, _) in enumerate(waiting):
            if count and rows + request.n > self.max_rows:
                return waiting[:count], waiting[count:]
            rows += request.n
        return waiting, []

    def _run(self, batch: list[tuple[GenerationRequest, Future]]) -> None:
        live = [
            (request, future) for request, future in batch if future.set_running_or_notify_cancel()
        ]
        if not live:
            return
        started = time.monotonic()
        try:
            results = self.generate([request for request, _ in live])
        except BaseException as error:  # noqa: BLE001 - handed to every waiting request
            self._fail(live, error)
            return
        self.last_pass_s = time.monotonic() - started
        self.passes += 1
        self.rows += sum(request.n for request, _ in live)
        for (_, future), completions in zip(live, results, strict=True):
            future.set_result(completions)

    @staticmethod
    def _fail(batch, error: BaseException) -> None:
        for _, future in batch:
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(error)
