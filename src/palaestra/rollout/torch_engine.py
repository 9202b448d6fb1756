"""The torch rollout engine: continuous batching over a slot KV cache, on any HF causal LM.

Rows (a request's ``n`` completions) join the running batch at the next forward pass and leave
it the moment they finish (end-of-sequence, a stop string, their own ``max_tokens``, their
request's ``cancel`` set); a request's prompt is prefilled once, inside a pass that also decodes
the rows already running, and its keys and values are copied to its other rows' slots. A prompt
that starts like one a slot already holds (a chat template's system prompt, a task's shared
instructions) copies the whole ``PREFIX_CHUNK``s they share and computes the rest. No row
waits for another row's end, and no row's tokens depend on what else is in the pass
(``models/slot_attention.py`` says how). A ``Decoder`` is that loop, one pass per ``step()``;
``generate_requests`` runs one until its requests are done, and a server keeps one running.

Models whose layers are not all plain attention (sliding windows, linear attention) generate
in padded passes instead: one pass per batch of requests, over transformers' own cache layers.
Built over the very module a learner updates (in its own precision), a weight update finds the
tensors already in place and copies nothing.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from palaestra.models import slot_attention
from palaestra.models.fused_pass import FusedPass, fused_pass
from palaestra.models.kv_cache import cache_argument, has_plain_attention, make_cache
from palaestra.models.packed_linear import PackedLinears, packed_linears
from palaestra.rollout.sampling import row_seed, sample_next_tokens
from palaestra.types import Completion


@dataclass
class _Row:
    """One completion being generated."""

    request: int
    params: object
    generator: torch.Generator
    prompt_len: int
    sample: int = 0
    """Which of its request's ``n`` completions this row is."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    slot: int = -1
    """Its slot in a decoder's cache while it runs."""
    length: int = 0
    """Positions of its slot filled so far (its prompt, then all but its latest token)."""

    def completion(self) -> Completion:
        return Completion(self.token_ids, self.text, self.finish_reason, self.logprobs)


