"""The checkpoint folder: the one module that knows its layout. Training writes it, the run store
lists it, endpoints serve it, LoRA export reads and writes it; each asks here.

    <run>/checkpoints/step_000010/
      config.json, model.safetensors, generation_config.json, tokenizer files  (plain HF)
      palaestra.json       run id, step, model name, LoRA base (what an endpoint needs to know)
      optimizer.pt         the optimiser's state (tensors only), written by the learner
      trainer_state.json   where the loop was: step, last step, data cursor, the step's log rows

A LoRA run's checkpoint holds ``adapter_config.json`` and ``adapter_model.safetensors`` in place
of the full weights (transformers with peft installed loads it over its base, named in
``palaestra.json`` as ``base_model_path``).

A folder appears under its ``step_NNNNNN`` name only once complete: it is written under a
hidden staging name, flushed, then renamed. A crash leaves a hidden ``.step_*`` folder, which
``remove_stale_staging`` deletes and ``list_checkpoints`` never lists. No torch at import: the
run store and the CLI read checkpoints without it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.atomic import fsync_folder, fsync_tree

INFO_FILE = "palaestra.json"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_SHARDS = "optimizer_shards"
"""A sharded learner's optimiser state: a torch.distributed.checkpoint folder, keyed by
parameter name, that any number of ranks (one included) reads back."""
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
FOLDER_NAME = re.compile(r"^step_(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    """A saved step: ``path`` is an HF-format directory transformers loads as it is."""

    path: Path
    step: int
    run_id: str | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> Checkpoint:
        path = Path(path).expanduser()
        info = read_info(path)
        return cls(path=path, step=int(info.get("step", 0)), run_id=info.get("run_id"))


def checkpoint_path(value: Checkpoint | str | Path) -> Path:
    """The folder of a Checkpoint handle or a path."""
    return value.path if isinstance(value, Checkpoint) else Path(value).expanduser()


def folder_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``checkpoints_dir`` as ``(step, path)``, sorted by step."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = FOLDER_NAME.match(child.name)
        if match and child.is_dir() and has_trainer_state(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def write_checkpoint(
    checkpoints_dir: Path,
    step: int,
    write_weights: Callable[[Path], None],
    info: dict[str, Any],
    trainer_state: dict[str, Any],
    needed_bytes: int = 0,
) -> Path:
    """Write ``step_NNNNNN`` atomically. ``write_weights(folder)`` puts the HF-format weights,
    tokenizer and optimiser state (or the adapters) into the staging folder; ``info`` becomes
    palaestra.json (with ``step``), ``trainer_state`` (plain JSON values) trainer_state.json,
    written last: a folder with it is complete. A save that fails (disk full, no permission)
    removes its staging folder and raises CheckpointSaveError naming the folder and why; one
    that cannot fit (``needed_bytes`` more than the disk has free) fails before writing."""
    final = checkpoints_dir / folder_name(step)
    check_free_space(final, needed_bytes)

    def write(staging: Path) -> None:
        write_weights(staging)
        write_info(staging, {**info, "step": step})
        text = json.dumps(trainer_state, default=str)
        (staging / TRAINER_STATE_FILE).write_text(text)

    try:
        return write_folder_atomic(final, write)
    except Exception as error:
        # A full disk reaches here as torch's or safetensors' own error type as often as an
        # OSError: name the checkpoint and the place for all. Earlier checkpoints are untouched.
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        code = error.errno if isinstance(error, OSError) else None
        raise CheckpointSaveError(
            code, f"cannot save checkpoint {final.name} to {final}: {reason}"
        ) from error


def check_free_space(final: Path, needed_bytes: int) -> None:
    """CheckpointSaveError (ENOSPC) naming the bytes needed and free when ``needed_bytes`` do
    not fit on the disk of ``final``'s folder, before anything is written."""
    if needed_bytes <= 0:
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(final.parent).free
    if needed_bytes > free:
        raise CheckpointSaveError(
            errno.ENOSPC,
            f"cannot save checkpoint {final.name} to {final}: it needs about {needed_bytes} bytes "
            f"({needed_bytes / 1024**3:.2f} GiB) and the disk has {free} bytes "
            f"({free / 1024**3:.2f} GiB) free. Free space, set recipe.save_total_limit to keep "
            "fewer checkpoints, or recipe.no_save_optim=True to write no optimiser state",
        )


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def drop_optimizer_state(folder: Path) -> None:
    """Delete a checkpoint's optimiser state: its weights still load; a run continued from it
    starts AdamW's moments afresh."""
    (folder / OPTIMIZER_FILE).unlink(missing_ok=True)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint so that it is never listed half deleted: renamed to a hidden
    staging name first (``remove_stale_staging`` finishes the job after a crash)."""
    hidden = folder.with_name(f".{folder.name}-removed")
    os.replace(folder, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; ``errno`` is the cause's where it had one (ENOSPC:
    the disk is full, EACCES: no permission)."""

    def __str__(self) -> str:
        return str(self.strerror)


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


def remove_stale_staging(checkpoints_dir: Path) -> None:
    """Delete checkpoints a crashed process left half written (hidden ``.step_*`` folders)."""
    if checkpoints_dir.is_dir():
        for child in checkpoints_dir.glob(".step_*"):
            shutil.rmtree(child, ignore_errors=True)


def write_info(folder: Path, info: dict[str, Any]) -> None:
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2))


def read_info(folder: str | Path) -> dict[str, Any]:
    """palaestra.json of ``folder``; empty for a plain HF folder that has none."""
    path = Path(folder) / INFO_FILE
    return _read_object(path) if path.is_file() else {}


def has_trainer_state(folder: str | Path) -> bool:
    return (Path(folder) / TRAINER_STATE_FILE).is_file()


def read_trainer_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / TRAINER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a palaestra checkpoint: no {TRAINER_STATE_FILE}")
    return _read_object(path)


def _read_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def has_optimizer_state(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / OPTIMIZER_FILE).is_file() or (folder / OPTIMIZER_SHARDS).is_dir()


def is_adapter_checkpoint(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_rank(folder: str | Path) -> int | None:
    return _read_object(Path(folder) / ADAPTER_CONFIG).get("r")


def adapter_base(folder: str | Path) -> str:
    """The weights the adapters at ``folder`` were trained on."""
    folder = Path(folder)
    base = read_info(folder).get("base_model_path")
    if base is None:
        base = _read_object(folder / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder}: the adapter checkpoint does not name its base model")
    return base


def is_model_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a model: full HF weights or LoRA adapters."""
    folder = Path(folder)
    return (folder / MODEL_CONFIG).is_file() or (folder / ADAPTER_CONFIG).is_file()


def check_model_folder(folder: str | Path, what: str = "checkpoint") -> None:
    """Raise FileNotFoundError naming ``folder`` unless it holds a model."""
    if not is_model_folder(folder):
        raise FileNotFoundError(
            f"{what} {folder} is neither an HF-format model directory ({MODEL_CONFIG}) nor "
            f"LoRA adapters ({ADAPTER_CONFIG})"
        )
