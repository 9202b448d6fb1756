"""The slot decoder: continuous batching over a slot KV cache. Rows join the running batch at
the next forward pass and leave it the moment they finish; a request's prompt is prefilled
once, inside a pass that also decodes the rows already running, and a prompt that starts like
one a slot already holds copies the whole ``PREFIX_CHUNK``s they share
(``engine/slot_attention.py`` says why no row's tokens depend on the others)."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from palaestra.engine import slot_attention
from palaestra.engine.fused_pass import FusedPass
from palaestra.engine.sampling import sample_next_tokens

if TYPE_CHECKING:
    from palaestra.engine.torch_engine import TorchEngine, _Row


@dataclass
class _Pending:
    """A request in a decoder: its rows, and the future its completions go to."""

    request: object
    rows: list[_Row]
    future: Future
    running: int = 0
    tokens: list[int] = field(default_factory=list)
    """The request's prompt."""


class Decoder:
    """Continuous batching: ``add`` requests at any time, ``step`` runs one forward pass.

    Each pass decodes one token of every running row, prefills the requests admitted since the
    last pass (as many as fit in ``max_batch`` rows, oldest first; a request larger than that
    runs alone), and retires the rows that finish, freeing their slots for the next pass.
    Only the thread that calls ``step`` may touch it, except ``add``, which any thread may call.
    """

    def __init__(self, engine: TorchEngine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        parameter = next(engine.model.parameters())
        self.kv = slot_attention.SlotKV(engine.model.config, parameter.dtype, parameter.device)
        self.packed = engine.packed_weights()
        """The model's weights packed for row-invariant products (None: not here, and passes
        with a repeatable row are padded instead)."""
        self.waiting: deque[_Pending] = deque()
        self.running: dict[int, tuple[_Row, _Pending]] = {}
        """Slot -> the row that holds it, and its request."""
        self.steps = 0
        """Forward passes run so far."""
        self.rows = 0
        """Rows admitted so far."""
        self.prefix_tokens = 0
        """Prompt tokens copied from another prompt's slot rather than computed, so far."""
        self.last_step_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request, index: int = 0) -> Future:
        """Queue ``request``; its future gets ``request.n`` completions once all are done.

        A request the engine cannot take (no prompt, over the context) raises here, named as
        request ``index``.
        """
        self.engine._check(index, request)
        future: Future = Future()
        rows = self.engine._rows(request, 0)
        self.waiting.append(_Pending(request, rows, future, tokens=list(request.token_ids)))
        return future

    def close(self) -> None:
        """Free the cache; a later ``step`` makes a new one."""
        self.kv.release()

    def fail(self, error: BaseException) -> None:
        """Hand ``error`` to every request not yet answered, and forget them all."""
        pending = {id(p): p for _, p in self.running.values()} | {id(p): p for p in self.waiting}
        self.running.clear()
        self.waiting.clear()
        self.kv.release()
        for item in pending.values():
            if not item.future.done():
                if item.future.running() or item.future.set_running_or_notify_cancel():
                    item.future.set_exception(error)

    @torch.inference_mode()
    def step(self) -> None:
        started = time.monotonic()
        segments: list[slot_attention.Segment] = []
        owners: dict[int, list[_Row]] = {}
        # The prompts whose keys and values a slot holds (id of the request -> its tokens
        # and the slot), from which a newcomer may copy a prefix.
        prompts: dict[int, tuple[list[int], int]] = {}
        for slot, (row, item) in self.running.items():  # each feeds the token it drew last
            segment = slot_attention.Segment(slot, row.length, [row.token_ids[-1]])
            segments.append(segment)
            owners[id(segment)] = [row]
            if id(item) not in prompts:
                prompts[id(item)] = (item.tokens, slot)
        for item in self._admit():
            first, tokens = item.rows[0].slot, item.tokens
            source, shared = shared_prefix(tokens, prompts.values())
            segment = slot_attention.Segment(
                first,
                shared,
                tokens[shared:],
                range(first + 1, first + len(item.rows)),
                source if shared else None,
            )
            segments.append(segment)
            owners[id(segment)] = item.rows
            prompts[id(item)] = (tokens, first)
            self.prefix_tokens += shared
        if not segments:
            return
        # Without packed weights, pad the pass to the rows from which a row's arithmetic no
        # longer depends on the batch, when some row's replies should repeat.
        repeatable = self.packed is None and any(
            row.params.seed is not None or row.params.temperature <= 0
            for rows in owners.values()
            for row in rows
        )
        plan = slot_attention.SlotPlan(
            self.kv, segments, slot_attention.MIN_ROWS if repeatable else 1
        )
        if isinstance(self.packed, FusedPass):
            logits_S_V = self.packed.forward(plan)
        else:
            logits_S_V = slot_attention.forward(self.engine.model, plan, self.packed)
        rows, index = [], []
        for s, segment in enumerate(plan.segments):
            for row in owners.get(id(segment), ()):
                row.length = segment.start + len(segment.tokens)
                rows.append(row)
                index.append(s)
        tokens_B, logprobs_B = sample_next_tokens(
            logits_S_V[torch.tensor(index, device=logits_S_V.device)],
            [row.params.temperature for row in rows],
            [row.params.top_p for row in rows],
            [row.generator for row in rows],
        )
        for row, token, logprob in zip(rows, tokens_B, logprobs_B, strict=True):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            _, item = self.running[row.slot]
            if item.request.on_token is not None:
                item.request.on_token(row.sample, token)
            if self.engine._finished(row, token, item.request.cancel):
                self._retire(row, item)
        self.steps += 1
        if not self.running:
            self.kv.release()  # idle: give the memory back
        self.last_step_s = time.monotonic() - started

    def _admit(self) -> list[_Pending]:
        """Requests that join this pass, each given consecutive free slots."""
        admitted = []
        while self.waiting:
            item = self.waiting[0]
            if self.running and len(self.running) + len(item.rows) > self.max_batch:
                break
            self.waiting.popleft()
            if not item.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            cancel = item.request.cancel
            if cancel is not None and cancel.is_set():
                for row in item.rows:
                    row.text, row.finish_reason = "", "abort"
                item.future.set_result([row.completion() for row in item.rows])
                continue
            first = self._free_run(len(item.rows))
            slots = first + len(item.rows)
            if slots > self.kv.slots - 1:  # grow by doubling, so growing (a copy) is rare
                slots = max(slots, min(2 * (self.kv.slots - 1), self.max_batch))
            needed = max(row.prompt_len + row.params.max_tokens for row in item.rows)
            self.kv.reserve(slots, needed)
            for j, row in enumerate(item.rows):
                row.slot = first + j
                self.running[row.slot] = (row, item)
            item.running = len(item.rows)
            self.rows += len(item.rows)
            admitted.append(item)
        return admitted

    def _free_run(self, count: int) -> int:
        """The first slot of ``count`` consecutive free ones (slots past the cache's end are
        free: the cache grows to them)."""
        start = 0
        while any(slot in self.running for slot in range(start, start + count)):
            start += 1
        return start

    def _retire(self, row: _Row, item: _Pending) -> None:
        del self.running[row.slot]
        item.running -= 1
        if item.running == 0:
            item.future.set_result([r.completion() for r in item.rows])


def shared_prefix(tokens: list[int], held) -> tuple[int, int]:
    """(slot, positions): the slot among ``held`` ((prompt, slot) pairs) whose prompt starts
    with the most whole ``PREFIX_CHUNK``s of ``tokens``, and how many positions those chunks
    hold; (-1, 0) where none shares a chunk. At least the last token of ``tokens`` is left to
    compute (its logits draw the first reply token)."""
    chunk = slot_attention.PREFIX_CHUNK
    best, source = 0, -1
    for prompt, slot in held:
        limit = min(len(prompt), len(tokens) - 1) // chunk * chunk
        shared = 0
        while shared < limit and prompt[shared : shared + chunk] == tokens[shared : shared + chunk]:
            shared += chunk
        if shared > best:
            best, source = shared, slot
    return source, best
