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

Every output is one chain of fused multiply-adds over its inputs in order, from zero, then its
bias: the same operations whatever the rows beside it, so a row gets the same bits at any count
and place (the engine's seeded replies rely on it; ``packed_linear.row_window`` checks it).

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


def source() -> str:
    """The kernel's C source."""
    tiles = "\n\n".join(_tile(rows, panels) for rows, panels in TILES)
    return f"#include <immintrin.h>\n#include <stdint.h>\n\n{tiles}\n{_DRIVER}"


def _cpu_runs_it() -> bool:
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


class _NotBuilt(Exception):
    """Why the kernel is not here: said in the one log line."""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use into ``kernel_cache()`` (a file named by the
    hash of its source and flags, so it builds once per machine, in a second or two); None,
    with one log line saying why, where this CPU cannot run it or it cannot be built or
    loaded (no C compiler, a compiler error, a cache folder that cannot be written)."""
    if not _cpu_runs_it():
        return None
    try:
        lib = ctypes.CDLL(str(_built()))
    except (_NotBuilt, OSError) as error:
        logger.warning("panel kernel: %s; generation uses oneDNN's products", error)
        return None
    lib.panel_product.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
    ]  # fmt: skip
    lib.panel_product.restype = None
    return lib


def _built() -> Path:
    """The kernel's shared library in ``kernel_cache()``, compiled there first if missing."""
    code = source()
    digest = hashlib.sha256("\n".join((code, *FLAGS)).encode()).hexdigest()[:16]
    folder = kernel_cache()
    built = folder / f"panel-{digest}.so"
    if built.exists():
        return built
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise _NotBuilt("no C compiler here (cc, or $CC)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        c_file, so_file = Path(scratch, "panel.c"), Path(scratch, "panel.so")
        c_file.write_text(code)
        command = [compiler, *FLAGS, str(c_file), "-o", str(so_file)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise _NotBuilt(f"{compiler} could not build it ({error})") from error
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise _NotBuilt(f"{compiler} could not build it ({last})")
        os.replace(so_file, built)  # whole, or not there: another process may race
    return built


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


def pack(weight: torch.Tensor) -> Panels:
    """``weight`` (float32 ``[out, in]``) copied into panels."""
    out, inputs = weight.shape
    blocks = -(-out // PANEL)
    padded = weight.detach()
    if out % PANEL:  # zeros after the last output (a copy only for such shapes)
        padded = torch.cat((padded, padded.new_zeros(blocks * PANEL - out, inputs)))
    panels = padded.view(blocks, PANEL, inputs).transpose(1, 2).contiguous()
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
