"""Weight-sync attestation: after each sync, an engine's digest of a few tensors it holds is
compared with the digest of the same tensors as the learner sent them.

A stale engine fails silently: it samples, the loss goes down for a while, and nothing says the
samples came from old weights (peers' most reported weight-sync bug). So after every sync each
engine hashes a few of the tensors it was sent, as it holds them (in its own dtype, after any
cast), and the sender hashes the same tensors cast to that dtype; a mismatch is a
``WeightSyncError`` naming the engine, the weight version and the tensors.

Which tensors: among those sent that the engine holds under the name and shape sent, the first
and the last in sorted order, and one that moves with the version (``version % len``), so that
over as many steps as tensors every one is checked. A LoRA policy sends its adapters only, so
the picks are adapters: what LoRA changes. An engine that stores some tensors under other names
or shapes (vLLM fuses q/k/v and gate/up, and its CPU build repacks linear weights) picks among
the rest; the sender hashes whichever tensors the engine reports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

PICKS = 3
"""Tensors attested per sync (and per engine): hashing a few keeps it cheap to leave on."""
MAX_HASHED = 2**20
"""Most values hashed of one tensor: a larger one is hashed on every k-th row (k by its shape
alone, so both sides take the same rows). The embedding of the 135M model (28M values) took
0.2 s a sync whole; a 4B model's is 14 times larger."""


class WeightSyncError(RuntimeError):
    """An engine does not hold the weights the learner sent it for a version."""


@dataclass(frozen=True)
class Attestation:
    """What one sync's attestation did: how many engines were checked, and how long it took
    (seconds; the loop logs it as ``attest_s``)."""

    engines: int
    seconds: float


def pick_names(names: Iterable[str], version: int, count: int = PICKS) -> list[str]:
    """Up to ``count`` of ``names``, the same on every process for a version: the first and the
    last in sorted order, and the one at ``version`` (modulo their number)."""
    ordered = sorted(names)
    if not ordered:
        return []
    indices = [0, len(ordered) - 1, version % len(ordered)]
    picked = list(dict.fromkeys(ordered[i] for i in indices))  # in order, without repeats
    return picked[:count]


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype, limit: int = MAX_HASHED) -> str:
    """blake2b (16 bytes) of ``tensor``'s values cast to ``dtype``, as raw little-endian bytes
    in row-major order: equal digests mean equal values, bit for bit, in that dtype. Over
    ``limit`` values, only rows 0, k, 2k, ... count (k = ceil(values / limit))."""
    tensor = tensor.detach()
    if tensor.numel() > limit:
        rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)
        tensor = rows[:: -(-tensor.numel() // limit)]
    data = tensor.to("cpu", dtype).contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


Held = dict[str, tuple[str, str]]
"""Digests an engine reports: tensor name -> (its dtype as torch names it, its digest)."""


def held_digests(
    tensors: Mapping[str, torch.Tensor], sent: Mapping[str, tuple], version: int
) -> Held:
    """Digests of a few of the tensors sent (``sent``: name -> shape), each in its own dtype:
    picked by ``version`` among those ``tensors`` holds under the name and shape sent."""
    held = [
        name
        for name, shape in sent.items()
        if name in tensors and tuple(tensors[name].shape) == tuple(shape)
    ]
    digests = {}
    for name in pick_names(held, version):
        tensor = tensors[name]
        digests[name] = (
            str(tensor.dtype).removeprefix("torch."),
            tensor_digest(tensor, tensor.dtype),
        )
    return digests


def sent_digests(weights: Mapping[str, torch.Tensor], held: Held) -> Held:
    """The digests of ``weights`` (what was sent) for the tensors in ``held``, each cast to the
    dtype the engine holds it in."""
    return {
        name: (dtype, tensor_digest(torch.as_tensor(weights[name]), getattr(torch, dtype)))
        for name, (dtype, _) in held.items()
    }


def shapes_of(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """Each tensor's shape by name: what an engine is told of a sync to pick what it attests."""
    return {name: tuple(tensor.shape) for name, tensor in weights.items()}


def compare(expected: Held, held: Held, engine: str, version: int) -> int:
    """How many tensors ``engine`` (in words: its index, pid, node) holds as sent;
    ``WeightSyncError`` naming the engine, the version and the tensors that differ."""
    wrong = sorted(name for name, value in held.items() if expected.get(name) != value)
    if wrong:
        raise WeightSyncError(
            f"weight sync to version {version}: {engine} does not hold what the learner sent "
            f"for {', '.join(wrong)} (it would sample from stale or corrupted weights)"
        )
    return len(held)


def attest_engine(engine, weights: Mapping[str, torch.Tensor], version: int, who: str) -> int:
    """Attest ``engine`` (one in this process, with ``weight_digests``) against ``weights``,
    what it was just sent for ``version``. Returns how many tensors were compared."""
    held = engine.weight_digests(shapes_of(weights), version)
    return compare(sent_digests(weights, held), held, who, version)
