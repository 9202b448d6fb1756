"""Saved eval results: the one module that writes and reads ``<home>/evals/<id>.json``.

    {"id": "eval-20250101-120000-a1b2c3", "created_at": ..., "dataset": ..., "endpoint": ...,
     "model": ..., "checkpoint": ..., "run_id": ..., "step": ..., "mean": ..., "total": ...,
     "rows": [{"prompt": ..., "response": ..., "score": ...}, ...], ...}

An evaluation writes one record when it finishes (atomically, so a reader never sees half of
it); the CLI and the dashboard list and read them. The fields are the evaluation's; this module
adds only the ``id``.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from palaestra.atomic import write_json_atomic
from palaestra.home import palaestra_home
from palaestra.runs.directory import read_json
from palaestra.runs.registry import SAFE_NAME


def evals_root(home: Path | None = None) -> Path:
    return (home or palaestra_home()) / "evals"


def new_eval_id() -> str:
    """``eval-<UTC date-time>-<random>``: sortable by time, unique across processes."""
    return f"eval-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def save_eval(record: dict[str, Any], home: Path | None = None) -> tuple[str, Path]:
    """Write ``record`` as a new eval under ``<home>/evals``; returns its id and file. The id
    is new and goes first in the file; an ``id`` already in ``record`` is replaced."""
    eval_id = new_eval_id()
    path = evals_root(home) / f"{eval_id}.json"
    fields = {key: value for key, value in record.items() if key != "id"}
    write_json_atomic(path, {"id": eval_id, **fields})
    return eval_id, path


def list_evals(home: Path | None = None, with_rows: bool = False) -> list[dict[str, Any]]:
    """Saved eval results, newest first; ``rows`` (the scored samples) only ``with_rows``."""
    folder = evals_root(home)
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        record = read_json(path)
        if record is None:
            continue
        record.setdefault("id", path.stem)
        if not with_rows:
            record = {k: v for k, v in record.items() if k != "rows"}
        found.append(record)
    found.sort(key=lambda e: e.get("created_at") or 0, reverse=True)
    return found


def read_eval(eval_id: str, home: Path | None = None) -> dict[str, Any]:
    """One saved eval with its rows; KeyError naming the id when there is none."""
    path = evals_root(home) / f"{eval_id}.json"
    record = read_json(path) if SAFE_NAME.match(eval_id) else None
    if record is None:
        raise KeyError(f"no eval {eval_id!r} under {path.parent}")
    record.setdefault("id", eval_id)
    return record
