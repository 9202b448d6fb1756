"""Checkpoint retention: what a run keeps on disk after each save, and how much room the next
save needs before it starts writing.

- Only the newest checkpoint keeps its optimiser state (what a resume reads); older ones keep
  their weights. With ``recipe.no_save_optim`` none is written at all.
- With ``recipe.save_total_limit = N`` the N newest checkpoints stay; older ones are deleted,
  except any that a running endpoint serves or a saved eval scored (their records name the
  checkpoint's folder), so what a user is looking at never disappears under them.
- A save whose estimated size is more than the disk has free fails before writing a byte.
"""

from __future__ import annotations

from pathlib import Path

from palaestra.checkpoints import (
    OPTIMIZER_FILE,
    drop_optimizer_state,
    folder_bytes,
    list_checkpoints,
    remove_checkpoint,
)
from palaestra.recipes import Recipe
from palaestra.runs.endpoints import read_records
from palaestra.runs.evals import list_evals

TOKENIZER_BYTES = 32 * 1024**2
"""Room for the tokenizer's files and the small JSON files beside the weights."""


def checkpoints_in_use() -> set[Path]:
    """Checkpoint folders a running endpoint serves or a saved eval scored."""
    named = [record.get("checkpoint") for record in read_records(running_only=True)]
    named += [record.get("checkpoint") for record in list_evals()]
    return {Path(path).resolve() for path in named if path}


def apply_retention(checkpoints_dir: Path, recipe: Recipe, newest: Path) -> list[Path]:
    """After ``newest`` was saved: drop older checkpoints' optimiser state and delete those
    past ``recipe.save_total_limit`` that nothing uses. Returns the deleted folders."""
    saved = [path for _, path in list_checkpoints(checkpoints_dir)]
    for path in saved:
        if path != newest:
            drop_optimizer_state(path)
    limit = recipe.save_total_limit
    if not limit or len(saved) <= limit:
        return []
    in_use = checkpoints_in_use()
    removed = []
    for path in saved[:-limit]:
        if path.resolve() not in in_use:
            remove_checkpoint(path)
            removed.append(path)
    return removed


def bytes_needed(checkpoints_dir: Path, recipe: Recipe, model) -> int:
    """About how many bytes the next checkpoint takes: the newest one's size (it still has
    its optimiser state), else the model's weights (or adapters) in float32 and AdamW's two
    moments from its shape; 0 when neither is known (no check)."""
    saved = list_checkpoints(checkpoints_dir)
    if saved:
        newest = saved[-1][1]
        size = folder_bytes(newest)
        if recipe.no_save_optim and (newest / OPTIMIZER_FILE).is_file():
            size -= (newest / OPTIMIZER_FILE).stat().st_size
        return size
    from palaestra.plan import model_shape

    try:
        shape = model_shape(model)
    except (ValueError, OSError):
        return 0
    trainable = shape.lora_params(recipe.lora_rank) if recipe.lora_rank else shape.params
    return trainable * (4 if recipe.no_save_optim else 12) + TOKENIZER_BYTES
