"""The linear layers of a generation pass as oneDNN products over pre-packed weights.

A decode pass multiplies a few rows by every weight matrix of the model. For that shape the
default CPU product is slow (on a 2-core AVX2 machine, 4 to 8 rows through SmolLM2's 49152 x
576 lm head take 23 ms; oneDNN with its weights packed ahead takes 6 to 7 ms) and its result for
a row depends on how many rows share the product: one row takes another kernel than four.

The packed product has such limits too, which depend on the CPU, the dtype and the weight's
shape. On a Xeon with AMX, bfloat16 products of more than 32 rows give some rows other bits
than fewer rows do (SmolLM2's head from 33 rows, its other weights from 33 rows in a few
elements), and a float32 product of one row over 1,100 or more inputs (SmolLM2's down
projection) other bits than two rows or more. So each packed weight's *row window* is found
once per shape on the machine (``row_window``): the fewest and most rows between which a row
gets the same bits whatever its count and place. ``product`` pads a smaller product up to the
fewest and splits a larger one into calls of at most the most, so a seeded reply repeats
whatever shares its passes, without padding the pass.

On CPUs whose best kernels are AVX2, float32 weights are packed into ``panel_kernel``'s panels
instead, and multiplied by its compiled kernel, faster for a pass's few rows; there every row
count holds by construction (``ANY_COUNT``).

``PackedLinears(model)`` packs every ``nn.Linear`` of ``model`` once (a copy of the weights in
``pack``'s layout); ``with packed.active():`` routes those layers' forward through the packed
copies, and leaves the module as it was after. Training never sees them. ``packed_linears``
returns ``None`` where oneDNN is missing or some weight has no row window on this machine, and
the engine pads passes instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from palaestra.engine import panel_kernel

PACKED_FOR_ROWS = 64
"""The batch size oneDNN packs the weights for."""

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
"""The row counts a window is checked at: the engine's passes come in these sizes (its
``slot_attention.bucket`` sizes), and a product split by a window's most rows into these."""

WINDOWS = tuple((fewest, most) for fewest in (1, 2, 4, 8) for most in (64, 32, 16, 8))
"""Candidate row windows, best first: a lone row padded least (a decode pass of one row
pays for its padding), then the most rows per call (a prompt's prefill is split into fewer
calls, each streaming the weight once)."""

ANY_COUNT = (1, 1 << 62)
"""The row window of panels: there a row gets the same bits at any count and place by
construction (each output one chain of multiply-adds over its inputs in order, whatever the
rows beside it: ``panel_kernel``, checked by ``tests/unit/test_panel_kernel.py``), so nothing
is probed (about 0.6 s of each engine's first build, most of it in the lm head's products),
padded or split."""

_windows: dict[tuple, tuple[int, int] | None] = {}


