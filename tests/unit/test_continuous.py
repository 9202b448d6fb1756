"""Continuous batching: rows join a running decoder at the next pass and leave when they end,
and what a row draws never depends on what shares its passes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.slot_attention import (
    KEY_BLOCK,
    MIN_ROWS,
    Segment,
    SlotKV,
    SlotPlan,
    bucket,
)
from palaestra.engine.torch_engine import TorchEngine
from tests.support.tiny_models import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = build_tiny_model(tokenizer, seed=5, max_position_embeddings=4096)
    return TorchEngine(model.eval(), tokenizer)


def request(tokenizer, text: str, max_tokens: int, n: int = 1, **params) -> GenerationRequest:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return GenerationRequest(ids, n, SamplingParams(max_tokens, **params))


def alone(engine, req: GenerationRequest) -> list[list[int]]:
    return [c.token_ids for c in engine.generate_requests([req])[0]]


def test_the_tiny_model_generates_continuously(engine):
    assert engine.continuous


def test_a_finished_row_s_slot_goes_to_the_waiting_request_at_the_next_pass(engine, tokenizer):
    decoder = engine.decoder(max_batch=2)
    short = decoder.add(request(tokenizer, "ab", 2, temperature=0.0))
    long = decoder.add(request(tokenizer, "cd", 10, temperature=0.0))
    late = decoder.add(request(tokenizer, "ef", 3, temperature=0.0))
    slots = []
    while decoder.busy:
        decoder.step()
        slots.append(sorted(decoder.running))
    # Pass 1 prefills short and long (slots 0 and 1); pass 2 ends short; pass 3 gives its
    # slot 0 to the late request while long goes on. Long's 10 tokens take 10 passes, and the
    # late request fits inside them: nothing waited for long to end.
    assert slots[0] == [0, 1] and slots[1] == [1] and slots[2] == [0, 1]
    assert decoder.steps == 10
    assert [len(f.result()[0].token_ids) for f in (short, long, late)] == [2, 10, 3]


def test_a_request_joining_mid_generation_draws_what_it_draws_alone(engine, tokenizer):
    greedy = request(tokenizer, "Say snow", 12, temperature=0.0)
    seeded = request(tokenizer, "Say wind please", 12, n=3, seed=7)
    first = request(tokenizer, "x", 20, n=2, seed=1)
    decoder = engine.decoder()
    early = decoder.add(first)
    for _ in range(3):
        decoder.step()  # first's rows are 3 tokens in when the others join
    joined = [decoder.add(greedy), decoder.add(seeded)]
    while decoder.busy:
        decoder.step()
    assert [c.token_ids for c in early.result()] == alone(engine, first)
    assert [c.token_ids for c in joined[0].result()] == alone(engine, greedy)
    assert [c.token_ids for c in joined[1].result()] == alone(engine, seeded)


def test_rows_are_bitwise_the_same_alone_and_in_a_crowd(engine, tokenizer):
    seeded = request(tokenizer, "Say rain", 16, n=2, seed=3)
    (by_itself,) = engine.generate_requests([seeded])
    others = [request(tokenizer, "a" * k, 16, n=k % 3 + 1, seed=k) for k in range(1, 9)]
    crowded = engine.generate_requests([*others[:4], seeded, *others[4:]])[4]
    for a, b in zip(by_itself, crowded, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exactly, not approximately


def test_a_cancelled_row_frees_its_slot_for_a_waiting_request(engine, tokenizer):
    cancel = threading.Event()
    decoder = engine.decoder(max_batch=1)
    endless = GenerationRequest(
        tokenizer("hi", add_special_tokens=False).input_ids,
        1,
        SamplingParams(200, temperature=0.0),
        cancel=cancel,
    )
    gone = decoder.add(endless)
    waiting = decoder.add(request(tokenizer, "yo", 4, temperature=0.0))
    for _ in range(3):
        decoder.step()
    assert sorted(decoder.running) == [0] and len(decoder.waiting) == 1
    cancel.set()  # what a server does when the client goes away
    decoder.step()  # the cancelled row ends at its next token
    assert gone.result()[0].finish_reason == "abort"
    decoder.step()  # and the waiting request takes its slot
    assert len(decoder.waiting) == 0 and sorted(decoder.running) == [0]
    while decoder.busy:
        decoder.step()
    assert len(waiting.result()[0].token_ids) == 4


def test_a_server_s_short_request_does_not_wait_for_long_ones(engine, tokenizer):
    from palaestra.serve.batcher import Batcher

    long = request(tokenizer, "hi", 3000, temperature=0.0)
    short = request(tokenizer, "yo", 3, temperature=0.0)

    async def scenario(batcher: Batcher) -> tuple[float, float]:
        begun = time.monotonic()
        await batcher.submit(short)
        by_itself = time.monotonic() - begun
        longs = [asyncio.ensure_future(batcher.submit(long)) for _ in range(4)]
        deadline = time.monotonic() + 30
        while batcher.rows < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        begun = time.monotonic()
        await batcher.submit(short)
        among_long = time.monotonic() - begun
        assert not any(task.done() for task in longs)  # they were still generating
        for task in longs:
            task.cancel()
        await asyncio.gather(*longs, return_exceptions=True)
        return by_itself, among_long

    batcher = Batcher(engine.decoder())
    try:
        by_itself, among_long = asyncio.run(scenario(batcher))
    finally:
        batcher.close()
    # A pass with four more rows costs a little more; waiting for 3000 tokens would be seconds.
    assert among_long < max(10 * by_itself, 0.5), (by_itself, among_long)


def test_the_plan_pads_to_min_rows_in_a_scratch_slot_and_groups_decode_rows(engine, monkeypatch):
    from palaestra.engine import slot_attention

    # Merging on, as where padding is exact (the plan's shape only; no arithmetic here).
    monkeypatch.setattr(slot_attention, "pads_exactly", lambda dtype, device: True)
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    kv.reserve(4, 100)
    assert kv.capacity == 2 * KEY_BLOCK  # whole blocks
    plan = SlotPlan(kv, [Segment(1, 5, [7]), Segment(0, 5, [8])])
    # Slots 0 and 1 decode in one group; the scratch slot (4) pads the pass to four tokens.
    assert plan.input_ids.tolist() == [[8, 7, 0, 0]]
    assert plan.position_ids.tolist() == [[5, 5, 0, 1]]
    [group] = plan.decodes
    assert group.tokens == range(2) and group.slots.tolist() == [0, 1]
    assert group.keys == KEY_BLOCK
    assert group.mask.shape == (2 * kv.kv_heads, 1, KEY_BLOCK)
    seen = group.mask[:, 0].eq(0).sum(-1).tolist()
    assert seen == [6] * (2 * kv.kv_heads)  # 6 keys seen, the rest at -inf
    assert group.mask[:, 0, 6:].eq(-torch.inf).all()
    assert plan.prompts == [(2, 4, 0, 2)]
    assert len(plan.last_token) == MIN_ROWS
    # Rows a few blocks apart share a group over the longest one's blocks, in slot order;
    # with merging off, only rows whose lengths round to the same blocks do, longest first.
    # Either way each group is a run of the pass's tokens, before the prompts.
    segments = [Segment(0, 70, [5]), Segment(1, 3, [6]), Segment(3, 63, [7])]
    mixed = SlotPlan(kv, segments, min_rows=1)
    assert mixed.input_ids.tolist() == [[5, 6, 7]]
    assert [(g.tokens, g.slots.tolist(), g.keys) for g in mixed.decodes] == [
        (range(3), [0, 1, 3], 2 * KEY_BLOCK),
    ]
    seen = mixed.decodes[0].mask[:: kv.kv_heads, 0].eq(0).sum(-1).tolist()
    assert seen == [71, 4, 64]
    apart = SlotPlan(kv, segments, min_rows=1, merge_blocks=0)
    assert apart.input_ids.tolist() == [[5, 6, 7]]
    assert [(g.tokens, g.slots.tolist(), g.keys) for g in apart.decodes] == [
        (range(1), [0], 2 * KEY_BLOCK),
        (range(1, 3), [1, 3], KEY_BLOCK),
    ]
    # Decode rows come before prompts whatever their slots; the padding comes last.
    prompt = SlotPlan(kv, [Segment(2, 0, [1, 2, 3, 4, 5], range(3, 4)), Segment(3, 9, [6])])
    assert prompt.input_ids.tolist() == [[6, 1, 2, 3, 4, 5]]
    assert [g.tokens for g in prompt.decodes] == [range(1)]
    assert prompt.prompts == [(1, 2, 0, 5)]
    assert prompt.copies == [(2, range(3, 4), 5)]
    assert prompt.last_token.tolist() == [0, 5, 5, 5]
    # A pass of nine tokens is padded to twelve, the three scratch tokens one prompt.
    nine = SlotPlan(kv, [Segment(2, 0, [1] * 8), Segment(0, 9, [6])])
    assert nine.input_ids.tolist() == [[6] + [1] * 8 + [0] * 3]
    assert nine.prompts == [(1, 2, 0, 8), (9, 4, 0, 3)]
    # One padding token too comes last, attending as a prompt would (not in a decode group).
    three = SlotPlan(kv, [Segment(0, 70, [5]), Segment(1, 3, [6]), Segment(2, 8, [7])])
    assert three.input_ids.tolist() == [[5, 6, 7, 0]]
    assert [(g.tokens, g.slots.tolist(), g.first_slot) for g in three.decodes] == [
        (range(3), [0, 1, 2], 0),
    ]
    assert three.prompts == [(3, 4, 0, 1)]
    alone = SlotPlan(kv, [Segment(0, 3, [6])], min_rows=1)
    assert alone.input_ids.tolist() == [[6]] and alone.last_token.tolist() == [0]


def _group(tokens: range, slots: list[int], keys: int, lengths: list[int], kv_heads: int, **kw):
    from palaestra.engine.slot_attention import DecodeGroup, decode_mask

    mask = decode_mask(lengths, keys, kv_heads, torch.float32, torch.device("cpu"))
    return DecodeGroup(tokens, torch.tensor(slots), keys, mask, **kw)


def test_a_decode_row_ignores_what_its_slot_holds_past_its_length(engine):
    """The masked tail of a row's key block changes nothing while it holds finite numbers (the
    cache's new room is zeros: a NaN key or value there would survive its zero weight)."""
    from palaestra.engine.slot_attention import decode_attention

    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, KEY_BLOCK, 8, generator=generator)
    values = torch.randn(3, 2, KEY_BLOCK, 8, generator=generator)
    query = torch.randn(4, 6, 8, generator=generator)  # 4 tokens, 6 heads over 2 kv heads
    group = _group(range(1, 3), [2, 0], KEY_BLOCK, [5, 9], kv_heads=2)
    out = decode_attention(query, keys, values, group, 0.5)
    for row, (token, slot, length) in enumerate([(1, 2, 5), (2, 0, 9)]):
        q = query[token].reshape(2, 3, 8)
        k, v = keys[slot, :, :length], values[slot, :, :length]
        expected = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
        assert torch.allclose(out[row], expected.reshape(6, 8), atol=1e-6)
    # Written into a pass's output, at the group's tokens only.
    written = torch.full_like(query, 7.0)
    decode_attention(query, keys, values, group, 0.5, written)
    assert torch.equal(written[1:3], out) and written[[0, 3]].eq(7.0).all()
    keys[2, :, 5:], values[2, :, 5:] = 1e4, 1e30
    assert torch.equal(out, decode_attention(query, keys, values, group, 0.5))
    for store in (keys, values):  # masked means a weight of zero, which a NaN survives
        store[2, :, 5:] = torch.nan
        assert decode_attention(query, keys, values, group, 0.5)[0].isnan().all()
        assert torch.equal(decode_attention(query, keys, values, group, 0.5)[1], out[1])
        store[2, :, 5:] = 0.0
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    kv.reserve(2, 10)
    kv.keys[0].fill_(3.0)
    kv.reserve(3, 70)
    assert kv.keys[0][2:].eq(0).all() and kv.values[0][:, :, KEY_BLOCK:].eq(0).all()


