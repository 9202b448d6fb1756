"""Crash safety at scale: one training run killed (SIGKILL) at random moments, resumed after
every kill, then resumed to the end. CI runs only its smoke form;
``tests/integration/faults/test_kills.py`` is the short form (one kill per moment).

    .venv/bin/python bench/faults.py [--kills 100] [--seed 0]
    .venv/bin/python bench/faults.py --smoke     # one random kill, no kills on purpose

A real run records its result under bench/results/faults/ (``bench/results.py``).

The run is the test suite's tiny model (a 2-layer, 32-wide Llama built in code; 2 prompts x 4
samples a step, a reward that takes 50 ms, a checkpoint every 2 steps, evaluation every 2). Each
kill lands at a random delay after the resumed process's first new step, except that one kill
in ten (never two in a row) lands at a random delay into the start. So every resume that is
not killed while starting makes a step before it is killed. Where the process was is read from
the stack the worker writes to train.log on SIGUSR1 just before the kill: starting, sampling,
update, evaluating, saving, recording (the step's log lines) or finishing. A moment that no
random kill reached is then hit on purpose, and counted apart.

After every kill: the run reads as failed at once (the run handle, a fresh handle, the
dashboard's summary), every listed checkpoint loads (weights, optimiser state, trainer state),
no unlisted step folder exists, and metrics.jsonl holds steps 1..k once each. At the end: the run
completed, metrics.jsonl holds steps 1..N once each in order with no torn line, samples.jsonl
each step's 8 rows once.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]  # the tiny model and the kill helpers the tests use (tests.support)

from results import add_arguments, record, skip, smoke_defaults  # noqa: E402

from tests.support.moments import (  # noqa: E402
    MOMENTS,
    checkpoint_problems,
    evaluated_config,
    kill_at,
    kill_now,
    kill_while_saving,
    log_of,
    log_problems,
)
from tests.support.tiny_models import build_tiny_model, build_tokenizer  # noqa: E402
from tests.support.tiny_runs import write_topics  # noqa: E402

REQUIRED = ("starting", "sampling", "update", "evaluating", "saving")
ROWS_PER_STEP = 2 * 4
STEP_LINE = re.compile(r"^step (\d+)/(\d+)", re.MULTILINE)


def steps_logged_since(run, offset: int) -> list[tuple[str, str]]:
    """The step lines the current process printed to train.log after ``offset``."""
    with open(log_of(run), "rb") as handle:
        handle.seek(offset)
        return STEP_LINE.findall(handle.read().decode(errors="replace"))


def wait_for_a_step(run, offset: int, timeout: float = 300.0) -> bool:
    """Wait until the process makes a step; False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if steps_logged_since(run, offset):
            return True
        if run.status_info()["state"] not in ("pending", "running"):
            return False
        time.sleep(0.02)
    raise TimeoutError(f"no step in {timeout} s")


class Checker:
    """The checks after each kill; checkpoints already checked and unchanged are skipped."""

    def __init__(self) -> None:
        self.checked: dict[Path, int] = {}
        self.corrupt: set[str] = set()
        self.not_failed = 0
        self.bad_metrics = 0

    def after_kill(self, run) -> None:
        from palaestra.launch.training import TrainingRun
        from palaestra.runs.directory import RunDirectory
        from palaestra.runs.records import run_summary

        readers = (
            run.status_info()["state"],
            TrainingRun.from_id(run.training_run_id).status,
            run_summary(RunDirectory(run.path))["state"],
        )
        if readers != ("failed",) * 3 or "resume()" not in run.status_info()["error"]:
            self.not_failed += 1
            print(f"  not read as failed: {readers}", flush=True)
        self.corrupt |= set(self.check_checkpoints(run))
        steps = [row["step"] for row in run.metrics()]
        if steps != list(range(1, len(steps) + 1)):
            self.bad_metrics += 1
            print(f"  metrics.jsonl steps at the kill: {steps}", flush=True)

    def check_checkpoints(self, run) -> list[str]:
        changed = [
            c.path
            for c in run.checkpoints()
            if self.checked.get(c.path) != (c.path / "trainer_state.json").stat().st_mtime_ns
        ]
        problems = checkpoint_problems(run, only=changed)
        for path in changed:
            self.checked[path] = (path / "trainer_state.json").stat().st_mtime_ns
        for problem in problems:
            print(f"  corrupt: {problem}", flush=True)
        return problems


