"""rollout_num_gpus against the GPUs this machine has: the error says how many it found, where,
and the two ways forward, and names Ray when the run would use Ray."""

from __future__ import annotations

import pytest

from palaestra.recipes import Recipe, RecipeNotRunnableError, check_runnable_here


async def reward(args, sample, **kwargs) -> float:
    return 0.0


@pytest.fixture
def no_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def refusal(**fields) -> str:
    with pytest.raises(RecipeNotRunnableError) as error:
        check_runnable_here(Recipe(custom_rm_function=reward, **fields))
    return str(error.value)


def test_the_tutorials_eight_gpus_on_a_laptop_name_ray_and_both_ways_forward(no_gpus):
    message = refusal(rollout_num_gpus=8)
    assert "rollout_num_gpus=8, but this machine has 0 CUDA GPU(s)" in message
    # More than one GPU runs on Ray.
    assert "(the run would use Ray, on a Ray instance of its own)" in message
    assert "set rollout_num_gpus=0 to train on the CPU" in message
    assert "backend='ray' with ray_address='HOST:PORT'" in message
    assert "local backend" not in message


def test_a_ray_run_without_an_address_counts_this_machine(no_gpus):
    message = refusal(rollout_num_gpus=1, backend="ray")
    assert "this machine has 0 CUDA GPU(s) (the run would use Ray" in message
    assert "local backend" not in message


def test_one_gpu_on_the_local_backend_names_this_process(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = refusal(rollout_num_gpus=3, backend="local")
    assert "this machine has 2 CUDA GPU(s) (the run would use Ray" in message  # 3 > 1: Ray
    assert "set rollout_num_gpus=2 or fewer" in message
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "(the run would use this process)" in refusal(rollout_num_gpus=1)


def test_enough_gpus_or_none_asked_for_pass(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_runnable_here(Recipe(custom_rm_function=reward, rollout_num_gpus=8))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    check_runnable_here(Recipe(custom_rm_function=reward, rollout_num_gpus=0))
