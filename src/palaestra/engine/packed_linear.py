"""The linear layers of a generation pass as oneDNN products over pre-packed weights.

A decode pass multiplies a few rows by every weight matrix of the model. For that shape the
default CPU product is slow (on a 2-core AVX2 machine, 4 to 8 rows through SmolLM2's 49152 x
576 lm head take 23 ms; oneDNN with its weights packed ahead takes 6 to 7 ms) and its result for
a row depends on how many rows share the product: one row takes another kernel than four. The
oneDNN product over weights packed for a batch of 64 gives every row the same bits from 1 row
to hundreds, so a seeded reply repeats whatever shares its passes, without padding the pass.

``PackedLinears(model)`` packs every ``nn.Linear`` of ``model`` once (a copy of the weights in
oneDNN's layout); ``with packed.active():`` routes those layers' forward through the packed
copies, and leaves the module as it was after. Training never sees them. ``packed_linears``
returns ``None`` where oneDNN is missing or its product is not row-invariant on this machine
(checked once per dtype), and the engine pads passes instead.
"""

from __future__ import annotations

import contextlib
import functools

import torch

PACKED_FOR_ROWS = 64
"""The batch size oneDNN packs the weights for; from 8 up its results no longer depend on the
rows in the product (measured on AVX2 and AVX-512 CPUs)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) copied into oneDNN's layout for ``product``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def product(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x W^T + bias`` over a weight ``pack`` made, for ``x`` of any leading shape."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def row_invariant(dtype: torch.dtype) -> bool:
    """Whether the packed product gives a row the same bits alone and among 2 to 67 others."""
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 80, generator=generator).to(dtype)
        x = torch.randn(68, 80, generator=generator).to(dtype)
        packed = pack(weight)
        alone = product(packed, None, x[:1])
        return all(
            torch.equal(product(packed, None, x[:rows])[:1], alone) for rows in (2, 3, 5, 8, 68)
        )
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
    """Whether packed products of weights like ``parameter`` run here and are row-invariant
    (oneDNN present, a CPU tensor, float32 or bfloat16)."""
    if parameter.device.type != "cpu" or parameter.dtype not in (torch.float32, torch.bfloat16):
        return False
    return torch.backends.mkldnn.is_available() and row_invariant(parameter.dtype)


def packed_linears(model: torch.nn.Module) -> PackedLinears | None:
    """Packed copies of ``model``'s linear weights, or ``None`` where this machine cannot give
    row-invariant products with them (``available``)."""
    return PackedLinears(model) if available(next(model.parameters())) else None
