"""The Ray backend on a real Ray cluster of this machine (a head started with ``ray start``):
the same samples and weights as the local backend, weight sync, a worker killed mid-run,
stop/resume/continue, a killed driver, the errors for a bad address and a missing extra, the
runtime_env mapping, and a second node joining over loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from palaestra.cli import main
from palaestra.recipes import Recipe, RecipeNotRunnableError
from palaestra.runs.handles import RunFailedError
from tests.support.episodes import LowercaseGame
from tests.support.tiny_runs import gate_path, gated_reward, tiny_config, wait_for, write_topics

# The cluster's nodes are 127.0.0.2 (the head) and 127.0.0.3 (a node that joins): loopback
# addresses that Ray does not rewrite to the machine's network address, as it does 127.0.0.1,
# so every connection stays on this machine (the token they share is set in conftest.py).
HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Nodes:
    """The Ray nodes this module started, each a ``ray start --block`` in a session of its own,
    so that stopping them ends their processes and no other Ray instance on the machine: a
    ``ray stop`` would end every one, a test's beside this module under xdist included. They
    are stopped as ``ray stop --force`` stops them, by SIGKILL (to their process groups): on
    SIGTERM a head takes half a minute to end. An actor still running has a group of its own
    and ends with its driver, which the tests have ended or shut down by then."""

    def __init__(self, folder: Path):
        self.folder, self.started = folder, []

    def start(self, *args: str, env: dict[str, str] | None = None) -> None:
        log = self.folder / f"node{len(self.started)}.log"
        with log.open("w") as out:
            node = subprocess.Popen(
                [RAY, "start", "--block", "--num-gpus=0", "--disable-usage-stats", *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            )  # fmt: skip
        self.started.append(node)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert node.poll() is None, f"ray start {' '.join(args)} failed:\n{log.read_text()}"
            assert time.monotonic() < deadline, (
                f"ray start {' '.join(args)} hangs:\n{log.read_text()}"
            )
            time.sleep(0.2)

    def stop(self) -> None:
        for node in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=120)


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory):
    nodes = Nodes(tmp_path_factory.mktemp("ray-nodes"))
    try:
        yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.stop()


@pytest.fixture(scope="module")
def ray_head(ray_nodes):
    """A Ray head on loopback with 3 CPUs; its address. Stopped (with any node that joined)
    when the module's tests are done."""
    port = free_port()
    ray_nodes.start(
        "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=3",
        "--include-dashboard=false",
    )  # fmt: skip
    return f"{HEAD_IP}:{port}"


@pytest.fixture
def data(tmp_path) -> Path:
    return write_topics(tmp_path / "topics.jsonl")


def on_ray(address: str, model_dir: Path, data: Path, **fields):
    """The tiny run of ``tiny_runs``, on the Ray cluster at ``address``."""
    return tiny_config(model_dir, data, backend="ray", ray_address=address, **fields)


def run_dir(home: Path, run_id: str) -> Path:
    return home / "runs" / run_id


