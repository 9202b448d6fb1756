"""rollout_num_gpus with ray_address counts the cluster's GPUs (``ray.cluster_resources()``),
not this machine's: a Ray instance that declares 2 GPUs, held by a process of its own."""

from __future__ import annotations

import pytest

from palaestra.launch.checks import check_ray_here
from palaestra.recipes import Recipe, RecipeNotRunnableError, check_runnable_here
from tests.support.ray_instances import held_ray_instance

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_gpu_cluster():
    """The address of a Ray instance that declares 2 GPUs (logical: no GPU is used)."""
    with held_ray_instance(num_cpus=1, num_gpus=2) as address:
        yield address


async def reward(args, sample, **kwargs) -> float:
    return 0.0


def test_the_clusters_gpus_are_counted(two_gpu_cluster, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine: none
    fields = dict(custom_rm_function=reward, backend="ray", ray_address=two_gpu_cluster)
    for recipe in (Recipe(rollout_num_gpus=2, **fields), Recipe(rollout_num_gpus=3, **fields)):
        check_runnable_here(recipe)  # this machine's count does not apply to a cluster
    check_ray_here(Recipe(rollout_num_gpus=2, **fields))
    with pytest.raises(RecipeNotRunnableError) as error:
        check_ray_here(Recipe(rollout_num_gpus=3, **fields))
    message = str(error.value)
    assert f"rollout_num_gpus=3, but the Ray cluster at {two_gpu_cluster} has 2" in message
    assert "set rollout_num_gpus=2 or fewer" in message
    assert not ray.is_initialized()  # the check joined the cluster and left it
