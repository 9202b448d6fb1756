"""The Hugging Face hub's cache, as ``huggingface_hub`` lays it out on disk: where a dataset's
snapshot lives, and whether the hub may be asked at all.

A dataset downloaded once (``hf download statworx/haiku --repo-type dataset``, or by any tool
that uses ``huggingface_hub``) sits in ``<hub cache>/datasets--statworx--haiku/``: ``refs/main``
holds the revision that ``main`` pointed to, and ``snapshots/<revision>/`` the repo's files as
the hub shows them (``data/train-00000-of-00001.parquet``...). ``datasets.load_dataset`` does
not read that layout offline (it wants its own processed cache), so palaestra reads the
snapshot's data files itself, with the same split slicing.
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``) forbids asking the hub."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hub_cache() -> Path:
    """The hub's cache folder, read from the environment as ``huggingface_hub`` reads it:
    ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "huggingface" / "hub"


def dataset_folder(repo: str) -> Path:
    """Where the cache keeps hub dataset ``repo`` (``owner/name``)."""
    return hub_cache() / ("datasets--" + repo.replace("/", "--"))


def dataset_snapshot(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot of ``repo`` at ``revision`` (a branch named in ``refs/`` or a
    commit hash), or None when the cache does not hold it."""
    folder = dataset_folder(repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None
