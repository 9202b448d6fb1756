"""What the Ray backend costs on one machine: the same haiku run on the local backend and on Ray
with one rollout worker, side by side, and where a Ray step's time goes.

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/ray_overhead.py [--steps 10]
    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/ray_overhead.py --smoke
        # one small step on each backend (Ray's skipped, one line, where Ray is not installed)

A real run records its result under bench/results/ray_overhead/ (``bench/results.py``).

Both runs call what a user's run calls (``TrainConfig.train()``), from the same seed, so they
sample the same haikus. The Ray run starts a Ray instance of its own (included in neither step
time). Per step: rollout (sampling and reward), train (the learner's update), weight sync (the
learner's weights into every worker) and the whole step, each the median over the steps after
the first (which warms up; the learner actor, a fresh process, takes a few steps more to reach
its pace, so short runs overstate the overhead). Few cores here, so more workers would only
share them: the split is what a reader needs to see where time would go on a cluster.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

from haiku_sweep import SMOKE_RECIPE, HaikuDataset, haiku_rm  # the tutorial's dataset, reward
from results import add_arguments, record, skip, smoke_defaults
from sweep_parallel import cpu_model

from palaestra import SmolLM2_135M, SmolLM2_135M_Recipe, TrainConfig

SPLIT = ("rollout_s", "train_s", "weight_sync_s", "step_s")


def time_run(steps: int, backend: str, smoke: bool = False) -> dict:
    extra = {"backend": "ray", "num_rollout_workers": 1} if backend == "ray" else {}
    extra |= SMOKE_RECIPE if smoke else {}
    config = TrainConfig(
        model=SmolLM2_135M(),
        dataset=HaikuDataset(hf_split="train[:10]"),
        recipe=SmolLM2_135M_Recipe(
            num_rollout=steps, custom_rm_function=haiku_rm, seed=42, **extra
        ),
        name=f"overhead-{backend}",
    )
    started = time.monotonic()
    result = config.train()
    rows = result.metrics()
    timed = rows[1:] or rows
    out = {name: statistics.median(row[name] for row in timed) for name in SPLIT}
    out |= {"wall_s": time.monotonic() - started, "reward": [r["reward_mean"] for r in rows]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--order", default="local,ray", help="backends, timed in this order")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, steps=1)
    backends = args.order.split(",")
    if "ray" in backends and importlib.util.find_spec("ray") is None:
        if not args.smoke:
            parser.error("the Ray backend needs Ray: pip install -e '.[ray]'")
        skip("ray", "Ray is not installed: pip install -e '.[ray]'")
        backends.remove("ray")
    SmolLM2_135M().weights_path()  # convert the GGUF once, outside the timings
    print(f"{cpu_model()}, {os.cpu_count()} cores; {args.steps} steps each", flush=True)
    results: dict[str, list[dict]] = {}
    for backend in backends:
        row = time_run(args.steps, backend, args.smoke)
        results.setdefault(backend, []).append(row)
        split = ", ".join(f"{name} {row[name]:.2f}" for name in SPLIT)
        print(f"{backend}: median {split}; run {row['wall_s']:.1f} s", flush=True)
        print(f"  rewards {' '.join(f'{r:+.2f}' for r in row['reward'])}", flush=True)
    headline = {
        f"{backend} step s": round(statistics.median(r["step_s"] for r in rows), 2)
        for backend, rows in results.items()
    }
    if "local" in results and "ray" in results:
        local = statistics.median(r["step_s"] for r in results["local"])
        ray = statistics.median(r["step_s"] for r in results["ray"])
        sync = statistics.median(r["weight_sync_s"] for r in results["ray"])
        print(
            f"ray step / local step: {ray / local:.3f}x; ray weight sync {sync:.2f} s = "
            f"{100 * sync / ray:.1f}% of its step",
            flush=True,
        )
        headline |= {"ray / local": round(ray / local, 3), "ray weight sync s": round(sync, 2)}
    record("ray_overhead", args, {"steps": args.steps, "runs": results}, headline)


if __name__ == "__main__":
    main()
