"""Groups of runs (sweeps): the group record, and what the CLI and dashboard show of a group.

    <home>/groups/<group_id>/
      group.json     name, grid, axes, the variants (run id and overrides), what was skipped,
                     and the process driving it (replaced atomically)
      driver.log     the driving process's output, when the group was launched

A variant is an ordinary run (``<home>/runs/<run_id>``) whose config.json names its group
(``group_id``), its values of the grid (``group_overrides``) and the grid's fields
(``group_axes``). This module owns the group record; runs stay the run store's.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import Any

from palaestra.atomic import write_json_atomic
from palaestra.home import palaestra_home
from palaestra.runs.directory import FINAL_STATES, RunDirectory, read_json, read_jsonl
from palaestra.runs.liveness import pid_alive
from palaestra.runs.registry import SAFE_NAME, runs_root


def groups_root(home: Path | None = None) -> Path:
    root = (home or palaestra_home()) / "groups"
    root.mkdir(parents=True, exist_ok=True)
    return root


def group_path(group_id: str, home: Path | None = None) -> Path:
    """The folder of ``group_id``; KeyError naming it when there is no such group."""
    if not SAFE_NAME.match(group_id):
        raise KeyError(f"{group_id!r} is not a group id")
    path = groups_root(home) / group_id
    if not (path / "group.json").is_file():
        known = ", ".join(list_group_ids(home)[:5]) or "none"
        raise KeyError(f"no group {group_id!r} under {groups_root(home)} (latest: {known})")
    return path


def write_group(record: dict[str, Any], home: Path | None = None) -> Path:
    path = groups_root(home) / record["group_id"]
    write_json_atomic(path / "group.json", record)
    return path


def read_group(group_id: str, home: Path | None = None) -> dict[str, Any]:
    record = read_json(group_path(group_id, home) / "group.json")
    if record is None:
        raise KeyError(f"group {group_id!r}: group.json is unreadable")
    return record


def update_group(group_id: str, home: Path | None = None, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into group.json, under a lock: the launcher and the driving process
    both write it."""
    with open(group_path(group_id, home) / ".group.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_group(group_id, home) | fields | {"updated_at": time.time()}
        write_group(record, home)
    return record


def list_group_ids(home: Path | None = None) -> list[str]:
    """Group ids, newest first."""
    root = groups_root(home)
    groups = [p for p in root.iterdir() if (p / "group.json").is_file()]
    groups.sort(
        key=lambda p: (read_json(p / "group.json") or {}).get("created_at", 0), reverse=True
    )
    return [p.name for p in groups]


def variant_rows(record: dict[str, Any], home: Path | None = None) -> list[dict[str, Any]]:
    """One row per variant: its run, overrides, state, step, last and best mean reward."""
    rows = []
    for variant in record.get("variants", []):
        run = RunDirectory(runs_root(home) / variant["run_id"])
        status = run.read_status()
        rewards = [
            row["reward_mean"]
            for row in read_jsonl(run.path / "metrics.jsonl")
            if isinstance(row.get("reward_mean"), int | float)
        ]
        rows.append(
            {
                "index": variant["index"],
                "run_id": variant["run_id"],
                "overrides": variant["overrides"],
                "state": status.get("state", "pending"),
                "step": status.get("step", 0),
                "total_steps": status.get("total_steps"),
                "final_reward": rewards[-1] if rewards else None,
                "best_reward": max(rewards) if rewards else None,
                "error": status.get("error") if status.get("state") == "failed" else None,
            }
        )
    return rows


def group_state(record: dict[str, Any], variants: list[dict[str, Any]]) -> str:
    """running while its driver lives or a variant runs; pending before a driver is recorded;
    then completed when every variant completed, failed when any failed, else stopped (a
    driver that died with variants left unstarted leaves it stopped)."""
    driver = record.get("driver") or {}
    states = [v["state"] for v in variants]
    if pid_alive(driver.get("pid"), driver.get("pid_start")) or "running" in states:
        return "running"
    if states and all(state == "completed" for state in states):
        return "completed"
    if "failed" in states:
        return "failed"
    unstarted = any(state not in FINAL_STATES for state in states)
    if unstarted and not driver and not record.get("ended_at"):
        return "pending"
    return "stopped"


def group_detail(group_id: str, home: Path | None = None) -> dict[str, Any]:
    """The group record with its state and a row per variant."""
    record = read_group(group_id, home)
    variants = variant_rows(record, home)
    return record | {"state": group_state(record, variants), "variants": variants}


def group_summary(group_id: str, home: Path | None = None) -> dict[str, Any]:
    """One line of the groups list: name, axes, how many variants are in which state, best."""
    detail = group_detail(group_id, home)
    variants = detail["variants"]
    best = [v for v in variants if v["best_reward"] is not None]
    top = max(best, key=lambda v: v["best_reward"]) if best else None
    counts: dict[str, int] = {}
    for variant in variants:
        counts[variant["state"]] = counts.get(variant["state"], 0) + 1
    return {
        "group_id": group_id,
        "name": detail.get("name"),
        "state": detail["state"],
        "axes": detail.get("axes", []),
        "variants": len(variants),
        "states": counts,
        "skipped": len(detail.get("skipped", [])),
        "best_run_id": top and top["run_id"],
        "best_reward": top and top["best_reward"],
        "created_at": detail.get("created_at"),
    }


def list_groups(home: Path | None = None) -> list[dict[str, Any]]:
    return [group_summary(group_id, home) for group_id in list_group_ids(home)]
