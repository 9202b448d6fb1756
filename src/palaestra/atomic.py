"""Crash-safe writes: another process reads the old file or the new one, never half of either.

Everything a reader in another process may open (status, metrics rewrites, prepared data,
checkpoints, converted weights) is written under a hidden temporary name, flushed to disk, and
renamed into place; a rename within one folder is atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=2, default=str).encode())


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folder itself to disk (before renaming it)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries, so a rename inside it survives a power cut."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
