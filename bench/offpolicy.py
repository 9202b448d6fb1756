"""Sampling ahead of training: the haiku run on the embedded model at max_staleness 0, 1 and 2,
side by side: steps per minute, reward after N steps, and where a step's time goes.

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/offpolicy.py [--steps 30]
        [--staleness 0,1,2] [--correction tis] [--backend local|ray] [--smoke]

Each run is what a user's run is (``TrainConfig.train()``: the first 10 training topics,
``SmolLM2_135M_Recipe``, seed 42), staleness > 0 with ``off_policy_correction``. Steps per
minute count the loop's own time (the sum of ``step_s``; model loading excluded). Reward is the
mean of the last 5 steps' ``reward_mean``. The medians of ``rollout_s`` (sampling and reward),
``train_s`` (the update), ``weight_sync_s`` and ``sample_wait_s`` (how long the loop waited for
the step's samples) give the arithmetic for a machine where sampler and learner do not share
cores: a synchronous step takes rollout + train + sync, an overlapped one max(rollout,
train + sync). Where they share cores (a laptop, this 2-core box) the overlap buys little.

``--smoke`` runs 2 steps of 2 prompts x 2 samples of 8 tokens per staleness, to check the
script end to end. Progress goes to stderr; the results, as JSON, to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from haiku_sweep import HaikuDataset, haiku_rm  # the tutorial's dataset and reward
from sweep_parallel import cpu_model

from palaestra import SmolLM2_135M, SmolLM2_135M_Recipe, TrainConfig

SPLIT = ("rollout_s", "train_s", "weight_sync_s", "sample_wait_s", "step_s")
SMOKE = {  # a smoke run also writes no optimiser state: CI's disk may be small
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "rollout_max_response_len": 8,
    "no_save_optim": True,
}


def run_at(staleness: int, args) -> dict:
    fields = dict(SMOKE) if args.smoke else {}
    if staleness:
        fields["off_policy_correction"] = args.correction
    if args.backend == "ray":
        fields |= {"backend": "ray", "num_rollout_workers": args.workers}
    config = TrainConfig(
        model=SmolLM2_135M(),
        dataset=HaikuDataset(hf_split="train[:10]"),
        recipe=SmolLM2_135M_Recipe(
            num_rollout=args.steps,
            max_staleness=staleness,
            custom_rm_function=haiku_rm,
            seed=42,
            save_interval=None,
            **fields,
        ),
        name=f"offpolicy-{staleness}",
    )
    started = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):  # the loop's step lines: stdout is the JSON
        rows = config.train().metrics()
    timed = rows[1:] or rows  # the first step warms up
    loop_s = sum(row["step_s"] for row in rows)
    return {
        "max_staleness": staleness,
        "steps": len(rows),
        "steps_per_minute": 60 * len(rows) / loop_s,
        "reward_last5": statistics.fmean(row["reward_mean"] for row in rows[-5:]),
        "rewards": [row["reward_mean"] for row in rows],
        "median": {name: statistics.median(row[name] for row in timed) for name in SPLIT},
        "staleness_mean": statistics.fmean(row.get("sample_staleness_mean", 0) for row in rows),
        "stale_dropped_groups": sum(row.get("stale_dropped_groups", 0) for row in rows),
        "wall_s": time.monotonic() - started,
    }


def overlap_arithmetic(synchronous: dict) -> dict:
    """What overlapping would make of the synchronous run's step where sampler and learner
    each have cores of their own: rollout + train + sync against max(rollout, train + sync)."""
    m = synchronous["median"]
    serial = m["rollout_s"] + m["train_s"] + m["weight_sync_s"]
    overlapped = max(m["rollout_s"], m["train_s"] + m["weight_sync_s"])
    return {"serial_s": serial, "overlapped_s": overlapped, "speedup": serial / overlapped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--correction", default="tis", choices=("none", "tis", "mis"))
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--workers", type=int, default=1, help="rollout workers on Ray")
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps per staleness")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 2
    SmolLM2_135M().weights_path()  # convert the GGUF once, outside the timings
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"{machine}; {args.steps} steps each on {args.backend}", file=sys.stderr, flush=True)
    runs = []
    for staleness in (int(k) for k in args.staleness.split(",")):
        row = run_at(staleness, args)
        runs.append(row)
        split = ", ".join(f"{name} {value:.2f}" for name, value in row["median"].items())
        print(
            f"staleness {staleness}: {row['steps_per_minute']:.2f} steps/min, reward (last 5) "
            f"{row['reward_last5']:+.2f}; median {split}",
            file=sys.stderr,
            flush=True,
        )
    result = {"bench": "offpolicy", "machine": machine, "backend": args.backend}
    result |= {"smoke": args.smoke, "steps": args.steps, "runs": runs}
    synchronous = [row for row in runs if row["max_staleness"] == 0]
    if synchronous:
        result["overlap_if_separate_cores"] = overlap_arithmetic(synchronous[0])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
