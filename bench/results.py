"""The one format of a benchmark's result: a JSON file per run, with the machine it ran on.

A bench script adds this module's options to its parser (``add_arguments``: ``--smoke`` and
``--results-dir``) and ends with ``record(...)``, which writes

    bench/results/<bench>/<UTC timestamp>-<short commit>.json

holding the bench's name, the UTC time, the git commit (and whether the tree had uncommitted
changes), the exact command line, the machine (CPU model, the flags that pick torch's code
paths, cores, the threads torch uses, memory, a GPU if torch sees one), the matmul peaks
measured then (``flops.matmul_peak_gflops``), the torch version, the bench's headline figures
(a few numbers a table shows) and all of its figures. ``bench/render.py`` turns these files
into docs/benchmarks.md and the README's results table.

A ``--smoke`` run writes no file unless ``--results-dir`` names a folder, so a CI smoke run
leaves the tree clean; it still builds the whole record, so the code that writes one is run.
Files are written atomically (a temporary name in the same folder, fsync, rename): a reader
never sees half a result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FORMAT = 1
"""The record's format version; ``render.py`` reads this one."""

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags that decide which kernels torch runs (AVX2 vs AVX-512, native bfloat16)."""

CPU_KINDS = ("AVX2-only", "AVX-512 BF16", "AMX")


def cpu_kind(flags: dict[str, bool]) -> str:
    """The CPU kind a result is grouped under: AMX, AVX-512 BF16 or AVX2-only (the latter also
    for a CPU with neither, e.g. an ARM one, whose flags the record still lists)."""
    if flags.get("amx_bf16"):
        return "AMX"
    if flags.get("avx512_bf16"):
        return "AVX-512 BF16"
    return "AVX2-only"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--smoke`` and ``--results-dir``, the options every bench script takes."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one small step on a tiny or the embedded model, to check the bench runs (CI); "
        "writes no result unless --results-dir is given",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help=f"where to write the result JSON (default {RESULTS.relative_to(REPO)}, "
        "none for --smoke)",
    )


def smoke_defaults(
    args: argparse.Namespace, parser: argparse.ArgumentParser, **values: object
) -> None:
    """Under ``--smoke``, set each option in ``values`` that the command line left at its
    default (an option given explicitly wins)."""
    if not args.smoke:
        return
    for name, value in values.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def skip(side: str, why: str) -> None:
    """The one line a smoke run prints for a side it cannot run here."""
    print(f"{side}: skipped ({why})", flush=True)


def cpu_description() -> dict:
    """CPU model and flags from /proc/cpuinfo (``lscpu`` where there is none)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    if not model or not flags:
        try:
            output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            output = ""
        for line in output.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and not model:
                model = value.strip()
            elif key.strip() == "Flags" and not flags:
                flags = set(value.split())
    chosen = {flag: flag in flags for flag in FLAGS}
    return {
        "cpu_model": model or platform.processor() or "unknown CPU",
        "cpu_flags": chosen,
        "cpu_kind": cpu_kind(chosen),
    }


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict:
    """What the run ran on: CPU, cores, torch's threads, memory, GPU, Python and platform."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        **cpu_description(),
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": memory_gib(),
        "gpu": gpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def measure_peaks(smoke: bool = False, size: int = 1536) -> dict[str, float]:
    """The CPU's matmul peaks, GFLOP/s: float32, and bfloat16 where the CPU multiplies it
    natively (elsewhere torch emulates it at a few GFLOP/s, which would take minutes to time
    and no bench computes in). ``size`` is the products' width (the embedded model's MLP width
    by default). A smoke run times small products twice: its peaks only show that the code
    runs."""
    import torch
    from flops import matmul_peak_gflops

    from palaestra.models.loading import compute_dtype

    names = ["float32"] + (["bfloat16"] if compute_dtype("auto", "cpu") == torch.bfloat16 else [])
    size, repeats = (256, 2) if smoke else (size, 5)
    return {
        name: round(matmul_peak_gflops(getattr(torch, name), size, repeats), 1) for name in names
    }


def git_state() -> dict:
    """The commit the run measured, and whether tracked files differed from it."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    return {
        "commit": commit or "unknown",
        "commit_short": commit[:7] or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


GIT_AT_START = git_state()
"""The commit of the code this process loaded: a long bench may outlast a commit or two."""


def build_record(
    bench: str,
    smoke: bool,
    figures: dict,
    headline: dict,
    peaks: dict[str, float],
    now: datetime | None = None,
) -> dict:
    """The result of one run, as ``render.py`` reads it."""
    import torch

    now = now or datetime.now(UTC)
    return {
        "format": FORMAT,
        "bench": bench,
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        **GIT_AT_START,
        "command": shlex.join(["python", *sys.argv]),
        "python_executable": sys.executable,
        "smoke": smoke,
        "machine": machine(),
        "matmul_gflops": peaks,
        "torch": torch.__version__,
        "headline": headline,
        "figures": figures,
    }


def write_record(record: dict, folder: Path) -> Path:
    """Write ``record`` atomically as ``folder/<bench>/<timestamp>-<commit>.json``."""
    stamp = record["time_utc"].replace("-", "").replace(":", "")
    target = Path(folder) / record["bench"] / f"{stamp}-{record['commit_short']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(record, out, indent=2, default=str)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def record(
    bench: str,
    args: argparse.Namespace,
    figures: dict,
    headline: dict,
    peaks: dict[str, float] | None = None,
) -> Path | None:
    """Build this run's record and write it where ``args`` say (``--results-dir``, else
    bench/results, and nowhere for ``--smoke`` without ``--results-dir``); the path, or None.

    ``headline`` holds the few figures the tables show (label -> number or text); ``peaks``
    the matmul peaks the bench measured itself (measured here when None)."""
    if peaks is None:
        peaks = measure_peaks(smoke=args.smoke)
    result = build_record(bench, args.smoke, figures, headline, peaks)
    folder = args.results_dir if args.results_dir is not None else None
    if folder is None and not args.smoke:
        folder = RESULTS
    if folder is None:
        print(f"{bench}: smoke run, result not written (--results-dir DIR writes it)")
        return None
    path = write_record(result, folder)
    print(f"{bench}: result written to {path}")
    return path
