"""The compiled decode attention: its numbers against float64, the keys and values it writes,
a row's bits alone and in a crowd, what it refuses, and the fallback where nothing builds it."""

from __future__ import annotations

import logging

import pytest
import torch

from palaestra.engine import attention_kernel, panel_kernel

needs_kernel = pytest.mark.skipif(
    attention_kernel.library() is None,
    reason="no AVX2 and FMA, or no C compiler, on this machine",
)

SLOTS, KV_HEADS, CAPACITY, HEADS = 12, 2, 192, 6


def case(dim: int, rows: int, seed: int = 0):
    """A cache of random keys and values, and ``rows`` rows in distinct slots, each with its
    query, new key and value (strided views of one pass's projections, as the engine has
    them) and a length from 1 to the capacity."""
    generator = torch.Generator().manual_seed(seed)
    shape = (SLOTS, KV_HEADS, CAPACITY, dim)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    projected = torch.randn(rows, HEADS + 2 * KV_HEADS, dim, generator=generator)
    query, key, value = projected.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    slots = torch.randperm(SLOTS, generator=generator)[:rows].contiguous()
    lengths = torch.randint(1, CAPACITY + 1, (rows,), generator=generator)
    lengths[0] = 1  # a row attending to its own token only
    lengths[-1] = CAPACITY  # and one filling its slot
    return keys, values, query, key, value, slots, lengths


def run(keys, values, query, key, value, slots, lengths, scaling=0.3):
    out = torch.empty(query.shape)
    scratch = torch.empty(torch.get_num_threads() * CAPACITY)
    attention_kernel.attend(query, key, value, keys, values, slots, lengths, scaling, out, scratch)
    return out


@needs_kernel
@pytest.mark.parametrize("dim", [64, 40, 128])
def test_decode_rows_attend_as_float64_softmax_attention_does(dim):
    keys, values, query, key, value, slots, lengths = case(dim, rows=7)
    before_keys, before_values = keys.clone(), values.clone()
    out = run(keys, values, query, key, value, slots, lengths)
    group = HEADS // KV_HEADS
    for r in range(7):
        slot, n = int(slots[r]), int(lengths[r])
        # The row's new key and value sit at its last position; nothing else moved.
        before_keys[slot, :, n - 1], before_values[slot, :, n - 1] = key[r], value[r]
        k = before_keys[slot, :, :n].double().repeat_interleave(group, 0)
        v = before_values[slot, :, :n].double().repeat_interleave(group, 0)
        weights = torch.softmax(torch.einsum("hd,hjd->hj", query[r].double(), k) * 0.3, -1)
        expected = torch.einsum("hj,hjd->hd", weights, v)
        assert torch.allclose(out[r].double(), expected, atol=2e-6, rtol=1e-5), r
    assert torch.equal(keys, before_keys) and torch.equal(values, before_values)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_crowd_at_any_thread_count():
    keys, values, query, key, value, slots, lengths = case(64, rows=9, seed=3)
    crowd = run(keys, values, query, key, value, slots, lengths)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in range(9):
            rows = slice(r, r + 1)
            alone = run(keys, values, query[rows], key[rows], value[rows], slots[rows],
                        lengths[rows])  # fmt: skip
            assert torch.equal(alone[0], crowd[r]), r
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_layouts_the_kernel_cannot_read_are_refused_naming_the_tensor():
    keys, values, query, key, value, slots, lengths = case(64, rows=3)
    with pytest.raises(ValueError, match="query must be float32"):
        run(keys, values, query.double(), key, value, slots, lengths)
    with pytest.raises(ValueError, match="lengths must be 3 contiguous int64s"):
        run(keys, values, query, key, value, slots, lengths.int())
    with pytest.raises(ValueError, match="keys and values must be contiguous"):
        run(keys.transpose(2, 3), values, query, key, value, slots, lengths)
    with pytest.raises(ValueError, match="scratch of 8 floats is too small"):
        attention_kernel.attend(query, key, value, keys, values, slots, lengths, 0.3,
                                torch.empty(query.shape), torch.empty(8))  # fmt: skip


@needs_kernel
def test_the_setting_and_the_cache_s_dtype_decide_where_it_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert attention_kernel.usable(torch.float32, cpu, 64)
    assert not attention_kernel.usable(torch.bfloat16, cpu, 64)
    assert not attention_kernel.usable(torch.float32, cpu, 60)  # not a multiple of 8
    monkeypatch.setenv(attention_kernel.SETTING, "0")
    assert not attention_kernel.usable(torch.float32, cpu, 64)


def test_without_a_compiler_decode_rows_attend_by_products_with_one_log_line(
    tmp_path, monkeypatch, caplog
):
    if not panel_kernel.cpu_runs_avx2():
        pytest.skip("this CPU runs no AVX2 kernel: nothing is built or logged")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    attention_kernel.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=attention_kernel.__name__):
            assert not attention_kernel.usable(torch.float32, torch.device("cpu"), 64)
            assert not attention_kernel.usable(torch.float32, torch.device("cpu"), 64)
    finally:
        attention_kernel.library.cache_clear()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "attention kernel: /nonexistent/cc could not build it ([Errno 2] No such file or "
        "directory: '/nonexistent/cc'); decode rows attend by batched products"
    ]
