"""Where one decode pass of the torch engine's fused pass goes: the products, and the rest.

    python bench/decode_pass.py [--rows 8] [--length 100] [--spread 8] [--repeats 40]
                                [--dtype float32|bfloat16]
    python bench/decode_pass.py --smoke    # 2 rows, 2 repeats: checks the code runs

A real run records its result under bench/results/decode_pass/ (``bench/results.py``).

The pass a running decoder makes once its rows are past their prompts: ``--rows`` rows of
SmolLM2-135M-Instruct in ``--dtype`` (the engine's weights and cache; float32 unless named),
each decoding one token, in consecutive slots, at lengths
``length, length + spread, ...`` (so they attend over different numbers of keys), their slots
filled with random keys and values. ``FusedPass.forward`` runs that pass ``--repeats`` times
after warm-up; the median is the pass. It runs as many times again with a clock around each
product with the weights: in each run, the products' sum, and the run less them, the rest
(norms, rotary, attention over the cache, the ops between them), each op as it runs in a
pass, after the weights streaming through the products have evicted the caches. Both are
medians over those runs.

Beside them, what bounds the products: the bytes of packed weights a pass reads (every
layer's four products and the head), the rate the products read them at (those bytes over
the products' time), and the rate this machine reads memory at all (the best of a few sums
over 256 MiB, past any cache, on the bench's threads). Where the two rates
are close, the products wait on memory, and only the rest is left to win at this row count.

The products are palaestra's compiled panel kernel where the engine uses it (float32 on CPUs
whose best kernels are AVX2, ``engine/panel_kernel.py``), else oneDNN's; the result names which.
``PALAESTRA_PANEL_PRODUCTS=0`` in front of the command times oneDNN's on the same machine.

The work is fixed (no sampling, no replies that differ from one version to the next), so two
versions of the code can be compared on it, one run of each in turn. Prints a markdown table,
then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from results import add_arguments, record, skip, smoke_defaults


def median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def read_gbps(repeats: int) -> float:
    """GB/s at which this process reads memory: the best of ``repeats`` sums over 256 MiB of
    float32, past any CPU cache (``devices.measure_cpu`` times a copy the same way for the
    plan; a sum reads only, as the products read their weights)."""
    buffer = torch.ones(64 << 20)
    buffer.sum()  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best / 1e9


def main() -> None:
    from palaestra import SmolLM2_135M
    from palaestra.engine import fused_pass, panel_kernel, slot_attention
    from palaestra.models.loading import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=100, help="the first row's length")
    parser.add_argument("--spread", type=int, default=8, help="between consecutive rows")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, rows=2, length=16, repeats=2)

    torch.set_num_threads(os.cpu_count() or 1)
    config = SmolLM2_135M()
    dtype = getattr(torch, args.dtype)
    model = load_causal_lm(config.weights_path(), dtype, "cpu", config.revision).eval()
    fused = fused_pass.fused_pass(model)
    if fused is None:
        if args.smoke:  # the engine takes its other path here: nothing of this bench's to run
            return skip("the fused pass", "packed products are unavailable on this machine")
        raise SystemExit("no fused pass on this machine (packed products unavailable)")
    lengths = [args.length + i * args.spread for i in range(args.rows)]
    kv = slot_attention.SlotKV(model.config, dtype, torch.device("cpu"))
    kv.reserve(args.rows, max(lengths) + 1)
    generator = torch.Generator().manual_seed(0)
    for store in kv.keys + kv.values:
        store.copy_(torch.randn(store.shape, generator=generator))  # cast by copy_
    # Row i sits in slot i; its token is written at position length - 1.
    segments = [slot_attention.Segment(i, n - 1, [100 + i]) for i, n in enumerate(lengths)]
    plan = slot_attention.SlotPlan(kv, segments)

    whole = median_ms(lambda: fused.forward(plan), args.repeats)
    product, spent = fused_pass.product, [0.0]

    def timed(packed, bias, x):
        started = time.perf_counter()
        out = product(packed, bias, x)
        spent[0] += time.perf_counter() - started
        return out

    def split() -> tuple[float, float]:
        """(products, rest) of one pass, in ms."""
        spent[0] = 0.0
        started = time.perf_counter()
        fused.forward(plan)
        return spent[0] * 1e3, (time.perf_counter() - started - spent[0]) * 1e3

    fused_pass.product = timed
    try:
        for _ in range(3):
            split()
        runs = [split() for _ in range(args.repeats)]
    finally:
        fused_pass.product = product
    products = statistics.median(p for p, _ in runs)
    rest = statistics.median(r for _, r in runs)
    weights = [
        fused.head,
        *(w for ly in fused.layers for w in (ly.qkv, ly.output, ly.gate_up, ly.down)),
    ]
    weight_bytes = sum(w.nbytes for w in weights)
    # Whose kernel multiplies: palaestra's panels (AVX2 CPUs, PALAESTRA_PANEL_PRODUCTS) or oneDNN.
    kernel = "panels" if isinstance(fused.head, panel_kernel.Panels) else "oneDNN"
    memory_gbps = read_gbps(3 if args.smoke else 10)
    report = {
        "rows": args.rows,
        "dtype": args.dtype,
        "lengths": lengths,
        "attention_groups": len(plan.decodes),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "products": kernel,
        "pass_ms": round(whole, 2),
        "products_ms": round(products, 2),
        "rest_ms": round(rest, 2),
        "weights_mb": round(weight_bytes / 1e6, 1),
        "products_read_gbps": round(weight_bytes / products / 1e6, 1),
        "memory_read_gbps": round(memory_gbps, 1),
    }
    print("| pass | products | rest | weights | products read | memory reads |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {whole:.1f} ms | {products:.1f} ms | {rest:.1f} ms | {weight_bytes / 1e6:.0f} MB "
        f"| {report['products_read_gbps']:.1f} GB/s | {memory_gbps:.1f} GB/s |"
    )
    print(json.dumps(report))
    headline = {
        "rows": args.rows,
        "dtype": args.dtype,
        "products": kernel,
        "pass ms": report["pass_ms"],
        "products ms": report["products_ms"],
    }
    headline |= {
        "rest ms": report["rest_ms"],
        "products GB/s": report["products_read_gbps"],
        "memory GB/s": report["memory_read_gbps"],
    }
    record("decode_pass", args, report, headline)


if __name__ == "__main__":
    main()
