"""Checkpoint retention in real runs of the tiny model: keep the last N (and what an eval
uses), optimiser state in the newest checkpoint only, and a save that cannot fit refused
before it writes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from palaestra.runs.handles import RunFailedError
from tests.support.tiny_runs import count_lowercase, tiny_config


def scored_first_checkpoint(args, sample, **kwargs) -> float:
    """``count_lowercase``; at step 3 it also saves an eval record of the run's checkpoint of
    step 1, as a user scoring it while the run goes on would."""
    if sample.step == 3:
        from palaestra.runs.evals import list_evals, save_eval

        if not list_evals():
            (run,) = (Path(os.environ["PALAESTRA_HOME"]) / "runs").iterdir()
            save_eval({"checkpoint": str(run / "checkpoints" / "step_000001"), "mean": 0.0})
    return count_lowercase(args, sample)


def test_five_saves_keeping_two_leave_two_and_the_one_an_eval_scored(
    home, tiny_model_dir, prompts_file
):
    config = tiny_config(
        tiny_model_dir,
        prompts_file,
        reward=scored_first_checkpoint,
        num_rollout=5,
        save_interval=1,
        save_total_limit=2,
    )
    result = config.train()
    kept = result.checkpoints()
    # Steps 2 and 3 went when 4 and 5 came; step 1 stays, an eval names it.
    assert [c.step for c in kept] == [1, 4, 5]
    folders = sorted(p.name for p in (result.path / "checkpoints").iterdir())
    assert folders == ["step_000001", "step_000004", "step_000005"]  # nothing half deleted
    with_optimizer = [c.step for c in kept if (c.path / "optimizer.pt").is_file()]
    assert with_optimizer == [5]  # only the newest: what a resume reads
    assert all((c.path / "model.safetensors").is_file() for c in kept)


def test_no_save_optim_writes_no_optimiser_state(home, tiny_model_dir, prompts_file):
    result = tiny_config(tiny_model_dir, prompts_file, num_rollout=2, no_save_optim=True).train()
    (checkpoint,) = result.checkpoints()
    assert not (checkpoint.path / "optimizer.pt").exists()
    assert (checkpoint.path / "model.safetensors").is_file()


def test_a_save_that_cannot_fit_fails_before_writing_naming_the_bytes(
    home, tiny_model_dir, prompts_file, monkeypatch
):
    import palaestra.checkpoints

    real = shutil.disk_usage

    def nearly_full(path):
        total, used, _ = real(path)
        return type(real(path))(total, used, 1000)  # 1000 bytes free

    monkeypatch.setattr(palaestra.checkpoints.shutil, "disk_usage", nearly_full)
    config = tiny_config(tiny_model_dir, prompts_file, num_rollout=1)
    with pytest.raises(RunFailedError) as failed:
        config.train()
    message = str(failed.value)
    # The tiny model: 2 layers of 32 wide, a 2-head attention and a 64-wide MLP over its
    # character vocabulary; its float32 weights and two Adam moments (12 bytes a parameter)
    # plus 32 MiB for the tokenizer's files are far more than 1000 bytes.
    assert "cannot save checkpoint step_000001" in message
    assert "the disk has 1000 bytes" in message and "needs about" in message
    needed = int(message.split("needs about ")[1].split(" bytes")[0])
    assert needed > 32 * 1024**2
    (run,) = (home / "runs").iterdir()
    assert list((run / "checkpoints").iterdir()) == []  # no folder, hidden or not
