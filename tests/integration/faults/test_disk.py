"""A checkpoint save that fails (disk full, no permission), while its files are written or
as its folder is renamed into place: the run fails naming the checkpoint, the path and the
reason; the checkpoints before it stay listed and load; no half-written folder is left or
listed; once the disk has room again, the run resumes and finishes with each step once."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

import pytest

from palaestra import RunFailedError
from palaestra.launch.training import TrainingRun
from palaestra.launch.worker import execute
from palaestra.runs.directory import RunDirectory
from palaestra.runs.registry import list_run_ids
from palaestra.train.learner import Learner
from tests.support.moments import checkpoint_problems, log_problems
from tests.support.tiny_runs import tiny_config, write_topics

STEPS = 4
FAILING_SAVE = 3


def failing_on(nth: int, action):
    """A counter that runs ``action`` (which raises) on its ``nth`` call."""
    calls = {"n": 0}

    def maybe_fail(*args) -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            action(*args)

    return maybe_fail


def disk_full(path) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def no_permission(path) -> None:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def train_until_the_save_fails(model_dir: Path, tmp_path: Path, reason: str) -> TrainingRun:
    data = write_topics(tmp_path / "topics.jsonl")
    config = tiny_config(model_dir, data, num_rollout=STEPS, save_interval=1)
    step = f"step_{FAILING_SAVE:06d}"
    with pytest.raises(RunFailedError) as failed:
        config.train()
    (run_id,) = list_run_ids()
    run = TrainingRun.from_id(run_id)
    final = run.path / "checkpoints" / step
    assert f"cannot save checkpoint {step} to {final}: {reason}" in str(failed.value)
    assert run.status == "failed" and str(final) in run.status_info()["error"]
    return run


def assert_earlier_checkpoints_intact(run: TrainingRun) -> None:
    assert [c.step for c in run.checkpoints()] == list(range(1, FAILING_SAVE))
    assert checkpoint_problems(run) == []
    names = sorted(p.name for p in (run.path / "checkpoints").iterdir())
    assert names == [f"step_{s:06d}" for s in range(1, FAILING_SAVE)]  # no staging left
    assert [m["step"] for m in run.metrics()] == list(range(1, FAILING_SAVE))


def resume_here_and_finish(run: TrainingRun) -> None:
    execute(RunDirectory(run.path), resume=True)
    assert run.status == "completed", run.status_info().get("error")
    assert [c.step for c in run.checkpoints()] == list(range(1, STEPS + 1))
    assert checkpoint_problems(run) == []
    assert log_problems(run, STEPS, 2 * 4) == []


def test_disk_full_while_writing_a_checkpoint(home, tiny_model_dir, tmp_path, monkeypatch):
    real_save = Learner.save
    fail = failing_on(FAILING_SAVE, lambda folder: disk_full(Path(folder) / "optimizer.pt"))

    def save_then_run_out_of_space(self, folder) -> None:
        real_save(self, folder)  # the weights are in the staging folder; the disk is full
        fail(folder)

    monkeypatch.setattr(Learner, "save", save_then_run_out_of_space)
    run = train_until_the_save_fails(tiny_model_dir, tmp_path, "No space left on device")
    assert_earlier_checkpoints_intact(run)
    monkeypatch.undo()  # undoes the home fixture's PALAESTRA_HOME too: the run resumes in its home
    monkeypatch.setenv("PALAESTRA_HOME", str(home))
    resume_here_and_finish(run)


def test_no_permission_to_rename_the_checkpoint(home, tiny_model_dir, tmp_path, monkeypatch):
    real_replace = os.replace
    fail = failing_on(FAILING_SAVE, no_permission)

    def replace(source, target, **kwargs) -> None:
        if Path(source).name.startswith(".step_"):  # a checkpoint's staging folder
            fail(target)
        real_replace(source, target, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    run = train_until_the_save_fails(tiny_model_dir, tmp_path, "Permission denied")
    assert_earlier_checkpoints_intact(run)
    monkeypatch.undo()  # undoes the home fixture's PALAESTRA_HOME too: the run resumes in its home
    monkeypatch.setenv("PALAESTRA_HOME", str(home))
    resume_here_and_finish(run)


def test_unwritable_checkpoints_folder(home, tiny_model_dir, tmp_path, monkeypatch):
    """chmod where it binds; as root, where it does not, the EACCES it would raise."""
    import palaestra.train.loop as loop

    real_write = loop.write_checkpoint

    def lock(folder: Path) -> None:
        if os.geteuid() == 0:
            real_mkdtemp = tempfile.mkdtemp
            monkeypatch.setattr(
                tempfile,
                "mkdtemp",
                lambda *a, dir=None, **k: (
                    no_permission(dir) if Path(dir) == folder else real_mkdtemp(*a, dir=dir, **k)
                ),
            )
        else:
            folder.chmod(stat.S_IRUSR | stat.S_IXUSR)

    lock_before = failing_on(FAILING_SAVE, lock)

    def write_checkpoint(checkpoints_dir, *args, **kwargs):
        lock_before(checkpoints_dir)
        return real_write(checkpoints_dir, *args, **kwargs)

    monkeypatch.setattr(loop, "write_checkpoint", write_checkpoint)
    run = train_until_the_save_fails(tiny_model_dir, tmp_path, "Permission denied")
    (run.path / "checkpoints").chmod(0o755)
    assert_earlier_checkpoints_intact(run)
    monkeypatch.undo()  # undoes the home fixture's PALAESTRA_HOME too: the run resumes in its home
    monkeypatch.setenv("PALAESTRA_HOME", str(home))
    resume_here_and_finish(run)
