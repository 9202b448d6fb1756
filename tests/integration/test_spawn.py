"""Launching: the one process helper starts a module in its own session, logs it, and stops it
(SIGTERM, then SIGKILL for a process that ignores it)."""

import os

import pytest


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_spawned_module_logs_and_is_stopped_or_killed(tmp_path, monkeypatch, ignores_sigterm):
    import signal
    import time

    from palaestra.launch.process import process_record, spawn_module, stop_process
    from palaestra.runs.liveness import pid_alive

    # Importable only through the caller's sys.path, which the child gets as PYTHONPATH.
    (tmp_path / "sleeper.py").write_text(
        "import os, signal, sys, time\n"
        f"if {ignores_sigterm}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', sys.argv[1], os.environ['EXTRA'], flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "logs" / "sleeper.log"
    process = spawn_module("sleeper", ["arg"], log, {"EXTRA": "env"})
    record = process_record(process)
    deadline = time.monotonic() + 30
    while "up" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    assert log.read_text() == "up arg env\n"
    assert os.getsid(process.pid) == process.pid  # its own session: a Ctrl-C here misses it
    killed = stop_process(record["pid"], record["pid_start"], timeout=1.0, process=process)
    assert killed is ignores_sigterm
    assert process.returncode == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM)
    assert not pid_alive(record["pid"], record["pid_start"])
