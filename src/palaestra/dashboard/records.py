"""Read-only records over the palaestra home: run summaries, saved evals, running endpoints.

The CLI and the dashboard both show these; neither writes anything under the home. Every
reader tolerates files that another process is writing (a run's status is replaced
atomically, a metrics line cut short is skipped) and fields that older runs lack.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from palaestra.home import palaestra_home
from palaestra.runs.directory import RunDirectory, pid_alive
from palaestra.runs.registry import list_run_ids, run_directory

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
ENDPOINT_FIELDS = (
    "name",
    "url",
    "host",
    "port",
    "pid",
    "model",
    "checkpoint",
    "run_id",
    "step",
    "started_at",
    "log",
    "authenticated",
)
"""What an endpoint record may show; anything else in its file (a key, a token) never leaves."""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # removed or being replaced between listing and reading
    return value if isinstance(value, dict) else None


def last_jsonl_row(path: Path, chunk: int = 65536) -> dict[str, Any] | None:
    """The last complete JSON line of ``path``, reading only the file's tail."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - chunk))
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written, or the cut-off start of the chunk
        if isinstance(row, dict):
            return row
    return None


def describe_dataset(dataset: dict[str, Any] | None) -> str:
    """``topics.jsonl [train]`` or ``statworx/haiku [train[:10]]``: source and split."""
    if not dataset:
        return "-"
    source = dataset.get("path") or dataset.get("hf_repo") or "-"
    if str(source).startswith(("/", "./", "../", "~")):
        source = Path(str(source)).name
    subset = f"/{dataset['hf_subset']}" if dataset.get("hf_subset") else ""
    return f"{source}{subset} [{dataset.get('hf_split', 'train')}]"


def run_summary(run: RunDirectory) -> dict[str, Any]:
    """One line of the runs list: state, model, dataset, progress, latest reward, timing."""
    config = _read_json(run.path / "config.json") or {}
    status = run.read_status()
    recipe = config.get("recipe") or {}
    last = last_jsonl_row(run.path / "metrics.jsonl") or {}
    first_step = status.get("first_step") or 0
    total = status.get("total_steps") or first_step + (recipe.get("num_rollout") or 0) or None
    started = status.get("started_at")
    finished = status.get("finished_at") if status.get("state") != "running" else None
    end = finished or (time.time() if status.get("state") == "running" else None)
    return {
        "run_id": run.run_id,
        "state": status.get("state", "pending"),
        "model": (config.get("model") or {}).get("name", "-"),
        "dataset": describe_dataset(config.get("dataset")),
        "step": status.get("step", 0),
        "first_step": first_step,
        "total_steps": total,
        "reward_mean": last.get("reward_mean"),
        "created_at": config.get("created_at") or status.get("created_at"),
        "started_at": started,
        "finished_at": finished,
        "duration_s": end - started if started and end else None,
        "error": status.get("error") if status.get("state") == "failed" else None,
    }


def list_runs(
    home: Path | None = None, status: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Summaries of every run, newest first; ``status`` keeps one state, ``limit`` the newest."""
    root = (home or palaestra_home()) / "runs"
    summaries = []
    for run_id in list_run_ids(home):
        summary = run_summary(RunDirectory(root / run_id))
        if status is None or summary["state"] == status:
            summaries.append(summary)
        if limit is not None and len(summaries) >= limit:
            break
    return summaries


def open_run(run_id: str, home: Path | None = None) -> RunDirectory:
    """The run directory of ``run_id``; KeyError naming the run when there is none."""
    if not SAFE_NAME.match(run_id):
        raise KeyError(f"{run_id!r} is not a run id")
    return RunDirectory(run_directory(run_id, home))


def run_detail(run_id: str, home: Path | None = None) -> dict[str, Any]:
    """Everything the run page shows except metrics, samples and the log, which it fetches
    on their own."""
    run = open_run(run_id, home)
    status = run.read_status()
    return {
        **run_summary(run),
        "status": status,
        "config": _read_json(run.path / "config.json") or {},
        "checkpoints": [{"step": s, "path": str(p)} for s, p in run.checkpoint_paths()],
        "log_path": str(run.log_path),
        "evals": [e for e in list_evals(home) if e.get("run_id") == run_id],
        "endpoints": [e for e in list_endpoints(home) if e.get("run_id") == run_id],
    }


def log_tail(run_id: str, lines: int = 200, home: Path | None = None) -> str:
    """The last ``lines`` lines of a run's train.log ("" before it has one)."""
    path = open_run(run_id, home).log_path
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - 256 * 1024))
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


# evals -------------------------------------------------------------------------------------


def list_evals(home: Path | None = None, with_rows: bool = False) -> list[dict[str, Any]]:
    """Saved eval results, newest first; ``rows`` (the scored samples) only ``with_rows``."""
    folder = (home or palaestra_home()) / "evals"
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        record = _read_json(path)
        if record is None:
            continue
        record.setdefault("id", path.stem)
        if not with_rows:
            record = {k: v for k, v in record.items() if k != "rows"}
        found.append(record)
    found.sort(key=lambda e: e.get("created_at") or 0, reverse=True)
    return found


def read_eval(eval_id: str, home: Path | None = None) -> dict[str, Any]:
    path = (home or palaestra_home()) / "evals" / f"{eval_id}.json"
    # An id is a file name inside evals/, never a path that leads out of it.
    record = _read_json(path) if SAFE_NAME.match(eval_id) else None
    if record is None:
        raise KeyError(f"no eval {eval_id!r} under {path.parent}")
    record.setdefault("id", eval_id)
    return record


# endpoints ---------------------------------------------------------------------------------


def endpoint_running(record: dict[str, Any]) -> bool:
    """Its server process is alive and is still the process that wrote the record."""
    pid = record.get("pid")
    return isinstance(pid, int) and pid_alive(pid, record.get("pid_start"))


def list_endpoints(home: Path | None = None, running_only: bool = True) -> list[dict[str, Any]]:
    """Endpoint records (running ones unless ``running_only=False``), newest first, each with
    ``running`` set and only the fields in ENDPOINT_FIELDS."""
    folder = (home or palaestra_home()) / "endpoints"
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        record = _read_json(path)
        if record is None:
            continue
        running = endpoint_running(record)
        if running or not running_only:
            shown = {key: record.get(key) for key in ENDPOINT_FIELDS}
            shown["name"] = shown["name"] or path.stem
            found.append({**shown, "running": running})
    found.sort(key=lambda e: e.get("started_at") or 0, reverse=True)
    return found
