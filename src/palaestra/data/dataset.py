"""DatasetConfig: where a dataset's rows come from and how each row becomes a prompt.

A pydantic model, like every user-facing config, that users subclass with plain class attributes
(``class HaikuDataset(HuggingFaceDataset): input_column = "keywords"``, no annotation). Its
metaclass (fields.py) gives such an attribute the base field before pydantic builds the class,
and refuses any other public name, so a misspelt knob is an error naming it and suggesting the
field, never a silent default. Values are checked strictly, at construction (class-level values
too) and on assignment, and the errors are a TypeError or DatasetError naming the field.

Rows come from the hub (``datasets.load_dataset``, imported lazily) or from local files (see
splits.py): one data file, whose single split is ``train``, or a folder of per-split files.
Prepared prompts can be cached as a file (prepared.py) named by a hash of everything that
shapes them.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import string
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator

from palaestra.atomic import write_bytes_atomic
from palaestra.data.fields import ConfigMeta, config_error, suggest
from palaestra.data.hub_cache import dataset_folder, dataset_snapshot, hub_offline
from palaestra.data.prepared import OUTPUT_FORMATS, encode_prompts, read_prompts
from palaestra.data.splits import (
    DATA_SUFFIXES,
    DatasetError,
    check_split,
    discover_splits,
    read_file,
    select_split,
)
from palaestra.types import Prompt

_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


class DatasetConfig(BaseModel, metaclass=ConfigMeta):
    """A dataset of prompts: its source, its split, and how a row is turned into chat messages."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        validate_default=True,
        validate_assignment=True,
        use_attribute_docstrings=True,
    )

    hf_repo: str | None = None
    """Hub dataset id (``statworx/haiku``), or a local data file or folder of per-split files."""
    hf_subset: str | None = None
    """Hub config name; for a local folder, a subfolder holding that config's split files."""
    hf_split: str = "train"
    """Split, with the ``datasets`` slicing syntax: ``train[:10]``, ``train[10%:20%]``, ``a+b``."""
    input_column: str = "input"
    """Column whose value fills ``{input}`` in ``prompt_template``."""
    output_column: str | None = None
    """Column holding the reference answer; it becomes the sample's ``label``."""
    system_prompt: str | None = None
    """Prepended to every prompt as a system message."""
    prompt_template: str = "{input}"
    """User message, formatted with ``input=`` the input column and every column by name."""
    apply_chat_template: bool = True
    """Render the messages with the tokenizer's chat template; False feeds the plain prompt."""
    output_format: str = "jsonl"
    """Format of the prepared-prompts file: ``jsonl`` or ``parquet``."""
    always_prepare: bool = True
    """False: reuse a prepared file made from the same config, chat template and source files."""
    messages_column: str | None = None
    """Column already holding a list of chat messages, used instead of ``prompt_template``."""

    _local_only: ClassVar[bool] = False
    _rows: list[dict[str, Any]] | None = PrivateAttr(default=None)

    def __init__(self, **overrides: Any) -> None:
        fields = type(self).model_fields
        for name in overrides:
            if name not in fields:
                raise TypeError(
                    f"{type(self).__name__}() got an unexpected keyword {name!r}"
                    f"{suggest(name, fields)}"
                )
        try:
            super().__init__(**overrides)
        except ValidationError as err:
            raise config_error(type(self), err) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            super().__setattr__(name, value)
            return
        fields = type(self).model_fields
        if name not in fields:
            raise AttributeError(
                f"{type(self).__name__} has no field {name!r}{suggest(name, fields)}"
            )
        try:
            super().__setattr__(name, value)
        except ValidationError as err:
            raise config_error(type(self), err) from None
        self._rows = None  # another field value may select other rows

    @field_validator("*", mode="before")
    @classmethod
    def _plain_path(cls, value: Any) -> Any:
        return _plain(value)

    @field_validator("output_format")
    @classmethod
    def _check_output_format(cls, value: str) -> str:
        if value not in OUTPUT_FORMATS:
            raise DatasetError(
                f"{cls.__name__}.output_format is {value!r}; allowed: {', '.join(OUTPUT_FORMATS)}"
            )
        return value

    @field_validator("hf_split")
    @classmethod
    def _check_split(cls, value: str) -> str:
        check_split(value)
        return value

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        _template_fields(value)
        return value

    def __getstate__(self) -> dict[str, Any]:
        # A pickled config (sent to a training process) carries the settings, not the rows.
        state = super().__getstate__()
        private = {**(state.get("__pydantic_private__") or {}), "_rows": None}
        return {**state, "__pydantic_private__": private}

    # Identity, as before pydantic: a config may key a dict, and its rows are no part of it.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        cls = type(self)
        changed = [
            f"{name}={getattr(self, name)!r}"
            for name, field in cls.model_fields.items()
            if getattr(self, name) != _plain(field.default)
        ]
        return f"{cls.__name__}({', '.join(changed)})"

    __str__ = __repr__

    def to_dict(self) -> dict[str, Any]:
        """Every field, plus ``"class"``: what a run's ``config.json`` records."""
        cls = type(self)
        return {"class": f"{cls.__module__}.{cls.__qualname__}", **self.model_dump()}

    @property
    def _where(self) -> str:
        return f"{self.hf_repo} split {self.hf_split!r}"

    def load(self) -> list[dict[str, Any]]:
        """Rows of the selected split with their original columns; read once per instance."""
        if self._rows is None:
            files = self._split_files()
            rows = self._load_hub() if files is None else self._read_split(files)
            self._rows = rows
        return self._rows

    def _split_files(self) -> dict[str, list[Path]] | None:
        """The files of each local split, or None when ``hf_repo`` is a hub id."""
        repo = self.hf_repo
        if repo is None:
            raise DatasetError(
                f"{type(self).__name__}.hf_repo is not set: set it to a hub dataset id "
                "or a local data file or folder"
            )
        path = Path(repo).expanduser()
        if not path.exists():
            if self._local_only or repo.startswith(_PATH_PREFIXES) or path.suffix in DATA_SUFFIXES:
                raise DatasetError(f"local dataset {repo} not found")
            if not hub_offline():
                return None  # the hub answers (datasets.load_dataset), or _load_hub falls back
            return self._cached_files(offline=True)
        if path.is_file():
            if path.suffix not in DATA_SUFFIXES:
                raise DatasetError(f"{repo}: unsupported file type; use {', '.join(DATA_SUFFIXES)}")
            if self.hf_subset is not None:
                raise DatasetError(f"{repo} is a single file; it has no subset {self.hf_subset!r}")
            return {"train": [path]}
        if self.hf_subset is not None:
            path = path / self.hf_subset
            if not path.is_dir():
                raise DatasetError(f"subset {self.hf_subset!r} not found: no folder {path}")
        return discover_splits(path)

    def _cached_files(self, offline: bool) -> dict[str, list[Path]]:
        """The files of each split of the hub cache's snapshot of ``hf_repo``."""
        repo = str(self.hf_repo)
        snapshot = dataset_snapshot(repo)
        if snapshot is None:
            why = "HF_HUB_OFFLINE is set" if offline else "the hub did not answer"
            raise DatasetError(
                f"{repo}: {why} and the Hugging Face cache holds no snapshot of it (looked in "
                f"{dataset_folder(repo)}). Download it where the hub is reachable: "
                f"hf download {repo} --repo-type dataset (with the same HF_HOME), or set "
                "hf_repo to a local file or folder"
            )
        if self.hf_subset is not None:
            snapshot = snapshot / self.hf_subset
            if not snapshot.is_dir():
                raise DatasetError(
                    f"{repo}: subset {self.hf_subset!r} not found: no folder {snapshot}"
                )
        return discover_splits(snapshot)

    def _load_hub(self) -> list[dict[str, Any]]:
        """Rows from the hub; the cache's snapshot when the hub cannot be reached."""
        repo = str(self.hf_repo)
        try:
            return _load_hub(repo, self.hf_subset, self.hf_split)
        except ConnectionError:
            if dataset_snapshot(repo) is None:
                raise
        return self._read_split(self._cached_files(offline=False))

    def _read_split(self, files: dict[str, list[Path]]) -> list[dict[str, Any]]:
        """The rows ``hf_split`` selects from local split files."""
        return select_split(
            self.hf_split,
            list(files),
            lambda split: [row for path in files[split] for row in read_file(path)],
            source=str(self.hf_repo),
        )

    def check_columns(self, rows: list[dict[str, Any]] | None = None) -> None:
        """Raise DatasetError unless every row has the columns and template fields this needs."""
        rows = self.load() if rows is None else rows
        if not rows:
            raise DatasetError(f"{self._where} is empty")
        columns = list(dict.fromkeys(key for row in rows for key in row))
        if self.messages_column is not None:
            needed = [("messages_column", self.messages_column)]
        else:
            needed = [("input_column", self.input_column)]
        if self.output_column is not None:
            needed.append(("output_column", self.output_column))
        for role, column in needed:
            missing = [i for i, row in enumerate(rows) if column not in row]
            if len(missing) == len(rows):
                raise DatasetError(
                    f"column {column!r} ({role}) not found in {self._where}; "
                    f"columns are: {', '.join(columns)}"
                )
            if missing:
                raise DatasetError(
                    f"column {column!r} ({role}) is missing from row {missing[0]} of "
                    f"{self._where} ({len(missing)} of {len(rows)} rows lack it)"
                )
        if self.messages_column is None:
            for name in _template_fields(self.prompt_template):
                if name != "input" and name not in columns:
                    raise DatasetError(self._bad_field(name, columns))

    def _bad_field(self, name: str, columns: list[str]) -> str:
        return (
            f"prompt_template {self.prompt_template!r} names {{{name}}}, which is neither "
            f"'input' nor a column of {self._where}; columns are: {', '.join(columns)}"
        )

    def prepare(
        self,
        tokenizer: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_dir: Path | None = None,
    ) -> list[Prompt]:
        """Every row as a Prompt; with ``cache_dir``, also written there as a prepared file.

        ``chat_template_kwargs`` reach the template (``enable_thinking=False``, for instance).
        """
        kwargs = dict(chat_template_kwargs or {})
        template = None
        if self.apply_chat_template:
            if tokenizer is None:
                raise DatasetError(
                    f"{type(self).__name__}.prepare() needs a tokenizer because "
                    "apply_chat_template is True; pass one or set apply_chat_template = False"
                )
            template = getattr(tokenizer, "chat_template", "")
            if template is None:
                raise DatasetError(
                    "the tokenizer has no chat template; give the model one "
                    "(ModelConfig.chat_template) or set apply_chat_template = False"
                )
        cached = None
        if cache_dir is not None:
            name = f"prepared-{self._cache_key(template, kwargs)}.{self.output_format}"
            cached = Path(cache_dir) / name
            if not self.always_prepare and cached.is_file():
                return read_prompts(cached)
        rows = self.load()
        self.check_columns(rows)
        prompts = [self._prompt(i, row, tokenizer, kwargs) for i, row in enumerate(rows)]
        if cached is not None:
            write_bytes_atomic(cached, encode_prompts(prompts, self.output_format))
        return prompts

    def _prompt(self, i: int, row: dict[str, Any], tokenizer: Any, kwargs: dict) -> Prompt:
        if self.messages_column is not None:
            messages = row[self.messages_column]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise DatasetError(
                    f"row {i} of {self._where}: {self.messages_column!r} must hold a list of "
                    f"{{'role': ..., 'content': ...}} messages, got {messages!r:.200}"
                )
            messages = [dict(m) for m in messages]
            # The row's own system message, when it has one, wins over system_prompt.
            has_system = bool(messages) and messages[0]["role"] == "system"
            if self.system_prompt is not None and not has_system:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        else:
            # input= wins over a column that happens to be called "input".
            fields = {**row, "input": row[self.input_column]}
            try:
                content = self.prompt_template.format(**fields)
            except KeyError as err:
                raise DatasetError(self._bad_field(err.args[0], list(row))) from None
            except (AttributeError, IndexError, TypeError, ValueError) as err:
                raise DatasetError(f"row {i} of {self._where}: prompt_template: {err}") from None
            messages = [{"role": "user", "content": content}]
            if self.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.apply_chat_template:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        else:
            text = "\n\n".join(str(m["content"]) for m in messages)
        label = row.get(self.output_column) if self.output_column is not None else None
        return Prompt(index=i, messages=messages, text=text, label=label, metadata=dict(row))

    def _cache_key(self, template: Any, kwargs: dict[str, Any]) -> str:
        # always_prepare changes when a file is rewritten, not what is in it.
        config = {k: v for k, v in self.to_dict().items() if k != "always_prepare"}
        # Local source files are stamped too, so editing rows.jsonl never serves stale prompts.
        files = self._split_files() or {}
        stamps = [
            [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
            for paths in files.values()
            for p in paths
        ]
        blob = json.dumps([config, template, kwargs, stamps], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class HuggingFaceDataset(DatasetConfig):
    """A dataset on the Hugging Face hub (or a local copy of one): subclass and set its fields."""


class LocalDataset(DatasetConfig):
    """Rows from local files: ``LocalDataset(path="rows.jsonl", input_column="question")``.

    ``path`` is an alias of ``hf_repo`` that reads better for local files; setting either one
    sets both. Unlike ``hf_repo`` on other configs, a missing path is never tried on the hub.
    """

    path: str | None = None
    """Local data file or folder; the same thing as ``hf_repo``."""

    _local_only: ClassVar[bool] = True

    def __init__(self, **overrides: Any) -> None:
        super().__init__(**overrides)
        if self.path is not None and self.hf_repo not in (None, self.path):
            raise TypeError(
                f"{type(self).__name__} got path={self.path!r} and hf_repo={self.hf_repo!r}; "
                "they are the same field, set one"
            )
        self.path = self.hf_repo = self.path if self.path is not None else self.hf_repo


def builtin_dataset(name: str) -> Path:
    """The folder of a dataset shipped with palaestra, e.g. ``builtin_dataset("haiku")``."""
    root = Path(str(importlib.resources.files("palaestra") / "data" / "builtin"))
    available = sorted(
        p.name
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir() and not p.name.startswith(("_", "."))
    )
    if name not in available:
        raise ValueError(
            f"unknown built-in dataset {name!r}; available: {', '.join(available) or '(none)'}"
        )
    return root / name


def _plain(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _template_fields(template: str) -> list[str]:
    """The names ``template`` formats; DatasetError on bad syntax or a positional ``{}``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DatasetError(
            f"prompt_template {template!r} is not a valid format string: {err}"
        ) from None
    names = [re.split(r"[.\[]", field)[0] for _, field, _, _ in parsed if field is not None]
    if any(n == "" or n.isdigit() for n in names):
        raise DatasetError(
            f"prompt_template {template!r} has a positional field; name it, e.g. {{input}}"
        )
    return names


def _load_hub(repo: str, subset: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    try:
        rows = datasets.load_dataset(repo, name=subset, split=split)
    except ValueError as err:  # unknown split or config: say which dataset asked for it
        raise DatasetError(f"{repo} (subset {subset!r}) split {split!r}: {err}") from err
    return [dict(row) for row in rows]
