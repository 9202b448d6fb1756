"""Attention over a slot KV cache: one forward pass mixes prompts and decode steps of any rows.

Continuous batching needs a cache in which sequences come and go without the others moving. The
cache here is a set of *slots*: per layer one buffer of keys and one of values, shaped
``[slots, kv_heads, capacity, head_dim]``; a sequence owns a slot and fills it from position 0.
A row that finishes frees its slot where it is; a newcomer takes any free slot. Nothing is
copied when the batch changes, which a padded cache (one shared length, rows aligned to it)
cannot offer. Slots, not pages: the engine's batches are tens of rows of hundreds of tokens on a
CPU, where a slot's waste (room reserved up to the longest request) is a few hundred MB at
worst, and a row's keys sit in one block its attention reads (or gathers with its group's)
at once.

A forward pass is a flat batch ``[1, N]`` of *segments*: each is some tokens of one slot,
written at positions ``start..start+count``. A prompt is one segment of many tokens (its
prefill); a decoding row is a segment of one token. The model runs with the attention function
registered here (``SLOT_ATTENTION``) and a ``SlotPlan`` passed as the ``slot_plan`` keyword,
which transformers hands to every attention layer; a Llama-family model's pass written out
(``fused_pass``) calls ``attend`` itself.

Every row gets the same arithmetic whatever else is in the pass, so a seeded request draws the
same tokens alone or in a crowd (the endpoint's scores repeat):
- a prompt's attention runs for that prompt alone, in chunks of ``PREFIX_CHUNK`` positions,
  so a prefix of whole chunks has the same keys and values in every prompt that starts
  with it (``Segment.prefix_from`` copies them rather than computing them again);
- decode rows share attention calls written as two batched products and a softmax (the scores'
  scaling and mask folded into the first product), whose per-row results do not depend on how
  many rows share them (the fused kernel's do: it splits work by the batch's size). The plan
  puts decode rows first in the pass, ordered by their groups, so a group's queries and
  outputs are a slice of the pass's, not a gather. A row reads its slot's keys in whole
  ``KEY_BLOCK``s, the ones past its length masked out; rows share a call over the longest
  one's blocks where they are at most ``MERGE_BLOCKS`` shorter, since padding a row's keys
  with masked ones changes none of its bits (``pads_exactly`` checks that once per dtype on
  the machine; where it fails, only rows whose lengths round to the same blocks share).
  With a float32 cache on a CPU with AVX2, all decode rows instead attend in one call of a
  compiled kernel per layer (``attention_kernel``), over each row's own keys, which also
  writes their new keys and values: the same bits for a row whatever shares the call;
- the linear layers see at least ``MIN_ROWS`` token rows (the plan pads with a scratch slot),
  since a one-row product takes another kernel than a many-row one. That padding costs a lone
  row about 2.5x its time (the one-row kernel is the fastest per row), so the engine asks for
  it only when a row in the pass is reproducible (seeded or greedy): an unseeded row has no
  replies to repeat.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from palaestra.engine import attention_kernel

SLOT_ATTENTION = "palaestra_slots"

MIN_ROWS = 4
"""Fewest token rows in a pass: from four rows on, a row's matmul result does not depend on
how many rows share the product (measured on the CPUs this was built on)."""

PREFIX_CHUNK = 16
"""A prompt attends in chunks of this many positions (at multiples of it), so the keys and
values of a chunk depend on the tokens up to its end only, never on the rest of the prompt:
another prompt starting with the same whole chunks may copy them instead of computing them,
and gets the same bits it would have computed."""

KEY_BLOCK = 64
"""A decode row attends over its keys in whole blocks of this many positions (the masked tail
included), and slots hold a whole number of blocks."""

MERGE_BLOCKS = 4
"""Decode rows attend in one call with a row up to this many key blocks longer than theirs
(where ``pads_exactly``). Each call has a fixed cost per layer (three products and a softmax
over batches of small matrices, a gather where slots are scattered) that a few masked blocks
more per row stay under at SmolLM2's sizes; past a few blocks, one long row would make every
short one read its length."""


def bucket(rows: int) -> int:
    """``rows`` rounded up to one of a few sizes (1-8, then steps of 4 to 32, of 8 to 64, of
    16 to 128, of 64 beyond), so products see few distinct shapes: oneDNN builds and keeps a
    kernel per shape (a few MB for a small model's weights), and one per row count would grow
    the process's memory with every new count. The steps stay small where passes are small:
    a padded row costs a product about as much as a real one."""
    for limit, step in ((8, 1), (32, 4), (64, 8), (128, 16)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 64) * 64


class SlotKV:
    """The keys and values of ``slots`` sequences of up to ``capacity`` positions, per layer.

    The last slot is scratch: the plan's padding rows write there and nothing reads it.
    """

    def __init__(self, config, dtype: torch.dtype, device: torch.device) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers = int(text.num_hidden_layers)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = int(
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        self.dtype, self.device = dtype, device
        self.slots = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.gathered = torch.empty(0, dtype=dtype, device=device)
        """Room the decode rows of scattered slots gather their keys and values into, reused
        by every layer and pass: a fresh tensor of a few MB per layer (long rows) would be
        mapped and faulted in anew each time, which cost several times the attention itself."""

    @property
    def scratch(self) -> int:
        return self.slots - 1

    def reserve(self, slots: int, capacity: int) -> None:
        """Room for ``slots`` sequences (plus scratch) of ``capacity`` positions (rounded up to
        whole ``KEY_BLOCK``s), keeping what the existing slots hold. Grows only; growing copies
        the filled buffers once. New room holds zeros: a decode row's masked tail reads it, and
        garbage there (a NaN key or value) would survive a zero attention weight."""
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        slots, capacity = max(slots + 1, self.slots), max(capacity, self.capacity)
        if slots == self.slots and capacity == self.capacity:
            return
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        for store in (self.keys, self.values):
            for layer in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store and self.slots:
                    # The old scratch slot is not copied: its contents are never read.
                    grown[: self.slots - 1, :, : self.capacity] = store[layer][:-1]
                if len(store) < self.layers:
                    store.append(grown)
                else:
                    store[layer] = grown
        self.slots, self.capacity = slots, capacity

    def gather_room(self, elements: int) -> torch.Tensor:
        """``gathered``, grown to at least ``elements`` (by half again, so growing is rare)."""
        if self.gathered.numel() < elements:
            size = max(elements, self.gathered.numel() * 3 // 2)
            self.gathered = torch.empty(size, dtype=self.dtype, device=self.device)
        return self.gathered

    def release(self) -> None:
        """Drop the buffers (the memory goes back at once); ``reserve`` makes new ones."""
        self.keys, self.values = [], []
        self.gathered = self.gathered.new_empty(0)
        self.slots = self.capacity = 0


@dataclass
class Segment:
    """``len(tokens)`` tokens of the sequence in ``slot``, at positions from ``start``."""

    slot: int
    start: int
    tokens: list[int]
    copies: range = range(0)
    """Slots that receive a copy of this segment's keys and values once written (the other
    samples of a prompt, which share its prefill)."""
    prefix_from: int | None = None
    """The slot whose positions ``0..start`` this slot receives before attending: a prefix of
    whole ``PREFIX_CHUNK``s another prompt computed, in an earlier pass or earlier in this
    one (``start`` is then a multiple of ``PREFIX_CHUNK``)."""


@dataclass
class DecodeGroup:
    """Decode rows (one token each) whose lengths round up to the same whole ``KEY_BLOCK``s,
    consecutive in the pass."""

    tokens: range
    """The rows' flat token indices in the pass."""
    slots: torch.Tensor
    keys: int
    """Key positions each row reads: its length rounded up to whole blocks."""
    mask: torch.Tensor
    """``[rows * kv_heads, 1, keys]``, added to the attention scores: 0 up to each row's
    length, -inf past it (rows repeated per key-value head, the batch of the products)."""
    first_slot: int | None = None
    """The first slot, where the rows hold consecutive slots (their keys are then read in
    place, a view; otherwise gathered, a copy of the same values)."""


