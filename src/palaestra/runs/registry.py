"""The run registry: every run directory under ``<home>/runs``, visible to any process."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

from palaestra.home import palaestra_home
from palaestra.runs.directory import RunDirectory

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
"""A run, eval, group or endpoint id: a file name inside its folder, never a path out of it.
It ends at the string's very end: ``$`` would let a trailing newline through."""


def runs_root(home: Path | None = None) -> Path:
    root = (home or palaestra_home()) / "runs"
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_run_id(name: str) -> str:
    """``<name>-<UTC date-time>-<random>``: readable, sortable by start, unique across processes."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def run_directory(run_id: str, home: Path | None = None) -> Path:
    """The folder of ``run_id``; KeyError naming it when it is not a run (or not a run id)."""
    if not SAFE_NAME.match(run_id):
        raise KeyError(f"{run_id!r} is not a run id")
    path = runs_root(home) / run_id
    if not (path / "config.json").is_file():
        known = ", ".join(list_run_ids(home)[:5]) or "none"
        raise KeyError(f"no run {run_id!r} under {runs_root(home)} (latest: {known})")
    return path


def list_run_ids(home: Path | None = None) -> list[str]:
    """Run ids, newest first (by start time recorded in the directory's config)."""
    root = runs_root(home)
    runs = [p for p in root.iterdir() if (p / "config.json").is_file()]
    runs.sort(key=lambda p: (p / "config.json").stat().st_mtime, reverse=True)
    return [p.name for p in runs]


def open_run(run_id: str, home: Path | None = None) -> RunDirectory:
    """The run directory of ``run_id``; KeyError naming the run when there is none."""
    return RunDirectory(run_directory(run_id, home))
