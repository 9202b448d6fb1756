"""A float32 product for the few rows of a generation pass, over weights laid out in panels,
compiled on this machine once.

A decode pass multiplies a handful of rows (one per sequence generating) by every weight of
the model, so it streams all the weights from memory for little arithmetic. On a 2-core AVX2
EPYC (float32 matmul peak 143-154 GFLOP/s that hour), oneDNN's packed products
(``packed_linear``) took 52.3 ms of one 8-row pass through SmolLM2-135M (its 121 weights read
from memory, not cache) where this kernel took 37.5, and 96.7 ms of a 32-row pass where this
took 84.5 (``bench/decode_pass.py --rows 8`` and ``--rows 32 --length 45 --spread 1``, one run
of each in turn; ``tests/unit/test_panel_kernel.py`` checks the numbers it gives).

The kernel is short C: a weight ``[out, in]`` is copied into panels of 16 outputs,
``[out / 16, in, 16]``, so a panel's weights for one input lie side by side; a tile of up to six
rows keeps its sums for one or two panels (12 to 24 outputs per row) in registers and walks the
inputs once, each step loading the panel's 16 weights and broadcasting one input of each row
(AVX2 fused multiply-adds). Panels are shared out among the threads (OpenMP, torch's own
runtime, so no second thread pool); a tile of rows leaves a panel in cache for the next tile.
The copy into panels is C too (``panel_pack``): the parts of a stacked weight (queries, keys
and values; gate and up) and a norm's weight folded in, in one pass, a panel's inputs
transposed eight at a time in registers. The engine packs each weight version once (every
step, in a run): SmolLM2-135M's took 0.41-0.45 s with torch's copies (stack and scale, then
transpose) and takes 0.26-0.27 s so, most of it the first touch of the new memory's pages
(medians of 10 builds after ``malloc_trim``, 2-core AVX2 EPYC, one run of each in turn).

Every output is one chain of fused multiply-adds over its inputs in order, from zero, then its
bias: the same operations whatever the rows beside it, so a row gets the same bits at any count
and place (the engine's seeded replies rely on it; ``packed_linear.row_window`` checks it).

``built`` compiles it (and ``attention_kernel``'s source) into a cache kept per machine.

The panels live in ordinary 4 KiB pages. In 2 MiB pages (``madvise(MADV_HUGEPAGE)``) a pass
read them faster, side by side in one process (2-core AVX2 EPYC: 32 rows 105.2 -> 100.7 ms,
8 rows 55.4 -> 47.8), but a run packs every step's weights into fresh memory, and under
Linux's default ``defrag=madvise`` each fresh huge page may wait for the kernel to compact
memory: in ``bench/grpo_step.py``'s loop a pack took 0.9-1.5 s so, against 0.2-0.26 s.

It is used for float32 weights on CPUs whose best kernels are AVX2 (``preferred``); oneDNN's
AVX-512 and AMX kernels are wider. ``PALAESTRA_PANEL_PRODUCTS=0`` turns it off, ``=1`` uses it
on any CPU with AVX2 and FMA. It needs a C compiler (``$CC``, else ``cc``): where none works,
generation uses oneDNN's products and one log line says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PANEL = 16
"""Outputs per panel: two AVX2 vectors of float32."""

TILES = ((6, 1), (5, 1), (4, 1), (3, 2), (3, 1), (2, 2), (2, 1), (1, 2), (1, 1))
"""(rows, panels) of the tiles compiled: at most 12 sums (registers) at once."""

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

SETTING = "PALAESTRA_PANEL_PRODUCTS"


def _tile(rows: int, panels: int) -> str:
    """C for one tile: ``rows`` rows by ``panels`` panels, sums in registers."""
    vectors = range(2 * panels)
    lines = [
        f"static void tile_{rows}x{panels}(const float *x, int64_t ldx, int64_t k,"
        " const float *p, int64_t ps, const float *bias, float *y, int64_t ldy, int64_t cols) {",
        f"  float o[{16 * panels}] __attribute__((aligned(32)));",
    ]
    for r in range(rows):
        lines.append(f"  const float *x{r} = x + {r} * ldx;")
        lines += [f"  __m256 c{r}_{v} = _mm256_setzero_ps();" for v in vectors]
    lines.append("  for (int64_t i = 0; i < k; i++) {")
    for v in vectors:
        lines.append(
            f"    __m256 w{v} = _mm256_load_ps(p + {v // 2} * ps + i * 16 + {8 * (v % 2)});"
        )
    for r in range(rows):
        lines.append(f"    __m256 a{r} = _mm256_broadcast_ss(x{r} + i);")
        lines += [f"    c{r}_{v} = _mm256_fmadd_ps(a{r}, w{v}, c{r}_{v});" for v in vectors]
    lines.append("  }")
    for r in range(rows):
        lines += [f"  _mm256_store_ps(o + {8 * v}, c{r}_{v});" for v in vectors]
        lines.append(
            f"  for (int64_t c = 0; c < cols && c < {16 * panels}; c++)"
            f" y[{r} * ldy + c] = bias ? o[c] + bias[c] : o[c];"
        )
    lines.append("}")
    return "\n".join(lines)


_DRIVER = r"""
/* y[m, n] = x[m, k] . W[n, k]^T + bias[n], W in panels: panels[n / 16][k][16]. Panels go to the
   threads two at a time; rows go through each pair six at a time, then what is left. */
