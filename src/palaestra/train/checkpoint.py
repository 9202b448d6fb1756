"""Checkpoints: HF-format weights that plain transformers loads, plus the trainer's state.

step_000010/
  config.json, model.safetensors, generation_config.json, tokenizer files
  palaestra.json       run id, step, model name (what an endpoint needs to know)
  trainer_state.pt     optimiser state, step, data cursor, RNG states (for resuming)

A LoRA run's checkpoint holds ``adapter_config.json`` and ``adapter_model.safetensors`` in
place of the full weights (transformers with peft installed loads it over its base, named in
``palaestra.json`` as ``base_model_path``); ``palaestra.train.lora.export_merged`` turns one
into a plain model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from palaestra.atomic import fsync_folder, fsync_tree


def save_checkpoint(
    checkpoints_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer,
    trainer_state: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Write ``step_NNNNNN`` atomically: staged under a hidden name, flushed, then renamed."""

    def write(staging: Path) -> None:
        model.save_pretrained(staging)  # a peft model writes its adapters only
        tokenizer.save_pretrained(staging)
        (staging / "palaestra.json").write_text(json.dumps({**info, "step": step}, indent=2))
        torch.save(trainer_state, staging / "trainer_state.pt")

    return write_folder_atomic(checkpoints_dir / f"step_{step:06d}", write)


def write_folder_atomic(final: Path, write: Callable[[Path], None]) -> Path:
    """Fill a hidden staging folder beside ``final`` with ``write``, flush it, rename it to
    ``final``. A crash leaves only a hidden ``.name-*`` folder, never a half-written ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write(staging)
        fsync_tree(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
        os.replace(staging, final)
        fsync_folder(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a palaestra checkpoint: no trainer_state.pt")
    # Our own file: optimiser tensors plus plain Python values and RNG byte tensors.
    return torch.load(path, map_location="cpu", weights_only=False)


def remove_stale_staging(checkpoints_dir: Path) -> None:
    """Delete checkpoints a crashed process left half written (hidden ``.step_*`` folders)."""
    if checkpoints_dir.is_dir():
        for child in checkpoints_dir.glob(".step_*"):
            shutil.rmtree(child, ignore_errors=True)