def test_rows_in_consecutive_slots_read_their_keys_in_place_with_the_same_bits(engine):
    from palaestra.engine.slot_attention import decode_attention

    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(6, 2, 3 * KEY_BLOCK, 8, generator=generator)
    values = torch.randn(6, 2, 3 * KEY_BLOCK, 8, generator=generator)
    query = torch.randn(3, 6, 8, generator=generator)
    lengths = [70, 100, 128]
    gathered = _group(range(3), [1, 2, 3], 2 * KEY_BLOCK, lengths, kv_heads=2)
    in_place = _group(range(3), [1, 2, 3], 2 * KEY_BLOCK, lengths, kv_heads=2, first_slot=1)
    out = decode_attention(query, keys, values, in_place, 0.3)
    assert torch.equal(out, decode_attention(query, keys, values, gathered, 0.3))
    alone = _group(range(1, 2), [2], 2 * KEY_BLOCK, lengths[1:2], kv_heads=2, first_slot=2)
    assert torch.equal(out[1:2], decode_attention(query, keys, values, alone, 0.3))
    # Gathered into the cache's reusable room: the same bits, and the room grows only once.
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    room = kv.gather_room(2 * 3 * 2 * 2 * KEY_BLOCK * 8)
    assert torch.equal(out, decode_attention(query, keys, values, gathered, 0.3, room=room))
    assert kv.gather_room(100).data_ptr() == room.data_ptr()
    kv.release()
    assert kv.gathered.numel() == 0
    # The plan reads in place only where the group's slots run without a gap.
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    kv.reserve(5, 64)
    plan = SlotPlan(kv, [Segment(1, 3, [4]), Segment(2, 9, [5]), Segment(4, 9, [6])], min_rows=1)
    assert [g.first_slot for g in plan.decodes] == [None]
    plan = SlotPlan(kv, [Segment(1, 3, [4]), Segment(2, 9, [5])], min_rows=1)
    assert [g.first_slot for g in plan.decodes] == [1]


