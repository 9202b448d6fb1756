"""Checkpoints: HF-format weights that plain transformers loads, plus the trainer's state.

step_000010/
  config.json, model.safetensors, generation_config.json, tokenizer files
  palaestra.json       run id, step, model name (what an endpoint needs to know)
  trainer_state.pt     optimiser state, step, data cursor, RNG states (for resuming)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
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
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"step_{step:06d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=checkpoints_dir))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "palaestra.json").write_text(json.dumps({**info, "step": step}, indent=2))
        torch.save(trainer_state, staging / "trainer_state.pt")
        fsync_tree(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
        os.replace(staging, final)
        fsync_folder(checkpoints_dir)
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
