"""What the CLI and the dashboard show of runs: one-line summaries, a run's detail, its log.

Read-only: nothing here writes under the home. Every reader tolerates files another process
is writing (a run's status is replaced atomically, a metrics line cut short is skipped) and
fields that older runs lack.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from palaestra.home import palaestra_home
from palaestra.runs.directory import RunDirectory, last_jsonl_row
from palaestra.runs.endpoints import list_endpoints
from palaestra.runs.evals import list_evals
from palaestra.runs.logs import last_lines
from palaestra.runs.registry import list_run_ids, open_run


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
    config = run.config()
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
        "group_id": config.get("group_id"),
        "group_overrides": config.get("group_overrides"),
    }


def list_runs(
    home: Path | None = None,
    status: str | None = None,
    limit: int | None = None,
    group: str | None = None,
) -> list[dict[str, Any]]:
    """Summaries of every run, newest first; ``status`` keeps one state, ``group`` one group's
    variants, ``limit`` the newest."""
    root = (home or palaestra_home()) / "runs"
    summaries = []
    for run_id in list_run_ids(home):
        summary = run_summary(RunDirectory(root / run_id))
        if (status is None or summary["state"] == status) and (
            group is None or summary["group_id"] == group
        ):
            summaries.append(summary)
        if limit is not None and len(summaries) >= limit:
            break
    return summaries


def run_detail(run_id: str, home: Path | None = None) -> dict[str, Any]:
    """Everything the run page shows except metrics, samples and the log, which it fetches
    on their own."""
    run = open_run(run_id, home)
    status = run.read_status()
    return {
        **run_summary(run),
        "status": status,
        "config": run.config(),
        "checkpoints": [{"step": s, "path": str(p)} for s, p in run.checkpoint_paths()],
        "log_path": str(run.log_path),
        "evals": [e for e in list_evals(home) if e.get("run_id") == run_id],
        "endpoints": [e for e in list_endpoints(home) if e.get("run_id") == run_id],
    }


def run_samples(run_id: str, step: int | None = None, home: Path | None = None) -> dict[str, Any]:
    """The samples of one step (default: the latest), with the steps there are to choose from."""
    run = open_run(run_id, home)
    steps = [row["step"] for row in run.metrics() if "step" in row]
    chosen = step if step is not None else (steps[-1] if steps else None)
    rows = run.samples(chosen) if chosen is not None else []
    return {"step": chosen, "steps": steps, "samples": rows}


def log_tail(run_id: str, lines: int = 200, home: Path | None = None) -> str:
    """The last ``lines`` lines of a run's train.log ("" before it has one)."""
    return "\n".join(last_lines(open_run(run_id, home).log_path, lines)[0])