def test_rows_a_few_blocks_apart_share_a_call_and_keep_the_bits_each_has_alone(engine, monkeypatch):
    from palaestra.engine import slot_attention
    from palaestra.engine.slot_attention import MERGE_BLOCKS, attend

    generator = torch.Generator().manual_seed(2)
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    kv.reserve(3, 8 * KEY_BLOCK)
    for store in kv.keys + kv.values:
        store.copy_(torch.randn(store.shape, generator=generator))
    filled = [t.clone() for t in kv.keys + kv.values]
    heads, dim = engine.model.config.num_attention_heads, kv.head_dim
    # Slot 0 is 7 blocks long, slot 2 is 5 (within MERGE_BLOCKS of 7), slot 1 is 1 (not).
    starts = {0: 6 * KEY_BLOCK + 3, 2: 4 * KEY_BLOCK + 10, 1: 30}
    assert 7 - 5 <= MERGE_BLOCKS < 7 - 1
    token = {
        slot: torch.randn(heads + 2 * kv.kv_heads, dim, generator=generator) for slot in starts
    }

    def attended(slots: list[int], **plan_fields) -> tuple[dict[int, torch.Tensor], SlotPlan]:
        for store, kept in zip(kv.keys + kv.values, filled, strict=True):
            store.copy_(kept)
        plan = SlotPlan(kv, [Segment(s, starts[s], [1]) for s in slots], min_rows=1, **plan_fields)
        x = torch.stack([token[s.slot] for s in plan.segments])
        q, k, v = x[:, :heads], x[:, heads : heads + kv.kv_heads], x[:, heads + kv.kv_heads :]
        out = attend(plan, 0, q, k, v, 0.25)
        return {s.slot: out[i] for i, s in enumerate(plan.segments)}, plan

    together, plan = attended([0, 1, 2])
    # Merged where padding is exact on this machine (on an AMX Xeon it is not in float32 past
    # 6 blocks of keys, and each row gets its own call).
    merged = [([0, 2], 7 * KEY_BLOCK), ([1], KEY_BLOCK)]
    apart = [([0], 7 * KEY_BLOCK), ([2], 5 * KEY_BLOCK), ([1], KEY_BLOCK)]
    expected = merged if slot_attention.pads_exactly(torch.float32, "cpu") else apart
    assert [(g.slots.tolist(), g.keys) for g in plan.decodes] == expected
    for slot in starts:
        by_itself, _ = attended([slot])
        assert torch.equal(together[slot], by_itself[slot]), slot
    # Where padding is not exact on this machine, only rows of the same blocks share a call.
    monkeypatch.setattr(slot_attention, "pads_exactly", lambda dtype, device: False)
    _, plan = attended([0, 1, 2])
    assert [g.slots.tolist() for g in plan.decodes] == [[0], [2], [1]]


