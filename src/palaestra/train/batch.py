"""Building the trainer's batch: token sequences, response masks, advantages; and data order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from palaestra.types import Sample, TrainBatch


def build_train_batch(
    samples_B: Sequence[Sample], advantages_B: torch.Tensor, pad_id: int
) -> TrainBatch:
    """Prompt + response of each sample, right-padded to the longest, with a response mask
    aligned to next-token logits (see ``TrainBatch.mask_B_T``)."""
    lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples_B]
    width = max(lengths)
    input_ids_B_T = torch.full((len(samples_B), width), pad_id, dtype=torch.long)
    attention_mask_B_T = torch.zeros((len(samples_B), width), dtype=torch.long)
    mask_B_T = torch.zeros((len(samples_B), width), dtype=torch.float32)
    for b, sample in enumerate(samples_B):
        prompt_len, total = len(sample.prompt_token_ids), lengths[b]
        input_ids_B_T[b, :total] = torch.tensor(sample.prompt_token_ids + sample.response_token_ids)
        attention_mask_B_T[b, :total] = 1
        # Logits at t predict token t + 1: response tokens prompt_len .. total - 1 are
        # predicted from positions prompt_len - 1 .. total - 2.
        mask_B_T[b, prompt_len - 1 : total - 1] = 1
    return TrainBatch(input_ids_B_T, attention_mask_B_T, mask_B_T, advantages_B.float())


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Slices of ``size`` sequences of similar length, each trimmed to its own longest.

    Sorting by length first keeps padding low; the loss is a token sum over the whole step, so
    the order of sequences does not change it.
    """
    lengths_B = batch.attention_mask_B_T.sum(dim=1)
    order_B = torch.argsort(lengths_B, descending=True, stable=True)
    slices = []
    for start in range(0, len(order_B), size):
        rows = order_B[start : start + size]
        width = int(lengths_B[rows].max())
        slices.append(
            TrainBatch(
                batch.input_ids_B_T[rows, :width],
                batch.attention_mask_B_T[rows, :width],
                batch.mask_B_T[rows, :width],
                batch.advantages_B[rows],
            )
        )
    return slices


def prompt_order(num_rows: int, seed: int, cursor: int, count: int) -> list[int]:
    """Row indices ``cursor .. cursor + count`` of an endless sequence of shuffled epochs.

    Each epoch is a fresh permutation seeded by ``(seed, epoch)``, so any position can be
    recomputed from the cursor alone: a resumed run continues exactly where it stopped.
    """
    indices: list[int] = []
    position = cursor
    while len(indices) < count:
        epoch, offset = divmod(position, num_rows)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator).tolist()
        taken = order[offset : offset + count - len(indices)]
        indices += taken
        position += len(taken)
    return indices
