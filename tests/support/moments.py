"""Killing a run's training process at a known moment, and checking what the kill left.

The worker writes its Python stack to train.log on SIGUSR1 (``launch/worker.py``); the line its
``train_one_step`` frame is on names the moment: sampling, the update, evaluating, saving, or
recording the step's logs. Outside a step the process is starting (imports, loading the model,
restoring logs) or finishing. ``kill_at`` asks for the stack until the moment is the one wanted
and sends SIGKILL at once; ``kill_now`` kills wherever the process is and says where that was.

Shared by ``tests/integration/faults/test_kills.py`` (one kill per moment) and ``bench/faults.py``
(a hundred at random moments).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from pathlib import Path

from palaestra.launch.training import TrainingRun
from palaestra.runs.directory import RunDirectory
from palaestra.runs.liveness import pid_alive

MOMENTS = ("starting", "sampling", "update", "evaluating", "saving", "recording", "finishing")
"""Where a kill can land; "unknown" besides, for a stack too deep to show the loop."""

FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>\S+)')

# What ``train_one_step`` does on a line, by the calls the line makes; the first match wins.
STEP_LINES = (
    ("sampling", ("sampler.sample(", "sampled =")),
    ("update", ("step_advantages(", "train_step(", "update_weights(", "trained =")),
    ("evaluating", ("evaluate(",)),
    ("saving", ("write_checkpoint(", "save_started")),
)


def dumped_moment(log: Path, offset: int, finished: bool, timeout: float = 3.0) -> str | None:
    """The moment the stack dump written to ``log`` after ``offset`` shows, as soon as it shows
    it (a kill follows within a millisecond or two); None if no dump comes by ``timeout``.
    ``finished``: the run's last step is logged (outside a step, the process is finishing)."""
    deadline = time.monotonic() + timeout
    size, quiet_since = offset, time.monotonic()
    while time.monotonic() < deadline:
        with open(log, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
        cut_short = False
        for line in text.splitlines():
            match = FRAME.match(line)
            if match and match["name"] == "train_one_step":  # only the main thread runs it
                return step_moment(source_line(match["file"], int(match["line"])))
            if match and match["name"] == "_run_module_as_main":  # the main thread's bottom
                return "finishing" if finished else "starting"
            cut_short = cut_short or line.strip() == "..."
        if offset + len(text) != size:
            size, quiet_since = offset + len(text), time.monotonic()
        elif cut_short and time.monotonic() - quiet_since > 0.02:
            return "unknown"  # a stack deeper than the dump shows, and no loop frame in it
        time.sleep(0.001)
    return None


def step_moment(text: str) -> str:
    """What ``train_one_step`` does on the source line ``text``."""
    for moment, calls in STEP_LINES:
        if any(call in text for call in calls):
            return moment
    return "recording"


def source_line(file: str, line: int) -> str:
    try:
        return Path(file).read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return ""


def log_of(run: TrainingRun) -> Path:
    return RunDirectory(run.path).log_path


def worker(run: TrainingRun) -> tuple[int, int | None]:
    info = run.status_info()
    return info["pid"], info.get("pid_start")


def wait_dead(pid: int, start: int | None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid, start):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still alive {timeout} s after SIGKILL")
        time.sleep(0.005)


def last_logged_step(run: TrainingRun) -> int:
    steps = [row["step"] for row in run.metrics()]
    return max(steps, default=0)


def where(run: TrainingRun) -> str | None:
    """Where the run's process is now; None once it has exited."""
    pid, start = worker(run)
    if not pid_alive(pid, start):
        return None
    if RunDirectory(run.path).file_state() != "running":
        return "starting"  # still importing: its stack handler may not be installed yet
    total = run.status_info().get("total_steps")
    finished = total is not None and last_logged_step(run) >= total
    offset = log_of(run).stat().st_size
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return None
    moment = dumped_moment(log_of(run), offset, finished)
    if moment is None:
        return None if not pid_alive(pid, start) else "unknown"
    return moment


def kill_now(run: TrainingRun) -> str | None:
    """SIGKILL the run's process where it is; the moment it was at, None if it had exited."""
    pid, start = worker(run)
    moment = where(run)
    if moment is None:
        return None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid, start)
    return moment


def kill_at(run: TrainingRun, moment: str, timeout: float = 60.0, seed: int = 0) -> None:
    """SIGKILL the run's process as soon as it is at ``moment``. ``starting`` kills at once."""
    pid, start = worker(run)
    if moment == "starting":
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid, start)
        return
    jitter = random.Random(seed)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        now = where(run)
        seen.append(now)
        if now is None:
            total = run.status_info().get("total_steps")
            raise AssertionError(
                f"the run ended before it was {moment} (step {last_logged_step(run)} of {total} "
                f"logged, {len(seen)} polls, {sorted({str(m) for m in seen})})"
            )
        if now == moment:
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid, start)
            return
        # Two cores: polling a process that is still starting would only slow it down.
        time.sleep(0.1 if now == "starting" else jitter.uniform(0, 0.005))
    raise AssertionError(f"the run was not {moment} within {timeout} s")


