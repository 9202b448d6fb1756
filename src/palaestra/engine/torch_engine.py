"""The torch rollout engine: continuous batching over a slot KV cache, on any HF causal LM.

Rows (a request's ``n`` completions) join the running batch at the next forward pass and leave
it the moment they finish (end-of-sequence, a stop string, their own ``max_tokens``, their
request's ``cancel`` set); a request's prompt is prefilled once, inside a pass that also decodes
the rows already running, and its keys and values are copied to its other rows' slots. A prompt
that starts like one a slot already holds (a chat template's system prompt, a task's shared
instructions) copies the whole ``PREFIX_CHUNK``s they share and computes the rest. No row
waits for another row's end, and no row's tokens depend on what else is in the pass
(``engine/slot_attention.py`` says how). A ``Decoder`` (``engine/slot_decoder.py``) is that
loop, one pass per ``step()``; ``generate_requests`` runs one until its requests are done, and a
server keeps one running.

Models whose layers are not all plain attention (sliding windows, linear attention) generate
in padded passes instead (``engine/padded_decoder.py``): one pass per batch of requests, over
transformers' own cache layers. Built over the very module a learner updates (in its own
precision), a weight update finds the tensors already in place and copies nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from palaestra.engine import GenerationRequest
from palaestra.engine.attest import Held, held_digests, pick_names
from palaestra.engine.fused_pass import FusedPass, fused_pass
from palaestra.engine.packed_linear import PackedLinears, packed_linears
from palaestra.engine.padded_decoder import PassDecoder
from palaestra.engine.sampling import row_seed, sample_next_tokens
from palaestra.engine.slot_decoder import Decoder
from palaestra.models.kv_cache import (
    cache_argument,
    has_plain_attention,
    make_cache,
    select_rows,
)
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
        self._discarded: dict[str, tuple[torch.Size, torch.dtype, torch.device]] | None = None
        """While asleep with its weights dropped (``sleep(weights=True)``): each parameter's
        name, shape, dtype and device, which the next ``update_weights`` must bring back."""
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
        if self._discarded is not None:
            missing = [name for name in self._discarded if name not in weights]
            if missing:
                raise KeyError(
                    f"weights for version {version} lack {len(missing)} of the parameters the "
                    f"engine dropped while asleep (sleep(weights=True)), e.g. {missing[:3]}: "
                    "it has nothing to sample them from"
                )
            for name, (shape, dtype, device) in self._discarded.items():
                params[name].data = torch.empty(shape, dtype=dtype, device=device)
            self._discarded = None
        with torch.no_grad():
            for name, tensor in weights.items():
                param = params[name]
                if tensor.data_ptr() != param.data_ptr():
                    param.copy_(tensor)
        self.weight_version = version
        self._packed, self._packed_version = None, None  # packed again at the next pass

    def weight_digests(self, sent: Mapping[str, tuple], version: int) -> Held:
        """Digests of a few of the sampling module's parameters among those in ``sent`` (name
        -> shape), picked by ``version``, as it holds them: what a weight sync is attested by
        (``engine.attest``). Still without the weights it dropped asleep, it holds none of
        them: each pick's digest is one no sent tensor has."""
        if self._discarded is not None:
            names = pick_names([name for name in sent if name in self._discarded], version)
            dtypes = {name: str(self._discarded[name][1]).removeprefix("torch.") for name in names}
            return {name: (dtypes[name], "nothing held") for name in names}
        return held_digests(dict(self.model.named_parameters()), sent, version)

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

    def sleep(self, weights: bool = False) -> int:
        """Drop what the next pass rebuilds: the packed copy of the weights (the slot cache and
        its buffers belong to each call's decoder, gone already) and, on CUDA, the allocator's
        cached blocks. Bytes freed: the packed tensors', and with ``weights`` the module's own.

        ``weights`` drops the parameters too where the engine samples from its own copy of
        the policy (``dtype`` other than the model's), as vLLM's sleep level 2 does: a caller
        that sends every parameter at the next ``update_weights`` (a synchronous run, whose
        update comes next) frees the copy for the update's length. Until then the engine
        cannot generate. Over the module it was given (a learner's) it drops nothing more."""
        freed = tensor_bytes(self._packed, shared_with=self.model)
        self._packed, self._packed_version = None, None
        if weights and self.model is not self._given and self._discarded is None:
            params = dict(self.model.named_parameters())  # tied parameters once
            self._discarded = {n: (p.shape, p.dtype, p.device) for n, p in params.items()}
            for parameter in params.values():
                freed += parameter.numel() * parameter.element_size()
                parameter.data = parameter.data.new_empty(0)
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            import torch.cuda

            with torch.cuda.device(device):
                torch.cuda.empty_cache()
        return freed

    def wake(self) -> None:
        """Nothing to restore: the weights are packed again at the next pass."""

    def generate(self, prompts_P: list[list[int]], n: int, params) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids), as ``completions_P_G``."""
        return self.generate_requests([GenerationRequest(p, n, params) for p in prompts_P])

    def decoder(self, max_batch: int | None = None):
        """A generation loop to feed requests into while it runs: a ``Decoder``, or for models
        the slot cache cannot hold, a ``PassDecoder`` over padded passes."""
        if self._discarded is not None:
            raise RuntimeError(
                "the engine dropped its weights while asleep (sleep(weights=True)) and has had "
                f"none since (version {self.weight_version}): update_weights comes first"
            )
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
        select_rows(cache, expand)
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
                select_rows(cache, index)
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


def tensor_bytes(holder, shared_with: torch.nn.Module | None = None, depth: int = 3) -> int:
    """Bytes of the distinct tensors ``holder`` holds (in its attributes, lists, tuples and
    dicts, ``depth`` levels down): what dropping it frees. Shared storages count once, and
    those of ``shared_with``'s parameters not at all (they outlive ``holder``)."""
    seen: set[int] = set()
    if shared_with is not None:
        seen = {p.untyped_storage().data_ptr() for p in shared_with.parameters()}

    def walk(item, level: int) -> int:
        if isinstance(item, torch.Tensor):
            try:
                key, size = item.untyped_storage().data_ptr(), item.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors
                key, size = id(item), item.numel() * item.element_size()
            if key in seen:
                return 0
            seen.add(key)
            return size
        if level > depth or item is None or isinstance(item, (str, bytes, int, float)):
            return 0
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, torch.nn.Module):
            children = list(vars(item).values())
        else:
            return 0
        return sum(walk(child, level + 1) for child in children)

    return walk(holder, 0)
