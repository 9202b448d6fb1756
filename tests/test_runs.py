"""The run directory on its own: status inference, locked updates, log files, checkpoint listing."""

import json
import os

import pytest

from palaestra.runs.directory import RunDirectory, process_start_time, read_jsonl


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run-1"
    path.mkdir()
    return RunDirectory(path)


def test_running_with_a_live_pid_reads_as_running(run):
    run.update_status(state="running", pid=os.getpid(), pid_start=process_start_time(os.getpid()))
    assert run.read_status()["state"] == "running"


def test_a_reused_pid_does_not_keep_a_dead_run_alive(run):
    # Our own pid, but a start time that is not ours: the process that wrote it is gone.
    run.update_status(
        state="running", pid=os.getpid(), pid_start=process_start_time(os.getpid()) - 1
    )
    status = run.read_status()
    assert status["state"] == "failed"
    assert "exited without reporting" in status["error"]


def test_compare_and_set_refuses_the_wrong_state(run):
    run.update_status(state="completed")
    with pytest.raises(ValueError, match="is completed, not failed or stopped"):
        run.update_status(expect=("failed", "stopped"), state="pending")
    assert json.loads((run.path / "status.json").read_text())["state"] == "completed"


def test_a_line_cut_short_by_a_crash_is_skipped(run):
    (run.path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_jsonl(run.path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]
    run.truncate_after_step("metrics.jsonl", 1)
    assert (run.path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_only_complete_checkpoints_are_listed(run):
    for name in ("step_000002", "step_000010", ".step_000011-x7", "step_000012", "notes"):
        (run.checkpoints_dir / name).mkdir(parents=True)
    for name in ("step_000002", "step_000010", ".step_000011-x7"):
        (run.checkpoints_dir / name / "trainer_state.pt").write_bytes(b"")
    # step_000012 has no trainer state (not ours, or emptied by hand): not a checkpoint.
    assert [step for step, _ in run.checkpoint_paths()] == [2, 10]
