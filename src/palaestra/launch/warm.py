"""A warm launcher: background processes forked from one that has imported torch already.

Every endpoint server and training worker palaestra starts is a new ``python -m``, and before
it does anything of its own it imports torch and transformers' modelling code: 4.5 to 5.5 s on
a 2-core CPU (``python -X importtime``: torch 1.8 s, ``transformers.modeling_utils`` another
2.6 to 3.8, most of it torch's distributed tensors and compiler that transformers imports). The
tutorial starts five such processes one after another; a notebook that serves checkpoints
starts one per checkpoint.

So the first background process a Python session starts also starts a launcher beside it: a
process of the same interpreter and environment that imports those modules (``PRELOAD``) and
then waits. A later process of that interpreter and environment is forked from it, in its own
session, its output appended to its log, in the caller's folder and environment, and runs its
module as ``python -m`` would; it starts with the imports done. Where the launcher is not ready
yet, is gone, or was started for another interpreter or environment, the process starts as a
new ``python -m``, as before.

An environment matches when every variable but palaestra's own (``PALAESTRA_*``, which only
palaestra's modules read, after the fork) and those in ``UNREAD`` is the same: a variable
torch or transformers reads as it is imported (``OMP_NUM_THREADS``, ``HF_HOME``) then has the
value the process would see.
The launcher holds one interpreter's imports in memory (about 350 MB) until the session that
started it exits (it reads its requests from that session, and ends when they end). It forks
only while it has a single Python thread; torch leaves one idle native thread at import, which
its own data loaders fork beside as well. Linux only; ``PALAESTRA_WARM_LAUNCHER=0`` turns it
off.

A forked process is the launcher's child, not the caller's: ``ForkedProcess`` stands in for
``Popen`` (``pid``, ``poll``, ``wait``, ``returncode``), with the exit status the launcher
reports when it reaps the process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "tokenizers",
)
"""What the launcher imports before it forks: what every endpoint server and training worker
imports first, and nothing of palaestra's (whose modules read ``PALAESTRA_*`` variables)."""

SETTING = "PALAESTRA_WARM_LAUNCHER"

REPLY_TIMEOUT_S = 10.0
"""How long a fork may take to be answered before the launcher counts as broken."""

_OWN_PREFIX = "PALAESTRA_"

UNREAD = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables no import reads that change between launches all the same (pytest names the
running test in one), left out of the match like palaestra's own."""


def _key(python: str, environment: dict[str, str]) -> tuple:
    return (
        os.path.abspath(python),  # not resolved: a virtual environment's python is a link
        tuple(
            sorted(
                (k, v)
                for k, v in environment.items()
                if not k.startswith(_OWN_PREFIX) and k not in UNREAD
            )
        ),
    )


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(SETTING, "") != "0"


class ForkedProcess:
    """A process the launcher forked, seen from the session that asked for it: the launcher
    reaps it and reports how it ended, as ``Popen.returncode`` would say it (negative: the
    signal that ended it)."""

    def __init__(self, pid: int, launcher: Launcher) -> None:
        from palaestra.runs.liveness import process_start_time

        self.pid = pid
        self.start_time = process_start_time(pid)
        self.returncode: int | None = None
        self._launcher = launcher

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exits.get(self.pid)
            if self.returncode is None and not self._launcher.running():
                from palaestra.runs.liveness import pid_alive

                # The launcher is gone (this session is ending): alive or not, nothing reports.
                if not pid_alive(self.pid, self.start_time):
                    self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


