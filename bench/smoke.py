"""Every benchmark's ``--smoke`` run, one after another: does each bench still run?

    python bench/smoke.py                  # all of them (make bench-smoke)
    python bench/smoke.py --only flops,grpo_step
    python bench/smoke.py --results-dir /tmp/results   # also keep their result files
    python bench/smoke.py --jobs 1         # one bench at a time

Each bench runs as its own process (``python bench/<name>.py --smoke``, the interpreter running
this script) from the repository root, with a temporary ``PALAESTRA_HOME`` of its own that
shares the converted model cache of the usual home, so runs and endpoints leave nothing behind
and the embedded model is converted once (before the benches start). ``--jobs`` benches run
at a time (2: most smoke runs spend as much time starting and waiting as computing). A line per
bench, as it ends, says how it ended and how long it took,
then the lines in which it skipped a side it cannot run here (TRL, vLLM, Ray, a GPU); a failed
bench's last log lines follow its line. The exit status is 1 if any bench failed, and a bench
file that this script does not list fails it too, so a new bench cannot go unsmoked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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


def shared_home(home: Path) -> dict[str, str]:
    """The environment of a smoke run: ``PALAESTRA_HOME`` at ``home`` (made here), its model
    cache linked to the usual home's (created if missing), so a model converts once for all."""
    from palaestra.home import share_usual_home

    home.mkdir()
    share_usual_home(home)
    return os.environ | {"PALAESTRA_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}


def processor_shares(jobs: int) -> queue.Queue:
    """The processors this process may use, dealt into ``jobs`` disjoint sets (a queue a
    bench takes one from and gives it back to); one set of None where there is one job or
    too few processors to share."""
    shares: queue.Queue = queue.Queue()
    cpus = sorted(os.sched_getaffinity(0))
    if jobs <= 1 or len(cpus) < jobs:
        for _ in range(max(1, jobs)):
            shares.put(None)
        return shares
    for share in range(jobs):
        shares.put(set(cpus[share::jobs]))
    return shares


def convert_embedded_model() -> None:
    """Convert the embedded model into the shared cache now, so benches started side by side
    do not each convert it (a no-op once cached)."""
    from palaestra.models.catalogue import SmolLM2_135M

    SmolLM2_135M().weights_path()


def disk_free(path: Path) -> str:
    return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free"


def reap(process: subprocess.Popen, timeout: float) -> tuple[int, float] | None:
    """(exit status, CPU seconds of the process and the children it reaped) once ``process``
    ends, or None if it is still running after ``timeout`` seconds. Each process's own
    accounting (``wait4``), so benches running side by side are told apart."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def run_one(
    name: str, argv: list[str], env: dict, log: Path, timeout: float, cpus: set[int] | None = None
) -> tuple[int, float, float]:
    """(exit status, wall seconds, CPU seconds) of ``bench/<name>.py --smoke``; status 124
    when it ran out of time. The bench runs in a session of its own, so a timeout also ends
    the workers it started. CPU seconds say more than wall ones on a machine that is busy.
    With ``cpus``, the bench runs on those processors only (and sizes its threads to them)."""
    command = [sys.executable, f"bench/{name}.py", "--smoke", *argv]  # run from REPO
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        if cpus:  # before the interpreter has started a thread: they all inherit it
            os.sched_setaffinity(process.pid, cpus)
        ended = reap(process, timeout)
        if ended is None:
            # Ctrl-C first: the bench's finally blocks stop what lives outside its session (an
            # endpoint's server); then whatever is left of the session goes.
            os.killpg(process.pid, signal.SIGINT)
            ended = reap(process, 60)
            if ended is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                ended = reap(process, 60)
            ended = (124, ended[1] if ended else 0.0)
    return ended[0], time.monotonic() - started, ended[1]


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
    parser.add_argument("--jobs", type=int, default=2, help="benches running at a time")
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
        print(f"smoke homes in {folder}: {disk_free(Path(folder))}", flush=True)
        logs = args.logs or Path(folder) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if args.jobs > 1:
            convert_embedded_model()
        printing = threading.Lock()
        # Side by side, each bench gets its own share of the processors: two benches each
        # running as many threads as the machine has processors spun against each other
        # (a 16 s smoke run took 277 s of CPU).
        shares = processor_shares(args.jobs)

        def smoke(name: str) -> None:
            home = Path(folder) / f"home-{name}"
            log = logs / f"{name}.log"
            cpus = shares.get()
            try:
                status, seconds, cpu = run_one(
                    name, argv, shared_home(home), log, args.timeout, cpus
                )
            finally:
                shares.put(cpus)
            with printing:
                report(name, status, seconds, cpu, log)
                if status != 0:
                    failed.append(name)
            # What the bench left (runs, checkpoints, sweeps), not the shared model cache.
            shutil.rmtree(home, ignore_errors=True)

        # Cheapest first, as listed: a broken import still shows in seconds.
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(smoke, names))
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
