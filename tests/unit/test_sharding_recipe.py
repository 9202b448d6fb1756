"""The learner-sharding fields of Recipe: defaults that keep one process, and refusals that
name the field for layouts not built yet."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from palaestra.recipes import Recipe


def test_defaults_keep_one_unsharded_learner():
    recipe = Recipe()
    assert (recipe.actor_num_nodes, recipe.actor_num_gpus_per_node) == (1, 1)
    assert recipe.learner_ranks == 1
    assert not recipe.colocate and not recipe.activation_checkpointing
    assert not recipe.optimizer_offload


def test_cpu_ranks_count_the_learners_processes():
    assert Recipe(actor_num_gpus_per_node=2).learner_ranks == 2  # 1 node x 2 ranks
    assert Recipe(actor_num_gpus_per_node=2, backend="ray").learner_ranks == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(actor_num_nodes=2), "actor_num_nodes=2"),
        (dict(actor_num_gpus_per_node=0), "actor_num_gpus_per_node"),
    ],
)
def test_layouts_not_built_yet_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        Recipe(**fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(actor_num_gpus_per_node=2, rollout_num_gpus=2), "actor_num_gpus_per_node=2"),
        (dict(actor_num_gpus_per_node=2, colocate=True), "colocate=True"),
    ],
)
def test_layouts_the_plan_sizes_but_a_run_cannot_build_are_refused_at_launch(fields, message):
    from palaestra.recipes import RecipeNotRunnableError, check_sharding_runs

    recipe = Recipe(**fields)  # describable, so TrainConfig.plan() can size it
    with pytest.raises(RecipeNotRunnableError, match=message):
        check_sharding_runs(recipe)
