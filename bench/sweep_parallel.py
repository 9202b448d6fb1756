"""How many variants of a sweep to run at once on this machine: the same two-variant group of
the haiku tutorial, one run at a time (each with every core) and two side by side (each with
half), timed as a whole and per step.

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/sweep_parallel.py [--steps 4] [--order 1,2]
    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/sweep_parallel.py --smoke
        # the two variants side by side, one small step each

A real run records its result under bench/results/sweep_parallel/ (``bench/results.py``).

It calls the code a user's sweep calls (``TrainingGroup.train(max_parallel=...)``). Columns:
the group's wall time from start to the last run's end, and the median seconds per step of
its runs (the first step of each run, which warms up, left out). The embedded model's
weights are converted once before timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from haiku_sweep import SMOKE_RECIPE, HaikuDataset, haiku_rm  # the tutorial's dataset, reward
from results import add_arguments, record, smoke_defaults

from palaestra import SmolLM2_135M, SmolLM2_135M_Recipe, TrainConfig, TrainingGroup


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_group(steps: int, max_parallel: int, smoke: bool = False) -> dict:
    model = SmolLM2_135M()
    small = SMOKE_RECIPE if smoke else {}
    base = TrainConfig(
        model=model,
        dataset=HaikuDataset(hf_split="train[:10]"),
        recipe=SmolLM2_135M_Recipe(
            num_rollout=steps, custom_rm_function=haiku_rm, seed=42, **small
        ),
        name="parallel",
    )
    group = TrainingGroup(base, grid={"recipe.lr": [3e-5, 1e-5]}, name=f"mp{max_parallel}")
    started = time.monotonic()
    result = group.train(max_parallel=max_parallel)
    wall = time.monotonic() - started
    # The first step of each run warms up (all of a one-step smoke run's steps: kept then).
    step_s = [row["step_s"] for run in result.results for row in run.metrics()[1:]] or [
        row["step_s"] for run in result.results for row in run.metrics()
    ]
    return {
        "max_parallel": max_parallel,
        "wall_s": wall,
        "median_step_s": statistics.median(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--order", default="1,2", help="max_parallel values, timed in this order")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, steps=1, order="2")
    SmolLM2_135M().weights_path()  # convert the GGUF once, outside the timings
    print(f"{cpu_model()}, {os.cpu_count()} cores; 2 variants x {args.steps} steps", flush=True)
    rows, headline = [], {}
    for max_parallel in [int(n) for n in args.order.split(",")]:
        row = time_group(args.steps, max_parallel, args.smoke)
        rows.append(row)
        print(
            f"max_parallel={row['max_parallel']}: group {row['wall_s']:.1f} s, "
            f"median step {row['median_step_s']:.2f} s",
            flush=True,
        )
        headline[f"max_parallel {max_parallel}: group s"] = round(row["wall_s"], 1)
        headline[f"max_parallel {max_parallel}: step s"] = round(row["median_step_s"], 2)
    record("sweep_parallel", args, {"steps": args.steps, "groups": rows}, headline)


if __name__ == "__main__":
    main()
