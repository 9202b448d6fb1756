"""Local splits: which files make up each split, reading them, and the slicing syntax.

A folder holds one file per split, ``<split>.jsonl`` (or .json, .parquet, .csv), or shards
``<split>-00000-of-00002.parquet``, at its top or under ``data/`` as hub repos lay them out.
``train``, ``train[:10]``, ``train[10:15]``, ``train[-5:]``, ``train[:10%]``,
``train[10%:20%]`` and concatenations such as ``train[:10]+test[:5]`` select the same rows here
as ``datasets.load_dataset(..., split=...)`` does on the hub, so a dataset config means the same
thing whether ``hf_repo`` names a hub id or a folder on disk. Percent boundaries use the library's
default ``closest`` rounding (``round(pct * n / 100)``); ``(pct1_dropremainder)`` is accepted too.

``DatasetError`` lives here because this is the lowest module of the data package.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A dataset's files, split, columns or prompt template do not fit its config."""


ACCEPTED_FORMS = (
    "train, train[:10], train[10:15], train[-5:], train[:10%], train[10%:20%], train[:10]+test[:5]"
)

# The same grammar as datasets.arrow_reader._SUB_SPEC_RE, with '-' allowed in split names
# because local file names (``validation-matched.jsonl``) may carry one.
_PART_RE = re.compile(
    r"^(?P<split>\w[\w.-]*)"
    r"(\[(?:(?P<from>-?[\d_]+)(?P<from_pct>%)?)?:(?:(?P<to>-?[\d_]+)(?P<to_pct>%)?)?\])?"
    r"(\((?P<rounding>[^)]*)\))?$"
)
_ROUNDINGS = ("closest", "pct1_dropremainder")

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# HF's shard naming, train-00000-of-00003.parquet; the stem before it is the split.
_SHARD_RE = re.compile(r"^(?P<split>.+?)-\d+(-of-\d+)?$")


@dataclass(frozen=True)
class SplitSlice:
    """One ``name[from:to]`` term of a split spec, before the split's length is known."""

    split: str
    start: int | None = None
    stop: int | None = None
    percent: bool = False
    rounding: str = "closest"

    def bounds(self, n: int) -> tuple[int, int]:
        """Absolute ``(start, stop)`` in a split of ``n`` rows, clamped like ``datasets``."""
        start, stop = self.start, self.stop
        if self.percent:
            start = 0 if start is None else self._pct_to_abs(start, n)
            stop = n if stop is None else self._pct_to_abs(stop, n)
        else:
            start = 0 if start is None else start
            stop = n if stop is None else stop
        if start < 0:
            start = max(n + start, 0)
        if stop < 0:
            stop = max(n + stop, 0)
        return min(start, n), min(stop, n)

    def _pct_to_abs(self, pct: int, n: int) -> int:
        if self.rounding == "closest":
            return int(round(pct * n / 100.0))
        if n < 100:
            raise DatasetError(
                f"split {self.split!r}: pct1_dropremainder rounding on a split of {n} rows "
                "(fewer than 100) always selects nothing"
            )
        return pct * math.trunc(n / 100.0)


def parse_split(spec: str) -> list[SplitSlice]:
    """Parse ``spec`` into its ``+``-separated terms; DatasetError on anything malformed."""
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"malformed split {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    slices = []
    for part in re.split(r"\s*\+\s*", spec.strip()):
        match = _PART_RE.match(part)
        if match is None:
            raise DatasetError(f"malformed split {spec!r}; accepted forms: {ACCEPTED_FORMS}")
        percent = bool(match["from_pct"] or match["to_pct"])
        # datasets silently reads '10:20%' as percent at both ends; a mix is more likely a typo.
        if percent and (
            (match["from"] and not match["from_pct"]) or (match["to"] and not match["to_pct"])
        ):
            raise DatasetError(
                f"malformed split {spec!r}: both boundaries of {part!r} must be rows or "
                f"percentages, not one of each; accepted forms: {ACCEPTED_FORMS}"
            )
        try:
            start = int(match["from"]) if match["from"] else None
            stop = int(match["to"]) if match["to"] else None
        except ValueError:  # the grammar lets a lone '_' through, as datasets' does
            raise DatasetError(
                f"malformed split {spec!r}; accepted forms: {ACCEPTED_FORMS}"
            ) from None
        if percent and any(b is not None and abs(b) > 100 for b in (start, stop)):
            raise DatasetError(f"malformed split {spec!r}: percentages must be within -100..100")
        rounding = match["rounding"] or "closest"
        if rounding not in _ROUNDINGS or (match["rounding"] and not percent):
            raise DatasetError(
                f"malformed split {spec!r}: rounding {rounding!r} needs percent boundaries "
                f"and one of {', '.join(_ROUNDINGS)}"
            )
        slices.append(SplitSlice(match["split"], start, stop, percent, rounding))
    return slices


def select_split(
    spec: str,
    available: Sequence[str],
    load: Callable[[str], list[dict[str, Any]]],
    source: str = "the dataset",
) -> list[dict[str, Any]]:
    """The rows ``spec`` selects; ``load(name)`` reads one whole split, once, only if needed."""
    slices = parse_split(spec)
    for piece in slices:
        if piece.split not in available:
            raise DatasetError(
                f"unknown split {piece.split!r} in {source}; available splits: "
                f"{', '.join(sorted(available)) or '(none)'}"
            )
    loaded: dict[str, list[dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for piece in slices:
        if piece.split not in loaded:
            loaded[piece.split] = load(piece.split)
        split_rows = loaded[piece.split]
        start, stop = piece.bounds(len(split_rows))
        rows.extend(split_rows[start:stop])
    return rows


def discover_splits(root: Path) -> dict[str, list[Path]]:
    """The files of each split in a folder, in the order their rows are read."""
    files: dict[str, list[Path]] = {}
    for folder in (root, root / "data"):
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix in DATA_SUFFIXES and not path.name.startswith("."):
                shard = _SHARD_RE.match(path.stem)
                files.setdefault(shard["split"] if shard else path.stem, []).append(path)
    if not files:
        raise DatasetError(
            f"no data files in {root}: expected <split>.jsonl (or .json, .parquet, .csv), "
            "shards <split>-00000-of-00002.parquet, or the same under data/"
        )
    for split, paths in files.items():
        if len({p.suffix for p in paths}) > 1:
            names = ", ".join(str(p) for p in paths)
            raise DatasetError(f"split {split!r} has files of more than one format: {names}")
    return files


def read_file(path: Path) -> list[dict[str, Any]]:
    """Every row of one data file, columns as stored."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if path.suffix == ".csv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path).to_pylist()
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"cannot read {path}: {err}") from err
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # like datasets, read a .json file of JSON Lines as such
        if isinstance(data, list) and all(isinstance(row, dict) for row in data):
            return data
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            columns = zip(*data.values(), strict=True)  # column-oriented: {"a": [...], "b": [...]}
            return [dict(zip(data, values, strict=True)) for values in columns]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
