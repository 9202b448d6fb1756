"""The training loop driven by a fake backend: a sampler that returns scripted groups and a
learner that records its calls. The loop depends on the two handles and nothing else."""

from __future__ import annotations

import json

import pytest

from palaestra import LocalDataset, ModelConfig, Recipe, TrainConfig
from palaestra.runs.directory import RunDirectory
from palaestra.train.loop import run_training
from palaestra.types import Rollout, Sample

G = 2


class Crash(RuntimeError):
    pass


class ScriptedSampler:
    """Step s draws one group of two samples with rewards (s + 2, s) from the prompt at the
    cursor; the cursor moves by one."""

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.version = 0

    def sample(self, step: int, cursor: int) -> Rollout:
        self.calls.append(("sample", step, cursor))
        samples = [
            Sample(
                prompt=f"p{cursor}",
                response=f"r{g}",
                label=None,
                metadata={},
                index=cursor,
                group_index=g,
                step=step,
                prompt_token_ids=[1, 2],
                response_token_ids=[3] * (g + 1),
                weight_version=self.version,
                reward=float(step + 2 - 2 * g),
            )
            for g in range(G)
        ]
        metrics = {"reward_mean": float(step + 1), "reward_std": 1.0}
        return Rollout(samples, samples, cursor + 1, metrics)

    def update_weights(self, weights, version: int) -> None:
        self.calls.append(("update_weights", dict(weights), version))
        self.version = version

    def evaluate(self, step: int) -> dict[str, float]:
        self.calls.append(("evaluate", step))
        return {"eval_reward_mean": -float(step)}

    def close(self) -> None:
        self.calls.append(("close",))


class RecordingLearner:
    def __init__(self, calls: list, crash_at: int | None = None) -> None:
        self.calls = calls
        self.crash_at = crash_at
        self.trained = 0

    def train_step(self, samples_B, advantages_B) -> dict:
        step = samples_B[0].step
        if step == self.crash_at:
            raise Crash(f"killed in the update of step {step}")
        self.calls.append(("train_step", [s.response for s in samples_B], list(advantages_B)))
        self.trained += 1
        return {"loss": 0.25 * step}

    def weights(self):
        return {"w": self.trained}

    def save(self, folder) -> None:
        self.calls.append(("save", folder.name.startswith(".step_")))
        (folder / "weights.txt").write_text(str(self.trained))

    def load(self, folder) -> None:
        self.calls.append(("load", folder.name, (folder / "weights.txt").read_text()))
        self.trained = int((folder / "weights.txt").read_text())


def fake_backend(calls: list, crash_at: int | None = None):
    def build(config, start):
        calls.append(("build", start.checkpoint and start.checkpoint.name, start.state.step))
        learner = RecordingLearner(calls, crash_at)
        if start.checkpoint is not None:
            learner.load(start.checkpoint)
        return ScriptedSampler(calls), learner

    return build


@pytest.fixture
def config(tiny_model_dir, prompts_file) -> TrainConfig:
    recipe = Recipe(
        num_rollout=4,
        save_interval=2,
        rollout_batch_size=1,
        n_samples_per_prompt=G,
        scale_rewards="none",
        eval_interval=3,
    )
    dataset = LocalDataset(path=str(prompts_file), input_column="topic")
    return TrainConfig(
        model=ModelConfig.from_pretrained(tiny_model_dir, name="tiny"),
        dataset=dataset,
        eval_dataset=dataset,
        recipe=recipe,
    )


def test_loop_samples_updates_syncs_evaluates_records_saves_in_order(tmp_path, config):
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    calls: list = []
    run_training(config, run, fake_backend(calls))

    assert calls[0] == ("build", None, 0)
    # Step 1: rewards (3, 1) around their mean 2, unscaled: advantages (+1, -1).
    assert calls[1:4] == [
        ("sample", 1, 0),
        ("train_step", ["r0", "r1"], [1.0, -1.0]),
        ("update_weights", {"w": 1}, 1),
    ]
    # Step 2 saves (save_interval 2) through a hidden staging folder; step 3 evaluates.
    assert calls[4:8] == [
        ("sample", 2, 1),
        ("train_step", ["r0", "r1"], [1.0, -1.0]),
        ("update_weights", {"w": 2}, 2),
        ("save", True),
    ]
    assert ("evaluate", 3) in calls and ("evaluate", 2) not in calls
    assert calls[-1] == ("close",)

    metrics = run.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["loss"] for m in metrics] == [0.25, 0.5, 0.75, 1.0]
    assert metrics[2]["eval_reward_mean"] == -3.0 and "eval_reward_mean" not in metrics[1]
    samples = run.samples(step=2)
    assert [(s["response"], s["advantage"], s["trained"]) for s in samples] == [
        ("r0", 1.0, True),
        ("r1", -1.0, True),
    ]
    # Samples record the weights they were drawn with: step 2's come from step 1's update.
    assert [s["weight_version"] for s in samples] == [1, 1]

    assert [step for step, _ in run.checkpoint_paths()] == [2, 4]
    last = run.checkpoint_paths()[-1][1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert (state["step"], state["last_step"], state["cursor"]) == (4, 4, 4)
    assert state["log_metrics"]["loss"] == 1.0
    assert (last / "weights.txt").read_text() == "4"
    assert json.loads((last / "palaestra.json").read_text())["step"] == 4


def test_resume_after_a_crash_repeats_no_step(tmp_path, config):
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(Crash):
        run_training(config, run, fake_backend([], crash_at=4))
    # Steps 1-3 were logged, step 2 saved; step 4 died in its update.
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]

    calls: list = []
    run_training(config, run, fake_backend(calls), resume=True)
    # The backend restarts from the step-2 checkpoint, the learner from its weights, and the
    # sampler from the data cursor saved with it.
    assert calls[:3] == [
        ("build", "step_000002", 2),
        ("load", "step_000002", "2"),
        ("sample", 3, 2),
    ]
    assert [m["step"] for m in run.metrics()] == [1, 2, 3, 4]
    assert [s["step"] for s in run.samples()] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [step for step, _ in run.checkpoint_paths()] == [2, 4]
