"""The haiku tutorial as a user runs it: ``examples/haiku.py`` (``make haiku``) start to end, its
wall time, what it learned and the memory its processes held.

    .venv/bin/python bench/tutorial.py [--runs 3] [--first-run]
    .venv/bin/python bench/tutorial.py --smoke
        # the same script with one step per training run of 2 x 2 answers of 8 tokens,
        # evaluated on one topic: does the whole path still run?

Each run is ``python examples/haiku.py`` in a process of its own, from the repository root,
with a fresh ``PALAESTRA_HOME`` (runs, checkpoints and endpoints start empty). That home
shares the usual home's converted models and ``image_overlay`` environments, as a user's
second run of the script does; ``--first-run`` leaves them out, so the conversion of the
embedded model and the overlay's build (which needs PyPI) are timed too.

Figures per run, read from the script's own summary lines: the three average scores (base,
after 10 steps, after 30), how many replies were three lines long at each, and the wall time
of the whole process; besides, the largest memory of the script's process tree at any moment
(all its processes together: the endpoints, the training runs and the warm launchers, each
shared page once: proportional set sizes; records before the warm launcher summed resident
sizes, ``peak_rss_mib``), sampled every 0.2 s from /proc; and where the time went: the
training steps (each step's ``step_s`` from its run's metrics.jsonl, summed, and of that the
rollouts, updates, weight syncs and saves) and
the rest (outside the steps: imports and model loads of the endpoints and training runs,
evaluations, the summary). The headline is the mean over the runs; the tutorial is not seeded, so a
single run's scores move by a few points from run to run (its evaluation has five topics).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results import REPO, add_arguments, record

SCRIPT = REPO / "examples" / "haiku.py"

SUMMARY = re.compile(
    r"average score, (?P<name>base model|after 10 steps|after 30 steps):\s+"
    r"(?P<score>[-+]?\d+\.\d+)\s+(?P<three>\d+) of (?P<replies>\d+) three lines"
)
STAGES = ("base model", "after 10 steps", "after 30 steps")

SMOKE_EDITS = (
    # (text in the script, what a smoke run puts instead, how many times it must appear)
    ('hf_split="train[10:15]"', 'hf_split="train[10:11]"', 1),
    ("num_rollout=10,", "num_rollout=1,", 1),
    ("num_rollout=20,", "num_rollout=1,", 1),
    (
        "n_samples_per_prompt=8,",
        "n_samples_per_prompt=2, rollout_batch_size=2, rollout_max_response_len=8, "
        "train_micro_batch_size=4,",
        2,
    ),
    ("save_interval=5,", "save_interval=1,", 1),
)
"""What a smoke run changes in the script, and nothing else; an edit that no longer finds its
text fails the smoke run, so the smoke cannot drift from the script without notice."""


def smoke_script(text: str) -> str:
    """The script's text with ``SMOKE_EDITS`` made; a ``ValueError`` naming the text that is
    not there the expected number of times."""
    for old, new, count in SMOKE_EDITS:
        found = text.count(old)
        if found != count:
            raise ValueError(
                f"{SCRIPT.relative_to(REPO)}: {old!r} appears {found} times, the smoke run "
                f"expects {count}; update SMOKE_EDITS in bench/tutorial.py"
            )
        text = text.replace(old, new)
    return text


def parse_summary(output: str) -> dict[str, dict]:
    """The script's three summary lines: stage -> score, three-line replies, replies. A
    ``ValueError`` if one is missing (the script failed or its summary changed)."""
    found = {m["name"]: m for m in SUMMARY.finditer(output)}
    missing = [stage for stage in STAGES if stage not in found]
    if missing:
        raise ValueError(f"the tutorial's output has no summary line for: {', '.join(missing)}")
    return {
        stage: {
            "score": float(found[stage]["score"]),
            "three_lines": int(found[stage]["three"]),
            "replies": int(found[stage]["replies"]),
        }
        for stage in STAGES
    }


def tree_memory_bytes(root: int) -> int:
    """The memory of ``root`` and every process below it, from /proc: the sum of their
    proportional set sizes (a page shared by n processes counts 1/n in each), so the pages a
    process forked from the warm launcher shares with it count once; their resident sizes
    where /proc gives no proportional one. 0 for a process that is gone."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            try:
                lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                field = "Pss:"
            except OSError:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
                field = "VmRSS:"
            total += next(int(ln.split()[1]) for ln in lines if ln.startswith(field)) * 1024
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError, StopIteration):
            continue
    return total


