"""Every benchmark's ``--smoke`` run, one after another: does each bench still run?

    python bench/smoke.py                  # all of them (make bench-smoke)
    python bench/smoke.py --only flops,grpo_step
    python bench/smoke.py --results-dir /tmp/results   # also keep their result files

Each bench runs as its own process (``python bench/<name>.py --smoke``, the interpreter running
this script) from the repository root, with a temporary ``PALAESTRA_HOME`` that shares the
converted model cache of the usual home, so runs and endpoints leave nothing behind and the
embedded model is converted once. A line per bench says how it ended and how long it took,
then the lines in which it skipped a side it cannot run here (TRL, vLLM, Ray, a GPU); a failed
bench's last log lines follow its line. The exit status is 1 if any bench failed, and a bench
file that this script does not list fails it too, so a new bench cannot go unsmoked.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

BENCHES = (
    "flops",
    "decode_pass",
    "precision",
    "activation_memory",
    "generation",
    "gpu_check",
    "multiturn",
    "grpo_step",
    "update_profile",
    "endpoint_throughput",
    "flood",
    "faults",
    "haiku_sweep",
    "sweep_parallel",
    "ray_overhead",
    "offpolicy",
    "plan_check",
    "tutorial",
)
"""Cheapest first, so a broken import shows in seconds."""

TOOLS = {"results", "render", "smoke", "model_shapes"}
"""Scripts in bench/ that are not benchmarks."""


def unlisted() -> list[str]:
    return sorted({path.stem for path in BENCH.glob("*.py")} - set(BENCHES) - TOOLS)


def shared_home(folder: Path) -> dict[str, str]:
    """The environment of a smoke run: ``PALAESTRA_HOME`` in ``folder``, its model cache
    linked to the usual home's (created if missing), so a model converts once for all."""
    from palaestra.home import palaestra_home

    models = palaestra_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    home = folder / "home"
    home.mkdir()
    (home / "models").symlink_to(models, target_is_directory=True)
    return os.environ | {"PALAESTRA_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}


def clear_runs(home: Path) -> None:
    """Remove what a bench left in the smoke home (runs, checkpoints, sweeps), keeping the
    shared model cache: benches run one after another on a disk that may be small."""
    for entry in home.iterdir():
        if entry.name == "models":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def disk_free(path: Path) -> str:
    return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free"


def cpu_seconds() -> float:
    """User + system CPU time of this process's finished children (and theirs, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(
    name: str, argv: list[str], env: dict, log: Path, timeout: float
) -> tuple[int, float, float]:
    """(exit status, wall seconds, CPU seconds) of ``bench/<name>.py --smoke``; status 124
    when it ran out of time. The bench runs in a session of its own, so a timeout also ends
    the workers it started. CPU seconds say more than wall ones on a machine that is busy."""
    command = [sys.executable, f"bench/{name}.py", "--smoke", *argv]  # run from REPO
    started, cpu = time.monotonic(), cpu_seconds()
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Ctrl-C first: the bench's finally blocks stop what lives outside its session (an
            # endpoint's server); then whatever is left of the session goes.
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = 124
    return status, time.monotonic() - started, cpu_seconds() - cpu


def report(name: str, status: int, seconds: float, cpu: float, log: Path) -> None:
    lines = log.read_text(errors="replace").splitlines()
    outcome = "ok" if status == 0 else ("TIMEOUT" if status == 124 else f"FAILED ({status})")
    print(f"{outcome:12} {name:20} {seconds:6.1f} s  (CPU {cpu:6.1f} s)", flush=True)
    for line in lines:
        if ": skipped (" in line:
            print(f"{'':12} {line}")
    if status != 0:
        print("\n".join(f"{'':12} | {line}" for line in lines[-25:]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated bench names")
    parser.add_argument("--skip", default="", help="comma-separated bench names to leave out")
    parser.add_argument("--results-dir", type=Path, default=None, help="passed to each bench")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per bench")
    parser.add_argument("--logs", type=Path, default=None, help="keep each bench's log here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(BENCHES)
    names = [name for name in names if name not in args.skip.split(",")]
    unknown = [name for name in names if name not in BENCHES]
    if unknown:
        parser.error(f"unknown bench {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    argv = ["--results-dir", str(args.results_dir.resolve())] if args.results_dir else []
    failed = unlisted()
    for name in failed:
        print(f"{'FAILED':12} {name:20} bench/{name}.py is not listed in bench/smoke.py")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="palaestra-smoke-") as folder:
        print(f"smoke home {folder}: {disk_free(Path(folder))}", flush=True)
        env = shared_home(Path(folder))
        logs = args.logs or Path(folder) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in names:
            log = logs / f"{name}.log"
            status, seconds, cpu = run_one(name, argv, env, log, args.timeout)
            report(name, status, seconds, cpu, log)
            clear_runs(Path(env["PALAESTRA_HOME"]))
            if status != 0:
                failed.append(name)
        free = disk_free(Path(folder))
    total = time.monotonic() - started
    passed = [name for name in names if name not in failed]
    print(
        f"{len(passed)} of {len(names)} smoke runs passed in {total:.0f} s ({free} at the end)"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
