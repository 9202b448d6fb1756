"""The trainer's batch: token sequences, loss masks and advantages as tensors, and its slices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from palaestra.types import Sample


@dataclass
class TrainBatch:
    """Right-padded token sequences of one step, ready for the policy's forward pass."""

    input_ids_B_T: torch.Tensor
    """Prompt followed by response tokens, padded on the right."""
    attention_mask_B_T: torch.Tensor
    """1 on real tokens (prompt and response), 0 on padding."""
    mask_B_T: torch.Tensor
    """1 where the *next-token prediction* at position t targets a trained response token.

    Aligned with the logits: ``mask_B_T[b, t] = 1`` means token ``t + 1`` of sequence ``b`` is a
    response token the model wrote, so its log-prob comes from the logits at position ``t``.
    """
    advantages_B: torch.Tensor
    """One advantage per sequence, broadcast over its response tokens."""
    sampler_logprobs_B_T: torch.Tensor | None = None
    """The sampler's log-prob of each response token, aligned like ``mask_B_T`` (position t
    holds token t + 1's), when the engine kept them for every sample."""
    old_logprobs_B_T: torch.Tensor | None = None
    """Log-probs under the policy that sampled the batch (the importance ratio's denominator),
    aligned like ``mask_B_T``; None: the policy being updated is that policy."""
    ref_logprobs_B_T: torch.Tensor | None = None
    """Log-probs under the KL reference, aligned like ``mask_B_T``, when a KL term is on."""
    importance_B_T: torch.Tensor | None = None
    """Off-policy correction's weight of each token's loss (``algo.importance``), when on."""

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        return TrainBatch(
            **{
                f.name: None if (value := getattr(self, f.name)) is None else value.to(device)
                for f in fields(self)
            }
        )


def build_train_batch(
    samples_B: Sequence[Sample],
    advantages_B: torch.Tensor,
    pad_id: int,
    mask_truncated: bool = False,
) -> TrainBatch:
    """Prompt + response of each sample, right-padded to the longest, with the sample's loss
    mask aligned to next-token logits (see ``TrainBatch.mask_B_T``).

    With ``mask_truncated``, responses cut at the length limit get an all-zero mask: they stay
    in the batch (and in their group's baseline) but add nothing to the loss; so do aborted
    episodes, always. The sampler's log-probs come along when every sample has them (a
    multi-turn sample has one for each response token, 0 where the environment wrote it).
    """
    lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples_B]
    width = max(lengths)
    input_ids_B_T = torch.full((len(samples_B), width), pad_id, dtype=torch.long)
    attention_mask_B_T = torch.zeros((len(samples_B), width), dtype=torch.long)
    mask_B_T = torch.zeros((len(samples_B), width), dtype=torch.float32)
    with_logprobs = all(s.response_logprobs is not None for s in samples_B)
    sampler_B_T = torch.zeros((len(samples_B), width)) if with_logprobs else None
    for b, sample in enumerate(samples_B):
        prompt_len, total = len(sample.prompt_token_ids), lengths[b]
        input_ids_B_T[b, :total] = torch.tensor(sample.prompt_token_ids + sample.response_token_ids)
        attention_mask_B_T[b, :total] = 1
        # Logits at t predict token t + 1: response tokens prompt_len .. total - 1 are
        # predicted from positions prompt_len - 1 .. total - 2.
        # An aborted episode stays in its group's baseline but is never trained on.
        skipped = sample.status == "aborted" or (
            mask_truncated and sample.finish_reason == "length"
        )
        if not skipped:
            mask_B_T[b, prompt_len - 1 : total - 1] = torch.tensor(
                sample.response_mask(), dtype=torch.float32
            )
        if sampler_B_T is not None:
            if len(sample.response_logprobs) != len(sample.response_token_ids):
                raise ValueError(
                    f"sample {sample.group_index} of prompt {sample.index}: "
                    f"{len(sample.response_logprobs)} sampler log-probs for "
                    f"{len(sample.response_token_ids)} response tokens"
                )
            sampler_B_T[b, prompt_len - 1 : total - 1] = torch.tensor(sample.response_logprobs)
    return TrainBatch(
        input_ids_B_T, attention_mask_B_T, mask_B_T, advantages_B.float(), sampler_B_T
    )


def take_rows(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
    """The sequences ``rows`` of ``batch``, trimmed to the longest of them."""
    width = int(batch.attention_mask_B_T[rows].sum(dim=1).max())

    def per_token(tensor_B_T: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor_B_T is None else tensor_B_T[rows, :width]

    return TrainBatch(
        per_token(batch.input_ids_B_T),
        per_token(batch.attention_mask_B_T),
        per_token(batch.mask_B_T),
        batch.advantages_B[rows],
        per_token(batch.sampler_logprobs_B_T),
        per_token(batch.old_logprobs_B_T),
        per_token(batch.ref_logprobs_B_T),
        per_token(batch.importance_B_T),
    )


def prefix_groups(
    input_ids_B_T: torch.Tensor, scored_B_T: torch.Tensor
) -> list[tuple[list[int], int]]:
    """Rows that share their context, each group with the length of that context.

    A row's context is its tokens before its first scored position (position t scores token
    t + 1, so a GRPO sample's context is its prompt but the last token): the part whose hidden
    states only feed later positions. Samples of one prompt share it. A row with nothing scored
    is a group of its own, with context length 0. Groups come in order of their first row.
    """
    first_B = torch.where(scored_B_T.any(dim=1), scored_B_T.int().argmax(dim=1), 0).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, start in enumerate(first_B):
        key = tuple(input_ids_B_T[b, :start].tolist()) if start else (-1 - b,)
        groups.setdefault(key, []).append(b)
    return [(rows, first_B[rows[0]]) for rows in groups.values()]


def micro_batch_rows(batch: TrainBatch, size: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: ``size`` sequences, samples of one prompt together
    (they share its pass, see ``train.scoring``), then by length.

    Groups go longest first, and rows within a group too, so padding stays low; every
    aggregation's normaliser is a count over the whole step (``LossScale``), so the order of
    sequences does not change the loss.
    """
    lengths_B = batch.attention_mask_B_T.sum(dim=1).tolist()
    groups = [rows for rows, _ in prefix_groups(batch.input_ids_B_T, batch.mask_B_T > 0)]
    groups.sort(key=lambda rows: -max(lengths_B[b] for b in rows))
    order_B = torch.tensor(
        [b for rows in groups for b in sorted(rows, key=lambda b: -lengths_B[b])]
    )
    return [order_B[start : start + size] for start in range(0, len(order_B), size)]


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Slices of ``size`` sequences of similar length, each trimmed to its own longest."""
    return [take_rows(batch, rows) for rows in micro_batch_rows(batch, size)]


def mini_batches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """``count`` consecutive slices of the batch, one per optimiser step of a rollout.

    Samples are group after group, so equal slices keep a group together when ``count``
    divides the number of groups. A slice left empty (fewer sequences than ``count``, after
    dynamic sampling) is skipped.
    """
    B = batch.input_ids_B_T.shape[0]
    return [take_rows(batch, rows) for rows in torch.arange(B).tensor_split(count) if len(rows)]
