"""Where palaestra keeps its state: the run registry, converted model weights, prepared data."""

from __future__ import annotations

import os
from pathlib import Path


def palaestra_home() -> Path:
    """``$PALAESTRA_HOME`` if set, else ``~/.palaestra``; created on first use."""
    home = Path(os.environ.get("PALAESTRA_HOME") or Path.home() / ".palaestra").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home
