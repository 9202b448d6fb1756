"""Runs side by side: each run's metrics, named by what sets it apart from the others.

A run's label is the config fields that differ among the runs compared, as dotted keys of its
config.json (``recipe.lr=0.01, recipe.n_samples_per_prompt=4``): what a reader needs to tell
the lines of an overlaid chart apart. Runs of one group (a sweep) differ in the group's grid
fields; for them the label names those fields, in the grid's order. Read-only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from palaestra.runs.registry import open_run

UNCOMPARED = ("run_id", "created_at", "group_id", "group_overrides", "group_axes")
"""Config keys that tell every run apart without saying how it was trained."""

_MISSING = object()


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"recipe": {"lr": 0.01}}`` as ``{"recipe.lr": 0.01}``; lists and empty objects are
    values of their own key."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{dotted}.")
        else:
            flat[dotted] = value
    return flat


def _one_group(configs: list[dict[str, Any]]) -> str | None:
    """The group id all ``configs`` share, or None when they are not one group's variants."""
    ids = {config.get("group_id") for config in configs}
    return ids.pop() if len(ids) == 1 and None not in ids else None


def field_value(config: dict[str, Any], field: str) -> Any:
    """The value of the dotted ``field`` in ``config`` (a group override wins: a grid may name a
    whole sub-config), or a marker when the config lacks it."""
    overrides = config.get("group_overrides") or {}
    if field in overrides:
        return overrides[field]
    value: Any = config
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _whole(field: str, flats: list[dict[str, Any]]) -> str:
    """``field``, or the shortest prefix of it that some config has as a value of its own: a
    sub-config set in one run and None in another (``eval_dataset``) differs as one field, not
    as each of its keys."""
    parts = field.split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if any(prefix in flat for flat in flats):
            return prefix
    return field


def differing_fields(configs: list[dict[str, Any]]) -> list[str]:
    """The dotted config fields whose values are not the same in all ``configs``, in config
    order; for the variants of one group, those of its grid fields, in the grid's order. A
    field some configs lack (runs from before it existed) differs; one that repeats an earlier
    field of its sub-config in every run (a local dataset's ``path`` and ``hf_repo``) is left
    out."""
    if len(configs) < 2:
        return []
    group = _one_group(configs)
    if group is not None:
        candidates: list[str] = []
        for config in configs:
            for field in [
                *(config.get("group_axes") or []),
                *(config.get("group_overrides") or {}),
            ]:
                if field not in candidates:
                    candidates.append(field)
    else:
        flats = [flatten(config) for config in configs]
        candidates = []
        for flat in flats:
            for field in (_whole(key, flats) for key in flat):
                if field.split(".")[0] not in UNCOMPARED and field not in candidates:
                    candidates.append(field)
    differing: dict[str, tuple[str, ...]] = {}
    for field in candidates:
        values = tuple(_key(field_value(config, field)) for config in configs)
        parent = field.rpartition(".")[0]
        repeats = any(
            seen == values and other.rpartition(".")[0] == parent
            for other, seen in differing.items()
        )
        if len(set(values)) > 1 and not repeats:
            differing[field] = values
    return list(differing)


def _key(value: Any) -> str:
    return "\0missing" if value is _MISSING else json.dumps(value, sort_keys=True, default=str)


def format_value(value: Any, width: int = 40) -> str:
    """A config value as a label shows it: strings bare, everything else as JSON; an object
    longer than ``width`` characters as ``{…}`` (a sub-config set in one run and not in
    another), a list cut to ``width``."""
    if value is _MISSING:
        return "unset"
    if isinstance(value, str):
        return value
    text = json.dumps(value, default=str)
    if len(text) <= width:
        return text
    return "{…}" if isinstance(value, dict) else text[: width - 1] + "…"


def run_label(config: dict[str, Any], fields: list[str], run_id: str) -> str:
    """``recipe.lr=0.01, recipe.n_samples_per_prompt=4``; the run id when ``fields`` is empty."""
    if not fields:
        return run_id
    return ", ".join(f"{field}={format_value(field_value(config, field))}" for field in fields)


def compare_runs(run_ids: list[str], home: Path | None = None) -> list[dict[str, Any]]:
    """Each run (duplicates once, in the order given): its id, label, state and metrics rows
    (its metrics.jsonl). KeyError naming the first run id that is not a run."""
    runs = [open_run(run_id, home) for run_id in dict.fromkeys(run_ids)]
    configs = [run.config() for run in runs]
    fields = differing_fields(configs)
    return [
        {
            "run_id": run.run_id,
            "label": run_label(config, fields, run.run_id),
            "state": run.read_status().get("state", "pending"),
            "group_id": config.get("group_id"),
            "metrics": run.metrics(),
        }
        for run, config in zip(runs, configs, strict=True)
    ]
