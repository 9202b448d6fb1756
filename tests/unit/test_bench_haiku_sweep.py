"""bench/haiku_sweep.py: recipe fields given on its command line reach every variant's recipe."""

from __future__ import annotations

import pytest

from tests.support.bench import bench_scripts


@pytest.fixture
def sweep(monkeypatch):
    with bench_scripts(monkeypatch, "haiku_sweep") as (module,):
        yield module


def test_set_pairs_are_json_values_or_strings(sweep):
    fields = sweep.parse_fields(["dynamic_sampling=false", "lr=1e-5", "loss_type=grpo"])
    assert fields == {"dynamic_sampling": False, "lr": 1e-5, "loss_type": "grpo"}
    assert sweep.describe(fields) == "dynamic_sampling=False, lr=1e-05, loss_type='grpo'"
    assert sweep.describe({}) == "none"
    with pytest.raises(ValueError, match="--set 'dynamic_sampling': expected FIELD=VALUE"):
        sweep.parse_fields(["dynamic_sampling"])


def test_set_fields_override_the_preset_in_each_variant(sweep):
    preset = sweep.config_for(3e-5, 0.8, 24, 10, 42).recipe
    assert (preset.dynamic_sampling, preset.train_micro_batch_size) == (False, 8)
    fields = sweep.parse_fields(["dynamic_sampling=true", "train_micro_batch_size=32"])
    changed = sweep.config_for(3e-5, 0.8, 24, 10, 42, **fields)
    assert (changed.recipe.dynamic_sampling, changed.recipe.train_micro_batch_size) == (True, 32)
    assert (changed.recipe.lr, changed.recipe.seed, changed.recipe.num_rollout) == (3e-5, 42, 10)
