"""Sampling ahead of training: the haiku tutorial's run at max_staleness 0, 1 (and 2), each
with several seeds, side by side: how far it learns, steps per minute, and where a step's time
goes.

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/offpolicy.py [--steps 30]
        [--staleness 0,1] [--seeds 42,1] [--correction tis] [--backend local|ray]
        [--workers 1] [--smoke] [--results-dir DIR]

Each run is the tutorial's evaluated training as ``bench/haiku_sweep.py`` runs it
(``TrainConfig.train()``: the first 10 training topics, 4 prompts x 8 samples a step,
``SmolLM2_135M_Recipe``'s preset, scored every 10 steps on the test split's 60 topics), with
``max_staleness`` set and, above 0, ``off_policy_correction``. "Learns as far" is judged by the
test score after the last step: a staleness's seeds against the synchronous seeds' spread (the
lowest to the highest of them). Beside it: the mean reward and the share of three-line answers
over the last 5 steps' training samples.

Steps per minute count the loop's own time (the sum of ``step_s``; model loading and the
evaluations' share of a step excluded where the metrics split it out). The medians of
``rollout_s`` (sampling and reward), ``train_s`` (the update), ``weight_sync_s`` and
``sample_wait_s`` (how long the loop waited for the step's samples) give the arithmetic for a
machine where sampler and learner do not share cores: a synchronous step takes rollout + train
+ sync, an overlapped one max(rollout, train + sync). Where they share cores (a laptop, this
2-core box) the overlap buys little.

``--smoke`` runs 2 steps of 2 prompts x 2 samples of 8 tokens per staleness, one seed, scored on
4 test topics, to check the script end to end. Progress goes to stderr; a real run records its
result under bench/results/offpolicy/ (``bench/results.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time

from haiku_sweep import GRID, base_score, config_for, summarise
from results import add_arguments, record, smoke_defaults
from sweep_parallel import cpu_model

from palaestra import SmolLM2_135M

SPLIT = ("rollout_s", "train_s", "weight_sync_s", "sample_wait_s", "step_s")


def run_at(staleness: int, seed: int, args) -> dict:
    fields: dict = {"max_staleness": staleness}
    if staleness:
        fields["off_policy_correction"] = args.correction
    if args.backend == "ray":
        fields |= {"backend": "ray", "num_rollout_workers": args.workers}
    if args.smoke:
        fields["no_save_optim"] = True  # CI's disk may be small
    lr, temperature, length = GRID[0]  # the preset's own values
    config = config_for(
        lr,
        temperature,
        length,
        args.steps,
        seed,
        args.smoke,
        name=f"offpolicy-{args.backend}-k{staleness}-seed{seed}",
        **fields,
    )
    started = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):  # the loop's step lines
        result = config.train()
    rows = result.metrics()
    timed = rows[1:] or rows  # the first step warms up
    loop_s = sum(row["step_s"] for row in rows)
    summary = summarise(result, args.steps)
    last_eval = max(summary["eval"], default=None)
    return {
        "max_staleness": staleness,
        "seed": seed,
        "steps": len(rows),
        "test_score": summary["eval"][last_eval] if last_eval else None,
        "eval": summary["eval"],
        "train_reward_last5": summary["train_reward_last5"],
        "three_lines_last5": summary["three_lines_last5"],
        "steps_per_minute": 60 * len(rows) / loop_s,
        "rewards": [row["reward_mean"] for row in rows],
        "median": {name: statistics.median(row[name] for row in timed) for name in SPLIT},
        "staleness_mean": statistics.fmean(row.get("sample_staleness_mean", 0) for row in rows),
        "stale_dropped_groups": sum(row.get("stale_dropped_groups", 0) for row in rows),
        "importance_capped_fraction": statistics.fmean(
            row.get("importance_capped_fraction", 0) for row in rows
        ),
        "run_id": summary["run_id"],
        "wall_s": time.monotonic() - started,
    }


def overlap_arithmetic(synchronous: dict) -> dict:
    """What overlapping would make of the synchronous run's step where sampler and learner
    each have cores of their own: rollout + train + sync against max(rollout, train + sync)."""
    m = synchronous["median"]
    serial = m["rollout_s"] + m["train_s"] + m["weight_sync_s"]
    overlapped = max(m["rollout_s"], m["train_s"] + m["weight_sync_s"])
    return {"serial_s": serial, "overlapped_s": overlapped, "speedup": serial / overlapped}


def compare(runs: list[dict]) -> dict:
    """Per staleness: the seeds' test scores, their mean and range, and whether each
    staleness's mean lies within (or above) the synchronous seeds' spread."""
    by_k: dict[int, list[dict]] = {}
    for row in runs:
        by_k.setdefault(row["max_staleness"], []).append(row)
    table = {}
    for k, rows in sorted(by_k.items()):
        scores = [row["test_score"] for row in rows if row["test_score"] is not None]
        table[k] = {
            "seeds": [row["seed"] for row in rows],
            "test_scores": scores,
            "test_mean": statistics.fmean(scores) if scores else None,
            "test_range": [min(scores), max(scores)] if scores else None,
            "three_lines_last5_mean": statistics.fmean(row["three_lines_last5"] for row in rows),
            "steps_per_minute_mean": statistics.fmean(row["steps_per_minute"] for row in rows),
        }
    synchronous = table.get(0)
    for k, entry in table.items():
        if k and synchronous and synchronous["test_range"] and entry["test_mean"] is not None:
            entry["within_sync_spread"] = entry["test_mean"] >= synchronous["test_range"][0]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", default="0,1")
    parser.add_argument("--seeds", default="42,1", help="comma-separated run seeds")
    parser.add_argument("--correction", default="tis", choices=("none", "tis", "mis"))
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--workers", type=int, default=1, help="rollout workers on Ray")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, steps=2, seeds="42")
    SmolLM2_135M().weights_path()  # convert the GGUF once, outside the timings
    machine = f"{cpu_model()}, {args.steps} steps each on {args.backend}"
    print(machine, file=sys.stderr, flush=True)
    stalenesses = [int(k) for k in args.staleness.split(",")]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    lr, temperature, length = GRID[0]
    base = base_score(config_for(lr, temperature, length, args.steps, seeds[0], args.smoke))
    print(f"base model's test score {base:+.2f}", file=sys.stderr, flush=True)
    runs = []
    for seed, staleness in itertools.product(seeds, stalenesses):  # seeds outer: pairs adjacent
        row = run_at(staleness, seed, args)
        runs.append(row)
        split = ", ".join(f"{name} {value:.2f}" for name, value in row["median"].items())
        print(
            f"staleness {staleness} seed {seed}: test score {row['test_score']:+.2f}, "
            f"three lines (last 5) {row['three_lines_last5']:.0%}, "
            f"{row['steps_per_minute']:.2f} steps/min; median {split}",
            file=sys.stderr,
            flush=True,
        )
    table = compare(runs)
    figures = {"backend": args.backend, "steps": args.steps, "base_test_score": base}
    figures |= {"correction": args.correction, "runs": runs, "by_staleness": table}
    synchronous = [row for row in runs if row["max_staleness"] == 0]
    if synchronous:
        figures["overlap_if_separate_cores"] = overlap_arithmetic(synchronous[0])
    headline: dict = {"backend": args.backend, "base": round(base, 2)}
    for k, entry in table.items():
        low, high = entry["test_range"] or (None, None)
        headline[f"k={k} test score (seeds)"] = (
            f"{entry['test_mean']:+.2f} ({low:+.2f} to {high:+.2f})" if low is not None else "n/a"
        )
        headline[f"k={k} steps/min"] = round(entry["steps_per_minute_mean"], 2)
    for k, entry in table.items():
        print(f"max_staleness {k}: {entry}", file=sys.stderr)
    record("offpolicy", args, figures, headline)


if __name__ == "__main__":
    main()