class PeakSampler:
    """The largest ``tree_memory_bytes`` of a process seen while it runs, sampled every
    ``interval`` seconds on a thread of its own."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, tree_memory_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def home_for_run(folder: Path, first_run: bool) -> Path:
    """A fresh palaestra home in ``folder``; unless ``first_run``, its converted models and
    overlay environments are the usual home's (linked, created if missing)."""
    home = folder / "home"
    home.mkdir()
    if not first_run:
        from palaestra.home import share_usual_home

        share_usual_home(home, ("models", "overlays"))
    return home


def run_once(script: Path, first_run: bool, index: int) -> dict:
    """One run of ``script``: its output echoed as it comes, each line with the seconds since
    the start, then its figures."""
    with tempfile.TemporaryDirectory(prefix="tutorial-") as folder:
        home = home_for_run(Path(folder), first_run)
        env = os.environ | {"PALAESTRA_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        sampler = PeakSampler(process.pid)
        lines = []
        for line in process.stdout:
            lines.append(line)
            print(f"[run {index} {time.monotonic() - started:6.1f} s] {line}", end="", flush=True)
        code = process.wait()
        seconds = time.monotonic() - started
        peak = sampler.stop()
        steps = step_metrics(home / "runs")
    output = "".join(lines)
    if code != 0:
        tail = "".join(lines[-20:])
        raise SystemExit(f"run {index}: {script.name} exited with {code}; its last lines:\n{tail}")
    summary = parse_summary(output)
    return {
        "seconds": round(seconds, 1),
        **time_split(steps, seconds),
        "peak_pss_mib": round(peak / 2**20),
        **{f"{stage} {key}": value for stage in STAGES for key, value in summary[stage].items()},
    }


PARTS = (
    ("steps", "step_s"),
    ("rollout", "rollout_s"),
    ("update", "train_s"),
    ("weight sync", "weight_sync_s"),
    ("saves", "save_s"),
)
"""Where the training steps' time goes, summed over a run's steps: (name, the metric of each
step's row in metrics.jsonl). A step's ``step_s`` holds the others and its reward."""


def step_metrics(runs: Path) -> list[dict]:
    """Every step's metrics row of every training run under ``runs`` (a home's runs folder)."""
    rows = []
    for path in sorted(runs.glob("*/metrics.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return rows


def time_split(steps: list[dict], seconds: float) -> dict:
    """How many steps a run of ``seconds`` made, each of ``PARTS`` summed over them (``"<part>
    s"``), and the seconds outside the steps."""
    parts = {name: round(sum(row.get(key, 0.0) for row in steps), 1) for name, key in PARTS}
    return {
        "steps": len(steps),
        **{f"{name} s": value for name, value in parts.items()},
        "outside the steps s": round(seconds - parts["steps"], 1),
    }


def headline(runs: list[dict]) -> dict:
    """The mean of the runs: minutes, points learned over the base, and the share of three-line
    replies after 30 steps; the largest peak memory."""

    def mean(values) -> float:
        return round(statistics.fmean(values), 2)

    return {
        "minutes": mean(r["seconds"] / 60 for r in runs),
        "points learned": mean(r["after 30 steps score"] - r["base model score"] for r in runs),
        "three-line share": mean(
            r["after 30 steps three_lines"] / r["after 30 steps replies"] for r in runs
        ),
        "steps min": mean(r["steps s"] / 60 for r in runs),
        "outside the steps min": mean(r["outside the steps s"] / 60 for r in runs),
        "peak MiB": max(r["peak_pss_mib"] for r in runs),
        "runs": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of the script (default 1)")
    parser.add_argument(
        "--first-run",
        action="store_true",
        help="no converted model and no overlay environment to start from",
    )
    add_arguments(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tutorial-script-") as folder:
        script = SCRIPT
        if args.smoke:
            script = Path(folder) / SCRIPT.name
            script.write_text(smoke_script(SCRIPT.read_text()))
        runs = [run_once(script, args.first_run, index) for index in range(1, args.runs + 1)]

    for index, run in enumerate(runs, 1):
        print(
            f"run {index}: {run['seconds'] / 60:.1f} min, "
            + ", ".join(
                f"{stage} {run[f'{stage} score']:+.2f} "
                f"({run[f'{stage} three_lines']}/{run[f'{stage} replies']} three lines)"
                for stage in STAGES
            )
            + f", peak {run['peak_pss_mib']} MiB; {run['steps']} steps "
            + ", ".join(f"{name} {run[f'{name} s']:.1f} s" for name, _ in PARTS)
            + f"; outside the steps {run['outside the steps s']:.1f} s"
        )
    figures = {"runs": runs, "first_run": args.first_run, "script": str(SCRIPT.relative_to(REPO))}
    record("tutorial", args, figures, headline(runs))


if __name__ == "__main__":
    main()
