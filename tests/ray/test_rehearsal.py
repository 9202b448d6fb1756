"""The tutorial's 8-GPU colocated layout (``rollout_num_gpus=8, actor_num_gpus_per_node=8,
colocate=True``) rehearsed on CPUs: a Ray instance that declares 8 GPUs places the learner's 8
ranks and 8 rollout workers in one placement group, rank i and worker i sharing bundle i, while
``PALAESTRA_DEVICE=cpu`` has torch compute on the CPU over gloo. The run's samples and weights
are the one-process run's; a killed engine worker is restarted; a killed learner rank fails the
run naming it, and ``resume()`` finishes it.

The kill scenarios use 2 GPUs (the same code path as 8; 16 actors starting on 2 cores are what
makes the 8-GPU run slow)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from palaestra.runs.handles import RunFailedError
from tests.support.ray_instances import held_ray_instance
from tests.support.tiny_runs import gate_path, gated_reward, tiny_config, wait_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def eight_gpu_cluster():
    """The address of a Ray instance that declares 8 GPUs (logical: none is used) and 16 CPUs.
    Started without the rehearsal switch, so an actor that has it got it from the run."""
    env = {k: v for k, v in os.environ.items() if k != "PALAESTRA_DEVICE"}
    # 16 actors importing torch on 2 shared cores can starve the raylet's heartbeats past
    # Ray's default 5 x 10 s; a node marked dead kills every actor.
    health = {"health_check_failure_threshold": 30, "health_check_timeout_ms": 30000}
    with held_ray_instance(env, num_cpus=16, num_gpus=8, _system_config=health) as address:
        yield address


@pytest.fixture
def rehearsal(monkeypatch, home):
    monkeypatch.setenv("PALAESTRA_DEVICE", "cpu")
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")


def colocated(address: str, model_dir: Path, data: Path, gpus: int, **fields):
    return tiny_config(
        model_dir,
        data,
        backend="ray",
        ray_address=address,
        rollout_num_gpus=gpus,
        actor_num_gpus_per_node=gpus,
        colocate=True,
        ray_cpus_per_worker=0.5,
        precision="float32",
        train_micro_batch_size=1,
        **fields,
    )


STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
table = ray.util.placement_group_table()[sys.argv[2]]
gpus, free = ray.cluster_resources()["GPU"], ray.available_resources().get("GPU", 0)
print(json.dumps([{k: table[k] for k in ("state", "strategy", "bundles")}, gpus, free]))
ray.shutdown()
"""


def cluster_state(address: str, group: str) -> tuple[dict, float, float]:
    """The placement group ``group``'s table entry, the cluster's GPUs and its free GPUs, asked
    from a child process (as the run's own check does: see ``launch.checks.cluster_gpus``)."""
    out = subprocess.run(
        [sys.executable, "-c", STATE, address, group],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    table, gpus, free = json.loads(out.strip().splitlines()[-1])
    table["bundles"] = {int(k): v for k, v in table["bundles"].items()}
    return table, gpus, free


def launched(config, home: Path):
    run = config.launch()
    return run, home / "runs" / run.training_run_id


def reached(path: Path, what: str, predicate, timeout: float = 300) -> None:
    """Wait for ``predicate()``, failing at once (with the run's error) if the run fails."""

    def done() -> bool:
        status = path / "status.json"
        if status.exists() and json.loads(status.read_text())["state"] == "failed":
            raise AssertionError(f"the run failed before {what}: {status.read_text()}")
        return predicate()

    wait_for(done, timeout=timeout, what=what)


def layout_of(log: Path) -> tuple[str, list[tuple[str, int, int]]]:
    """From the run's ``ray: colocated`` line: the placement group and, per bundle, its GPU
    ids and the pids of learner rank i and rollout worker i."""
    line = next(x for x in log.read_text().splitlines() if x.startswith("ray: colocated"))
    group = re.search(r"placement group (\w+)", line).group(1)
    bundles = re.findall(r"bundle \d+: GPU (\[[\d, ]*\]), rank pid (\d+), worker pid (\d+)", line)
    return group, [(gpus, int(rank), int(worker)) for gpus, rank, worker in bundles]


def samples_of(path: Path) -> list[dict]:
    keys = ("step", "index", "group_index", "response_tokens", "reward", "weight_version")
    lines = (path / "samples.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in keys} for line in lines]


def test_the_eight_gpu_layout_runs_on_cpus(
    eight_gpu_cluster, rehearsal, home, tiny_model_dir, prompts_file
):
    fields = dict(num_rollout=2, reward=gated_reward)
    local = tiny_config(
        tiny_model_dir, prompts_file, num_rollout=2, precision="float32", train_micro_batch_size=1
    ).train()
    gate_path().unlink(missing_ok=True)
    started = time.monotonic()
    run, path = launched(
        colocated(eight_gpu_cluster, tiny_model_dir, prompts_file, 8, **fields), home
    )
    # Step 2 waits in the reward: the run holds its actors and placement group meanwhile.
    reached(path, "step 1", lambda: (path / "samples.jsonl").exists(), timeout=400)
    group, bundles = layout_of(path / "train.log")
    assert len(bundles) == 8
    # Rank i and worker i share GPU i (one id each, all 8 distinct): Ray placed them in one
    # bundle of one GPU, half of it each.
    assert sorted(gpus for gpus, _, _ in bundles) == [f"[{i}]" for i in range(8)]
    assert len({pid for _, rank, worker in bundles for pid in (rank, worker)}) == 16
    table, gpus, free = cluster_state(eight_gpu_cluster, group)
    assert table["state"] == "CREATED" and table["strategy"] == "STRICT_PACK"
    assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 0.5}] * 8
    assert gpus - free == 8  # the 16 actors' halves
    gate_path().touch()
    result = run.result(timeout=400)
    print(f"8-GPU rehearsal: {time.monotonic() - started:.0f} s from launch to the end")

    # Weights reached every engine: step 2's samples (drawn after the first sync) are the
    # one-process run's, at weight version 1.
    assert samples_of(path) == samples_of(Path(local.path))
    metrics = result.metrics()
    for row in metrics:  # the engines slept through each update and woke before the sync
        assert row["sleep_s"] >= 0 and row["wake_s"] >= 0 and row["sleep_freed_bytes"] >= 0
    (checkpoint,) = result.checkpoints()
    assert (checkpoint.path / "optimizer_shards" / ".metadata").is_file()
    expected = load_file(local.checkpoints()[-1].path / "model.safetensors")
    got = load_file(checkpoint.path / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():  # 8 ranks' sums in another order, as in
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)  # test_sharded_ray
    # Every actor saw the switch (the instance was started without it): one device listed.
    (line,) = [x for x in (path / "train.log").read_text().splitlines() if "ray: colocated" in x]
    assert line.endswith("; device cpu (PALAESTRA_DEVICE=cpu)")


