"""Starting runs: a new run directory, then training in a child process or in this one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import cloudpickle

from palaestra.atomic import write_json_atomic
from palaestra.runs.directory import RunDirectory, process_start_time
from palaestra.runs.handles import TrainingRun, TrainResult
from palaestra.runs.registry import new_run_id, runs_root

if TYPE_CHECKING:
    from palaestra.train.config import TrainConfig


def create_run(config: TrainConfig) -> RunDirectory:
    """Validate ``config`` here, where errors are easy to read, then write its run directory."""
    config.validate_here()
    # cloudpickle ships functions defined in a script's __main__ or a notebook cell by value;
    # functions of importable modules go by name, found through the sys.path passed on below.
    try:
        pickled = cloudpickle.dumps(config)
    except Exception as error:
        raise TypeError(
            f"cannot send this TrainConfig to the training process ({error}); a reward "
            "(recipe.custom_rm_function) or dataset that holds a lock, an open file or a live "
            "client must create it inside the function instead"
        ) from error
    run = RunDirectory(runs_root() / new_run_id(config.name or config.model.name))
    run.path.mkdir(parents=True)
    (run.path / "config.pkl").write_bytes(pickled)
    write_json_atomic(
        run.path / "config.json",
        {"run_id": run.run_id, "created_at": time.time(), **config.to_json_dict()},
    )
    run.update_status(state="pending", step=0, created_at=time.time())
    return run


def spawn_worker(run: RunDirectory, resume: bool = False, show_output: bool = False) -> TrainingRun:
    """Start the training process for ``run``. Claims the run first (pending, old error cleared),
    so a second resume of the same run fails instead of starting a second process."""
    allowed = ("failed", "stopped") if resume else ("pending",)
    run.update_status(
        expect=allowed, state="pending", pid=None, pid_start=None, error=None, traceback=None
    )
    log_offset = run.log_path.stat().st_size if run.log_path.is_file() else 0
    command = [sys.executable, "-m", "palaestra.runs.worker", str(run.path)]
    if resume:
        command.append("--resume")
    # The caller's import path, so the child imports the same modules (a script's siblings).
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with open(run.log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a Ctrl-C in the notebook does not kill training
        )
    run.update_status(pid=process.pid, pid_start=process_start_time(process.pid))
    return TrainingRun(run, process, show_output=show_output, log_offset=log_offset)


def launch(config: TrainConfig, show_output: bool = False) -> TrainingRun:
    return spawn_worker(create_run(config), show_output=show_output)


def train_here(config: TrainConfig) -> TrainResult:
    from palaestra.runs.worker import execute

    run = create_run(config)
    execute(run, config)
    return TrainingRun(run).result()
