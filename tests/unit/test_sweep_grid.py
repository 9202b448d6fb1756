"""Sweeps, before anything runs: the variants of a grid, refused or skipped combinations, and
overrides of nested configs."""

from __future__ import annotations

import pytest

from palaestra.launch.sweeps import InvalidVariantError, TrainingGroup, apply_overrides
from tests.support.tiny_runs import tiny_config, write_topics


@pytest.fixture
def base(tiny_model_dir, home, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    return tiny_config(tiny_model_dir, data, num_rollout=2).model_copy(update={"name": "sw"})


def test_variants_are_every_combination_first_field_slowest(base):
    group = TrainingGroup(
        base, grid={"recipe.lr": [1e-2, 1e-3], "recipe.n_samples_per_prompt": [2, 4, 8]}
    )
    variants = list(group.iter_variants())
    # 2 x 3 = 6 combinations; lr varies slowest, as itertools.product orders them.
    assert [(v.recipe.lr, v.recipe.n_samples_per_prompt) for v in variants] == [
        (1e-2, 2), (1e-2, 4), (1e-2, 8), (1e-3, 2), (1e-3, 4), (1e-3, 8),
    ]  # fmt: skip
    assert {v.group_id for v in variants} == {group.group_id}
    assert variants[4].group_overrides == {"recipe.lr": 1e-3, "recipe.n_samples_per_prompt": 4}
    assert variants[4].group_axes == ["recipe.lr", "recipe.n_samples_per_prompt"]
    # Everything outside the grid is the base's, and the base itself is untouched.
    assert all(v.recipe.rollout_batch_size == 2 for v in variants)
    assert base.recipe.lr == 1e-2 and base.group_id is None
    assert [v.name for v in variants[:2]] == ["sw-v1", "sw-v2"]


def test_an_invalid_combination_is_refused_naming_the_variant_and_field(base):
    grid = {"recipe.lr": [1e-2, -1.0]}
    with pytest.raises(InvalidVariantError, match=r"variant 2 of 2 \(recipe.lr=-1.0\): lr"):
        TrainingGroup(base, grid=grid)
    with pytest.raises(InvalidVariantError, match="Recipe has no field 'lrr'"):
        TrainingGroup(base, grid={"recipe.lrr": [1e-2]})
    with pytest.raises(InvalidVariantError, match="TrainConfig has no field 'recipes'"):
        TrainingGroup(base, grid={"recipes.lr": [1e-2]})
    # Each value is valid alone; one combination breaks a rule across fields.
    grid = {"recipe.advantage_estimator": ["grpo", "gspo"], "recipe.loss_type": ["cispo"]}
    with pytest.raises(
        InvalidVariantError,
        match=r"variant 2 of 2 \(recipe.advantage_estimator='gspo', recipe.loss_type='cispo'\)",
    ):
        TrainingGroup(base, grid=grid)


def test_skip_invalid_keeps_the_valid_variants_and_records_the_rest(base):
    group = TrainingGroup(base, grid={"recipe.lr": [-1.0, 1e-3]}, skip_invalid=True)
    assert [v.recipe.lr for v in group.iter_variants()] == [1e-3]
    assert group.skipped[0]["overrides"] == {"recipe.lr": -1.0}
    assert "variant 1 of 2" in group.skipped[0]["error"]
    with pytest.raises(InvalidVariantError, match="no valid variant"):
        TrainingGroup(base, grid={"recipe.lr": [-1.0]}, skip_invalid=True)


def test_grid_values_must_be_lists(base):
    with pytest.raises(ValueError, match=r"grid\['recipe.lr'\] must be a list"):
        TrainingGroup(base, grid={"recipe.lr": 1e-3})
    with pytest.raises(ValueError, match="grid is empty"):
        TrainingGroup(base, grid={})


def test_overrides_reach_nested_configs_and_revalidate(base):
    config = apply_overrides(base, {"dataset.prompt_template": "Write about {input}"}, "v")
    assert config.dataset.prompt_template == "Write about {input}"
    assert base.dataset.prompt_template == "Say {input}"
    with pytest.raises(InvalidVariantError, match="v: dataset.hf_split") as error:
        apply_overrides(base, {"dataset.hf_split": "train[oops"}, "v")
    assert "train[oops" in str(error.value)