def test_a_killed_engine_worker_is_restarted(
    eight_gpu_cluster, rehearsal, home, tiny_model_dir, prompts_file
):
    local = tiny_config(
        tiny_model_dir, prompts_file, precision="float32", train_micro_batch_size=1
    ).train()
    gate_path().unlink(missing_ok=True)
    config = colocated(eight_gpu_cluster, tiny_model_dir, prompts_file, 2, reward=gated_reward)
    run, path = launched(config, home)
    reached(path, "step 1", lambda: (path / "samples.jsonl").exists())
    _, bundles = layout_of(path / "train.log")
    os.kill(bundles[0][2], signal.SIGKILL)  # rollout worker 0, between sampling and update
    time.sleep(1)
    gate_path().touch()
    result = run.result(timeout=300)
    log = (path / "train.log").read_text()
    assert "rollout worker 0 died" in log
    assert [m["step"] for m in result.metrics()] == [1, 2, 3]
    # The restart got the learner's weights: the samples after it are the one-process run's.
    assert samples_of(path) == samples_of(Path(local.path))


def test_a_killed_learner_rank_fails_the_run_and_resume_continues(
    eight_gpu_cluster, rehearsal, home, tiny_model_dir, prompts_file
):
    config = colocated(
        eight_gpu_cluster, tiny_model_dir, prompts_file, 2, reward=gated_reward, save_interval=1
    )
    gate_path().unlink(missing_ok=True)
    run, path = launched(config, home)
    reached(path, "step 1", lambda: (path / "checkpoints" / "step_000001").exists())
    _, bundles = layout_of(path / "train.log")
    os.kill(bundles[1][1], signal.SIGKILL)  # learner rank 1
    gate_path().touch()
    with pytest.raises(RunFailedError, match=r"learner rank 1 died .* resume\(\)"):
        run.result(timeout=300)
    result = run.resume().result(timeout=300)
    assert [m["step"] for m in result.metrics()] == [1, 2, 3]
    assert (result.checkpoints()[-1].path / "model.safetensors").is_file()


def test_a_run_of_its_own_declares_the_gpus_it_rehearses_on(
    rehearsal, home, tiny_model_dir, prompts_file, monkeypatch
):
    # No ray_address: the run starts a Ray instance of its own (even beside the held one),
    # which declares rollout_num_gpus GPUs because the switch is on; without it, this machine
    # has no GPU and the run would be refused.
    monkeypatch.setenv("RAY_ADDRESS", "local")
    config = colocated(None, tiny_model_dir, prompts_file, 2, num_rollout=1)
    result = config.train()
    (row,) = result.metrics()
    assert row["sleep_s"] >= 0 and row["wake_s"] >= 0
    assert not ray.is_initialized()  # the run's own instance ended with it
