"""Sweeps: ``TrainingGroup(base, grid={"recipe.lr": [...]})`` trains every combination of the
grid's values as ordinary runs tagged with their group, at most ``max_parallel`` at a time.

Every variant is built and validated before anything starts, so a bad combination is refused
(naming the variant and the field) or, with ``skip_invalid``, recorded as skipped. All the
variants' run directories are written at once (pending), then a driver starts them as slots
free up: in this process for ``train()``, in a detached process for ``launch()``
(``python -m palaestra.launch.sweeps GROUP_DIR``), which returns at once.

Why ``max_parallel`` is 1 by default: one run already keeps every core busy (torch's matmuls
use all of them), so a second run beside it slows both. Measured on a 2-core AMD EPYC with
``bench/sweep_parallel.py`` (two haiku variants, 4 steps each): one at a time, 13.1-13.4 s a
step and 125-129 s for the group; two at once, 19.8 s a step and 93 s for the group. So 1 gives
each run its full speed (the first results come soonest); 2 finishes the whole group in about
three quarters of the time. Each of ``max_parallel`` runs gets an equal share of the cores
(``OMP_NUM_THREADS``), so runs side by side do not fight over the same threads.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from palaestra.launch.process import process_record, spawn_module, stop_process
from palaestra.launch.training import TrainingRun, create_run, spawn_worker
from palaestra.runs import groups
from palaestra.runs.directory import FINAL_STATES, RunDirectory
from palaestra.runs.liveness import process_start_time
from palaestra.runs.registry import new_run_id, runs_root

if TYPE_CHECKING:
    from palaestra.config import TrainConfig

DRIVER = "palaestra.launch.sweeps"


class InvalidVariantError(ValueError):
    """A grid combination that does not make a valid TrainConfig; names the variant and field."""


class TrainingGroup:
    """A sweep over ``grid``: dotted TrainConfig fields (``"recipe.lr"``, ``"recipe.
    n_samples_per_prompt"``, ``"name"``) to the values each takes. Variants are every
    combination, the first field varying slowest."""

    def __init__(
        self,
        base: TrainConfig,
        grid: dict[str, list[Any]],
        *,
        name: str | None = None,
        skip_invalid: bool = False,
    ) -> None:
        if not grid:
            raise ValueError("TrainingGroup: grid is empty; give at least one field and values")
        for field, values in grid.items():
            if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
                raise ValueError(f"TrainingGroup: grid[{field!r}] must be a list of values")
            if not list(values):
                raise ValueError(f"TrainingGroup: grid[{field!r}] has no values")
        self.base = base
        self.grid = {field: list(values) for field, values in grid.items()}
        self.name = name or f"{base.name or base.model.name}-sweep"
        self.group_id = new_run_id(self.name)
        self.skip_invalid = skip_invalid
        self.skipped: list[dict[str, Any]] = []
        self._variants = self._build()

    def __repr__(self) -> str:
        return f"TrainingGroup({self.group_id!r}, variants={len(self._variants)})"

    def iter_variants(self) -> Iterator[TrainConfig]:
        """The valid variants, in grid order, each tagged with the group and its overrides."""
        yield from self._variants

    def _build(self) -> list[TrainConfig]:
        axes = list(self.grid)
        combos = list(itertools.product(*self.grid.values()))
        variants = []
        for number, values in enumerate(combos, start=1):
            overrides = dict(zip(axes, values, strict=True))
            where = f"variant {number} of {len(combos)} ({describe_overrides(overrides)})"
            try:
                config = apply_overrides(self.base, overrides, where)
                config.validate_here()  # the recipe against this machine, the dataset's columns
            except Exception as error:
                named = isinstance(error, InvalidVariantError)
                message = str(error) if named else f"{where}: {error}"
                if not self.skip_invalid and named:
                    raise
                if not self.skip_invalid:
                    raise InvalidVariantError(message) from error
                self.skipped.append({"overrides": overrides, "error": message})
                continue
            base_name = self.base.name or self.base.model.name
            variants.append(
                config.model_copy(
                    update={
                        "name": config.name if "name" in overrides else f"{base_name}-v{number}",
                        "group_id": self.group_id,
                        "group_overrides": overrides,
                        "group_axes": axes,
                    }
                )
            )
        if not variants:
            raise InvalidVariantError(
                f"TrainingGroup {self.name!r}: no valid variant; "
                + "; ".join(item["error"] for item in self.skipped)
            )
        return variants

    def _create(self, max_parallel: int, continue_on_error: bool) -> Path:
        """Write every variant's run directory (pending) and the group record."""
        runs = [create_run(config) for config in self._variants]
        record = {
            "group_id": self.group_id,
            "name": self.name,
            "grid": self.grid,
            "axes": list(self.grid),
            "variants": [
                {"index": i, "run_id": run.run_id, "overrides": config.group_overrides}
                for i, (run, config) in enumerate(zip(runs, self._variants, strict=True))
            ],
            "skipped": self.skipped,
            "created_at": time.time(),
            "max_parallel": max_parallel,
            "continue_on_error": continue_on_error,
            "driver": None,
        }
        return groups.write_group(record)

    def train(self, max_parallel: int | None = None, continue_on_error: bool = True) -> GroupResult:
        """Train every variant, at most ``max_parallel`` at a time (default: see the module
        docstring), and return when all have ended. Without ``continue_on_error`` the first
        failure leaves the variants not yet started unstarted (stopped) and is raised."""
        max_parallel = check_max_parallel(max_parallel)
        self._create(max_parallel, continue_on_error)
        groups.update_group(self.group_id, driver=process_record_of_self())
        drive(self.group_id, max_parallel, continue_on_error, verbose=True)
        result = GroupRun(self.group_id).result()
        if not continue_on_error and result.failed:
            raise result.failed[0][1]
        return result

    def launch(self, max_parallel: int | None = None, continue_on_error: bool = True) -> GroupRun:
        """Start the group in a detached process and return its handle at once."""
        max_parallel = check_max_parallel(max_parallel)
        path = self._create(max_parallel, continue_on_error)
        process = spawn_module(DRIVER, [str(path)], path / "driver.log")
        groups.update_group(self.group_id, driver=process_record(process))
        return GroupRun(self.group_id, process)


class GroupResult:
    """How a group ended: each variant's run handle, and the failures among them."""

    def __init__(self, group_id: str, runs: list[TrainingRun]) -> None:
        self.group_id = group_id
        self.runs = runs
        self.failed: list[tuple[TrainingRun, Exception]] = []
        self.results = []
        for run in runs:
            try:
                self.results.append(run.result())
            except Exception as error:  # RunFailedError, RunStoppedError: kept, not raised
                self.failed.append((run, error))

    def __repr__(self) -> str:
        return (
            f"GroupResult({self.group_id!r}, completed={len(self.results)}, "
            f"failed={len(self.failed)})"
        )


class GroupRun:
    """A launched group: its runs, its state, waiting on it and stopping it."""

    def __init__(self, group_id: str, process=None) -> None:
        self.group_id = group_id
        self._process = process

    def __repr__(self) -> str:
        return f"GroupRun({self.group_id!r}, status={self.status!r})"

    def detail(self) -> dict[str, Any]:
        if self._process is not None:
            self._process.poll()  # reap our own driver so it reads as exited
        return groups.group_detail(self.group_id)

    @property
    def status(self) -> str:
        return self.detail()["state"]

    def runs(self) -> list[TrainingRun]:
        return [TrainingRun.from_id(v["run_id"]) for v in self.detail()["variants"]]

    def result(self, timeout: float | None = None) -> GroupResult:
        """Wait until every variant has ended (and the driver with them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status in ("pending", "running"):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"group {self.group_id} still running after {timeout} s")
            time.sleep(0.5)
        return GroupResult(self.group_id, self.runs())

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the driver (no further variant starts), then every variant still running."""
        driver = groups.read_group(self.group_id).get("driver") or {}
        stop_process(
            driver.get("pid"), driver.get("pid_start"), timeout=timeout, process=self._process
        )
        for run in self.runs():
            run.stop(timeout=timeout)
            _cancel(run._run, "the group was stopped before this variant started")


def drive(group_id: str, max_parallel: int, continue_on_error: bool, verbose: bool = False):
    """Start the group's pending variants, at most ``max_parallel`` at a time, until all end.
    Interrupted (SIGTERM, Ctrl-C), it stops the variants it started and cancels the rest."""
    record = groups.read_group(group_id)
    pending = [RunDirectory(runs_root() / v["run_id"]) for v in record["variants"]]
    pending = [run for run in pending if run.read_status()["state"] == "pending"]
    threads = max(1, (os.cpu_count() or 1) // max_parallel)
    env = {"OMP_NUM_THREADS": str(threads)} if max_parallel > 1 else None
    active: list[TrainingRun] = []
    started, failed = 0, False
    try:
        while pending or active:
            while pending and len(active) < max_parallel and not failed:
                active.append(spawn_worker(pending.pop(0), env=env))
                started += 1
                _say(
                    verbose,
                    f"started {active[-1].training_run_id} ({started}/{len(record['variants'])})",
                )
            for handle in list(active):
                info = handle.status_info()
                if info["state"] in FINAL_STATES:
                    active.remove(handle)
                    error = f": {info['error']}" if info.get("error") else ""
                    _say(verbose, f"{handle.training_run_id} {info['state']}{error}")
                    failed = failed or (info["state"] == "failed" and not continue_on_error)
            if failed and pending:
                for run in pending:
                    _cancel(run, "not started: an earlier variant failed (continue_on_error=False)")
                pending = []
            time.sleep(0.3)
    except BaseException:
        for handle in active:
            handle.stop()
        for run in pending:
            _cancel(run, "the group was stopped before this variant started")
        raise
    finally:
        groups.update_group(group_id, driver=None, ended_at=time.time())


def _say(verbose: bool, line: str) -> None:
    if verbose:
        print(f"sweep: {line}", flush=True)


def _cancel(run: RunDirectory, why: str) -> None:
    """Mark a variant that never started as stopped, saying why."""
    try:
        run.update_status(expect=("pending",), state="stopped", error=why, finished_at=time.time())
    except ValueError:
        pass  # it started (or ended) meanwhile: its own status says how


def check_max_parallel(max_parallel: int | None) -> int:
    if max_parallel is None:
        return 1
    if not isinstance(max_parallel, int) or max_parallel < 1:
        raise ValueError(f"max_parallel must be a whole number >= 1, got {max_parallel!r}")
    return max_parallel


def process_record_of_self() -> dict[str, int | None]:
    return {"pid": os.getpid(), "pid_start": process_start_time(os.getpid())}


# overrides ----------------------------------------------------------------------------------


def describe_overrides(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{field}={value!r}" for field, value in overrides.items())


def apply_overrides(base: TrainConfig, overrides: dict[str, Any], where: str) -> TrainConfig:
    """``base`` with each dotted field set, every object on the way rebuilt and validated."""
    config = base
    for field, value in overrides.items():
        config = _set(config, field.split("."), value, where, field)
    return config


def _set(obj: Any, path: list[str], value: Any, where: str, field: str) -> Any:
    name = path[0]
    if not isinstance(obj, BaseModel) or name not in type(obj).model_fields:
        owner = type(obj).__name__
        raise InvalidVariantError(f"{where}: {field}: {owner} has no field {name!r}")
    if len(path) > 1:
        value = _set(getattr(obj, name), path[1:], value, where, field)
    values = {key: getattr(obj, key) for key in type(obj).model_fields} | {name: value}
    try:
        return type(obj)(**values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or field}: {e['msg']}" for e in error.errors()
        )
        raise InvalidVariantError(f"{where}: {problems}") from None
    except (TypeError, ValueError) as error:
        raise InvalidVariantError(f"{where}: {field}: {error}") from None


def main(argv: list[str]) -> None:
    """The detached driver of a launched group."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    path = Path(argv[0])
    record = groups.read_group(path.name, path.parent.parent)
    drive(record["group_id"], record["max_parallel"], record["continue_on_error"], verbose=True)


if __name__ == "__main__":
    main(sys.argv[1:])
