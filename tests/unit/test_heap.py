"""Freed heap memory goes back to the system when the learner asks."""

from __future__ import annotations

import os

import pytest
import torch

from palaestra.train.heap import (
    _malloc_trim,
    file_mappings,
    in_mapping,
    own_memory,
    release_free_memory,
)


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_memory_freed_in_the_middle_of_the_heap_is_returned():
    # 96 KB blocks stay under glibc's mmap threshold: they come from the heap, and freed they
    # stay resident, since the block kept last holds the heap's top in place.
    blocks = [torch.ones(24_000) for _ in range(3_000)]  # 275 MiB, every page written
    last = blocks[-1]
    del blocks
    before = resident_mib()
    assert release_free_memory()
    after = resident_mib()
    assert before - after > 200, (before, after)
    assert float(last.sum()) == 24_000  # what is still held is untouched


@pytest.mark.skipif(not file_mappings(), reason="needs /proc/self/maps")
def test_parameters_loaded_from_a_weights_file_move_into_the_processs_memory(tmp_path):
    from palaestra import Recipe
    from palaestra.models.loading import load_causal_lm
    from palaestra.train.learner import Learner
    from tests.support.tiny_models import save_tiny_model_dir

    folder = save_tiny_model_dir(tmp_path / "model")
    model = load_causal_lm(str(folder), torch.float32)
    parameters = list(model.parameters())
    expected = [p.detach().clone() for p in parameters]
    # transformers maps the safetensors file and leaves the tensors in it (no copy)
    mapped = [in_mapping(p.data_ptr(), file_mappings()) for p in parameters]
    assert all(mapped), mapped
    frozen = parameters[0]
    frozen.requires_grad_(False)  # never written: it may stay in the file

    learner = Learner(model, Recipe(lr=1e-3))
    assert [p for group in learner.optimizer.param_groups for p in group["params"]] == parameters[
        1:
    ]
    ranges = file_mappings()
    assert in_mapping(frozen.data_ptr(), ranges)
    assert not any(in_mapping(p.data_ptr(), ranges) for p in parameters[1:])
    assert all(torch.equal(p, e) for p, e in zip(parameters, expected, strict=True))
    assert own_memory(parameters[1:]) == 0  # nothing left to copy


def test_an_address_is_in_a_mapping_from_its_start_up_to_its_end():
    ranges = [(100, 200), (300, 400)]
    inside = [a for a in (99, 100, 199, 200, 250, 300, 399, 400) if in_mapping(a, ranges)]
    assert inside == [100, 199, 300, 399]
    assert not in_mapping(5, [])
