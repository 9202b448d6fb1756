"""Streaming: tokens leave the generation thread as they are sampled and reach the client as
server-sent events, while the batch they belong to is still generating.

The engine calls a request's ``on_token`` from its thread; the callback hands each token to the
event loop, where a ``TextStream`` per choice turns the growing token list into text deltas.
Text that might still change is held back: a half-decoded character, the tail that could be the
start of a stop string, the inside of a thinking block not yet closed. The completion's final
text is the authority: whatever it adds at the end is sent last.

A client that disconnects mid-stream ends its ``EventStream``, which closes the events, and
with them its requests: generation for it stops at the next token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.responses import StreamingResponse

from palaestra.engine import GenerationRequest
from palaestra.serve.batcher import Batcher
from palaestra.types import Completion


class TextStream:
    """One choice's text as it grows: ``update(token_ids)`` and ``finish(text)`` return the
    new parts, as ``{"content": ...}`` or ``{"reasoning_content": ...}`` deltas."""

    def __init__(self, tokenizer, stops: tuple[str, ...], parse: Callable | None) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.parse = parse
        self.sent = {"reasoning_content": "", "content": ""}
        self.stopped = False

    def update(self, token_ids: list[int]) -> list[dict[str, str]]:
        if self.stopped:
            return []
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        else:
            text = text[: len(text) - self.hold] if self.hold else text
        text = text.rstrip("\ufffd")  # a character whose bytes are not all decoded yet
        return self._deltas(text)

    def finish(self, text: str) -> list[dict[str, str]]:
        return self._deltas(text)

    def _deltas(self, text: str) -> list[dict[str, str]]:
        if self.parse is None:
            parts = {"content": text}
        else:
            parsed = self.parse(text)
            parts = {"reasoning_content": parsed.thinking or "", "content": parsed.content}
        deltas = []
        for key, value in parts.items():
            # Only ever append: a part that no longer extends what was sent waits for the end.
            if value.startswith(self.sent[key]) and len(value) > len(self.sent[key]):
                deltas.append({key: value[len(self.sent[key]) :]})
                self.sent[key] = value
        return deltas


class EventStream(StreamingResponse):
    """A response of server-sent ``events`` that closes them as soon as it ends, however it
    ends. Starlette stops iterating when the client disconnects, but leaves a generator that
    was waiting at a ``yield`` suspended until the garbage collector finds it, and its requests
    would go on generating until then."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def stream_requests(
    batcher: Batcher,
    requests: list[GenerationRequest],
    tokenizer,
    parse: Callable | None,
    chunk: Callable[[int, dict[str, Any] | None, str | None], dict[str, Any]],
    usage: Callable[[list[Completion]], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """Server-sent events for ``requests`` (choice ``i * n + j`` is request ``i``'s ``j``th
    completion). ``chunk(index, delta, finish_reason)`` writes one event's JSON; ``usage``, if
    given, writes the closing usage event from the finished completions."""
    loop = asyncio.get_running_loop()
    arrivals: asyncio.Queue = asyncio.Queue()
    streams, tokens = [], []
    submitted = []
    for request in requests:
        base = len(streams)
        streams += [TextStream(tokenizer, request.params.stop, parse) for _ in range(request.n)]
        tokens += [[] for _ in range(request.n)]

        def on_token(j: int, token: int, base: int = base) -> None:
            loop.call_soon_threadsafe(arrivals.put_nowait, (base + j, token))

        submitted.append(asyncio.ensure_future(batcher.submit(replace(request, on_token=on_token))))
    everything = asyncio.gather(*submitted)

    def answered(future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()  # read below, or never once the client is gone: not an error
        # Token callbacks are queued on the loop before the batch's result is, so this marker
        # comes after every token.
        arrivals.put_nowait(None)

    everything.add_done_callback(answered)
    try:
        for index in range(len(streams)):
            yield _event(chunk(index, {"role": "assistant", "content": ""}, None))
        while (arrival := await arrivals.get()) is not None:
            index, token = arrival
            tokens[index].append(token)
            for delta in streams[index].update(tokens[index]):
                yield _event(chunk(index, delta, None))
        try:
            completions = [c for completions_n in everything.result() for c in completions_n]
        except Exception as error:  # the stream has begun: an error can only be an event now
            yield _event({"error": {"message": str(error), "type": "server_error"}})
            return
        for index, completion in enumerate(completions):
            for delta in streams[index].finish(completion.text):
                yield _event(chunk(index, delta, None))
            yield _event(chunk(index, None, completion.finish_reason))
        if usage is not None:
            yield _event(usage(completions))
        yield "data: [DONE]\n\n"
    finally:
        # Closed or cancelled before the end: the client is gone, so its requests stop (a
        # no-op for those already answered).
        for task in submitted:
            task.cancel()


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