def run_bench(kills: int, seed: int, home: Path, on_purpose: bool = True) -> dict:
    rng = random.Random(seed)
    model_dir = home / "tiny-model"
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_topics(home / "topics.jsonl")
    steps = 3 * kills + 10  # more than the kills can get through: the last resume finishes it
    config = evaluated_config(model_dir, data, 2, num_rollout=steps, save_interval=2)

    started = time.monotonic()
    counts: collections.Counter[str] = collections.Counter()
    targeted: collections.Counter[str] = collections.Counter()
    checker = Checker()
    startup_s: list[float] = []
    run = config.launch()
    try:
        early_before = False
        offset = 0
        while sum(counts.values()) < kills:
            spawned = time.monotonic()
            if startup_s and not early_before and rng.random() < 0.1:
                time.sleep(rng.uniform(0, statistics.median(startup_s)))
            else:
                if not wait_for_a_step(run, offset):
                    raise RuntimeError(
                        f"the run ended after {sum(counts.values())} kills: add steps"
                    )
                startup_s.append(time.monotonic() - spawned)
                # A row put back from a checkpoint on resume has no timings: skip those.
                timed = [row["step_s"] for row in run.metrics()[-10:] if "step_s" in row]
                step_s = statistics.median(timed or [0.2])
                time.sleep(rng.uniform(0, 2 * step_s))
            moment = kill_now(run)
            if moment is None:
                raise RuntimeError("the run ended before a kill: add steps")
            counts[moment] += 1
            early_before = moment == "starting"
            checker.after_kill(run)
            number = sum(counts.values())
            print(
                f"kill {number:3d}: {moment:10s} checkpoints {len(run.checkpoints())}", flush=True
            )
            offset = log_of(run).stat().st_size
            run = run.resume()

        missed = [moment for moment in REQUIRED if counts[moment] == 0]
        if not on_purpose and missed:
            skip("kills on purpose", f"smoke run; not reached: {', '.join(missed)}")
            missed = []
        for moment in missed:
            if moment == "saving":
                kill_while_saving(run, timeout=300)
            else:
                kill_at(run, moment, timeout=300, seed=seed)
            targeted[moment] += 1
            checker.after_kill(run)
            print(f"kill on purpose: {moment}", flush=True)
            run = run.resume()

        run.result(timeout=1800)
    except BaseException:
        run.stop(timeout=5)  # no training process may outlive the bench's temporary folder
        raise
    final_problems = log_problems(run, steps, ROWS_PER_STEP) + checkpoint_problems(run)
    metrics = [row["step"] for row in run.metrics()]
    return {
        "kills": sum(counts.values()) + sum(targeted.values()),
        "counts": counts,
        "targeted": targeted,
        "status": run.status,
        "steps": steps,
        "checkpoints": len(run.checkpoints()),
        "corrupt": sorted(checker.corrupt),
        "not_failed": checker.not_failed,
        "bad_metrics": checker.bad_metrics,
        "duplicated": len(metrics) - len(set(metrics)),
        "missing": len(set(range(1, steps + 1)) - set(metrics)),
        "final_problems": final_problems,
        "wall_s": time.monotonic() - started,
    }


def summary(result: dict, argv: list[str]) -> str:
    counts, targeted = result["counts"], result["targeted"]
    per_moment = ", ".join(f"{m} {counts[m]}" for m in (*MOMENTS, "unknown") if counts[m])
    extra = ", ".join(f"{m} {n}" for m, n in targeted.items())
    ok = (
        result["status"] == "completed"
        and not result["corrupt"]
        and not result["final_problems"]
        and result["not_failed"] == 0
        and result["bad_metrics"] == 0
    )
    lines = [
        f"$ .venv/bin/python bench/faults.py {' '.join(argv)}".rstrip(),
        f"kills survived        {result['kills'] if ok else 'NOT ALL'} of {result['kills']} "
        f"SIGKILLs of one run, each resumed; the last resume: {result['status']}",
        f"kills per moment      {per_moment}" + (f"; on purpose: {extra}" if extra else ""),
        f"read as failed        {result['kills'] - result['not_failed']} of {result['kills']} "
        "at once (handle, fresh handle, dashboard summary)",
        f"corrupt checkpoints   {len(result['corrupt'])} (every listed one loaded after every "
        f"kill: weights, optimiser, trainer state; {result['checkpoints']} at the end)",
        f"metric steps          {result['duplicated']} duplicated, {result['missing']} missing of "
        f"1..{result['steps']}; {len(result['final_problems'])} problems in the final logs",
        f"wall time             {result['wall_s']:.0f} s on {os.cpu_count()} cores "
        f"({platform.machine()}, Python {platform.python_version()})",
    ]
    lines += [f"  {problem}" for problem in result["final_problems"][:20]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100, help="random-moment kills (100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random moments (0)")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, kills=1)
    with tempfile.TemporaryDirectory(prefix="palaestra-faults-") as folder:
        os.environ["PALAESTRA_HOME"] = str(Path(folder) / "home")
        result = run_bench(args.kills, args.seed, Path(folder), on_purpose=not args.smoke)
    print()
    print(summary(result, sys.argv[1:]))
    ok = result["status"] == "completed" and not result["corrupt"]
    headline = {
        "kills survived": result["kills"] if ok else f"NOT ALL of {result['kills']}",
        "corrupt checkpoints": len(result["corrupt"]),
        "metric steps lost or doubled": result["duplicated"] + result["missing"],
        "wall s": round(result["wall_s"], 1),
    }
    record("faults", args, result, headline)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
