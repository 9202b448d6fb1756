"""Where palaestra keeps its state: the run registry, converted model weights, prepared data."""

from __future__ import annotations

import os
from pathlib import Path


def palaestra_home() -> Path:
    """``$PALAESTRA_HOME`` if set, else ``~/.palaestra``; created on first use."""
    home = Path(os.environ.get("PALAESTRA_HOME") or Path.home() / ".palaestra").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def share_usual_home(home: Path, names: tuple[str, ...] = ("models",)) -> None:
    """Link the folders ``names`` of the usual home (``palaestra_home()``, each created if
    missing) into the other home ``home``, which must have none of them yet: a second home
    (a bench's, a test's) then uses the models the usual one converted, and its conversions
    land there too, so a model converts once for both."""
    for name in names:
        shared = palaestra_home() / name
        shared.mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(shared, target_is_directory=True)
