"""Shared fixtures (a tiny model saved once per session, an isolated palaestra home, a topics
file) and the tiers: each test is marked by the folder it lives in, so ``-m unit`` or
``-m "not integration"`` select as the folders do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny_models import save_tiny_model_dir

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "ray", "vllm", "gpu")
"""The folders under tests/ that hold test modules; each one's name is also its marker."""


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        tier = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
        if tier in TIERS:
            item.add_marker(tier)
        # Whatever folder a test is in, its marker says what it needs.
        if item.get_closest_marker("gpu") and not cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("vllm") and not vllm_installed():
            item.add_marker(pytest.mark.skip(reason="needs vLLM (make test-vllm)"))


def cuda_available() -> bool:
    import torch  # only when a gpu test was collected: the light tests need no torch

    return torch.cuda.is_available()


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True)
def _no_inherited_terminal_width(monkeypatch) -> None:
    """The CLI's tables shrink to the terminal's width only where one is known (a tty, or
    ``COLUMNS``); a test reads them as a pipe would. pytest-xdist's workers export
    ``COLUMNS=80``, which would cut the columns a test expects whole."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An HF-format directory with a 2-layer, 32-wide Llama and the character tokenizer."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh PALAESTRA_HOME for one test."""
    path = tmp_path / "home"
    monkeypatch.setenv("PALAESTRA_HOME", str(path))
    return path


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    """A six-row JSONL dataset of topics."""
    path = tmp_path / "topics.jsonl"
    topics = ["rain", "snow", "sun", "wind", "moon", "sea"]
    path.write_text("".join(json.dumps({"topic": t, "answer": t.upper()}) + "\n" for t in topics))
    return path
