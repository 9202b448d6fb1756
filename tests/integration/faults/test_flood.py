"""A small flood on a real endpoint: every request is answered, refused cleanly, or dropped by
its own client; none is lost, the server's memory comes back, and it still answers.

The long form, and its measured numbers, is ``bench/flood.py``; this runs its ``flood`` at a
size CI can afford.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.tiny_runs import serving

BENCH = Path(__file__).resolve().parents[3] / "bench" / "flood.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_flood", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def flooded(tmp_path_factory, tiny_model_dir):
    """A real endpoint on the tiny model that holds at most 8 requests at once."""
    with serving(tmp_path_factory.mktemp("flood-home"), tiny_model_dir, "flood",
                 max_queued_requests=8) as endpoint:  # fmt: skip
        yield endpoint


def test_a_flood_loses_nothing_and_gives_its_memory_back(flooded):
    bench = load_bench()
    pid = flooded.info["pid"]
    # Warm-up at the same concurrency, so allocator pools are as full as they will get.
    asyncio.run(bench.flood(flooded.url, 64, 32, max_tokens=8, timeout_s=60))
    before = bench.rss_bytes(pid)

    started = time.monotonic()
    tally = asyncio.run(bench.flood(flooded.url, 400, 32, max_tokens=8, timeout_s=60))
    wall_s = time.monotonic() - started

    counts = tally.counts
    assert counts["lost"] == 0, dict(tally.lost)
    assert sum(counts.values()) == 400
    # 32 clients into a queue of 8: some are refused (cleanly, or they would count as lost),
    # plenty are answered, and every eighth request's client drops its stream on purpose.
    assert counts["refused"] > 0, dict(counts)
    assert counts["answered"] >= 100, dict(counts)
    assert 0 < counts["disconnected"] <= 50, dict(counts)
    assert wall_s < 60

    time.sleep(0.5)  # the dropped streams' last tokens
    after = bench.rss_bytes(pid)
    assert abs(after / before - 1) <= 0.10, (before, after)

    normal = httpx.post(
        f"{flooded.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert normal.status_code == 200
    assert normal.json()["choices"][0]["finish_reason"] in ("stop", "length")