@pytest.mark.parametrize("kernel", ["compiled", "batched products"])
def test_a_short_row_beside_a_long_one_draws_what_it_draws_alone(
    engine, tokenizer, monkeypatch, kernel
):
    from palaestra.engine import attention_kernel, slot_attention

    compiled = kernel == "compiled"
    if compiled and not attention_kernel.usable(torch.float32, torch.device("cpu"), 64):
        pytest.skip("no compiled attention kernel on this machine")
    monkeypatch.setenv(attention_kernel.SETTING, "1" if compiled else "0")

    merged = []
    decode_attention = slot_attention.decode_attention

    def spy(query, keys, values, group, *args, **kwargs):
        seen = group.mask[:: keys.shape[1], 0].eq(0).sum(-1)  # each row's own length
        merged.append(bool((-(-seen // KEY_BLOCK) * KEY_BLOCK < group.keys).any()))
        return decode_attention(query, keys, values, group, *args, **kwargs)

    long = request(tokenizer, "long " * 30, 140, seed=4)
    short = request(tokenizer, "Say hail", 30, n=2, seed=9)
    monkeypatch.setattr(slot_attention, "decode_attention", spy)
    decoder = engine.decoder()
    first = decoder.add(long)
    while decoder.steps < 40:
        decoder.step()  # the long row is about three blocks in when the short one joins
    joined = decoder.add(short)
    while decoder.busy:
        decoder.step()
    # The compiled kernel reads each row's own keys only. With batched products, where padding
    # is exact here, the short rows read the long row's blocks, masked, in its call. Either
    # way they draw what they draw alone.
    if compiled:
        assert merged == []
    else:
        assert any(merged) == slot_attention.pads_exactly(torch.float32, "cpu")
    assert [c.token_ids for c in first.result()] == alone(engine, long)
    assert [(c.token_ids, c.logprobs) for c in joined.result()] == [
        (c.token_ids, c.logprobs) for c in engine.generate_requests([short])[0]
    ]


def test_row_counts_fall_in_few_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 41, 120, 129, 300)] == [
        1, 2, 3, 4, 5, 8, 12, 40, 48, 128, 192, 320
    ]  # fmt: skip
    assert len({bucket(n) for n in range(1, 1025)}) == 8 + 6 + 4 + 4 + 14


def test_growing_the_cache_keeps_what_the_slots_hold(engine):
    kv = SlotKV(engine.model.config, torch.float32, torch.device("cpu"))
    kv.reserve(2, 64)
    kv.keys[0][:2, :, :10] = 1.5
    kv.reserve(5, 128)
    assert kv.slots == 6 and kv.capacity == 128 and kv.scratch == 5
    assert torch.equal(kv.keys[0][:2, :, :10], torch.full_like(kv.keys[0][:2, :, :10], 1.5))


def test_packed_linears_match_the_module_s_and_leave_it_as_it_was(engine):
    from palaestra.engine.packed_linear import packed_linears

    model = engine.model
    packed = packed_linears(model)
    if packed is None:
        pytest.skip("oneDNN's packed product is not available or not row-invariant here")
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed.active():
            fast = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.allclose(fast, plain, atol=1e-5)
    assert torch.equal(after, plain)  # the module's own layers are back
    assert all(type(layer).forward is layer.forward.__func__ for layer in packed.layers)


def test_without_packed_weights_a_seeded_row_is_padded_and_still_repeats(
    engine, tokenizer, monkeypatch
):
    monkeypatch.setattr(engine, "packed_weights", lambda: None)
    seeded = request(tokenizer, "Say rain", 12, n=1, seed=9)
    by_itself = alone(engine, seeded)
    decoder = engine.decoder()
    decoder.add(request(tokenizer, "bb", 12, n=2))  # unseeded company
    crowded = decoder.add(seeded)
    while decoder.busy:
        decoder.step()
    assert [c.token_ids for c in crowded.result()] == by_itself


def test_a_prompt_prefilled_in_two_parts_scores_as_in_one(engine):
    from palaestra.engine.slot_attention import forward

    model, ids = engine.model, [3, 5, 7, 9, 11, 13, 2, 4]
    kv = SlotKV(model.config, torch.float32, torch.device("cpu"))
    kv.reserve(2, 64)
    with torch.no_grad():
        whole = forward(model, SlotPlan(kv, [Segment(0, 0, ids)], min_rows=1))[0]
        forward(model, SlotPlan(kv, [Segment(1, 0, ids[:5])], min_rows=1))
        # The rest continues slot 1 from position 5: causal over the slot's first five too.
        rest = forward(model, SlotPlan(kv, [Segment(1, 5, ids[5:])], min_rows=1))[0]
        plain = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(rest, whole, atol=1e-5) and torch.allclose(whole, plain, atol=1e-5)


def test_a_prompt_copies_the_whole_chunks_it_shares_and_draws_what_it_draws_alone(
    engine, tokenizer
):
    from palaestra.engine.slot_attention import PREFIX_CHUNK
    from palaestra.engine.slot_decoder import shared_prefix

    system = tokenizer("You are a terse poet. " * 6, add_special_tokens=False).input_ids
    other = tokenizer("Answer in French, briefly. " * 6, add_special_tokens=False).input_ids
    assert min(len(system), len(other)) > 2 * PREFIX_CHUNK and system[0] != other[0]
    whole = 2 * PREFIX_CHUNK
    first = GenerationRequest(system + [5, 6, 7], 2, SamplingParams(12, seed=1))
    greedy = GenerationRequest(system[:whole] + [8, 9], 1, SamplingParams(10, temperature=0.0))
    computed = GenerationRequest(other + [4] * 3, 1, SamplingParams(10, seed=2))
    copied = GenerationRequest(other[:whole] + [3] * 9, 2, SamplingParams(10, seed=4))
    requests = [first, greedy, computed, copied]
    expected = [engine.generate_requests([r])[0] for r in requests]
    # Greedy joins while first runs, and copies its prefix from first's slot; copied joins in
    # the same pass as computed, and copies its prefix within that pass.
    decoder = engine.decoder()
    futures = [decoder.add(first)]
    decoder.step()
    assert decoder.prefix_tokens == 0
    futures += [decoder.add(r) for r in requests[1:]]
    decoder.step()
    assert decoder.prefix_tokens == 2 * whole
    while decoder.busy:
        decoder.step()
    for future, by_itself in zip(futures, expected, strict=True):
        assert [c.token_ids for c in future.result()] == [c.token_ids for c in by_itself]
        assert [c.logprobs for c in future.result()] == [c.logprobs for c in by_itself]
    # Only whole chunks of both prompts, and never a prompt's last token.
    held = [(list(range(40)), 3)]
    assert shared_prefix(list(range(40)), held) == (3, 32)
    assert shared_prefix(list(range(33)), held) == (3, 32)
    assert shared_prefix(list(range(32)), held) == (3, 16)
    assert shared_prefix(list(range(20)) + [99] * 20, held) == (3, 16)
    assert shared_prefix([99] + list(range(1, 40)), held) == (-1, 0)
    assert shared_prefix(list(range(100)), [(list(range(31)), 2), (list(range(50)), 5)]) == (5, 48)
