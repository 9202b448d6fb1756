"""Handles on runs: TrainingRun (live), TrainResult (finished), Checkpoint (a saved step).

Handles only read the run directory (and signal the training process), so any process can
hold one: ``TrainingRun.from_id(run_id)`` reattaches from a notebook, the CLI or the dashboard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.runs.directory import FINAL_STATES, RunDirectory, pid_alive
from palaestra.runs.registry import list_run_ids, run_directory


class RunFailedError(RuntimeError):
    """The run ended in failure; the message is the run's own error."""


class RunStoppedError(RuntimeError):
    """The run was stopped before it finished."""


@dataclass(frozen=True)
class Checkpoint:
    """A saved step: ``path`` is an HF-format directory transformers loads as it is."""

    path: Path
    step: int
    run_id: str | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> Checkpoint:
        path = Path(path).expanduser()
        info_file = path / "palaestra.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        return cls(path=path, step=int(info.get("step", 0)), run_id=info.get("run_id"))


class _RunView:
    def __init__(self, run: RunDirectory) -> None:
        self._run = run

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
        return json.loads((self._run.path / "config.json").read_text())


class TrainResult(_RunView):
    """A run that completed."""

    def __repr__(self) -> str:
        return f"TrainResult({self.training_run_id!r}, checkpoints={len(self.checkpoints())})"


class TrainingRun(_RunView):
    """A launched run, running or finished."""

    def __init__(
        self,
        run: RunDirectory,
        process: subprocess.Popen | None = None,
        show_output: bool = False,
        log_offset: int = 0,
    ) -> None:
        super().__init__(run)
        self._process = process
        self._show_output = show_output
        self._log_offset = log_offset

    @classmethod
    def from_id(cls, run_id: str, home: Path | None = None) -> TrainingRun:
        return cls(RunDirectory(run_directory(run_id, home)))

    @classmethod
    def list(cls, status: str | None = None, home: Path | None = None) -> list[TrainingRun]:
        """Every run in the registry, newest first; ``status`` keeps only runs in that state."""
        runs = [cls.from_id(run_id, home) for run_id in list_run_ids(home)]
        return [run for run in runs if status is None or run.status == status]

    def __repr__(self) -> str:
        return f"TrainingRun({self.training_run_id!r}, status={self.status!r})"

    def status_info(self) -> dict[str, Any]:
        if self._process is not None:
            self._process.poll()  # reap our own child so it reads as exited, not a zombie
        return self._run.read_status()

    @property
    def status(self) -> str:
        """pending, running, completed, failed or stopped."""
        return self.status_info()["state"]

    def done(self) -> bool:
        return self.status in FINAL_STATES

    def result(self, timeout: float | None = None) -> TrainResult:
        """Wait for the run to end. Raises RunFailedError with the run's error if it failed,
        RunStoppedError if it was stopped, TimeoutError if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.status_info()
            self._print_new_output()
            if info["state"] in FINAL_STATES:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {self.training_run_id} still {info['state']} after {timeout} s"
                )
            time.sleep(0.5)
        if info["state"] == "failed":
            raise RunFailedError(f"run {self.training_run_id} failed: {info.get('error')}")
        if info["state"] == "stopped":
            raise RunStoppedError(
                f"run {self.training_run_id} was stopped at step {info.get('step')}"
            )
        return TrainResult(self._run)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the training process to stop (SIGTERM), wait for it, then force it (SIGKILL).
        Completed checkpoints stay; the run's status becomes ``stopped``."""
        info = self.status_info()
        pid, start = info.get("pid"), info.get("pid_start")
        if info["state"] in FINAL_STATES or not pid_alive(pid, start):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.status_info()["state"] not in FINAL_STATES:
            time.sleep(0.2)
        if self.status_info()["state"] in FINAL_STATES and self._run_file_state() in FINAL_STATES:
            return  # it ended by itself (stopped, or completed just before the signal landed)
        if pid_alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._process is not None:
                self._process.wait()
        # Killed, or gone before it could install its handler: record what the user asked for.
        if self._run_file_state() not in FINAL_STATES:
            self._run.update_status(state="stopped", finished_at=time.time())

    def _run_file_state(self) -> str | None:
        """The state the run wrote itself, without the dead-process inference."""
        try:
            return json.loads((self.path / "status.json").read_text()).get("state")
        except FileNotFoundError:
            return None

    def resume(self, show_output: bool = False) -> TrainingRun:
        """Continue a failed or stopped run in place from its latest checkpoint, to the step
        it was launched to reach. Any other state is a ValueError."""
        from palaestra.runs.launch import spawn_worker

        return spawn_worker(self._run, resume=True, show_output=show_output)

    def _print_new_output(self) -> None:
        if not self._show_output or not self._run.log_path.is_file():
            return
        with open(self._run.log_path, "rb") as handle:
            handle.seek(self._log_offset)
            chunk = handle.read()
        # Print whole lines only; a partial last line waits for the next poll.
        end = chunk.rfind(b"\n") + 1
        if end:
            sys.stdout.write(chunk[:end].decode(errors="replace"))
            sys.stdout.flush()
            self._log_offset += end
