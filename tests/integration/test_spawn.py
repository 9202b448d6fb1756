"""Launching: the one process helper starts a module in its own session, logs it, and stops it
(SIGTERM, then SIGKILL for a process that ignores it); after the first, from a warm launcher
that has imported torch already, where the interpreter and environment match."""

import os
import signal
import sys
import time

import pytest

from palaestra.launch import warm
from palaestra.launch.process import process_record, spawn_module, stop_process
from palaestra.runs.liveness import pid_alive

needs_linux = pytest.mark.skipif(sys.platform != "linux", reason="the warm launcher is Linux's")

SLEEPER = """\
import json, os, signal, sys, time
if {ignores_sigterm}: signal.signal(signal.SIGTERM, signal.SIG_IGN)
print('up', sys.argv[1], os.environ['EXTRA'], os.environ.get('PALAESTRA_SECRET'), flush=True)
print(json.dumps({{"torch_at_start": "torch" in sys.modules, "cwd": os.getcwd(),
                  "main": __name__}}), flush=True)
time.sleep(60)
"""


@pytest.fixture
def launchers():
    """No warm launcher before the test, none left after it."""
    warm._close_all()
    yield warm._launchers
    warm._close_all()


def wait_for_log(log, process, text="up"):
    deadline = time.monotonic() + 30
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # its second line


@pytest.mark.parametrize("ignores_sigterm", [False, True])
@pytest.mark.parametrize("how", ["new process", pytest.param("warm", marks=needs_linux)])
def test_a_spawned_module_logs_and_is_stopped_or_killed(
    tmp_path, monkeypatch, launchers, ignores_sigterm, how
):
    # Importable only through the caller's sys.path, which the child gets as PYTHONPATH.
    (tmp_path / "sleeper.py").write_text(SLEEPER.format(ignores_sigterm=ignores_sigterm))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    if how == "warm":
        # The first process of this interpreter and environment starts the launcher.
        first = spawn_module("sleeper", ["first"], tmp_path / "first.log", {"EXTRA": "env"})
        assert type(first).__name__ == "Popen"
        stop_process(first.pid, timeout=1.0, process=first)
        (launcher,) = launchers.values()
        assert launcher.ready.wait(60), "the launcher never said it was ready"
    log = tmp_path / "logs" / "sleeper.log"
    env = {"EXTRA": "env", "PALAESTRA_SECRET": "s3"}
    process = spawn_module("sleeper", ["arg"], log, env)
    assert isinstance(process, warm.ForkedProcess) is (how == "warm")
    record = process_record(process)
    wait_for_log(log, process)
    up, facts = log.read_text().splitlines()
    assert up == "up arg env s3"
    # Forked warm, it starts with torch imported; it runs as python -m would, where it was asked.
    assert eval(facts.replace("true", "True").replace("false", "False")) == {
        "torch_at_start": how == "warm",
        "cwd": str(tmp_path),
        "main": "__main__",
    }
    assert os.getsid(process.pid) == process.pid  # its own session: a Ctrl-C here misses it
    killed = stop_process(record["pid"], record["pid_start"], timeout=1.0, process=process)
    assert killed is ignores_sigterm
    assert process.returncode == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM)
    assert not pid_alive(record["pid"], record["pid_start"])


@needs_linux
def test_a_warm_process_reports_its_exit_status_and_another_environment_starts_anew(
    tmp_path, monkeypatch, launchers
):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert spawn_module("exits", ["0"], tmp_path / "a.log").wait(timeout=30) == 0
    (launcher,) = launchers.values()
    assert launcher.ready.wait(60)
    forked = spawn_module("exits", ["3"], tmp_path / "b.log")
    assert isinstance(forked, warm.ForkedProcess) and forked.wait(timeout=30) == 3
    # A variable torch might read as it is imported differs: a new process, and a new launcher
    # for that environment replaces the old one.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    again = spawn_module("exits", ["4"], tmp_path / "c.log")
    assert type(again).__name__ == "Popen" and again.wait(timeout=30) == 4
    (replacement,) = launchers.values()
    assert replacement is not launcher and launcher.process.poll() is not None
    # Turned off, nothing is forked.
    assert replacement.ready.wait(60)
    monkeypatch.setenv(warm.SETTING, "0")
    assert type(spawn_module("exits", ["0"], tmp_path / "d.log")).__name__ == "Popen"


@needs_linux
def test_the_plan_check_runs_forked_from_a_ready_launcher_and_refuses_there_too(
    tmp_path, monkeypatch, launchers, home, tiny_model_dir, prompts_file
):
    from palaestra.launch.plan_check import check_in_launcher
    from palaestra.plan import PlanDoesNotFitError
    from tests.support.tiny_runs import tiny_config

    fits = tiny_config(tiny_model_dir, prompts_file)
    assert check_in_launcher(fits) is False  # no launcher ready: the caller checks it itself
    assert not launchers  # and none was started for it
    (tmp_path / "sleeper.py").write_text(SLEEPER.format(ignores_sigterm=False))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("EXTRA", "env")  # the launcher's environment is the caller's
    first = spawn_module("sleeper", ["first"], tmp_path / "first.log")
    stop_process(first.pid, timeout=1.0, process=first)
    (launcher,) = launchers.values()
    assert launcher.ready.wait(60), "the launcher never said it was ready"
    assert check_in_launcher(fits) is True
    # Activations of 4096 sequences of 100,000 tokens: no machine here holds them.
    huge = tiny_config(
        tiny_model_dir, prompts_file, rollout_max_response_len=100_000, train_micro_batch_size=4096,
        rollout_batch_size=512,
    )  # fmt: skip
    with pytest.raises(PlanDoesNotFitError, match="the largest term is"):
        check_in_launcher(huge)
    assert not any(home.glob("runs/*"))  # refused before any run folder exists
