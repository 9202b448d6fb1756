"""SIGUSR1 asks a training process where it is; asking must never end it.

The process below starts and joins threads without pause (as a run's reward pools and
endpoint clients do) while SIGUSR1 arrives every millisecond. With ``faulthandler``'s own
SIGUSR1 dump this segfaulted within a few dozen signals here (a thread exited while its frames
were read); the worker's handler must survive them all and write stacks the fault tests can
read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.support.moments import FRAME

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from palaestra.launch.worker import install_signal_handlers

    install_signal_handlers()

    def churning_threads(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            threads = [threading.Thread(target=sum, args=(range(200),)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    print("ready", flush=True)
    churning_threads(float(sys.argv[1]))
    print("survived", flush=True)
    """
)


def test_stack_dumps_on_sigusr1_never_end_the_process():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    sent, started = 0, time.monotonic()
    while child.poll() is None and time.monotonic() - started < 2.5:
        os.kill(child.pid, signal.SIGUSR1)
        sent += 1
        time.sleep(0.001)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err[-2000:]
    assert out.strip() == "survived"
    assert sent > 500
    dumps = err.split("Current thread 0x")[1:]
    assert len(dumps) > 10
    # faulthandler's format, newest call first: the loop's frame, then its caller's. The last
    # dump, since the first may come before the child has entered the loop.
    frames = [FRAME.match(line) for line in dumps[-1].splitlines()]
    names = [match["name"] for match in frames if match]
    assert names[names.index("churning_threads") + 1] == "<module>"
    assert all(int(match["line"]) > 0 for match in frames if match)


STUCK = textwrap.dedent(
    """
    import signal, time
    from palaestra.launch.worker import install_signal_handlers

    install_signal_handlers()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a run that never gets to its stop

    def stuck_in_a_reward():
        while True:
            time.sleep(0.01)

    print("ready", flush=True)
    stuck_in_a_reward()
    """
)


def test_a_process_killed_after_ignoring_its_stop_first_writes_where_it_was():
    from palaestra.launch.process import stop_process

    child = subprocess.Popen(
        [sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    killed = stop_process(child.pid, timeout=0.5, process=child, poll_s=0.05, dump=signal.SIGUSR1)
    assert killed and child.returncode == -signal.SIGKILL
    (dump,) = child.stderr.read().split("Current thread 0x")[1:]
    names = [match["name"] for match in map(FRAME.match, dump.splitlines()) if match]
    assert names[names.index("stuck_in_a_reward") + 1] == "<module>"