class TorchEngine:
    """Generates with a transformers causal LM, at most ``max_batch`` rows per forward pass,
    in the model's own precision or (``dtype``) from a copy of it in another one."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        max_batch: int = 64,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.dtype = dtype
        self.model = model
        """The module that samples: ``model`` itself, or its frozen copy in ``dtype``."""
        self._given = model
        if dtype is not None and next(model.parameters()).dtype != dtype:
            self.model = sampling_copy(model, dtype)
        self.weight_version = 0
        self._packed: FusedPass | PackedLinears | None = None
        self._packed_version: int | None = None
        self.continuous = has_plain_attention(self.model.config)
        """Whether it generates by continuous batching (every layer plain attention)."""
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = sorted(eos_ids)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        )

    @property
    def max_context(self) -> int:
        """Most tokens (prompt plus completion) one row may hold: the model's position limit."""
        return int(self.model.config.max_position_embeddings)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Sample from ``weights`` (the sampling module's parameter names) from now on.

        A tensor that already is the module's own parameter (the engine samples from the
        learner's module) is skipped; others are copied in, cast to the engine's precision.
        """
        params = dict(self.model.named_parameters())
        unknown = [name for name in weights if name not in params]
        if unknown:
            raise KeyError(
                f"weights for version {version} name {len(unknown)} parameters the engine's "
                f"model does not have, e.g. {unknown[:3]}"
            )
        with torch.no_grad():
            for name, tensor in weights.items():
                param = params[name]
                if tensor.data_ptr() != param.data_ptr():
                    param.copy_(tensor)
        self.weight_version = version
        self._packed, self._packed_version = None, None  # packed again at the next pass

    def packed_weights(self) -> FusedPass | PackedLinears | None:
        """The sampling module's weights packed for generation passes: a ``FusedPass`` for
        Llama-family models, else its linear layers packed; made once per weight version
        (``update_weights`` drops them, and so does the end of each ``generate_requests`` when
        the engine samples from the module it was given, which its owner may change). ``None``
        where packing is unavailable or not row-invariant."""
        if self._packed_version != self.weight_version:
            self._packed = fused_pass(self.model) or packed_linears(self.model)
            self._packed_version = self.weight_version
        return self._packed

    def close(self) -> None:
        """Drop the packed weights; the module itself is the garbage collector's."""
        self._packed, self._packed_version = None, None

    def generate(self, prompts_P: list[list[int]], n: int, params) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids), as ``completions_P_G``."""
        from palaestra.rollout import GenerationRequest

        return self.generate_requests([GenerationRequest(p, n, params) for p in prompts_P])

    def decoder(self, max_batch: int | None = None):
        """A generation loop to feed requests into while it runs: a ``Decoder``, or for models
        the slot cache cannot hold, a ``PassDecoder`` over padded passes."""
        if self.continuous:
            return Decoder(self, max_batch or self.max_batch)
        return PassDecoder(self._generate_padded, max_batch or self.max_batch)

    def generate_requests(self, requests: list) -> list[list[Completion]]:
        """``request.n`` completions of each request, all requests batched together."""
        decoder = self.decoder()
        futures = [decoder.add(request, index) for index, request in enumerate(requests)]
        was_training = self.model.training
        self.model.eval()
        try:
            while decoder.busy:
                decoder.step()
        finally:
            self.model.train(was_training)
            decoder.close()
            if self.model is self._given:
                # The module may be a learner's, trained in place between calls: its packed
                # copy would be stale by then, and would sit in memory beside the optimiser.
                self._packed, self._packed_version = None, None
        return [future.result() for future in futures]

    def _rows(self, request, index: int) -> list[_Row]:
        """The rows of ``request``, each with its own generator."""
        device = next(self.model.parameters()).device
        params, rows = request.params, []
        for j in range(request.n):
            if params.seed is not None:
                seed = row_seed(params.seed, j)
            else:  # still reproducible under torch.manual_seed
                seed = int(torch.randint(2**62, (1,)))
            generator = torch.Generator(device).manual_seed(seed)
            rows.append(_Row(index, params, generator, len(request.token_ids), j))
        return rows

    def _generate_padded(self, requests: list) -> list[list[Completion]]:
        """All requests in padded passes of at most ``max_batch`` rows (models with other
        than plain attention layers)."""
        device = next(self.model.parameters()).device
        rows = [row for r, request in enumerate(requests) for row in self._rows(request, r)]
        for start in range(0, len(rows), self.max_batch):
            self._run_padded(rows[start : start + self.max_batch], requests, device)
        completions: list[list[Completion]] = [[] for _ in requests]
        for row in rows:
            completions[row.request].append(row.completion())
        return completions

    def _check(self, index: int, request) -> None:
        params = request.params
        if request.n < 1:
            raise ValueError(f"request {index}: n must be at least 1, got {request.n}")
        if params.max_tokens < 1:
            raise ValueError(
                f"request {index}: max_tokens must be at least 1, got {params.max_tokens}"
            )
        if not request.token_ids:
            raise ValueError(f"request {index}: the prompt has no tokens")
        if len(request.token_ids) + params.max_tokens > self.max_context:
            raise ValueError(
                f"request {index}: {len(request.token_ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {self.max_context} tokens"
            )

    @torch.inference_mode()
    def _run_padded(self, rows: list[_Row], requests: list, device: torch.device) -> None:
        # Prefill each distinct request once, then give each of its rows a copy of the cache.
        unique = sorted({row.request for row in rows})
        prompts = [requests[r].token_ids for r in unique]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        # Position ids count real tokens only, so a left-padded prompt sees the positions it
        # would see alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = make_cache(self.model.config, width + max(row.params.max_tokens for row in rows))
        cache_kwarg = {cache_argument(self.model): cache}
        logits = self.model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=True,
            logits_to_keep=1,
            **cache_kwarg,
        ).logits[:, -1]
        slot = {r: i for i, r in enumerate(unique)}
        expand = torch.tensor([slot[row.request] for row in rows], device=device)
        cache.batch_select_indices(expand)
        logits_B_V = logits[expand]
        attention_mask = attention_mask.to(device)[expand]
        positions_B = torch.tensor([row.prompt_len for row in rows], device=device)

        active = list(rows)
        while True:
            tokens_B, logprobs_B = sample_next_tokens(
                logits_B_V,
                [row.params.temperature for row in active],
                [row.params.top_p for row in active],
                [row.generator for row in active],
            )
            keep = []
            for b, row in enumerate(active):
                row.token_ids.append(tokens_B[b])
                row.logprobs.append(logprobs_B[b])
                on_token = requests[row.request].on_token
                if on_token is not None:
                    on_token(row.sample, tokens_B[b])
                if not self._finished(row, tokens_B[b], requests[row.request].cancel):
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask = attention_mask[index]
                positions_B = positions_B[index]
                active = [active[b] for b in keep]
                tokens_B = [tokens_B[b] for b in keep]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((len(active), 1))], dim=1
            )
            logits_B_V = self.model(
                input_ids=torch.tensor(tokens_B, device=device)[:, None],
                attention_mask=attention_mask,
                position_ids=positions_B[:, None],
                use_cache=True,
                **cache_kwarg,
            ).logits[:, -1]
            positions_B = positions_B + 1

    def _finished(self, row: _Row, token: int, cancel=None) -> bool:
        """Whether ``row`` ends with ``token`` (or is cancelled); if so, its text and finish
        reason are set."""
        if cancel is not None and cancel.is_set():
            row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            row.finish_reason = "abort"
            return True
        stops = row.params.stop
        if stops:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
            if cuts:
                row.text, row.finish_reason = text[: min(cuts)], "stop"
                return True
        if token in self.eos_ids:
            row.finish_reason = "stop"
        elif len(row.token_ids) >= row.params.max_tokens:
            row.finish_reason = "length"
        else:
            return False
        row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        return True


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


def sampling_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``model`` with its parameters in ``dtype``.

    Buffers keep their precision: rotary frequencies rounded to bfloat16 would shift the
    positions of long sequences. Tied parameters stay tied, so each is converted once.
    """
    clone = copy.deepcopy(model).eval()
    for parameter in clone.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
        parameter.data = parameter.data.to(dtype)
    return clone
