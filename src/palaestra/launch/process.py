"""Starting and stopping the processes palaestra runs in the background: training runs and
endpoint servers alike.

A process is ``python -m MODULE ARGS``, detached in its own session (a Ctrl-C in the notebook
or terminal that started it does not reach it), with stdout and stderr appended to a log file
and the caller's import path, so it imports the same modules the caller did (a script's
sibling files, a notebook's folder). Stopping asks first (SIGTERM), then forces (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from palaestra.launch import warm
from palaestra.runs.liveness import pid_alive, process_start_time


def spawn_module(
    module: str,
    args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    python: str | os.PathLike | None = None,
    warm_only: bool = False,
) -> subprocess.Popen | warm.ForkedProcess | None:
    """Start ``python -m module *args`` detached, its output appended to ``log``: forked from
    a warm launcher of the same interpreter and environment where one is ready
    (``launch.warm``), else a new process. ``env``
    adds to this process's environment (a secret goes here, never on the command line, where
    ``ps`` shows it). ``python``: another interpreter than this one (an overlay environment's,
    which reaches this environment's site-packages itself, after its own). ``warm_only``:
    None rather than a new process where no launcher is ready (and none is started)."""
    environment = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": child_pythonpath(python),
        **(env or {}),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    interpreter = str(python or sys.executable)
    forked = warm.spawn(interpreter, module, args, log, environment, start=not warm_only)
    if forked is not None or warm_only:
        return forked
    with open(log, "ab") as out:
        return subprocess.Popen(
            [interpreter, "-m", module, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )


def child_pythonpath(python: str | os.PathLike | None = None) -> str:
    """The ``PYTHONPATH`` of a process ``spawn_module`` starts: this process's ``sys.path``
    (a script's own folder, a test's), less this environment's site-packages where the child
    runs another interpreter (an overlay's, which reaches them itself, after its own: on
    ``PYTHONPATH`` they would shadow its packages)."""
    path = [p for p in sys.path if p and os.path.isdir(p)]
    if python is not None:
        import site

        sites = {*site.getsitepackages(), site.getusersitepackages()}
        path = [p for p in path if p not in sites]
    return os.pathsep.join(path)


def process_record(process: subprocess.Popen) -> dict[str, int | None]:
    """``pid`` and ``pid_start``: what a status or endpoint record stores to find the process
    again (and to tell it from a later process that reuses its pid)."""
    return {"pid": process.pid, "pid_start": process_start_time(process.pid)}


DUMP_WAIT_S = 1.0
"""How long a process that ignored a stop gets to write its stacks before it is killed."""


def stop_process(
    pid: int | None,
    start_time: int | None = None,
    *,
    timeout: float = 30.0,
    group: bool = False,
    ended: Callable[[], bool] | None = None,
    process: subprocess.Popen | None = None,
    poll_s: float = 0.1,
    dump: int | None = None,
) -> bool:
    """Ask ``pid`` to stop (SIGTERM to it, or with ``group`` to its whole process group), wait
    up to ``timeout`` seconds for ``ended()`` (default: the process is gone), then SIGKILL it if
    it still runs. ``process``, our own child, is reaped. Returns whether it had to be killed.

    ``dump``, a signal on which the process writes its threads' stacks (a training worker's
    SIGUSR1), is sent to it alone before the SIGKILL, so its log says where it was stuck.
    ``start_time`` guards against signalling a later process that reuses a dead one's pid."""
    if not pid_alive(pid, start_time):
        _reap(process)
        return False
    ended = ended or (lambda: not pid_alive(pid, start_time))
    _signal(pid, signal.SIGTERM, group)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not ended():
        time.sleep(poll_s)
    killed = not ended() and pid_alive(pid, start_time)
    if killed and dump is not None:
        _signal(pid, dump, group=False)
        time.sleep(DUMP_WAIT_S)
    if killed:
        _signal(pid, signal.SIGKILL, group)
    if killed or not pid_alive(pid, start_time):
        _reap(process)  # gone, so this returns at once; one that ended() but still exits is left
    return killed


def _signal(pid: int, signum: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it exited between the liveness check and the signal


def _reap(process: subprocess.Popen | None) -> None:
    if process is not None:
        process.wait()
