"""A TrainConfig described in TOML: what ``palaestra train RECIPE.toml`` runs.

    name = "haiku"                  # optional: prefix of the run id
    checkpoint = "path/step_000010" # optional: start from this checkpoint

    [model]
    name = "SmolLM2-135M-Instruct"  # a catalogue entry, by model name or class name
    # path = "./my-model"           # or an HF-format directory; source = "org/id" for the hub

    [dataset]
    builtin = "haiku"               # or: path = "prompts.jsonl", or: hf_repo = "statworx/haiku"
    hf_split = "train[:10]"
    input_column = "keywords"

    [recipe]
    preset = "SmolLM2_135M_Recipe"  # optional: a Recipe class of palaestra.recipes
    num_rollout = 10
    custom_rm_function = "palaestra.rewards.haiku:haiku_reward"

    [eval_dataset]                  # optional; same keys as [dataset], needs recipe.eval_interval

    [[metrics]]                     # optional, repeatable: mirror metrics to a tracker
    kind = "trackio"                # or "wandb"; other keys: TrackioConfig's or WandbConfig's
    project = "haiku"

``model = "SmolLM2-135M-Instruct"`` is short for a ``[model]`` table with only a name. Relative
paths are relative to the TOML file, and its folder is importable, so a reward can live in a
module beside it (``custom_rm_function = "my_rewards:score"``).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from palaestra import recipes
from palaestra.config import TrainConfig
from palaestra.data import DatasetConfig, HuggingFaceDataset, LocalDataset, builtin_dataset
from palaestra.models import ModelConfig
from palaestra.models.catalogue import find_catalogue_model


class TrainFileError(ValueError):
    """A training TOML file that cannot become a TrainConfig; the message names file and field."""


class TrainFile(BaseModel):
    """The top level of a training TOML file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str | dict[str, Any]
    """A catalogue model name, or a table: ``name``/``path``/``source`` and ModelConfig fields."""
    dataset: dict[str, Any]
    """DatasetConfig fields, plus ``builtin`` or ``path`` to say where rows come from."""
    recipe: dict[str, Any] = {}
    """Recipe fields, plus ``preset``: the Recipe class whose defaults they override."""
    eval_dataset: dict[str, Any] | None = None
    """Like ``dataset``; scored every ``recipe.eval_interval`` steps."""
    checkpoint: str | None = None
    """Checkpoint directory to start from."""
    name: str | None = None
    """Prefix of the run id."""
    metrics: list[dict[str, Any]] | None = None
    """``[[metrics]]`` tables: trackers to mirror metrics to, each chosen by its ``kind``."""


def load_train_file(path: str | Path) -> TrainConfig:
    """Read ``path`` into a TrainConfig; TrainFileError names the file and the bad field."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TrainFileError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as error:
        raise TrainFileError(f"{path}: not valid TOML: {error}") from None
    try:
        spec = TrainFile.model_validate(data)
    except ValidationError as error:
        raise TrainFileError(_describe(path, "", error)) from None
    folder = path.resolve().parent
    model = _section(path, "model", _model, spec.model, folder)
    dataset = _section(path, "dataset", _dataset, spec.dataset, folder)
    eval_dataset = None
    if spec.eval_dataset is not None:
        eval_dataset = _section(path, "eval_dataset", _dataset, spec.eval_dataset, folder)
    recipe = _section(path, "recipe", _recipe, spec.recipe, folder)
    checkpoint = str(_resolve(spec.checkpoint, folder)) if spec.checkpoint else None
    try:
        return TrainConfig(
            model=model,
            dataset=dataset,
            eval_dataset=eval_dataset,
            recipe=recipe,
            checkpoint=checkpoint,
            name=spec.name,
            **({} if spec.metrics is None else {"metrics": spec.metrics}),
        )
    except ValidationError as error:
        raise TrainFileError(_describe(path, "", error)) from None


def _section(path: Path, name: str, build, value: Any, folder: Path) -> Any:
    """``build(value, folder)``, with any error prefixed by the file and ``[name]``."""
    try:
        return build(value, folder)
    except ValidationError as error:
        raise TrainFileError(_describe(path, name, error)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        message = error.args[0] if isinstance(error, KeyError) else error
        raise TrainFileError(f"{path}: [{name}] {message}") from None


def _describe(path: Path, section: str, error: ValidationError) -> str:
    where = f"[{section}] " if section else ""
    problems = [
        f"{where}{'.'.join(str(part) for part in item['loc']) or '(top level)'}: {item['msg']}"
        for item in error.errors()
    ]
    return f"{path}: " + "; ".join(problems)


def _resolve(value: str, folder: Path) -> Path:
    candidate = Path(value).expanduser()
    return candidate if candidate.is_absolute() else folder / candidate


def _model(value: str | dict[str, Any], folder: Path) -> ModelConfig:
    fields = {"name": value} if isinstance(value, str) else dict(value)
    path = fields.pop("path", None)
    if path is not None:
        fields["source"] = str(_resolve(path, folder))
    if "source" in fields:
        source = fields["source"]
        fields.setdefault("name", Path(source.rstrip("/")).name)
        return ModelConfig(**fields)
    if "name" not in fields:
        raise ValueError("give the model's catalogue name, or a path or source")
    return find_catalogue_model(fields.pop("name"))(**fields)


def _dataset(value: dict[str, Any], folder: Path) -> DatasetConfig:
    fields = dict(value)
    builtin = fields.pop("builtin", None)
    if builtin is not None:
        if "hf_repo" in fields or "path" in fields:
            raise ValueError("set one of builtin, path and hf_repo")
        return HuggingFaceDataset(hf_repo=str(builtin_dataset(builtin)), **fields)
    if "path" in fields:
        fields["path"] = str(_resolve(fields["path"], folder))
        return LocalDataset(**fields)
    repo = fields.get("hf_repo")
    if isinstance(repo, str) and repo.startswith(("./", "../")):
        fields["hf_repo"] = str(_resolve(repo, folder))
    return HuggingFaceDataset(**fields)


def _recipe(value: dict[str, Any], folder: Path) -> recipes.Recipe:
    fields = dict(value)
    preset = fields.pop("preset", "Recipe")
    cls = getattr(recipes, preset, None)
    if not (isinstance(cls, type) and issubclass(cls, recipes.Recipe)):
        known = sorted(
            name
            for name, item in vars(recipes).items()
            if isinstance(item, type) and issubclass(item, recipes.Recipe)
        )
        raise ValueError(f"preset {preset!r} is not a recipe; known: {', '.join(known)}")
    if isinstance(fields.get("custom_rm_function"), str) and str(folder) not in sys.path:
        # A reward module beside the file imports here and, through sys.path, in the run.
        sys.path.insert(0, str(folder))
    return cls(**fields)