void panel_product(const float *x, int64_t m, int64_t ldx, int64_t k, const float *panels,
                   int64_t n, const float *bias, float *y, int64_t ldy, int threads)
{
    int64_t blocks = (n + 15) / 16, ps = k * 16, pairs = (blocks + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < pairs; pair++) {
        int64_t b = 2 * pair, col = b * 16, cols = n - col;
        int two = b + 1 < blocks;
        const float *p = panels + b * ps;
        const float *b0 = bias ? bias + col : 0, *b1 = bias ? bias + col + 16 : 0;
        int64_t c0 = cols < 16 ? cols : 16, r = 0;
        const float *xr = x;
        float *yr = y + col;
        for (; r + 6 <= m; r += 6, xr += 6 * ldx, yr += 6 * ldy) {
            tile_6x1(xr, ldx, k, p, ps, b0, yr, ldy, c0);
            if (two) tile_6x1(xr, ldx, k, p + ps, ps, b1, yr + 16, ldy, cols - 16);
        }
        switch (m - r) {
        case 5:
            tile_5x1(xr, ldx, k, p, ps, b0, yr, ldy, c0);
            if (two) tile_5x1(xr, ldx, k, p + ps, ps, b1, yr + 16, ldy, cols - 16);
            break;
        case 4:
            tile_4x1(xr, ldx, k, p, ps, b0, yr, ldy, c0);
            if (two) tile_4x1(xr, ldx, k, p + ps, ps, b1, yr + 16, ldy, cols - 16);
            break;
        case 3:
            if (two) tile_3x2(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            else tile_3x1(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            break;
        case 2:
            if (two) tile_2x2(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            else tile_2x1(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            break;
        case 1:
            if (two) tile_1x2(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            else tile_1x1(xr, ldx, k, p, ps, b0, yr, ldy, cols);
            break;
        }
    }
}
"""


_PACK = r"""
/* Eight rows of eight floats transposed in registers: r[c] becomes (r0[c], ..., r7[c]). */
static inline void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int q = 0; q < 4; q++) {
        t[2 * q] = _mm256_unpacklo_ps(r[2 * q], r[2 * q + 1]);
        t[2 * q + 1] = _mm256_unpackhi_ps(r[2 * q], r[2 * q + 1]);
    }
    for (int h = 0; h < 2; h++) {
        u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
}

/* panels[b][i][j] = rows[16 b + j][i] * scale[i] (scale optional), zeros past the last row:
   the rows may lie anywhere (the parts of a stacked weight), and each is read once. A whole
   panel goes eight inputs at a time, its two halves transposed in registers. */
void panel_pack(const int64_t *rows, int64_t out, int64_t k, const float *scale, float *panels)
{
    for (int64_t b = 0; b < (out + 15) / 16; b++) {
        const float *src[16];
        int64_t n = out - 16 * b < 16 ? out - 16 * b : 16, i = 0;
        float *p = panels + b * k * 16;
        for (int64_t j = 0; j < n; j++) src[j] = (const float *)rows[16 * b + j];
        if (n == 16) {
            for (; i + 8 <= k; i += 8) {
                __m256 lo[8], hi[8];
                for (int j = 0; j < 8; j++) {
                    lo[j] = _mm256_loadu_ps(src[j] + i);
                    hi[j] = _mm256_loadu_ps(src[j + 8] + i);
                }
                transpose8(lo);
                transpose8(hi);
                for (int c = 0; c < 8; c++) {
                    if (scale) {
                        __m256 s = _mm256_broadcast_ss(scale + i + c);
                        lo[c] = _mm256_mul_ps(lo[c], s);
                        hi[c] = _mm256_mul_ps(hi[c], s);
                    }
                    _mm256_store_ps(p + (i + c) * 16, lo[c]);
                    _mm256_store_ps(p + (i + c) * 16 + 8, hi[c]);
                }
            }
        }
        for (; i < k; i++) {
            float *q = p + i * 16;
            for (int64_t j = 0; j < n; j++) q[j] = scale ? src[j][i] * scale[i] : src[j][i];
            for (int64_t j = n; j < 16; j++) q[j] = 0.0f;
        }
    }
}
"""


def source() -> str:
    """The kernel's C source."""
    tiles = "\n\n".join(_tile(rows, panels) for rows, panels in TILES)
    return f"#include <immintrin.h>\n#include <stdint.h>\n\n{tiles}\n{_DRIVER}\n{_PACK}"


def cpu_runs_avx2() -> bool:
    """An x86-64 CPU with AVX2 and FMA (read from /proc/cpuinfo, Linux's list of flags)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return "avx2" in flags and "fma" in flags


def kernel_cache() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/palaestra/kernels``, by default
    ``~/.cache/palaestra/kernels``. A cache of this machine's, shared by every palaestra home
    (a test's or a bench's too): deleting it costs one build."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "palaestra" / "kernels"


class NotBuilt(Exception):
    """Why the kernel is not here: said in the one log line."""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use into ``kernel_cache()`` (a file named by the
    hash of its source and flags, so it builds once per machine, in a second or two); None,
    with one log line saying why, where this CPU cannot run it or it cannot be built or
    loaded (no C compiler, a compiler error, a cache folder that cannot be written)."""
    if not cpu_runs_avx2():
        return None
    try:
        lib = ctypes.CDLL(str(built("panel", source())))
    except (NotBuilt, OSError) as error:
        logger.warning("panel kernel: %s; generation uses oneDNN's products", error)
        return None
    lib.panel_product.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
    ]  # fmt: skip
    lib.panel_product.restype = None
    lib.panel_pack.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
    ]  # fmt: skip
    lib.panel_pack.restype = None
    return lib


def built(name: str, code: str) -> Path:
    """The shared library of C ``code`` in ``kernel_cache()`` (``name-<hash of code and
    flags>.so``), compiled there first if missing; ``NotBuilt`` says why it cannot be."""
    digest = hashlib.sha256("\n".join((code, *FLAGS)).encode()).hexdigest()[:16]
    folder = kernel_cache()
    library_file = folder / f"{name}-{digest}.so"
    if library_file.exists():
        return library_file
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NotBuilt("no C compiler here (cc, or $CC)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        c_file, so_file = Path(scratch, f"{name}.c"), Path(scratch, f"{name}.so")
        c_file.write_text(code)
        command = [compiler, *FLAGS, str(c_file), "-o", str(so_file)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NotBuilt(f"{compiler} could not build it ({error})") from error
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise NotBuilt(f"{compiler} could not build it ({last})")
        os.replace(so_file, library_file)  # whole, or not there: another process may race
    return library_file


def preferred(dtype: torch.dtype) -> bool:
    """Whether generation products of ``dtype`` weights use panels here: float32, on a CPU
    whose best torch kernels are AVX2 (or wherever ``PALAESTRA_PANEL_PRODUCTS=1``), unless
    ``PALAESTRA_PANEL_PRODUCTS=0``; and the kernel builds."""
    setting = os.environ.get(SETTING, "")
    if dtype != torch.float32 or setting == "0":
        return False
    if setting != "1" and torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    return library() is not None


@dataclass(frozen=True)
class Panels:
    """A float32 weight ``[out, in]`` copied into panels for ``product``."""

    panels: torch.Tensor
    """``[ceil(out / 16), in, 16]``, zeros past the weight's last output."""
    shape: tuple[int, int]
    """The weight's ``(out, in)``."""

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes


def pack(
    weights: torch.Tensor | Sequence[torch.Tensor], scale: torch.Tensor | None = None
) -> Panels:
    """``weights`` (float32 ``[out, in]``, or several stacked along their outputs) copied into
    panels, each input times ``scale[input]`` where given (a norm's weight folded in), in one
    pass over them: the engine packs every weight version, each step's in a run."""
    parts = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    parts = [
        part.detach() if part.stride(-1) == 1 else part.detach().contiguous() for part in parts
    ]
    inputs = parts[0].shape[1]
    if any(
        part.dtype != torch.float32 or part.dim() != 2 or part.shape[1] != inputs for part in parts
    ):
        raise ValueError(
            "panels pack float32 [out, in] weights of one width; got "
            + ", ".join(f"{tuple(part.shape)} {part.dtype}" for part in parts)
        )
    if scale is not None:
        scale = scale.detach().to(torch.float32).contiguous()
        if scale.shape != (inputs,):
            raise ValueError(f"a scale of shape {tuple(scale.shape)} for {inputs} inputs")
    # Each output's row, wherever its part lies: the address of its first input.
    rows = torch.cat(
        [part.data_ptr() + 4 * part.stride(0) * torch.arange(part.shape[0]) for part in parts]
    )
    out = rows.shape[0]
    panels = torch.empty(-(-out // PANEL), inputs, PANEL)
    library().panel_pack(
        rows.data_ptr(), out, inputs, None if scale is None else scale.data_ptr(),
        panels.data_ptr(),
    )  # fmt: skip
    return Panels(panels, (out, inputs))


def product(packed: Panels, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``rows W^T + bias`` for float32 ``rows`` ``[m, in]``: ``[m, out]``."""
    out, inputs = packed.shape
    if rows.dtype != torch.float32 or rows.shape[-1] != inputs or rows.dim() != 2:
        raise ValueError(f"panel product of {tuple(rows.shape)} {rows.dtype} rows over a "
                         f"float32 weight of {inputs} inputs")  # fmt: skip
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = rows.new_empty(rows.shape[0], out)
    if rows.shape[0]:
        library().panel_product(
            rows.data_ptr(), rows.shape[0], rows.stride(0), inputs, packed.panels.data_ptr(),
            out, None if bias is None else bias.data_ptr(), y.data_ptr(), out,
            torch.get_num_threads(),
        )  # fmt: skip
    return y
