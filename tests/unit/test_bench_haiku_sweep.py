"""bench/haiku_sweep.py: recipe fields given on its command line reach every variant's recipe."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    yield importlib.import_module("haiku_sweep")
    for name in ("haiku_sweep", "results", "flops"):
        sys.modules.pop(name, None)


def test_set_pairs_are_json_values_or_strings(sweep):
    fields = sweep.parse_fields(["dynamic_sampling=false", "lr=1e-5", "loss_type=grpo"])
    assert fields == {"dynamic_sampling": False, "lr": 1e-5, "loss_type": "grpo"}
    assert sweep.describe(fields) == "dynamic_sampling=False, lr=1e-05, loss_type='grpo'"
    assert sweep.describe({}) == "none"
    with pytest.raises(ValueError, match="--set 'dynamic_sampling': expected FIELD=VALUE"):
        sweep.parse_fields(["dynamic_sampling"])


def test_set_fields_override_the_preset_in_each_variant(sweep):
    preset = sweep.config_for(3e-5, 0.8, 24, 10, 42).recipe
    assert preset.dynamic_sampling is True  # SmolLM2_135M_Recipe's own
    changed = sweep.config_for(3e-5, 0.8, 24, 10, 42, **sweep.parse_fields(["dynamic_sampling=false"]))
    assert changed.recipe.dynamic_sampling is False
    assert (changed.recipe.lr, changed.recipe.seed, changed.recipe.num_rollout) == (3e-5, 42, 10)