def samples_of(home: Path, run_id: str) -> list[dict]:
    lines = (run_dir(home, run_id) / "samples.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def final_weights(home: Path, run_id: str) -> dict[str, torch.Tensor]:
    folders = sorted((run_dir(home, run_id) / "checkpoints").glob("step_*"))
    names = ("model.safetensors", "adapter_model.safetensors")
    return load_file(next(folders[-1] / n for n in names if (folders[-1] / n).exists()))


ALGORITHMS = {
    "grpo": {},
    "lora": {"lora_rank": 4},
    # DAPO's dynamic sampling: rounds of 3 prompts until 2 groups whose rewards differ.
    "dapo": {"dynamic_sampling": True, "over_sampling_batch_size": 3, "eps_clip_high": 0.28},
    # Episodes of two replies: each turn's batched call is split over the workers.
    "multi-turn": {"environment": LowercaseGame, "max_turns": 2, "rollout_max_response_len": 6},
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_workers_draw_the_local_samples_and_end_with_its_weights(
    home, tiny_model_dir, data, ray_head, algorithm
):
    fields = ALGORITHMS[algorithm]
    local = tiny_config(tiny_model_dir, data, **fields).train()
    remote = on_ray(ray_head, tiny_model_dir, data, num_rollout_workers=2, **fields).train()
    expected = samples_of(home, local.training_run_id)
    got = samples_of(home, remote.training_run_id)
    assert len(got) >= 3 * 2 * 4
    # Every sample the same: prompt, tokens, reward; each tagged with the weights that drew it.
    keys = ("step", "index", "group_index", "response_tokens", "reward", "weight_version")
    assert [{k: s[k] for k in keys} for s in got] == [{k: s[k] for k in keys} for s in expected]
    assert [s["weight_version"] for s in got] == [s["step"] - 1 for s in got]
    local_weights = final_weights(home, local.training_run_id)
    ray_weights = final_weights(home, remote.training_run_id)
    assert local_weights.keys() == ray_weights.keys()
    # The learner actor runs with other thread counts: sums in another order, within 1e-5.
    for name, tensor in local_weights.items():
        torch.testing.assert_close(ray_weights[name], tensor, rtol=0, atol=1e-5)
    assert all(m["weight_sync_s"] >= 0 for m in remote.metrics())
    # Both workers attested after every sync (LoRA: on its adapters, all that is sent).
    assert [m["attested_engines"] for m in remote.metrics()] == [2, 2, 2]
    assert all(m["attest_s"] > 0 for m in remote.metrics())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_every_worker_holds_the_learners_weights_after_a_sync(
    home, tiny_model_dir, data, ray_head, lora, precision
):
    from palaestra.backends.ray import build_ray
    from palaestra.train.state import Start, TrainerState

    config = on_ray(
        ray_head, tiny_model_dir, data, lora_rank=lora, num_rollout_workers=2, precision=precision
    )
    # The learner keeps float32 weights; workers sample from them in the run's precision (in
    # bfloat16, a copy rounded to it), so both are compared in that precision.
    dtype = getattr(torch, precision)
    sampler, learner = build_ray(config, Start(None, TrainerState(0, 3)))
    try:
        pool = sampler.engine
        rollout = sampler.sample(1, 0)
        advantages = [float(i % 3) - 1 for i in range(len(rollout.trained_B))]
        before = ray.get(learner.actor.digest.remote(dtype))
        learner.train_step(rollout.trained_B, advantages)
        after = ray.get(learner.actor.digest.remote(dtype))
        assert after != before  # the step changed the weights...
        stale = ray.get([w.digest.remote(dtype) for w in pool.workers])
        assert stale == [before, before]  # ...which the workers do not have until the sync
        attested = sampler.update_weights(learner.weights(), version=1)
        assert attested.engines == 2 and attested.seconds > 0
        synced = ray.get([w.digest.remote(dtype) for w in pool.workers])
        assert synced == [after, after]
        assert pool.weight_version == 1
        assert {s.weight_version for s in sampler.sample(2, 2).samples_B} == {1}
    finally:
        sampler.close()


def test_a_worker_that_keeps_its_old_weights_fails_the_sync_naming_it(
    home, tiny_model_dir, data, ray_head
):
    from palaestra.backends.ray import build_ray
    from palaestra.engine.attest import WeightSyncError
    from palaestra.train.state import Start, TrainerState

    config = on_ray(ray_head, tiny_model_dir, data, num_rollout_workers=2, precision="bfloat16")
    sampler, learner = build_ray(config, Start(None, TrainerState(0, 3)))
    try:
        pool = sampler.engine
        rollout = sampler.sample(1, 0)
        learner.train_step(rollout.trained_B, [float(i % 3) - 1 for i in range(8)])

        def skip_loads(worker):  # runs in worker 1's process: loads say done, change nothing
            def stale(weights, version):
                worker.engine.weight_version = version

            worker.engine.update_weights = stale
            return os.getpid()

        pid = ray.get(pool.workers[1].__ray_call__.remote(skip_loads))
        with pytest.raises(WeightSyncError) as error:
            sampler.update_weights(learner.weights(), version=1)
        message = str(error.value)
        assert "weight sync to version 1" in message
        assert f"rollout worker 1 (pid {pid}, node " in message
    finally:
        sampler.close()


def launched(config, home: Path):
    run = config.launch()
    return run, run_dir(home, run.training_run_id)


def actor_pids(log: Path) -> list[int]:
    """The pids the run's ``ray:`` line names: the learner's, then each worker's."""
    line = next(x for x in log.read_text().splitlines() if x.startswith("ray: learner pid"))
    return [int(pid) for pid in re.findall(r"(\d+) \(\d+ threads\)", line)]


def alive_actors() -> list[str]:
    """The processes of this machine that hold a palaestra actor (Ray titles each one
    ``ray::CLASS``; the process of an actor that ended exits)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    titles = ("ray::RolloutWorker", "ray::LearnerActor")
    return [line.strip() for line in out.splitlines() if line.split(None, 1)[-1].startswith(titles)]


def test_a_killed_worker_is_restarted_and_its_step_redone(
    home, tiny_model_dir, data, ray_head, capsys
):
    local = tiny_config(tiny_model_dir, data).train()
    config = on_ray(ray_head, tiny_model_dir, data, reward=gated_reward, num_rollout_workers=2)
    run, path = launched(config, home)
    wait_for(lambda: (path / "samples.jsonl").exists(), what="step 1")
    # Steps from 2 on wait in the reward, so worker 0 dies between sampling and the next step.
    pids = actor_pids(path / "train.log")
    os.kill(pids[1], signal.SIGKILL)  # pids: the learner's, worker 0's, worker 1's
    time.sleep(1)
    gate_path().touch()
    run.result(timeout=180)
    log = (path / "train.log").read_text()
    assert "rollout worker 0 died" in log
    # The CLI reads a Ray run as any other, and says where it ran.
    capsys.readouterr()
    assert main(["run", "get", run.training_run_id]) == 0
    shown = capsys.readouterr().out
    assert "status     completed, step 3/3" in shown
    assert f"backend    ray, 2 rollout worker(s) on {ray_head}" in shown
    keys = ("step", "index", "group_index", "response_tokens", "reward")
    expected = samples_of(home, local.training_run_id)
    assert [{k: s[k] for k in keys} for s in samples_of(home, run.training_run_id)] == [
        {k: s[k] for k in keys} for s in expected
    ]


def test_a_killed_learner_fails_the_run_and_resume_continues(home, tiny_model_dir, data, ray_head):
    config = on_ray(ray_head, tiny_model_dir, data, reward=gated_reward, save_interval=1)
    run, path = launched(config, home)
    wait_for(lambda: (path / "checkpoints" / "step_000001").exists(), what="step 1's checkpoint")
    os.kill(actor_pids(path / "train.log")[0], signal.SIGKILL)
    gate_path().touch()
    with pytest.raises(RunFailedError, match="the learner actor died .* resume()"):
        run.result(timeout=120)
    wait_for(lambda: alive_actors() == [], timeout=60, what="the workers to end")
    result = run.resume().result(timeout=180)
    assert [m["step"] for m in result.metrics()] == [1, 2, 3]


def test_stop_resume_and_continue_on_ray(home, tiny_model_dir, data, ray_head):
    config = on_ray(
        ray_head, tiny_model_dir, data, reward=gated_reward, num_rollout_workers=2, save_interval=1
    )
    run, path = launched(config, home)
    wait_for(lambda: (path / "checkpoints" / "step_000001").exists(), what="step 1's checkpoint")
    wait_for(lambda: len(alive_actors()) == 3, what="the run's three actors")
    run.stop()
    assert run.status == "stopped"
    wait_for(lambda: alive_actors() == [], timeout=60, what="the actors to end")

    gate_path().touch()
    resumed = run.resume()
    result = resumed.result(timeout=180)
    assert [m["step"] for m in result.metrics()] == [1, 2, 3]

    more = on_ray(ray_head, tiny_model_dir, data, num_rollout=2)
    more = more.model_copy(update={"checkpoint": result.checkpoints()[-1]})
    continued = more.launch().result(timeout=180)
    assert [m["step"] for m in continued.metrics()] == [4, 5]
    assert alive_actors() == []


def test_a_killed_driver_leaves_no_actors(home, tiny_model_dir, data, ray_head):
    config = on_ray(ray_head, tiny_model_dir, data, reward=gated_reward, num_rollout_workers=2)
    run, path = launched(config, home)
    wait_for(lambda: (path / "samples.jsonl").exists(), what="step 1")
    assert len(alive_actors()) == 3
    os.kill(run.status_info()["pid"], signal.SIGKILL)
    wait_for(lambda: alive_actors() == [], timeout=60, what="the actors to end")


def test_an_address_nothing_answers_is_named_within_seconds(tiny_model_dir, data):
    address = f"127.0.0.1:{free_port()}"
    config = tiny_config(tiny_model_dir, data, backend="ray", ray_address=address)
    started = time.monotonic()
    with pytest.raises(RecipeNotRunnableError, match=f"ray_address='{address}': nothing answers"):
        config.launch()
    assert time.monotonic() - started < 10
    with pytest.raises(RecipeNotRunnableError, match="is not HOST:PORT"):
        tiny_config(tiny_model_dir, data, backend="ray", ray_address="head-node").launch()


def test_without_ray_installed_the_error_names_the_extra(tmp_path):
    script = (
        "import sys; sys.modules['ray'] = None\n"  # what an environment without ray sees
        "from palaestra.recipes import Recipe\n"
        "from palaestra.launch.checks import check_ray_here, import_ray\n"
        "recipe = Recipe(backend='ray', custom_rm_function='palaestra.rewards.haiku:haiku_rm')\n"
        "for call in (lambda: check_ray_here(recipe), import_ray):\n"
        "    try:\n"
        "        call()\n"
        "    except Exception as error:\n"
        "        print(type(error).__name__, error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    expected = "backend='ray' needs Ray, which is not installed: pip install 'palaestra[ray]'"
    assert out == [f"RecipeNotRunnableError {expected}"] * 2


def test_ray_fields_on_the_local_backend_are_refused_by_name():
    with pytest.raises(ValueError, match="num_rollout_workers=2 is a Ray backend field"):
        Recipe(num_rollout_workers=2)
    with pytest.raises(ValueError, match="ray_address='auto' is a Ray backend field"):
        Recipe(ray_address="auto")


def test_runtime_env_variables_reach_the_workers(home, tiny_model_dir, data, ray_head):
    from palaestra.backends.ray import build_ray
    from palaestra.train.state import Start, TrainerState

    if ray.is_initialized():  # the job's runtime_env is set when the driver connects
        ray.shutdown()
    config = on_ray(
        ray_head,
        tiny_model_dir,
        data,
        image_overlay=lambda image: image.env({"PALAESTRA_MARK": "overlay"}),
    )
    sampler, _ = build_ray(config, Start(None, TrainerState(0, 1)))
    try:
        worker = sampler.engine.workers[0]
        seen = ray.get(worker.__ray_call__.remote(lambda self: os.environ.get("PALAESTRA_MARK")))
        assert seen == "overlay"
    finally:
        sampler.close()
        ray.shutdown()


def test_a_second_node_joins_and_takes_a_worker(home, tiny_model_dir, data, ray_head, ray_nodes):
    """The joined node stays until the module's fixture stops every node it started."""
    # A local Ray instance started in this process (ray.init) sets
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in os.environ, and `ray start` then refuses to join
    # a second node; a node joining a cluster on purpose says so.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    ray_nodes.start(
        f"--address={ray_head}", f"--node-ip-address={NODE_IP}", "--num-cpus=1", env=env
    )
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=ray_head)
    wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, what="two nodes")
    ray.shutdown()
    # The workers' placement group spreads its bundles over the nodes when it can.
    config = on_ray(ray_head, tiny_model_dir, data, num_rollout_workers=2, ray_cpus_per_worker=1)
    result = config.launch().result(timeout=240)
    log = (run_dir(home, result.training_run_id) / "train.log").read_text()
    assert "2 rollout worker(s) on 2 node(s)" in log
    assert [m["step"] for m in result.metrics()] == [1, 2, 3]


def test_sampling_ahead_on_ray_settles_every_prompt_once(home, tiny_model_dir, data, ray_head):
    """max_staleness=1 on two workers: each step drawn by the learner's last weights or the
    ones before, none dropped, every prompt position of the data order trained once."""
    from palaestra.train.ledger import ledger_problems

    config = on_ray(
        ray_head,
        tiny_model_dir,
        data,
        num_rollout_workers=2,
        num_rollout=4,
        max_staleness=1,
        off_policy_correction="tis",
    )
    remote = config.train()
    metrics = remote.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["stale_dropped_groups"] for m in metrics] == [0] * 4
    assert all(0 < m["importance_ratio_mean"] < 2 for m in metrics)
    for sample in samples_of(home, remote.training_run_id):
        assert max(sample["step"] - 2, 0) <= sample["weight_version"] <= sample["step"] - 1
    folder = sorted((run_dir(home, remote.training_run_id) / "checkpoints").glob("step_*"))[-1]
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["cursor"] == 4 * 2
    assert ledger_problems(state["ledger"], state["cursor"]) == []
    assert {entry[2] for entry in state["ledger"]} == {"trained"}
