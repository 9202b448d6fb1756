"""The benchmark scripts (bench/*.py), imported by tests as they import each other: with bench/
on the path, and gone from ``sys.modules`` afterwards so no other test sees them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def bench_scripts(monkeypatch, *names: str) -> Iterator[list[ModuleType]]:
    """The scripts ``names`` (e.g. ``"render"``), imported; every bench module imported in
    between (their own imports, ``results`` or ``flops``) is unloaded at the end."""
    monkeypatch.syspath_prepend(str(BENCH))
    try:
        yield [importlib.import_module(name) for name in names]
    finally:
        for name, module in list(sys.modules.items()):
            if BENCH in Path(getattr(module, "__file__", None) or "/").parents:
                del sys.modules[name]
