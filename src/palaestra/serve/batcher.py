"""Continuous batching for the server: requests join the running generation at its next pass.

HTTP handlers run on the event loop and must not block it; generation runs on one worker thread
that owns a decoder (``TorchEngine.decoder()``). Each handler submits a ``GenerationRequest``
and awaits its future. The worker hands every newly queued request to the decoder, then runs one
decoder step (one forward pass: a token for every running row, the prompts of the newcomers),
and again, for as long as anything is queued or running. A request that arrives while others
generate starts at the next pass, and a short one leaves the moment it ends.

A handler that is cancelled (its client went away) frees its place at once: a request still
waiting is never generated, and a running one stops at its next token (its ``cancel`` event),
which frees its rows' slots for the next pass.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import replace

from palaestra.engine import GenerationRequest
from palaestra.types import Completion


class Batcher:
    """Runs ``decoder`` on a worker thread over whatever requests are submitted."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        """A ``Decoder`` (or ``PassDecoder``): ``add(request) -> Future``, ``step()``, ``busy``."""
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="palaestra-batcher", daemon=True)
        self.in_flight = 0
        """Requests submitted and not yet answered (waiting or generating)."""
        self.cancelled = 0
        """Requests whose handler was cancelled (client gone) before they were answered."""
        self._closed = False
        self._thread.start()

    @property
    def passes(self) -> int:
        """Forward passes run so far; with ``rows`` it shows how well requests batch."""
        return self.decoder.steps

    @property
    def rows(self) -> int:
        """Sequences (requests times ``n``) generated or generating."""
        return self.decoder.rows

    @property
    def prefix_tokens(self) -> int:
        """Prompt tokens copied from another prompt in the cache rather than computed."""
        return self.decoder.prefix_tokens

    @property
    def last_pass_s(self) -> float:
        """How long the latest pass took."""
        return self.decoder.last_step_s

    async def submit(self, request: GenerationRequest) -> list[Completion]:
        """The request's ``n`` completions, generated with whatever else is running."""
        if self._closed:
            raise RuntimeError("the server is shutting down")
        if request.cancel is None:
            request = replace(request, cancel=threading.Event())
        handed: asyncio.Future = asyncio.get_running_loop().create_future()
        self.in_flight += 1  # on the event loop only, so no lock
        try:
            self._queue.put((request, handed))
            # The worker answers with the decoder's future for this request (or an error).
            future = await handed
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # Waiting: it never starts; running: its rows end at their next token.
            request.cancel.set()
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while not self._closed:
            if not self.decoder.busy:
                try:
                    self._add(*self._queue.get(timeout=0.2))
                except queue.Empty:
                    continue
            while True:
                try:
                    self._add(*self._queue.get_nowait())
                except queue.Empty:
                    break
            if self.decoder.busy:
                try:
                    self.decoder.step()
                except BaseException as error:  # noqa: BLE001 - handed to every request held
                    self.decoder.fail(error)
        self.decoder.fail(RuntimeError("the server is shutting down"))
        while True:
            try:
                request, handed = self._queue.get_nowait()
            except queue.Empty:
                break
            self._answer(handed, error=RuntimeError("the server is shutting down"))

    def _add(self, request: GenerationRequest, handed: asyncio.Future) -> None:
        if request.cancel.is_set():
            return  # its handler is gone already
        try:
            future = self.decoder.add(request)
        except Exception as error:  # noqa: BLE001 - a request the engine cannot take
            self._answer(handed, error=error)
        else:
            self._answer(handed, future=future)

    @staticmethod
    def _answer(handed: asyncio.Future, future=None, error: BaseException | None = None) -> None:
        def answer() -> None:
            if handed.done():
                return
            if error is not None:
                handed.set_exception(error)
            else:
                handed.set_result(future)

        try:
            handed.get_loop().call_soon_threadsafe(answer)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass
