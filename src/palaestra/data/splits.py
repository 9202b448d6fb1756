"""Local splits: which files make up each split, reading them, and selecting rows by a split spec.

A folder holds one file per split, ``<split>.jsonl`` (or .json, .parquet, .csv), or shards
``<split>-00000-of-00002.parquet``, at its top or under ``data/`` as hub repos lay them out.

A split spec (``train``, ``train[:10]``, ``train[10:15]``, ``train[-5:]``, ``train[:10%]``,
``train[10%:20%](pct1_dropremainder)``, ``train[:10]+test[:5]``) is parsed and turned into row
bounds by ``datasets.ReadInstruction``, the code ``datasets.load_dataset(..., split=...)`` runs on
the hub, so a dataset config selects the same rows whether ``hf_repo`` names a hub id or a folder
on disk. This module adds what the library leaves out: errors that name the spec and list the
accepted forms, split names with a ``-`` (local file names carry them), and no ``datasets``
import at all for a spec that names one whole split.

``DatasetError`` lives here because this is the lowest module of the data package.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import ReadInstruction


class DatasetError(ValueError):
    """A dataset's files, split, columns or prompt template do not fit its config."""


ACCEPTED_FORMS = (
    "train, train[:10], train[10:15], train[-5:], train[:10%], train[10%:20%], train[:10]+test[:5]"
)

# A spec naming one whole split; datasets' split-name grammar, with '-' allowed.
_WHOLE_SPLIT_RE = re.compile(r"\w+([.-]\w+)*")
# datasets' own separator between the terms of a spec.
_TERM_SEP_RE = re.compile(r"\s*\+\s*")
# datasets' grammar refuses '-' in a split name, so one travels through its parser as this
# token. A '-' after '[' or ':' (a negative bound) has no word character before it and stays.
_DASH_IN_NAME_RE = re.compile(r"(?<=\w)-(?=\w)")
_DASH = "_0x2d_"

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# HF's shard naming, train-00000-of-00003.parquet; the stem before it is the split.
_SHARD_RE = re.compile(r"^(?P<split>.+?)-\d+(-of-\d+)?$")


def check_split(spec: str) -> None:
    """DatasetError unless ``spec`` is a well-formed split spec; cheap for a whole split."""
    if not (isinstance(spec, str) and _WHOLE_SPLIT_RE.fullmatch(spec)):
        parse_split(spec)


def parse_split(spec: str) -> list[ReadInstruction]:
    """One ``datasets.ReadInstruction`` per ``+``-separated term; DatasetError if malformed.

    Terms are parsed apart so that each keeps its own rounding, as in a single term.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"malformed split {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    from datasets import ReadInstruction

    terms = []
    for term in _TERM_SEP_RE.split(spec.strip()):
        try:
            terms.append(ReadInstruction.from_spec(_DASH_IN_NAME_RE.sub(_DASH, term)))
        except ValueError as err:
            raise DatasetError(_malformed(spec, term, str(err))) from None
        _check_units(spec, term)
    return terms


def split_name(term: ReadInstruction) -> str:
    """The split a parsed term reads (its spec starts with the name)."""
    return str(term).partition("[")[0].replace(_DASH, "-")


def _malformed(spec: str, term: str, reason: str) -> str:
    """Today's message for each way ``datasets`` refuses a term."""
    if "Percent slice boundaries" in reason:
        return f"malformed split {spec!r}: percentages must be within -100..100"
    if "rounding" in reason:
        rounding = term.rpartition("(")[2].rstrip(")")
        return (
            f"malformed split {spec!r}: rounding {rounding!r} needs percent boundaries "
            "and one of closest, pct1_dropremainder"
        )
    return f"malformed split {spec!r}; accepted forms: {ACCEPTED_FORMS}"


def _check_units(spec: str, term: str) -> None:
    # datasets silently reads '10:20%' as percent at both ends; a mix is more likely a typo.
    bounds = [b for b in term.partition("[")[2].partition("]")[0].split(":") if b]
    if len({b.endswith("%") for b in bounds}) > 1:
        raise DatasetError(
            f"malformed split {spec!r}: both boundaries of {term!r} must be rows or "
            f"percentages, not one of each; accepted forms: {ACCEPTED_FORMS}"
        )


def select_split(
    spec: str,
    available: Sequence[str],
    load: Callable[[str], list[dict[str, Any]]],
    source: str = "the dataset",
) -> list[dict[str, Any]]:
    """The rows ``spec`` selects; ``load(name)`` reads one whole split, once, only if needed."""
    if isinstance(spec, str) and _WHOLE_SPLIT_RE.fullmatch(spec):
        _check_known([spec], available, source)
        return load(spec)
    terms = parse_split(spec)
    names = [split_name(term) for term in terms]
    _check_known(names, available, source)
    loaded = {name: load(name) for name in dict.fromkeys(names)}
    rows: list[dict[str, Any]] = []
    for name, term in zip(names, terms, strict=True):
        split_rows = loaded[name]
        try:
            (bounds,) = term.to_absolute({_DASH_IN_NAME_RE.sub(_DASH, name): len(split_rows)})
        except ValueError:  # the one way a known split fails: pct1 rounding of < 100 rows
            raise DatasetError(
                f"split {name!r}: pct1_dropremainder rounding on a split of {len(split_rows)} "
                "rows (fewer than 100) always selects nothing"
            ) from None
        rows.extend(split_rows[bounds.from_ : bounds.to])
    return rows


def _check_known(names: list[str], available: Sequence[str], source: str) -> None:
    for name in names:
        if name not in available:
            raise DatasetError(
                f"unknown split {name!r} in {source}; available splits: "
                f"{', '.join(sorted(available)) or '(none)'}"
            )


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
