"""Training runs as processes: create a run directory, start its worker (or train in this
process), and TrainingRun, the handle that waits on a run, stops and resumes it.

The run's files belong to the store (``palaestra.runs``); this module adds the control, and
starts and stops the worker with the process helper endpoints use too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from palaestra.atomic import write_json_atomic
from palaestra.launch.process import process_record, spawn_module, stop_process
from palaestra.launch.worker import ENTER_OVERLAY, overlay_entry
from palaestra.runs.directory import FINAL_STATES, RunDirectory
from palaestra.runs.handles import RunView, TrainResult, result_of
from palaestra.runs.logs import new_lines
from palaestra.runs.registry import list_run_ids, new_run_id, runs_root
from palaestra.runs.trust import verify, write_signed

if TYPE_CHECKING:
    from palaestra.config import TrainConfig
    from palaestra.overlay.environment import Overlay

WORKER = "palaestra.launch.worker"


class TrainingRun(RunView):
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

    def result(self, timeout: float | None = None) -> TrainResult:
        """Wait for the run to end. Raises RunFailedError with the run's error if it failed,
        RunStoppedError if it was stopped, TimeoutError if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.status_info()
            self._print_new_output()
            if info["state"] in FINAL_STATES:
                return result_of(self._run, info)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {self.training_run_id} still {info['state']} after {timeout} s"
                )
            time.sleep(0.5)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the training process to stop (SIGTERM), wait for it, then force it (SIGKILL),
        after asking it for its threads' stacks (SIGUSR1), which train.log keeps. Completed
        checkpoints stay; the run's status becomes ``stopped``."""
        info = self.status_info()
        if info["state"] in FINAL_STATES:
            return
        stop_process(
            info.get("pid"),
            info.get("pid_start"),
            timeout=timeout,
            ended=lambda: self.status_info()["state"] in FINAL_STATES,
            process=self._process,
            poll_s=0.2,
            dump=signal.SIGUSR1,
        )
        # Killed, or gone before it could install its handler: record what the user asked for.
        if self._run.file_state() not in FINAL_STATES:
            self._run.update_status(state="stopped", finished_at=time.time())

    def resume(self, show_output: bool = False) -> TrainingRun:
        """Continue a failed or stopped run in place from its latest checkpoint, to the step
        it was launched to reach. Any other state is a ValueError."""
        return spawn_worker(self._run, resume=True, show_output=show_output)

    def _print_new_output(self) -> None:
        if self._show_output:
            lines, self._log_offset = new_lines(self._run.log_path, self._log_offset)
            if lines:
                sys.stdout.write("".join(line + "\n" for line in lines))
                sys.stdout.flush()


def create_run(config: TrainConfig) -> RunDirectory:
    """Validate ``config`` here, where errors are easy to read, then write its run directory."""
    config.validate_here()
    # cloudpickle ships functions defined in a script's __main__ or a notebook cell by value;
    # functions of importable modules go by name, found through the caller's sys.path, which
    # the worker gets as its PYTHONPATH.
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
    write_signed(run.path / "config.pkl", pickled)  # the worker loads only what this home signed
    write_json_atomic(
        run.path / "config.json",
        {"run_id": run.run_id, "created_at": time.time(), **config.to_json_dict()},
    )
    run.update_status(state="pending", step=0, created_at=time.time())
    return run


def spawn_worker(
    run: RunDirectory,
    resume: bool = False,
    show_output: bool = False,
    env: dict[str, str] | None = None,
) -> TrainingRun:
    """Start the training process for ``run`` (``env`` adds to its environment). Claims the run
    first (pending, old error cleared), so a second resume of the same run fails instead of
    starting a second process."""
    allowed = ("failed", "stopped") if resume else ("pending",)
    verify(run.path / "config.pkl")  # a run folder copied from elsewhere fails here, not later
    run.update_status(
        expect=allowed, state="pending", pid=None, pid_start=None, error=None, traceback=None
    )
    log_offset = run.log_path.stat().st_size if run.log_path.is_file() else 0
    overlay = prepare_overlay(run)
    args = [str(run.path), *(["--resume"] if resume else [])]
    process = None
    if overlay is not None and enters_forked(run, overlay):
        # Forked from this environment's warm launcher, the worker moves into the overlay
        # itself (launch.worker.enter_overlay): no cold start in the overlay's Python.
        fork_env = {**(env or {}), ENTER_OVERLAY: overlay_entry(overlay)}
        process = spawn_module(WORKER, args, run.log_path, env=fork_env, warm_only=True)
    if process is None:
        python = None
        if overlay is not None:
            env, python = {**overlay.environment(), **(env or {})}, overlay.python
        process = spawn_module(WORKER, args, run.log_path, env=env, python=python)
    run.update_status(**process_record(process))
    return TrainingRun(run, process, show_output=show_output, log_offset=log_offset)


def enters_forked(run: RunDirectory, overlay: Overlay) -> bool:
    """Whether ``run``'s worker may start forked from this environment's warm launcher and
    move into ``overlay`` itself: a run of one process on the local backend (Ray's actors and
    a sharded learner's ranks start the overlay's Python themselves), whose overlay sets no
    variables (one that torch or transformers reads at import would come too late)."""
    recipe = json.loads((run.path / "config.json").read_text())["recipe"]
    one_process = (
        recipe.get("backend", "local") == "local"
        and recipe.get("rollout_num_gpus", 0) <= 1
        and recipe.get("actor_num_gpus_per_node", 1) == 1
        and recipe.get("actor_num_nodes", 1) == 1
    )
    return one_process and not overlay.env_vars


def prepare_overlay(run: RunDirectory) -> Overlay | None:
    """The overlay environment of ``run``'s ``image_overlay`` (recorded in its config.json),
    built or reused, noted in train.log; None without one. A command that fails fails the run
    and raises here, before training."""
    steps = json.loads((run.path / "config.json").read_text())["recipe"].get("image_overlay")
    if steps is None:
        return None
    from palaestra.overlay.environment import OverlayBuildError, ensure_overlay

    try:
        overlay = ensure_overlay(steps)
    except OverlayBuildError as error:
        with open(run.log_path, "a") as log:
            log.write(f"palaestra: {error}\n")
        error_text = f"{type(error).__name__}: {error}"
        run.update_status(state="failed", error=error_text, finished_at=time.time())
        raise
    with open(run.log_path, "a") as log:
        log.write(f"palaestra: {overlay.describe()}\n")
    return overlay


def launch(config: TrainConfig, show_output: bool = False) -> TrainingRun:
    return spawn_worker(create_run(config), show_output=show_output)


def train_here(config: TrainConfig) -> TrainResult:
    """Train in this process; with an ``image_overlay``, the rest of this process runs in its
    environment (its packages first on ``sys.path``, its variables set)."""
    from palaestra.launch.worker import execute

    run = create_run(config)
    overlay = prepare_overlay(run)
    if overlay is not None:
        from palaestra.overlay.environment import activate_here

        activate_here(overlay)
    execute(run, config)
    return TrainingRun(run).result()
