"""What to serve: a ``palaestra serve`` target (checkpoint folder, model folder, hub id or
catalogue name) resolved to a model and checkpoint, the name an endpoint of them is listed
under, and what a request that leaves ``max_tokens`` or ``temperature`` out gets. Both servers
(palaestra's own and vLLM's) and the ``Endpoint`` handle ask here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from palaestra.checkpoints import is_model_folder, read_info
from palaestra.models.catalogue import find_catalogue_model
from palaestra.models.config import ModelConfig

DEFAULT_MAX_TOKENS = 512
"""``max_tokens`` when a request leaves it out and the model sets no ``default_max_tokens``
(bounded by the context left after the prompt)."""
DEFAULT_TEMPERATURE = 1.0
"""``temperature`` when a request leaves it out and the model sets no ``default_temperature``."""


def resolve_target(target: str) -> tuple[ModelConfig, str | None]:
    """What ``palaestra serve TARGET`` serves: (model, checkpoint path or None).

    A checkpoint folder (it has palaestra.json) serves its weights with its model's settings;
    a model folder or a hub id serves as it is; a catalogue name (``SmolLM2-135M-Instruct`` or
    ``SmolLM2_135M``) serves the catalogue's model.
    """
    path = Path(target).expanduser()
    info = read_info(path) if path.is_dir() else {}
    if info and is_model_folder(path):
        try:
            model = find_catalogue_model(str(info.get("model")))()
        except (KeyError, ValueError):
            model = ModelConfig.from_pretrained(path, name=info.get("model"))
        return model, str(path)
    if path.exists():
        return ModelConfig.from_pretrained(path), None
    try:
        return find_catalogue_model(target)(), None
    except (KeyError, ValueError):
        if "/" in target:
            return ModelConfig.from_pretrained(target), None
        raise


def default_name(model: ModelConfig, checkpoint: Any = None) -> str:
    """``<model>`` for the base model, ``<model>-<run id>-step<N>`` for a checkpoint."""
    parts = [model.name]
    if checkpoint is not None:
        parts += [
            checkpoint.run_id or Path(checkpoint.path).parent.parent.name,
            f"step{checkpoint.step}",
        ]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-")
