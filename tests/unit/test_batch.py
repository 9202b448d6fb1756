"""Batch building: token layout, the response mask's alignment, micro-batches, data order."""

import pytest
import torch

from palaestra.rollout.sampler import prompt_order
from palaestra.train.batch import build_train_batch, micro_batches
from palaestra.types import Sample


def _sample(prompt, response):
    return Sample(
        prompt="",
        response="",
        label=None,
        metadata={},
        index=0,
        group_index=0,
        prompt_token_ids=prompt,
        response_token_ids=response,
    )


def test_mask_marks_positions_whose_next_token_is_a_response_token():
    samples = [_sample([5, 6, 7], [8, 9]), _sample([5], [8, 9, 10])]
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0]), pad_id=0)
    assert batch.input_ids_B_T.tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 0]]
    assert batch.attention_mask_B_T.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # Sequence 0: logits at positions 2 and 3 predict the response tokens 8 and 9.
    # Sequence 1: positions 0, 1, 2 predict 8, 9, 10.
    assert batch.mask_B_T.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert batch.advantages_B.tolist() == [1.0, -1.0]


def test_micro_batches_sort_by_length_and_trim_padding():
    samples = [_sample([1], [2]), _sample([1, 1, 1], [2, 2, 2]), _sample([1, 1], [2])]
    batch = build_train_batch(samples, torch.tensor([0.1, 0.2, 0.3]), pad_id=0)
    first, second = micro_batches(batch, 2)
    # Longest first: lengths 6 and 3 together, then the length-2 one alone, trimmed to width 2.
    assert first.advantages_B.tolist() == pytest.approx([0.2, 0.3])
    assert first.input_ids_B_T.shape == (2, 6)
    assert second.input_ids_B_T.tolist() == [[1, 2]]
    assert second.mask_B_T.tolist() == [[1, 0]]
    # Every response token is in exactly one micro-batch.
    assert sum(float(m.mask_B_T.sum()) for m in (first, second)) == float(batch.mask_B_T.sum())


def test_prompt_order_is_a_permutation_per_epoch_and_resumable():
    order = prompt_order(num_rows=5, seed=3, cursor=0, count=10)
    assert sorted(order[:5]) == [0, 1, 2, 3, 4]
    assert sorted(order[5:]) == [0, 1, 2, 3, 4]
    assert order[:5] != order[5:] or order[:5] != list(range(5))
    # Resuming at any cursor gives the same sequence.
    assert prompt_order(5, 3, 0, 4) + prompt_order(5, 3, 4, 6) == order
    assert prompt_order(5, 4, 0, 10) != order
