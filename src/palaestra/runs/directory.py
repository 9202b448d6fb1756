"""The run directory: the files a run writes and every other tool reads.

    <home>/runs/<run_id>/
      config.json      the resolved TrainConfig
      config.pkl       the TrainConfig by value (cloudpickle), for the training process,
                       signed by the home's key (palaestra.runs.trust)
      status.json      state, step, pid, error (replaced atomically)
      metrics.jsonl    one object per step
      samples.jsonl    every sample of every step
      train.log        the training process's stdout and stderr
      checkpoints/step_000010/   a checkpoint folder (its format: palaestra.checkpoints)

The training process writes these files, the store reads them; every reader tolerates a file
being replaced or appended to while it reads.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.atomic import write_bytes_atomic, write_json_atomic
from palaestra.checkpoints import list_checkpoints
from palaestra.runs.liveness import pid_alive

STATES = ("pending", "running", "completed", "failed", "stopped")
FINAL_STATES = ("completed", "failed", "stopped")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file another process may be replacing: None when it is missing, not yet
    complete, or not an object (removed or being replaced between listing and reading)."""
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON Lines file; a last line cut short by a crash is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def last_jsonl_row(path: Path, chunk: int = 65536) -> dict[str, Any] | None:
    """The last complete JSON line of ``path``, reading only the file's tail."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - chunk))
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written, or the cut-off start of the chunk
        if isinstance(row, dict):
            return row
    return None


@dataclass(frozen=True)
class RunDirectory:
    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.path / "train.log"

    # status.json -------------------------------------------------------------------------

    def read_status(self) -> dict[str, Any]:
        """The run's status. A run whose process died without saying so reads as failed."""
        try:
            status = json.loads((self.path / "status.json").read_text())
        except FileNotFoundError:
            status = {"state": "pending", "step": 0}
        if status.get("state") in ("pending", "running") and status.get("pid"):
            if not pid_alive(status["pid"], status.get("pid_start")):
                status = {
                    **status,
                    "state": "failed",
                    "error": status.get("error") or self._died(status["pid"]),
                }
        return status

    def _died(self, pid: int) -> str:
        """Why a run whose process is gone without a word failed, and what continues it."""
        checkpoints = self.checkpoint_paths()
        where = (
            f"its last checkpoint (step {checkpoints[-1][0]})"
            if checkpoints
            else "where it started (no checkpoint of its own yet)"
        )
        return (
            f"the training process (pid {pid}) was killed or interrupted: it "
            f"exited without reporting; resume() continues the run from {where}; "
            f"see {self.log_path}"
        )

    def update_status(self, expect: tuple[str, ...] | None = None, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into status.json. The launcher and the training process both write
        it, so the read-merge-replace happens under a lock; readers need none (os.replace).

        With ``expect``, the update happens only if the run's state (as ``read_status`` sees it)
        is one of those, else ValueError: a compare-and-set for claiming a run.
        """
        with open(self.path / ".status.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                status = json.loads((self.path / "status.json").read_text())
            except FileNotFoundError:
                status = {}
            if expect is not None and self.read_status()["state"] not in expect:
                raise ValueError(
                    f"run {self.run_id} is {self.read_status()['state']}, not {' or '.join(expect)}"
                )
            status.update(fields, updated_at=time.time())
            write_json_atomic(self.path / "status.json", status)
        return status

    # metrics.jsonl and samples.jsonl ---------------------------------------------------------

    def append_jsonl(self, name: str, rows: list[dict]) -> None:
        with open(self.path / name, "a") as handle:
            handle.write("".join(json.dumps(row, default=str) + "\n" for row in rows))
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_after_step(self, name: str, step: int) -> None:
        """Drop rows past ``step`` (written after the checkpoint a resumed run restarts from)."""
        path = self.path / name
        if path.is_file():
            kept = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
            text = "".join(json.dumps(row) + "\n" for row in kept)
            write_bytes_atomic(path, text.encode())

    def metrics(self) -> list[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def samples(self, step: int | None = None) -> list[dict]:
        rows = read_jsonl(self.path / "samples.jsonl")
        return rows if step is None else [row for row in rows if row.get("step") == step]

    # checkpoints ------------------------------------------------------------------------------

    def checkpoint_paths(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, sorted by step (checkpoints.py decides
        what counts as complete)."""
        return list_checkpoints(self.checkpoints_dir)

    def config(self) -> dict[str, Any]:
        """The resolved TrainConfig as written at launch; empty before it exists."""
        return read_json(self.path / "config.json") or {}

    def file_state(self) -> str | None:
        """The state the run wrote itself, without ``read_status``'s dead-process inference."""
        return (read_json(self.path / "status.json") or {}).get("state")
