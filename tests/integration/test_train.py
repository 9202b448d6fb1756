"""Training end to end on a tiny model: updates, logs, checkpoints, processes, crashes, resume."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from palaestra import LocalDataset, RunFailedError, TrainConfig, TrainingRun
from palaestra.data import DatasetError
from palaestra.runs.handles import RunStoppedError
from palaestra.runs.registry import list_run_ids
from tests.support.tiny_runs import count_lowercase, make_config, wait_for


async def slow_after_step_2(args, sample, **kwargs) -> float:
    """Holds steps 3 and later for a second, so a test can kill the run in the middle."""
    if sample.step >= 3:
        await asyncio.sleep(1.0)
    return count_lowercase(args, sample)


async def failing_reward(args, sample, **kwargs):
    if sample.group_index == 1:
        return float("nan")
    return 0.0


def test_one_step_updates_weights_and_writes_the_run_directory(home, tiny_model_dir, prompts_file):
    result = make_config(tiny_model_dir, prompts_file).train()
    run_dir = home / "runs" / result.training_run_id
    assert result.training_run_id.startswith("tiny-")

    (checkpoint,) = result.checkpoints()
    assert checkpoint.step == 1
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(checkpoint.path / "model.safetensors")
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) > 0.9 * len(before), f"only {len(changed)} of {len(before)} tensors moved"

    (metrics,) = result.metrics()
    samples = result.samples()
    assert metrics["step"] == 1
    assert len(samples) == 2 * 4
    assert metrics["reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 8)
    assert all(s["reward"] == sum(c.islower() for c in s["response"]) for s in samples)
    assert metrics["reward_std"] > 0
    for key in ("loss", "entropy", "grad_norm", "rollout_s", "reward_s", "train_s", "save_s"):
        assert isinstance(metrics[key], float), key
    # Advantages are normalised within each group: they sum to ~0 per prompt.
    for index in {s["index"] for s in samples}:
        group = [s["advantage"] for s in samples if s["index"] == index]
        assert len(group) == 4 and abs(sum(group)) < 1e-4

    config = json.loads((run_dir / "config.json").read_text())
    assert config["recipe"]["custom_rm_function"] == f"{count_lowercase.__module__}:count_lowercase"
    assert config["dataset"]["input_column"] == "topic"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 1 and status["total_steps"] == 1


def test_checkpoint_loads_in_plain_transformers(home, tiny_model_dir, prompts_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = make_config(tiny_model_dir, prompts_file).train()
    path = result.latest_checkpoint().path
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    output = model.generate(
        **tokenizer("Say sun", return_tensors="pt"), max_new_tokens=3, do_sample=False
    )
    assert output.shape[1] == len("Say sun") + 3
    assert json.loads((path / "palaestra.json").read_text())["step"] == 1


def test_bad_column_fails_before_any_run_starts(home, tiny_model_dir, prompts_file):
    config = make_config(tiny_model_dir, prompts_file)
    config.dataset.input_column = "keywords"
    with pytest.raises(DatasetError, match="keywords.*topic, answer"):
        config.launch()
    assert list_run_ids() == []


def test_reward_returning_nan_fails_the_run_naming_the_sample(home, tiny_model_dir, prompts_file):
    run = make_config(tiny_model_dir, prompts_file, reward=failing_reward).launch()
    with pytest.raises(RunFailedError) as error:
        run.result(timeout=120)
    assert "sample 1 of prompt " in str(error.value)
    assert "must be finite" in str(error.value)
    assert run.status == "failed"
    assert "RewardError" in run.status_info()["traceback"]
    assert run.checkpoints() == []


def test_launch_returns_at_once_and_from_id_reattaches(home, tiny_model_dir, prompts_file):
    started = time.monotonic()
    run = make_config(tiny_model_dir, prompts_file, num_rollout=2).launch()
    assert time.monotonic() - started < 5
    again = TrainingRun.from_id(run.training_run_id)
    result = again.result(timeout=120)
    assert [c.step for c in result.checkpoints()] == [2]
    assert [m["step"] for m in result.metrics()] == [1, 2]
    assert run.done() and run.status == "completed"
    assert list_run_ids() == [run.training_run_id]
    assert [r.training_run_id for r in TrainingRun.list(status="completed")] == [
        run.training_run_id
    ]
    assert TrainingRun.list(status="running") == []


def test_continue_from_checkpoint_numbers_steps_after_it(home, tiny_model_dir, prompts_file):
    first = make_config(tiny_model_dir, prompts_file, num_rollout=2).train()
    checkpoint = first.checkpoints()[-1]
    config = make_config(tiny_model_dir, prompts_file, num_rollout=2)
    config = config.model_copy(update={"checkpoint": checkpoint})
    second = config.train()
    assert [m["step"] for m in second.metrics()] == [3, 4]
    assert [c.step for c in second.checkpoints()] == [4]
    folder = second.checkpoints()[-1].path
    state = json.loads((folder / "trainer_state.json").read_text())
    # The data cursor continued too: 4 steps x 2 prompts; Adam's moments were carried over,
    # so its own step count is 4, not 2.
    assert (state["step"], state["cursor"], state["last_step"]) == (4, 8, 4)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]
    adam_steps = {float(v["step"]) for v in optimizer["state"].values()}
    assert adam_steps == {4.0}
    assert json.loads((second.path / "config.json").read_text())["checkpoint"] == str(
        checkpoint.path
    )


def test_kill_then_resume_finishes_with_every_step_once(home, tiny_model_dir, prompts_file):
    run = make_config(
        tiny_model_dir, prompts_file, num_rollout=4, save_interval=1, reward=slow_after_step_2
    ).launch()
    wait_for(
        lambda: (c := run.latest_checkpoint()) is not None and c.step >= 2,
        what="the step-2 checkpoint",
    )
    assert run.status == "running"
    os.kill(run.status_info()["pid"], signal.SIGKILL)
    wait_for(lambda: run.status == "failed", what="the killed run to read as failed")
    assert "exited without reporting" in run.status_info()["error"]
    # A checkpoint being written at the moment of the kill stays hidden.
    (run.path / "checkpoints" / ".step_000009-partial").mkdir()
    steps_at_kill = [c.step for c in run.checkpoints()]
    assert 9 not in steps_at_kill

    resumed = run.resume()
    resumed.result(timeout=120)
    assert [m["step"] for m in resumed.metrics()] == [1, 2, 3, 4]
    assert [c.step for c in resumed.checkpoints()] == [1, 2, 3, 4]
    assert not list((run.path / "checkpoints").glob(".step_*"))
    from transformers import AutoModelForCausalLM

    for checkpoint in resumed.checkpoints():
        AutoModelForCausalLM.from_pretrained(checkpoint.path)
    assert {s["step"] for s in resumed.samples()} == {1, 2, 3, 4}
    assert len(resumed.samples()) == 4 * 2 * 4


def test_crash_while_saving_keeps_earlier_checkpoints(
    home, tiny_model_dir, prompts_file, monkeypatch
):
    import palaestra.train.learner as learner_module

    real_save = torch.save
    calls = {"n": 0}

    def save_that_breaks_the_second_time(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(learner_module.torch, "save", save_that_breaks_the_second_time)
    config = make_config(tiny_model_dir, prompts_file, num_rollout=3, save_interval=1)
    with pytest.raises(RunFailedError, match="disk full"):
        config.train()
    (run_id,) = list_run_ids()
    run = TrainingRun.from_id(run_id)
    assert [c.step for c in run.checkpoints()] == [1]
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == ["step_000001"]


def test_stop_ends_a_running_run(home, tiny_model_dir, prompts_file):
    run = make_config(tiny_model_dir, prompts_file, num_rollout=500).launch()
    wait_for(lambda: run.status_info().get("step", 0) >= 1, what="the first step")
    run.stop(timeout=60)
    assert run.status == "stopped"
    with pytest.raises(RunStoppedError):
        run.result(timeout=5)
    assert "palaestra: stopped" in (run.path / "train.log").read_text()


def test_reward_defined_in_a_scripts_main_reaches_the_training_process(
    home, tiny_model_dir, prompts_file, tmp_path
):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        from palaestra import LocalDataset, ModelConfig, Recipe, TrainConfig

        BONUS = 0.5

        async def my_reward(args, sample, **kwargs):
            return BONUS + len(sample.response)

        class Topics(LocalDataset):
            input_column = "topic"
            prompt_template = "Say {{input}}"

        config = TrainConfig(
            model=ModelConfig.from_pretrained({str(tiny_model_dir)!r}),
            dataset=Topics(path={str(prompts_file)!r}),
            recipe=Recipe(num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
                          rollout_max_response_len=4, custom_rm_function=my_reward),
        )
        run = config.launch(show_output=True)
        result = run.result(timeout=120)
        print("run id", run.training_run_id, len(result.checkpoints()))
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "step 1/1" in done.stdout
    assert "run id" in done.stdout and done.stdout.strip().endswith(" 1")
    (run_id,) = list_run_ids()
    samples = TrainingRun.from_id(run_id).samples()
    assert [s["reward"] for s in samples] == [0.5 + len(s["response"]) for s in samples]


def test_eval_dataset_is_scored_every_eval_interval(home, tiny_model_dir, prompts_file):
    base = make_config(tiny_model_dir, prompts_file, num_rollout=2)
    eval_dataset = LocalDataset(
        path=str(prompts_file),
        hf_split="train[:3]",
        input_column="topic",
        prompt_template="Say {input}",
    )
    recipe = base.recipe.model_copy(update={"eval_interval": 2})
    config = TrainConfig(
        model=base.model, dataset=base.dataset, recipe=recipe, eval_dataset=eval_dataset
    )
    result = config.train()
    first, second = result.metrics()
    assert "eval_reward_mean" not in first
    # One sample per eval row, scored by the training reward (lowercase letters, at most 8).
    assert 0 <= second["eval_reward_mean"] <= 8


def test_eval_interval_needs_an_eval_dataset(tiny_model_dir, prompts_file):
    with pytest.raises(ValueError, match="eval_interval is set but TrainConfig.eval_dataset"):
        make_config(tiny_model_dir, prompts_file, eval_interval=1)


def test_stopped_run_resumes_to_its_target_and_only_once(home, tiny_model_dir, prompts_file):
    run = make_config(
        tiny_model_dir, prompts_file, num_rollout=4, save_interval=1, reward=slow_after_step_2
    ).launch()
    wait_for(lambda: run.status_info().get("step", 0) >= 2, what="step 2")
    run.stop()
    assert run.status == "stopped"
    resumed = run.resume()
    with pytest.raises(ValueError, match="not failed or stopped"):
        run.resume()  # claimed already: no second process on the same run
    resumed.result(timeout=120)
    assert [m["step"] for m in resumed.metrics()] == [1, 2, 3, 4]
    assert resumed.status_info().get("error") is None


def test_crash_between_saving_and_logging_loses_no_step(
    home, tiny_model_dir, prompts_file, monkeypatch
):
    from palaestra.runs.directory import RunDirectory

    real_append = RunDirectory.append_jsonl

    def append_that_dies_at_step_2(self, name, rows):
        if name == "metrics.jsonl" and rows[0]["step"] == 2:
            raise KeyboardInterrupt  # as if killed right after the step-2 checkpoint landed
        return real_append(self, name, rows)

    monkeypatch.setattr(RunDirectory, "append_jsonl", append_that_dies_at_step_2)
    with pytest.raises(Exception, match="stopped"):
        make_config(tiny_model_dir, prompts_file, num_rollout=3, save_interval=1).train()
    monkeypatch.setattr(RunDirectory, "append_jsonl", real_append)
    (run_id,) = list_run_ids()
    run = TrainingRun.from_id(run_id)
    assert [m["step"] for m in run.metrics()] == [1]
    assert [c.step for c in run.checkpoints()] == [1, 2]
    run.resume().result(timeout=120)
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]
    assert sorted({s["step"] for s in run.samples()}) == [1, 2, 3]
    assert len(run.samples()) == 3 * 2 * 4
