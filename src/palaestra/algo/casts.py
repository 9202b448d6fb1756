"""Weights cast to the compute dtype once per version instead of at every use.

Under bfloat16 autocast a float32 weight is cast at each product that reads it. In a
learner's update each weight is read four times or more per micro-batch (its groups' prompt
pass and their answers pass, forward and backward), and the weights only change at the
optimiser's step, so the same copy is made over and over: for SmolLM2-135M a cast of every
weight is a pass over 540 MB. ``weights_cast_once`` keeps the copies for the length of a
block and ``cast_weight`` hands them out; the layers that cast weights themselves
(``models.lean_layers`` and the lm head in ``algo.logprobs``) go through ``cast_weight``.
"""

from __future__ import annotations

import contextlib

import torch

_casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] | None = None
"""While ``weights_cast_once`` is open: (id(weight), dtype) -> (weight, its version, the cast)."""


@contextlib.contextmanager
def weights_cast_once():
    """Inside the block, ``cast_weight`` casts each weight to a dtype once and hands back the
    same copy at every later use, until the weight is changed in place (its version counter
    moves, as at an optimiser step), when it casts it again. The copies live until the block
    ends: one compute-dtype copy of every weight used (for SmolLM2-135M in bfloat16, 270 MB),
    against one cast per use without it. Blocks nest; the outermost one owns the copies."""
    global _casts
    outer = _casts
    if outer is None:
        _casts = {}
    try:
        yield
    finally:
        if outer is None:
            _casts = None


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` (without autograd history), cast once per version of the weight
    inside ``weights_cast_once``, else at every call."""
    if weight.dtype == dtype:
        return weight
    if _casts is None:
        return weight.detach().to(dtype)
    key = (id(weight), dtype)  # unique while the entry holds the weight
    hit = _casts.get(key)
    if hit is not None and hit[1] == weight._version:
        return hit[2]
    cast = weight.detach().to(dtype)
    _casts[key] = (weight, weight._version, cast)
    return cast


def casting_once() -> bool:
    """Whether a ``weights_cast_once`` block is open."""
    return _casts is not None
