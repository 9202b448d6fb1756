"""Read-only handles on runs: a run's checkpoints, metrics, samples and status, and
TrainResult (a run that completed).

They only read the run directory, so any process can hold one. Controlling a run (waiting on
its process, stopping, resuming) is ``palaestra.launch.training.TrainingRun``, which builds on
``RunView``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from palaestra.checkpoints import Checkpoint
from palaestra.runs.directory import FINAL_STATES, RunDirectory
from palaestra.runs.registry import run_directory


class RunFailedError(RuntimeError):
    """The run ended in failure; the message is the run's own error."""


class RunStoppedError(RuntimeError):
    """The run was stopped before it finished."""


class RunView:
    """What any process can read of a run, live or finished."""

    def __init__(self, run: RunDirectory) -> None:
        self._run = run

    @classmethod
    def from_id(cls, run_id: str, home: Path | None = None):
        return cls(RunDirectory(run_directory(run_id, home)))

    @property
    def training_run_id(self) -> str:
        return self._run.run_id

    @property
    def path(self) -> Path:
        return self._run.path

    def checkpoints(self) -> list[Checkpoint]:
        """Complete checkpoints, sorted by step; a half-written one is never listed."""
        return [Checkpoint(p, s, self._run.run_id) for s, p in self._run.checkpoint_paths()]

    def latest_checkpoint(self) -> Checkpoint | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def metrics(self) -> list[dict[str, Any]]:
        """One dict per step (reward mean/std, loss, timings, ...), from ``metrics.jsonl``."""
        return self._run.metrics()

    def samples(self, step: int | None = None) -> list[dict[str, Any]]:
        return self._run.samples(step)

    def config(self) -> dict[str, Any]:
        return self._run.config()

    def status_info(self) -> dict[str, Any]:
        return self._run.read_status()

    @property
    def status(self) -> str:
        """pending, running, completed, failed or stopped."""
        return self.status_info()["state"]

    def done(self) -> bool:
        return self.status in FINAL_STATES


class TrainResult(RunView):
    """A run that completed."""

    def __repr__(self) -> str:
        return f"TrainResult({self.training_run_id!r}, checkpoints={len(self.checkpoints())})"


def result_of(run: RunDirectory, info: dict[str, Any]) -> TrainResult:
    """The result of a run that ended as ``info`` (its status) says: RunFailedError with the
    run's error if it failed, RunStoppedError if it was stopped."""
    if info["state"] == "failed":
        raise RunFailedError(f"run {run.run_id} failed: {info.get('error')}")
    if info["state"] == "stopped":
        raise RunStoppedError(f"run {run.run_id} was stopped at step {info.get('step')}")
    return TrainResult(run)
