"""A run's (or a group's) metrics as one table, written as CSV or JSON Lines for notebooks and
spreadsheets: ``palaestra run export ID --format csv``.

Each row is one step of one run: ``run_id`` first, then for a group's variants their grid
values (one column per grid field, named as in the grid), then the step's metrics as the run
wrote them. Columns are the union over all rows, in the order they first appear; a value a
row lacks is left empty (CSV) or absent (JSON Lines). Read-only, like the rest of the store.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from palaestra.runs import groups
from palaestra.runs.registry import SAFE_NAME, open_run, runs_root

FORMATS = ("csv", "jsonl")


def metrics_table(item_id: str, home: Path | None = None) -> list[dict[str, Any]]:
    """The metrics rows of run ``item_id``, or of every variant of group ``item_id``."""
    if SAFE_NAME.match(item_id) and (runs_root(home) / item_id / "config.json").is_file():
        return [{"run_id": item_id, **row} for row in open_run(item_id, home).metrics()]
    try:
        record = groups.read_group(item_id, home)
    except KeyError:
        raise KeyError(f"no run or group {item_id!r} under {runs_root(home).parent}") from None
    rows = []
    for variant in record["variants"]:
        run = open_run(variant["run_id"], home)
        rows += [{"run_id": run.run_id, **variant["overrides"], **row} for row in run.metrics()]
    return rows


def to_csv(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _cell(value) for key, value in row.items()})
    return out.getvalue()


def to_jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, default=str) + "\n" for row in rows)


def export_text(item_id: str, fmt: str, home: Path | None = None) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    rows = metrics_table(item_id, home)
    return to_csv(rows) if fmt == "csv" else to_jsonl(rows)


def _cell(value: Any) -> Any:
    """CSV cells: numbers and text as they are, anything nested as JSON, None as empty."""
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return value