def pack(
    weights: torch.Tensor | Sequence[torch.Tensor], scale: torch.Tensor | None = None
) -> torch.Tensor | panel_kernel.Panels:
    """``weights`` (``[out, in]``, or several stacked along their outputs), each input times
    ``scale[input]`` where given (a norm folded in), copied into the layout ``product``
    multiplies by: panels where ``panel_kernel.preferred`` (one pass over the weights), else
    oneDNN's (the stacked, scaled copy first where there is more than the weight itself)."""
    parts = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if panel_kernel.preferred(parts[0].dtype):
        return panel_kernel.pack(parts, scale)
    if scale is None:
        weight = parts[0].detach() if len(parts) == 1 else torch.cat(parts)
    else:  # scaled as they are stacked: one pass, not a copy and then another
        weight = parts[0].new_empty(sum(part.shape[0] for part in parts), parts[0].shape[1])
        first = 0
        for part in parts:
            torch.mul(part, scale, out=weight[first : first + part.shape[0]])
            first += part.shape[0]
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def _call(packed, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    if isinstance(packed, panel_kernel.Panels):
        return panel_kernel.product(packed, bias, rows)
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def product(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x W^T + bias`` over a weight ``pack`` made, for ``x`` of any leading shape, in calls
    whose row counts lie in the weight's ``row_window``."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    fewest, most = row_window(packed) or (1, max(count, 1))
    if fewest <= count <= most:
        out = _call(packed, bias, rows)
    else:
        parts = []
        for first in range(0, max(count, 1), most):
            part = rows[first : first + most]
            short = fewest - part.shape[0]
            if short > 0:  # padding rows: zeros, whose results are dropped
                part = torch.cat((part, part.new_zeros(short, part.shape[1])))
            parts.append(_call(packed, bias, part)[: part.shape[0] - max(short, 0)])
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def row_window(packed: torch.Tensor) -> tuple[int, int] | None:
    """(fewest, most): the row counts between which ``product`` over ``packed`` gives each row
    the same bits whatever the count and the row's place among them, on this machine with this
    many threads; the first of ``WINDOWS`` that holds, found once per dtype and shape. None
    where none holds. Panels hold at ``ANY_COUNT``."""
    if isinstance(packed, panel_kernel.Panels):
        return ANY_COUNT
    key = (type(packed), packed.dtype, tuple(packed.shape), torch.get_num_threads())
    if key not in _windows:
        _windows[key] = next((w for w in WINDOWS if _holds(packed, *w)), None)
    return _windows[key]


def _holds(packed: torch.Tensor, fewest: int, most: int) -> bool:
    """Whether every count of ``ROW_COUNTS`` from ``fewest`` to ``most`` rows, taken from
    the first and the last of ``most`` random rows, gives those rows the bits they get all
    together. (oneDNN picks its kernels by shape, never by values: random rows will do.)"""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(most, packed.shape[1], generator=generator).to(packed.dtype)
    together = _call(packed, None, x)
    for count in (c for c in ROW_COUNTS if fewest <= c <= most):
        for first in {0, most - count}:
            if not torch.equal(
                _call(packed, None, x[first : first + count]), together[first : first + count]
            ):
                return False
    return True


@functools.cache
def runs(dtype: torch.dtype) -> bool:
    """Whether ``pack`` and ``product`` work for weights of ``dtype`` here."""
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        return torch.equal(_call(pack(weight), None, weight), torch.full((8, 8), 8.0).to(dtype))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinears:
    """oneDNN-packed copies of the weights of every ``nn.Linear`` in a module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
        with torch.no_grad():
            self.packed = [pack(layer.weight) for layer in self.layers]
        self.forwards = [
            functools.partial(product, packed, layer.bias)
            for layer, packed in zip(self.layers, self.packed, strict=True)
        ]

    @contextlib.contextmanager
    def active(self):
        """The layers compute with the packed weights inside the block."""
        for layer, forward in zip(self.layers, self.forwards, strict=True):
            layer.forward = forward
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward


def available(parameter: torch.Tensor) -> bool:
    """Whether packed products of weights like ``parameter`` run here (oneDNN present, a CPU
    tensor, float32 or bfloat16); each weight's ``row_window`` says whether they are
    row-invariant."""
    if parameter.device.type != "cpu" or parameter.dtype not in (torch.float32, torch.bfloat16):
        return False
    return torch.backends.mkldnn.is_available() and runs(parameter.dtype)


def row_invariant(packed_weights) -> bool:
    """Whether every one of ``packed_weights`` has a ``row_window`` here."""
    return all(row_window(packed) is not None for packed in packed_weights)


def packed_linears(model: torch.nn.Module) -> PackedLinears | None:
    """Packed copies of ``model``'s linear weights, or ``None`` where this machine cannot give
    row-invariant products with them (``available``, ``row_invariant``)."""
    if not available(next(model.parameters())):
        return None
    packed = PackedLinears(model)
    return packed if row_invariant(packed.packed) else None
