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
    assert (preset.dynamic_sampling, preset.train_micro_batch_size) == (False, 32)
    fields = sweep.parse_fields(["dynamic_sampling=true", "train_micro_batch_size=16"])
    changed = sweep.config_for(3e-5, 0.8, 24, 10, 42, **fields)
    assert (changed.recipe.dynamic_sampling, changed.recipe.train_micro_batch_size) == (True, 16)
    assert (changed.recipe.lr, changed.recipe.seed, changed.recipe.num_rollout) == (3e-5, 42, 10)


def test_the_headline_is_the_first_variants_mean_over_its_seeds(sweep):
    def row(lr, seed, after, three, step_s):
        run = dict(lr=lr, temperature=0.8, max_tokens=20, seed=seed, fields={}, base=-9.95)
        return run | dict(eval={10: after}, three_lines_last5=three, step_s=step_s)

    results = [row(3e-5, 42, -6.0, 0.7, 5.0), row(3e-5, 1, -8.0, 0.5, 6.0)]
    results.append(row(1e-5, 42, -9.9, 0.1, 4.0))  # another variant: not in the headline
    assert sweep.sweep_headline(results) == {
        "variant (lr, temperature, tokens)": "3e-05, 0.8, 20",
        "seeds": 2,
        "test score before": -9.95,
        "after 10 steps": -7.0,
        "three lines, last 5 steps": 0.6,
        "s per step": 5.5,
        "other fields": "none",
    }