def kill_while_saving(run: TrainingRun, timeout: float = 60.0) -> Path:
    """SIGKILL the run's process while a checkpoint's hidden staging folder exists (the save
    has begun and is not yet renamed into place); the folder the kill left behind. The process
    is frozen (SIGSTOP) before the folder is checked, so the save cannot finish in between."""
    pid, start = worker(run)
    checkpoints = run.path / "checkpoints"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, start):
            raise AssertionError("the run ended before it saved")
        if checkpoints.is_dir() and any(checkpoints.glob(".step_*")):
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
            staging = list(checkpoints.glob(".step_*"))
            if staging:
                os.kill(pid, signal.SIGKILL)
                wait_dead(pid, start)
                return staging[0]
            os.kill(pid, signal.SIGCONT)  # renamed in the meantime: wait for the next save
        time.sleep(0.001)
    raise AssertionError(f"the run did not save within {timeout} s")


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` has stopped (a SIGSTOP lands asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that just exited
        if all(state in "tTZX" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop within {timeout} s")


def checkpoint_problems(run: TrainingRun, only: list[Path] | None = None) -> list[str]:
    """Why each listed checkpoint (or those of ``only``) would not load (weights, optimiser,
    trainer state), and any step folder that is not listed; empty when all is well."""
    import torch
    from safetensors.torch import load_file

    problems = []
    listed = {c.path for c in run.checkpoints()}
    for folder in sorted(run.path.joinpath("checkpoints").glob("step_*")):
        if folder not in listed:
            problems.append(f"{folder.name}: a step folder that is not listed")
    for checkpoint in run.checkpoints():
        folder = checkpoint.path
        if only is not None and folder not in only:
            continue
        try:
            weights = load_file(folder / "model.safetensors")
            assert weights, "no tensors"
            if checkpoint == run.checkpoints()[-1]:  # older ones drop theirs (retention)
                optimizer = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]
                assert optimizer["state"], "no optimiser state"
            state = json.loads((folder / "trainer_state.json").read_text())
            assert state["step"] == checkpoint.step, f"trainer state says {state['step']}"
            info = json.loads((folder / "palaestra.json").read_text())
            assert info["step"] == checkpoint.step, f"palaestra.json says {info['step']}"
        except Exception as error:
            problems.append(f"{folder.name}: {type(error).__name__}: {error}")
    return problems


def log_problems(run: TrainingRun, last_step: int, rows_per_step: int) -> list[str]:
    """Torn lines, and steps missing, repeated or out of order, in metrics.jsonl (each step
    once, 1..``last_step``) and samples.jsonl (``rows_per_step`` rows each, none twice)."""
    problems = []
    parsed: dict[str, list[dict]] = {}
    for name in ("metrics.jsonl", "samples.jsonl"):
        rows = []
        for number, line in enumerate((run.path / name).read_text().splitlines(), 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                problems.append(f"{name} line {number} is torn: {line[:60]!r}")
        parsed[name] = rows
    steps = [row["step"] for row in parsed["metrics.jsonl"]]
    if steps != list(range(1, last_step + 1)):
        problems.append(f"metrics.jsonl steps are {steps}, not 1..{last_step}")
    samples = parsed["samples.jsonl"]
    keys = [(row["step"], row["group_index"], row["index"]) for row in samples]
    if len(keys) != len(set(keys)):
        problems.append(f"samples.jsonl repeats {len(keys) - len(set(keys))} rows")
    for step in range(1, last_step + 1):
        count = sum(1 for key in keys if key[0] == step)
        if count != rows_per_step:
            problems.append(f"samples.jsonl has {count} rows of step {step}, not {rows_per_step}")
    if [key[0] for key in keys] != sorted(key[0] for key in keys):
        problems.append("samples.jsonl steps are out of order")
    return problems


async def paced_reward(args, sample, **kwargs) -> float:
    """``count_lowercase`` after 50 ms: sampling and evaluating last long enough to land in."""
    from tests.support.tiny_runs import count_lowercase

    await asyncio.sleep(0.05)
    return count_lowercase(args, sample)


def evaluated_config(
    model_dir: Path, data: Path, eval_interval: int, reward=paced_reward, **recipe
):
    """``tiny_config`` (rewarded by ``paced_reward``) plus an eval set of three topics scored
    every ``eval_interval`` steps."""
    from palaestra import LocalDataset, TrainConfig
    from tests.support.tiny_runs import tiny_config

    base = tiny_config(model_dir, data, reward=reward, **recipe)
    evals = LocalDataset(
        path=str(data), hf_split="train[:3]", input_column="topic", prompt_template="Say {input}"
    )
    return TrainConfig(
        model=base.model,
        dataset=base.dataset,
        recipe=base.recipe.model_copy(update={"eval_interval": eval_interval}),
        eval_dataset=evals,
    )
