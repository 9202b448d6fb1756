"""SIGKILL a run's training process at each moment of a step (starting, sampling, the update,
evaluating, saving), check what every reader sees at once and that every listed checkpoint
loads, resume, and after the last kill finish with each step logged exactly once.

``bench/faults.py`` does the same at a hundred random moments."""

from __future__ import annotations

import inspect

from palaestra.cli import main as cli_main
from palaestra.launch.training import TrainingRun
from palaestra.runs.directory import RunDirectory
from palaestra.runs.records import run_summary
from tests.support.moments import (
    STEP_LINES,
    checkpoint_problems,
    evaluated_config,
    kill_at,
    kill_while_saving,
    log_problems,
)
from tests.support.tiny_runs import write_topics

STEPS = 6
ROWS_PER_STEP = 2 * 4  # prompts x samples per prompt (tiny_config)


def assert_killed_reads_as_failed(run: TrainingRun, capsys) -> None:
    """The handle, a fresh reader, the dashboard's summary and ``palaestra run list`` all say
    failed at once, and the error says how to continue."""
    latest = run.latest_checkpoint()
    info = run.status_info()
    assert info["state"] == "failed"
    assert "killed or interrupted" in info["error"] and "resume()" in info["error"]
    if latest is None:
        assert "no checkpoint of its own yet" in info["error"]
    else:
        assert f"last checkpoint (step {latest.step})" in info["error"]
    assert TrainingRun.from_id(run.training_run_id).status == "failed"
    summary = run_summary(RunDirectory(run.path))
    assert summary["state"] == "failed" and "killed or interrupted" in summary["error"]
    capsys.readouterr()
    assert cli_main(["run", "list"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if run.training_run_id in x]
    assert line.split()[1] == "failed"


def assert_left_intact(run: TrainingRun) -> None:
    assert checkpoint_problems(run) == []
    steps = [row["step"] for row in run.metrics()]
    assert steps == list(range(1, len(steps) + 1))  # a torn last line is skipped, never merged


def test_kills_at_every_moment_lose_nothing(home, tiny_model_dir, tmp_path, capsys):
    data = write_topics(tmp_path / "topics.jsonl")
    config = evaluated_config(tiny_model_dir, data, 2, num_rollout=STEPS, save_interval=1)
    run = config.launch()
    for moment in ("starting", "sampling", "update", "evaluating", "saving"):
        if moment == "saving":
            staging = kill_while_saving(run)
            assert staging.exists() and staging.name.startswith(".step_")
        else:
            kill_at(run, moment)
        assert_killed_reads_as_failed(run, capsys)
        assert_left_intact(run)
        run = run.resume()
    run.result(timeout=180)
    assert run.status == "completed"
    assert [c.step for c in run.checkpoints()] == list(range(1, STEPS + 1))
    assert not list((run.path / "checkpoints").glob(".step_*"))  # the torn save was cleaned
    assert checkpoint_problems(run) == []
    assert log_problems(run, STEPS, ROWS_PER_STEP) == []
    evaluated = [row["step"] for row in run.metrics() if "eval_reward_mean" in row]
    assert evaluated == [2, 4, 6]


def test_moments_name_the_loop_lines():
    """Each call the moment classifier looks for is still on a line of the loop's step."""
    from palaestra.train.loop import train_one_step

    source = inspect.getsource(train_one_step)
    for _, calls in STEP_LINES:
        for call in calls:
            assert call in source, f"train_one_step no longer has {call!r}"