def decode_mask(lengths: list[int], keys: int, kv_heads: int, dtype, device) -> torch.Tensor:
    """A ``DecodeGroup.mask`` for rows of these lengths (positions filled, this token's
    included)."""
    hidden = torch.arange(keys, device=device) >= torch.tensor(lengths, device=device)[:, None]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)
    return mask.repeat_interleave(kv_heads, dim=0)[:, None, :]


@dataclass
class SlotPlan:
    """What one forward pass computes, in index tensors the attention layers use."""

    kv: SlotKV
    segments: list[Segment]
    min_rows: int = MIN_ROWS
    """Fewest token rows (and logit rows) in the pass. Either count is padded up to its
    ``bucket`` in any case."""
    merge_blocks: int = MERGE_BLOCKS
    """How many key blocks shorter than a group's longest row a decode row may be to join its
    call (0: only rows of the same blocks share one)."""
    input_ids: torch.Tensor = field(init=False)
    position_ids: torch.Tensor = field(init=False)
    last_token: torch.Tensor = field(init=False)
    """Flat index of each segment's last token, padded to a ``bucket`` of at least
    ``min_rows`` entries."""
    prompts: list[tuple[int, int, int, int]] = field(init=False)
    """(first flat token, slot, start, tokens) of each segment of several tokens, and of the
    padding."""
    decodes: list[DecodeGroup] = field(init=False)
    """The one-token segments, grouped by key blocks."""
    copies: list[tuple[int, range, int]] = field(init=False)
    """(slot, slots to copy it to, positions): prefills shared by a prompt's other samples."""
    prefixes: list[tuple[int, int, int]] = field(init=False)
    """(slot, slot to copy it to, positions): prefixes copied before attention, in the order
    the segments were given (a prompt may pass on a prefix it received earlier in the pass)."""

    def __post_init__(self) -> None:
        segments = list(self.segments)
        self.prefixes = [
            (s.prefix_from, s.slot, s.start) for s in segments if s.prefix_from is not None
        ]
        total = sum(len(s.tokens) for s in segments)
        padding = bucket(max(total, self.min_rows)) - total
        if padding > 0:
            segments.append(Segment(self.kv.scratch, 0, [0] * padding))

        scratch, kv = self.kv.scratch, self.kv
        reach = self.merge_blocks if pads_exactly(kv.dtype, str(kv.device)) else 0

        def blocks(segment: Segment) -> int:
            return segment.start // KEY_BLOCK + 1

        # Decode rows first, in groups that each make a run of the pass's tokens, longest rows
        # first, by slot within a group; then the prompts by slot; the padding (the scratch
        # slot's) last.
        groups: list[list[Segment]] = []
        rows = [s for s in segments if len(s.tokens) == 1 and s.slot != scratch]
        for segment in sorted(rows, key=lambda s: (-blocks(s), s.slot)):
            if groups and blocks(groups[-1][0]) - blocks(segment) <= reach:
                groups[-1].append(segment)
            else:
                groups.append([segment])
        for group in groups:
            group.sort(key=lambda s: s.slot)
        decoding = {id(s) for s in rows}
        others = sorted((s for s in segments if id(s) not in decoding), key=lambda s: s.slot)
        self.segments = [s for group in groups for s in group] + others
        self.copies = [(s.slot, s.copies, s.start + len(s.tokens)) for s in others if s.copies]
        tokens, positions, slots, last = [], [], [], []
        self.prompts = []
        for segment in self.segments:
            offset, count = len(tokens), len(segment.tokens)
            tokens += segment.tokens
            positions += range(segment.start, segment.start + count)
            slots += [segment.slot] * count
            last.append(offset + count - 1)
            if id(segment) not in decoding:
                self.prompts.append((offset, segment.slot, segment.start, count))
        device = kv.device
        self.decodes, first = [], 0
        for group in groups:
            keys = max(map(blocks, group)) * KEY_BLOCK
            held = [segment.slot for segment in group]
            consecutive = held == list(range(held[0], held[0] + len(held)))
            lengths = [segment.start + 1 for segment in group]
            self.decodes.append(
                DecodeGroup(
                    range(first, first + len(group)),
                    torch.tensor(held, device=device),
                    keys,
                    decode_mask(lengths, keys, kv.kv_heads, kv.dtype, device),
                    held[0] if consecutive else None,
                )
            )
            first += len(group)
        self.input_ids = torch.tensor([tokens], device=device)
        self.position_ids = torch.tensor([positions], device=device)
        self.slot_index = torch.tensor(slots, device=device)
        self.position_index = self.position_ids[0]
        # Where the compiled kernel attends for the decode rows, it writes their keys and
        # values too; indexing writes the rest.
        self.kernel = first > 0 and attention_kernel.usable(kv.dtype, device, kv.head_dim)
        self.written = first if self.kernel else 0
        if self.kernel:
            self.decode_slots = self.slot_index[:first]
            self.decode_lengths = self.position_index[:first] + 1
        last += [last[-1]] * (bucket(max(len(last), self.min_rows)) - len(last))
        self.last_token = torch.tensor(last, device=device)


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention interface transformers calls per layer: ``query`` ``[1, heads, N, dim]``,
    ``key``/``value`` ``[1, kv_heads, N, dim]`` for the plan's tokens; returns
    ``[1, N, heads, dim]``."""
    out = attend(
        kwargs["slot_plan"],
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling,
    )
    return out[None], None


def attend(
    plan: SlotPlan,
    layer: int,
    query_N_H_D: torch.Tensor,
    key_N_K_D: torch.Tensor,
    value_N_K_D: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``[N, heads, dim]``: the pass's N tokens attending in ``layer``, after their keys and
    values are written to their slots (and a shared prefill copied to its other slots)."""
    keys, values = plan.kv.keys[layer], plan.kv.values[layer]
    written = plan.written
    if written == 0:
        keys[plan.slot_index, :, plan.position_index] = key_N_K_D
        values[plan.slot_index, :, plan.position_index] = value_N_K_D
    elif written < len(plan.slot_index):
        slots, positions = plan.slot_index[written:], plan.position_index[written:]
        keys[slots, :, positions] = key_N_K_D[written:]
        values[slots, :, positions] = value_N_K_D[written:]
    for source, slot, end in plan.prefixes:
        keys[slot, :, :end] = keys[source, :, :end]
        values[slot, :, :end] = values[source, :, :end]
    out = query_N_H_D.new_empty(query_N_H_D.shape)
    if plan.kernel:
        rows = slice(0, written)
        scratch = plan.kv.gather_room(torch.get_num_threads() * ((keys.shape[2] + 7) // 8 * 8))
        attention_kernel.attend(
            query_N_H_D[rows], key_N_K_D[rows], value_N_K_D[rows], keys, values,
            plan.decode_slots, plan.decode_lengths, scaling, out[rows], scratch,
        )  # fmt: skip
        if written == len(plan.slot_index):
            return out
    elif not plan.prompts and len(plan.decodes) == 1:  # one group makes the whole pass
        group = plan.decodes[0]
        return decode_attention(query_N_H_D, keys, values, group, scaling, room=room(plan, group))
    else:
        for group in plan.decodes:
            decode_attention(query_N_H_D, keys, values, group, scaling, out, room(plan, group))
    for offset, slot, start, count in plan.prompts:
        first = start
        while first < start + count:  # chunk by chunk, each causal over the slot before it
            end = min((first // PREFIX_CHUNK + 1) * PREFIX_CHUNK, start + count)
            rows = slice(offset + first - start, offset + end - start)
            q = query_N_H_D[rows].transpose(0, 1)[None]
            k, v = keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end]
            mask = None
            if first:
                mask = torch.ones((end - first, end), dtype=torch.bool, device=q.device)
                mask = mask.tril(first)
            result = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=not first, scale=scaling, enable_gqa=True
            )
            out[rows] = result[0].transpose(0, 1)
            first = end
    for slot, copies, end in plan.copies:
        for store in (keys, values):
            store[copies.start : copies.stop, :, :end] = store[slot, :, :end]
    return out


def room(plan: SlotPlan, group: DecodeGroup) -> torch.Tensor | None:
    """Where ``group`` gathers its keys and values (None: it reads them in place)."""
    if group.first_slot is not None:
        return None
    kv = plan.kv
    return kv.gather_room(2 * len(group.tokens) * kv.kv_heads * group.keys * kv.head_dim)


def decode_attention(
    query_N_H_D: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: DecodeGroup,
    scaling: float,
    out: torch.Tensor | None = None,
    room: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[rows, heads, dim]``: each row of ``group`` (its query among the pass's
    ``query_N_H_D``) attending over its slot in one layer's ``keys`` and ``values``; written
    into ``out`` (``[N, heads, dim]``, at the group's tokens) when given. Rows in scattered
    slots gather their keys and values into ``room`` (flat, at least twice their size) when
    given, else into new tensors.

    Three ops over a batch of ``rows * kv_heads`` small matrices: scores scaled and masked in
    one product (``baddbmm``), their softmax, the values' product.
    """
    heads, dim = query_N_H_D.shape[1], query_N_H_D.shape[-1]
    rows, kv_heads, keys_read = len(group.tokens), keys.shape[1], group.keys
    batch = rows * kv_heads
    q = query_N_H_D[group.tokens.start : group.tokens.stop].reshape(batch, -1, dim)
    if group.first_slot is not None:
        k = keys[group.first_slot : group.first_slot + rows, :, :keys_read]
        v = values[group.first_slot : group.first_slot + rows, :, :keys_read]
    else:
        shape, size = (rows, kv_heads, keys_read, dim), rows * kv_heads * keys_read * dim
        if room is None:
            room = keys.new_empty(2 * size)
        k, v = room[:size].view(shape), room[size : 2 * size].view(shape)
        torch.index_select(keys[:, :, :keys_read], 0, group.slots, out=k)
        torch.index_select(values[:, :, :keys_read], 0, group.slots, out=v)
    k, v = k.reshape(batch, keys_read, dim), v.reshape(batch, keys_read, dim)
    scores = torch.baddbmm(group.mask, q, k.transpose(1, 2), alpha=scaling)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if out is None:
        return torch.bmm(weights, v).view(rows, heads, dim)
    target = out[group.tokens.start : group.tokens.stop]
    torch.bmm(weights, v, out=target.view(batch, -1, dim))
    return target


@functools.cache
def pads_exactly(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether a decode row's attention gives the same bits over its own key blocks as over
    more blocks with the extra keys masked, beside other rows: then rows of different lengths
    may share a call and a seeded reply still repeats whatever shares its passes. Checked once
    per dtype and device with this machine's kernels (it holds where each score is a dot
    product over the head's dimension, and a masked key adds an exact zero to the softmax's
    sum and to the values' product)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 2, 6, 64
    shape = (4, kv_heads, 16 * KEY_BLOCK, dim)
    keys = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    values = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    query = torch.randn(3, heads, dim, generator=generator).to(device=device, dtype=dtype)

    def attention(lengths: list[int], keys_read: int) -> torch.Tensor:
        mask = decode_mask(lengths, keys_read, kv_heads, dtype, keys.device)
        slots = torch.arange(1, len(lengths) + 1, device=keys.device)
        group = DecodeGroup(range(len(lengths)), slots, keys_read, mask, first_slot=1)
        return decode_attention(query[: len(lengths)], keys, values, group, dim**-0.5)

    # Long rows too: on a Xeon with AMX, float32 padding is exact up to 6 blocks of keys and
    # never past them.
    for length in (5, KEY_BLOCK, KEY_BLOCK + 7, 3 * KEY_BLOCK - 1, 9 * KEY_BLOCK + 5):
        own = -(-length // KEY_BLOCK) * KEY_BLOCK
        alone = attention([length], own)
        for more in (1, 2, 5):
            keys_read = own + more * KEY_BLOCK
            beside = attention([length, keys_read, keys_read - 3], keys_read)
            if not torch.equal(beside[:1], alone):
                return False
    return True


AttentionInterface.register(SLOT_ATTENTION, slot_attention)


def forward(model: torch.nn.Module, plan: SlotPlan, packed=None) -> torch.Tensor:
    """The logits after each segment's last token, ``[segments (at least min_rows), vocab]``.

    The model runs with slot attention (and ``packed``'s linear layers, a ``PackedLinears``,
    if given) for this call only: the same module may be a learner's, whose training passes
    keep their own.
    """
    config = model.config
    kept = config._attn_implementation
    config._attn_implementation = SLOT_ATTENTION
    try:
        with packed.active() if packed is not None else contextlib.nullcontext():
            return model(
                input_ids=plan.input_ids,
                position_ids=plan.position_ids,
                use_cache=False,
                logits_to_keep=plan.last_token,
                slot_plan=plan,
            ).logits[0]
    finally:
        config._attn_implementation = kept
