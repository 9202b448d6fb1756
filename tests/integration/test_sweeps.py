"""Sweeps run: a group trained here and one launched in the background, how many variants run
at once, stopping a group, and the CLI's sweep."""

from __future__ import annotations

import json
import time

import pytest

from palaestra.launch.sweeps import TrainingGroup
from palaestra.runs import groups
from palaestra.runs.registry import open_run
from tests.support.tiny_runs import tiny_config, write_topics


@pytest.fixture
def base(tiny_model_dir, home, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    return tiny_config(tiny_model_dir, data, num_rollout=2).model_copy(update={"name": "sw"})


def test_train_runs_each_variant_as_a_tagged_run_and_records_the_group(base, home):
    group = TrainingGroup(base, grid={"recipe.lr": [1e-2, 1e-3]}, name="lr")
    result = group.train()
    assert len(result.results) == 2 and not result.failed
    detail = groups.group_detail(group.group_id)
    assert detail["state"] == "completed" and detail["driver"] is None
    for variant, lr in zip(detail["variants"], [1e-2, 1e-3], strict=True):
        run = open_run(variant["run_id"])
        config = run.config()
        assert config["group_id"] == group.group_id
        assert config["group_overrides"] == {"recipe.lr": lr}
        assert config["recipe"]["lr"] == lr
        rewards = [row["reward_mean"] for row in run.metrics()]
        assert len(rewards) == 2
        assert variant["final_reward"] == rewards[-1] and variant["best_reward"] == max(rewards)
    summary = groups.list_groups()[0]
    assert summary["group_id"] == group.group_id
    assert summary["states"] == {"completed": 2} and summary["variants"] == 2
    # The dashboard shows the group the sweep recorded, and compares its runs by their lr.
    from fastapi.testclient import TestClient

    from palaestra.dashboard.app import create_app

    client = TestClient(create_app(home))
    shown = client.get(f"/api/groups/{group.group_id}").json()
    assert [v["run_id"] for v in shown["variants"]] == [v["run_id"] for v in detail["variants"]]
    ids = ",".join(v["run_id"] for v in detail["variants"])
    labels = [run["label"] for run in client.get(f"/api/compare?runs={ids}").json()]
    assert labels == ["recipe.lr=0.01", "recipe.lr=0.001"]


def test_a_failing_variant_without_continue_on_error_leaves_the_rest_unstarted(base):
    def broken_reward(args, sample, **kwargs) -> float:
        raise RuntimeError("reward broke")

    grid = {"recipe.custom_rm_function": [broken_reward, broken_reward, broken_reward]}
    group = TrainingGroup(base, grid=grid)
    with pytest.raises(Exception, match="reward broke"):
        group.train(continue_on_error=False)
    states = [v["state"] for v in groups.group_detail(group.group_id)["variants"]]
    assert states == ["failed", "stopped", "stopped"]
    second = open_run(groups.read_group(group.group_id)["variants"][1]["run_id"])
    assert "earlier variant failed" in second.read_status()["error"]
    assert not second.metrics()  # it never trained


def test_launch_returns_at_once_and_respects_max_parallel(base):
    group = TrainingGroup(base, grid={"recipe.lr": [1e-2, 1e-3, 1e-4]})
    started = time.monotonic()
    handle = group.launch(max_parallel=2)
    assert time.monotonic() - started < 5  # the variants train in the background
    assert len(handle.runs()) == 3
    most_at_once = 0
    while handle.status in ("pending", "running"):
        states = [run.status for run in handle.runs()]
        most_at_once = max(most_at_once, states.count("running"))
        time.sleep(0.05)
    result = handle.result(timeout=300)
    assert len(result.results) == 3
    assert most_at_once <= 2
    # Each of two runs side by side gets half the cores (recorded in the driver's group).
    record = groups.read_group(group.group_id)
    assert record["max_parallel"] == 2 and record["ended_at"] is not None
    log = (groups.group_path(group.group_id) / "driver.log").read_text()
    assert log.count("sweep: started") == 3


def test_stopping_a_launched_group_stops_its_runs_and_cancels_the_rest(base, home):
    from tests.support.tiny_runs import gated_reward

    group = TrainingGroup(
        base.model_copy(update={"recipe": base.recipe.model_copy(update={"num_rollout": 3})}),
        grid={"recipe.custom_rm_function": [gated_reward, gated_reward]},
    )
    handle = group.launch(max_parallel=1)
    first = handle.runs()[0]
    deadline = time.monotonic() + 120
    while first.status != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    handle.stop(timeout=30)
    states = [run.status for run in handle.runs()]
    assert states == ["stopped", "stopped"]
    assert handle.status == "stopped"
    status = json.loads((handle.runs()[1].path / "status.json").read_text())
    assert "stopped before this variant started" in status["error"]


def write_sweep_file(folder, model) -> object:
    (folder / "sweep_rewards.py").write_text(
        "from tests.support.tiny_runs import count_lowercase  # noqa: F401\n"
    )
    write_topics(folder / "topics.jsonl")
    path = folder / "base.toml"
    path.write_text(
        f"""name = "cli"
[model]
path = "{model}"
name = "tiny"
[dataset]
path = "topics.jsonl"
input_column = "topic"
prompt_template = "Say {{input}}"
[recipe]
num_rollout = 2
rollout_batch_size = 2
n_samples_per_prompt = 4
rollout_max_response_len = 8
lr = 0.01
custom_rm_function = "sweep_rewards:count_lowercase"
"""
    )
    return path


def test_cli_sweeps_a_grid_lists_the_group_and_exports_its_metrics(
    tiny_model_dir, home, tmp_path, capsys
):
    import csv
    import io

    from palaestra.cli import main, parse_grid

    assert parse_grid(["recipe.lr=1e-6,1e-5", "recipe.advantage_estimator=grpo,gspo"]) == {
        "recipe.lr": [1e-6, 1e-5],
        "recipe.advantage_estimator": ["grpo", "gspo"],
    }
    path = write_sweep_file(tmp_path, tiny_model_dir)
    code = main(["sweep", str(path), "--grid", "recipe.lr=0.01,-1", "--skip-invalid"])
    out = capsys.readouterr().out
    assert code == 0
    assert "skipped variant 2 of 2 (recipe.lr=-1)" in out
    group_id = out.split("group id: ")[1].split()[0]
    (variant,) = groups.group_detail(group_id)["variants"]
    run = open_run(variant["run_id"])
    rewards = [row["reward_mean"] for row in run.metrics()]
    # The closing table: the variant's run, its lr, state, steps, final and best reward.
    row = next(line for line in out.splitlines() if line.startswith(run.run_id)).split()
    assert row == [run.run_id, "0.01", "completed", "2/2", f"{rewards[-1]:+.3f}",
                   f"{max(rewards):+.3f}"]  # fmt: skip

    assert main(["group", "list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[1].split()[:5] == [group_id, "completed", "recipe.lr", "1", "completed:1"]
    assert main(["run", "list", "--group", group_id]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [run.run_id]

    assert main(["run", "get", run.run_id]) == 0
    assert f"group      {group_id} (recipe.lr=0.01)" in capsys.readouterr().out
    assert main(["run", "export", group_id, "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run_id"] for r in table] == [run.run_id] * 2
    assert [float(r["recipe.lr"]) for r in table] == [0.01, 0.01]
    assert [float(r["reward_mean"]) for r in table] == rewards
    out_file = tmp_path / "m.jsonl"
    assert main(["run", "export", run.run_id, "--format", "jsonl", "-o", str(out_file)]) == 0
    assert capsys.readouterr().out == f"wrote 2 rows to {out_file}\n"
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert lines == [{"run_id": run.run_id, **row} for row in run.metrics()]
    assert main(["run", "export", "no-such-thing"]) == 1
    assert "no run or group 'no-such-thing'" in capsys.readouterr().err
