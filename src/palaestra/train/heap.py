"""Giving the memory a step has freed back to the system.

glibc's allocator keeps what a process frees for later allocations, and hands the heap back
to the system only from its top. A training step frees a lot in the middle of the heap (the
rollout's caches, the passes' activations, the gradients after the update), so without help
the process's resident size grows towards the sum of its phases' high-water marks rather
than following what it holds. ``release_free_memory`` asks glibc (``malloc_trim``) to return
every free page between phases; a page used again later costs one zeroed page fault
(CHANGELOG.md's entry for it says what it saved and cost).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (not Linux, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; True if any were returned."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
