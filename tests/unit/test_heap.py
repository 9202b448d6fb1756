"""Freed heap memory goes back to the system when the learner asks."""

from __future__ import annotations

import os

import pytest
import torch

from palaestra.train.heap import _malloc_trim, release_free_memory


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