class Launcher:
    """A launcher process for one interpreter and environment, started in the background.

    It answers each request with one line (``{"pid": N}`` or ``{"declined": why}``) and writes
    ``{"exited": N, "code": C}`` whenever a process it forked ends; a thread here reads them."""

    def __init__(self, python: str, environment: dict[str, str]) -> None:
        self.key = _key(python, environment)
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.replies: queue.Queue[dict] = queue.Queue()
        self.exits: dict[int, int] = {}
        self.process = subprocess.Popen(
            [python, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # palaestra's own variables (an endpoint's key among them) go to each process only.
            env={k: v for k, v in environment.items() if not k.startswith(_OWN_PREFIX)},
            start_new_session=True,  # a Ctrl-C in the caller's terminal does not reach it
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, name="palaestra-launcher", daemon=True).start()

    def running(self) -> bool:
        return self.process.poll() is None

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip() == "ready":
                self.ready.set()
                continue
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "exited" in message:
                self.exits[message["exited"]] = message["code"]
            else:
                self.replies.put(message)
        self.replies.put({})  # gone: a spawn waiting for its reply gives up

    def spawn(
        self, module: str, args: list[str], log: Path, environment: dict[str, str]
    ) -> ForkedProcess | None:
        """``python -m module *args`` forked from the launcher, or None where it cannot be
        (not ready, gone, or it declined)."""
        if not self.ready.is_set() or not self.running():
            return None
        request = {
            "module": module,
            "args": list(args),
            "log": str(log),
            "env": environment,
            "cwd": os.getcwd(),
        }
        with self.lock:
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                reply = self.replies.get(timeout=REPLY_TIMEOUT_S)
            except (OSError, ValueError, queue.Empty):
                reply = {}
            if "pid" not in reply and "declined" not in reply:
                self.process.kill()  # broken: the next spawn starts another launcher
                return None
            if "declined" in reply:
                return None
            # A pid the kernel reuses: the notice of its earlier process came before this reply.
            self.exits.pop(reply["pid"], None)
            return ForkedProcess(reply["pid"], self)

    def close(self) -> None:
        try:
            self.process.stdin.close()  # it ends when its requests do
            self.process.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


_launchers: dict[str, Launcher] = {}
_lock = threading.Lock()


def spawn(
    python: str,
    module: str,
    args: list[str],
    log: Path,
    environment: dict[str, str],
    start: bool = True,
) -> ForkedProcess | None:
    """``python -m module *args`` forked from a ready launcher of ``python`` and
    ``environment``; or None, having started one for next time where none matches (unless
    ``start`` is False)."""
    if not enabled():
        return None
    key = _key(python, environment)
    with _lock:
        launcher = _launchers.get(key[0])
        if launcher is None or launcher.key != key or launcher.process.poll() is not None:
            if not start:
                return None
            if launcher is not None:
                launcher.close()
            _launchers[key[0]] = Launcher(python, environment)
            return None
    return launcher.spawn(module, args, log, environment)


@atexit.register
def _close_all() -> None:
    with _lock:
        for launcher in _launchers.values():
            launcher.close()
        _launchers.clear()


# --- the launcher process ------------------------------------------------------------------


def _say(message: str | dict) -> None:
    """One line to the session, in one write: a line about an ended process may be written
    from the signal handler while the loop is between lines."""
    line = message if isinstance(message, str) else json.dumps(message)
    os.write(1, (line + "\n").encode())


def _reap(signum, frame) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve() -> dict | None:
    """Import ``PRELOAD``, say ready, then fork a process per request line until stdin ends.
    Returns the request in a forked process (which then runs it), None in the launcher."""
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module missing here is imported after the fork
            pass
    signal.signal(signal.SIGCHLD, _reap)
    _say("ready")
    for line in sys.stdin:
        request = json.loads(line)
        if threading.active_count() > 1:  # a thread of Python's would be lost in the fork
            _say({"declined": "threads"})
            continue
        pid = os.fork()
        if pid == 0:
            _become(request)
            return request
        _say({"pid": pid})
    return None


def _become(request: dict) -> None:
    """Turn this forked process into what ``process.spawn_module`` starts: its own session,
    stdin from /dev/null, output appended to the log, the caller's folder and environment."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own children are its own to reap
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - what a process started so would read
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # where ``python -m`` puts the folder it starts in
    if "numpy" in sys.modules:  # its global generator was seeded in the launcher
        sys.modules["numpy"].random.seed()


def _run(request: dict) -> None:
    import runpy

    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    forked = _serve()
    if forked is not None:
        _run(forked)
