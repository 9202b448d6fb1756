"""A multi-turn run of the tiny model that crashes at step 3 and resumes in the middle as if never
stopped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from palaestra import RunFailedError, TrainingRun
from palaestra.launch.worker import execute
from palaestra.runs.directory import RunDirectory
from palaestra.runs.registry import list_run_ids
from tests.support.episodes import LowercaseGame, episode_reward
from tests.support.tiny_runs import tiny_config, write_topics


def crash_once_at_step_3(args, sample, **kwargs) -> float:
    marker = Path(os.environ["PALAESTRA_HOME"]) / "crashed-once"
    if sample.step == 3 and not marker.exists():
        marker.touch()
        raise RuntimeError("killed in the middle of the run")
    return episode_reward(args, sample)


def test_a_multi_turn_run_resumes_in_the_middle_as_if_never_stopped(home, tiny_model_dir, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    fields = dict(
        environment=LowercaseGame,
        max_turns=2,
        num_rollout=4,
        save_interval=1,
        rollout_max_response_len=6,
    )
    steady = tiny_config(tiny_model_dir, data, reward=episode_reward, **fields).train()

    with pytest.raises(RunFailedError, match="killed in the middle"):
        tiny_config(tiny_model_dir, data, reward=crash_once_at_step_3, **fields).train()
    (run_id,) = [r for r in list_run_ids() if r != steady.training_run_id]
    run = TrainingRun.from_id(run_id)
    assert [c.step for c in run.checkpoints()] == [1, 2]
    execute(RunDirectory(run.path), resume=True)
    assert run.status == "completed", run.status_info().get("error")

    assert [m["step"] for m in run.metrics()] == [1, 2, 3, 4]
    assert [c.step for c in run.checkpoints()] == [1, 2, 3, 4]
    resumed, reference = run.samples(), TrainingRun.from_id(steady.training_run_id).samples()
    assert len(resumed) == 4 * 2 * 4  # each step once: 2 prompts x 4 episodes
    keys = ("step", "index", "group_index", "response", "reward", "mask_spans", "messages")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in reference]
    for row in resumed:
        assert row["status"] == "truncated" or row["status"] == "completed"
        assert [m["role"] for m in row["messages"]][-3:] == ["assistant", "user", "assistant"]
