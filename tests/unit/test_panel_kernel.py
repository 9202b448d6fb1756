"""The compiled panel product: its numbers, a row's bits at any count and place, the build it
keeps, and the fallback where nothing builds it."""

from __future__ import annotations

import logging

import pytest
import torch

from palaestra.engine import packed_linear, panel_kernel

needs_kernel = pytest.mark.skipif(
    panel_kernel.library() is None, reason="no AVX2 and FMA, or no C compiler, on this machine"
)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache, and ``library`` forgotten before and after the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    panel_kernel.library.cache_clear()
    yield tmp_path / "cache" / "palaestra" / "kernels"
    panel_kernel.library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("out, inputs", [(100, 37), (576, 576), (3072, 576), (40, 1536)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_panel_products_match_float64_products(out, inputs, with_bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inputs, generator=generator)
    bias = torch.randn(out, generator=generator) if with_bias else None
    packed = panel_kernel.pack(weight)
    assert packed.panels.shape == (-(-out // 16), inputs, 16)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 64):
        x = torch.randn(rows, inputs, generator=generator)
        want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        got = panel_kernel.product(packed, bias, x)
        assert got.shape == (rows, out) and got.dtype == torch.float32
        # float32 sums of `inputs` products of unit normals: a few ulps of sqrt(inputs).
        assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * inputs), rows


@needs_kernel
@pytest.mark.parametrize(
    "shapes",
    [[(100, 37)], [(576, 576), (192, 576), (192, 576)], [(7, 40), (3, 40)], [(16, 8), (5, 8)]],
    ids=["one, ragged", "q k v", "parts under a panel", "a whole panel then a part"],
)
@pytest.mark.parametrize("scaled", [False, True], ids=["as they are", "scaled"])
def test_pack_stacks_and_scales_in_one_pass_what_torch_would(shapes, scaled):
    generator = torch.Generator().manual_seed(2)
    # Rows inside wider tensors, so a part's row stride is not its width.
    parts = [
        torch.randn(out, inputs + 3, generator=generator)[:, :inputs] for out, inputs in shapes
    ]
    scale = torch.randn(shapes[0][1], generator=generator) if scaled else None
    stacked = torch.cat(parts) if scale is None else torch.cat(parts) * scale
    out, inputs = stacked.shape
    blocks = -(-out // 16)
    padded = torch.cat((stacked, stacked.new_zeros(blocks * 16 - out, inputs)))
    want = padded.view(blocks, 16, inputs).transpose(1, 2)  # [block, input, output in block]
    packed = panel_kernel.pack(parts if len(parts) > 1 else parts[0], scale)
    assert packed.shape == (out, inputs)
    assert torch.equal(packed.panels, want)


@needs_kernel
def test_pack_names_what_it_cannot_pack():
    with pytest.raises(ValueError, match=r"\(4, 8\) torch.float32, \(4, 6\) torch.float32"):
        panel_kernel.pack([torch.zeros(4, 8), torch.zeros(4, 6)])
    with pytest.raises(ValueError, match="bfloat16"):
        panel_kernel.pack(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a scale of shape \(6,\) for 8 inputs"):
        panel_kernel.pack(torch.zeros(4, 8), torch.ones(6))


@needs_kernel
def test_a_row_gets_the_same_bits_at_any_count_and_place():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(3072, 576, generator=generator)
    bias = torch.randn(3072, generator=generator)
    packed = panel_kernel.pack(weight)
    # Rows inside a wider tensor: a row stride other than their width.
    x = torch.randn(40, 600, generator=generator)[:, :576]
    alone = torch.cat([panel_kernel.product(packed, bias, x[i : i + 1]) for i in range(40)])
    for count in (2, 3, 5, 6, 7, 8, 12, 33, 40):
        for first in {0, 40 - count, (40 - count) // 2}:
            got = panel_kernel.product(packed, bias, x[first : first + count])
            assert torch.equal(got, alone[first : first + count]), (count, first)


@needs_kernel
def test_the_engine_packs_float32_weights_in_panels_as_the_setting_says(monkeypatch):
    weight = torch.randn(64, 32)
    monkeypatch.setenv(panel_kernel.SETTING, "1")
    packed = packed_linear.pack(weight)
    assert isinstance(packed, panel_kernel.Panels)
    assert packed_linear.row_window(packed) == packed_linear.ANY_COUNT  # nothing split
    x = torch.randn(5, 32)
    assert torch.allclose(packed_linear.product(packed, None, x), x @ weight.T, atol=1e-5)
    assert not panel_kernel.preferred(torch.bfloat16)  # float32 only
    monkeypatch.setenv(panel_kernel.SETTING, "0")
    assert type(packed_linear.pack(weight)) is torch.Tensor  # oneDNN's layout


@needs_kernel
def test_the_kernel_builds_once_and_is_kept(fresh_build, monkeypatch):
    assert panel_kernel.library() is not None
    (built,) = fresh_build.glob("panel-*.so")
    stamp = built.stat().st_mtime_ns
    # Another process (the cache forgotten) loads the file; no compiler is needed to.
    panel_kernel.library.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert panel_kernel.library() is not None
    assert [p.name for p in fresh_build.iterdir()] == [built.name]  # no scratch left behind
    assert built.stat().st_mtime_ns == stamp


def test_without_a_compiler_generation_falls_back_with_one_log_line(
    fresh_build, monkeypatch, caplog
):
    if not panel_kernel.cpu_runs_avx2():
        pytest.skip("this CPU runs no AVX2 kernel: nothing is built or logged")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(panel_kernel.SETTING, "1")
    with caplog.at_level(logging.WARNING, logger=panel_kernel.__name__):
        assert panel_kernel.library() is None
        assert not panel_kernel.preferred(torch.float32)
        packed = packed_linear.pack(torch.randn(64, 32))
    assert type(packed) is torch.Tensor  # oneDNN's layout
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "/nonexistent/cc" in lines[0] and "oneDNN" in lines[0], lines
    assert not fresh_build.exists() or not any(fresh_build.iterdir())


def test_a_compiler_that_fails_is_named_with_its_last_line(fresh_build, monkeypatch, caplog):
    if not panel_kernel.cpu_runs_avx2():
        pytest.skip("this CPU runs no AVX2 kernel: nothing is built or logged")
    failing = fresh_build.parent.parent / "cc"
    failing.parent.mkdir(parents=True, exist_ok=True)
    failing.write_text("#!/bin/sh\necho 'cc: error: unrecognized option' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with caplog.at_level(logging.WARNING, logger=panel_kernel.__name__):
        assert panel_kernel.library() is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(failing) in line and "unrecognized option" in line


def test_a_cache_folder_that_cannot_be_made_falls_back_naming_it(tmp_path, monkeypatch, caplog):
    if not panel_kernel.cpu_runs_avx2():
        pytest.skip("this CPU runs no AVX2 kernel: nothing is built or logged")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would go\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    panel_kernel.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=panel_kernel.__name__):
            assert panel_kernel.library() is None
    finally:
        panel_kernel.library.cache_clear()
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(blocked) in line and "oneDNN" in line, line
