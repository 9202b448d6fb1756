"""The overlay environment an ``image_overlay`` builds: layered on this one, built once and
reused, commands run as written in it (pip, ``uv pip install --system``, ``python -c``), a
failing command's error, and a launched run whose reward imports what the overlay installed.
Nothing here needs the network: the packages are wheels written by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palaestra.overlay import overlay_steps
from palaestra.overlay.environment import OverlayBuildError, ensure_overlay
from tests.support.tiny_runs import tiny_config, write_topics
from tests.support.wheels import write_wheel


def run_in(overlay, code: str) -> str:
    done = subprocess.run(
        [str(overlay.python), "-c", code],
        env=overlay.environment() | {"PYTHONPATH": ""},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_commands_act_in_the_overlay_which_sees_this_environment(home, tmp_path):
    pip_wheel = write_wheel(tmp_path, "overlay_pip_probe", 1)
    uv_wheel = write_wheel(tmp_path, "overlay_uv_probe", 2)
    runs = tmp_path / "runs.txt"
    steps = overlay_steps(
        lambda image: image.env({"PROBE_GREETING": "hello"}).run_commands(
            f"pip install --no-index {pip_wheel}",
            f"uv pip install --system --no-index {uv_wheel}",
            f"python -c \"import os, sys; open('{runs}', 'a').write("
            "sys.prefix + ' ' + os.environ['PROBE_GREETING'] + chr(10))\"",
        )
    )
    overlay = ensure_overlay(steps)
    assert overlay.built_s is not None
    assert overlay.path.parent == home / "overlays" and overlay.path.is_symlink()
    # python -c ran the overlay's Python, with the variable image.env set before it.
    assert runs.read_text() == f"{overlay.path.resolve()} hello\n"
    where = run_in(
        overlay,
        "import overlay_pip_probe, overlay_uv_probe, torch, palaestra, os; "
        "print(overlay_pip_probe.__file__, overlay_uv_probe.VALUE, os.environ['PROBE_GREETING'])",
    )
    # Both installs went into the overlay, and this environment's packages (torch) are seen.
    assert where.startswith(str(overlay.path / "lib"))
    assert where.endswith(" 2 hello")
    for probe in ("overlay_pip_probe", "overlay_uv_probe"):
        alone = subprocess.run([sys.executable, "-c", f"import {probe}"], capture_output=True)
        assert alone.returncode != 0, f"{probe} leaked into this environment"
    again = ensure_overlay(steps)
    assert again.built_s is None and again.path == overlay.path
    assert "reused" in again.describe()
    assert runs.read_text().count("\n") == 1  # nothing ran the second time


def test_a_failing_command_names_itself_its_exit_code_and_its_output(home):
    steps = overlay_steps(
        lambda image: image.run_commands(
            "echo first-step-ok",
            "echo about to fail; echo the-reason >&2; exit 3",
            "echo never",
        )
    )
    with pytest.raises(OverlayBuildError) as error:
        ensure_overlay(steps)
    message = str(error.value)
    assert "command 2 of 3 failed with exit code 3: echo about to fail;" in message
    assert "    about to fail\n    the-reason" in message
    assert list((home / "overlays").iterdir()) == [next((home / "overlays").glob("*.lock"))]


def test_an_unreachable_index_fails_with_the_tools_own_error(home):
    """No network (an index under .invalid, which never resolves): uv's own error, soon."""
    steps = overlay_steps(
        lambda image: image.uv_pip_install("six", index_url="https://pypi.invalid/simple")
    )
    started = time.monotonic()
    with pytest.raises(OverlayBuildError) as error:
        ensure_overlay(steps)
    assert "exit code" in str(error.value) and "pypi.invalid" in str(error.value)
    assert time.monotonic() - started < 300


async def probe_reward(args, sample, **kwargs) -> float:
    import overlay_run_probe  # installed by the run's image_overlay, not in this environment

    return float(overlay_run_probe.VALUE)


def test_a_launched_run_executes_in_the_overlay_and_reuses_it(home, tiny_model_dir, tmp_path):
    wheel = write_wheel(tmp_path, "overlay_run_probe", 7)
    data = write_topics(tmp_path / "topics.jsonl")
    overlay = lambda image: image.run_commands(f"uv pip install --system --no-index {wheel}")  # noqa: E731
    config = tiny_config(
        tiny_model_dir, data, reward=probe_reward, num_rollout=1, image_overlay=overlay
    )
    first = config.launch()
    result = first.result(timeout=600)
    run = home / "runs" / result.training_run_id
    log = (run / "train.log").read_text()
    assert "image_overlay: built the environment at" in log, log
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_mean"] == 7.0  # the reward imported the overlay's package
    recorded = json.loads((run / "config.json").read_text())["recipe"]["image_overlay"]
    assert recorded == [{"run": f"uv pip install --system --no-index {wheel}"}]
    second = config.launch()
    second.result(timeout=600)
    log = (home / "runs" / second.training_run_id / "train.log").read_text()
    assert "image_overlay: reused the environment at" in log, log


def test_a_failing_overlay_fails_launch_before_training(home, tiny_model_dir, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    config = tiny_config(
        tiny_model_dir,
        data,
        image_overlay=lambda image: image.pip_install("--no-index", "no-such-package-here"),
    )
    with pytest.raises(OverlayBuildError, match="exit code 1: python -m pip install"):
        config.launch()
    (run,) = (home / "runs").iterdir()
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "OverlayBuildError" in status["error"]
    assert not (run / "metrics.jsonl").exists()
    assert Path(run / "train.log").read_text().count("no-such-package-here") >= 1


TRAIN_HERE = """
import json, sys
from pathlib import Path
from test_overlay import probe_reward
from tests.support.tiny_runs import tiny_config

model_dir, data, wheel = sys.argv[1:]
config = tiny_config(
    Path(model_dir), Path(data), reward=probe_reward, num_rollout=1,
    image_overlay=lambda image: image.run_commands(f"pip install --no-index {wheel}"),
)
result = config.train()
print(json.dumps({"run_id": result.training_run_id, "prefix": sys.prefix}))
"""


def test_train_in_this_process_runs_the_rest_of_it_in_the_overlay(home, tiny_model_dir, tmp_path):
    """``config.train()``: the caller's own process takes the overlay's packages and variables
    (in a child process here, so this test session's sys.path stays as it is)."""
    wheel = write_wheel(tmp_path, "overlay_run_probe", 3)
    data = write_topics(tmp_path / "topics.jsonl")
    path = [p for p in sys.path if p]
    done = subprocess.run(
        [sys.executable, "-c", TRAIN_HERE, str(tiny_model_dir), str(data), str(wheel)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    run = home / "runs" / answer["run_id"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_mean"] == 3.0  # imported from the overlay, in this process
    assert answer["prefix"] == sys.prefix  # the process kept its own Python


SLEEPER = "import time; time.sleep(60)\n"


def probe_config(model_dir, folder, value: int):
    """One step rewarded by ``probe_reward``, whose overlay pip-installs ``overlay_run_probe``
    with ``VALUE = value``."""
    wheel = write_wheel(folder, "overlay_run_probe", value)
    return tiny_config(
        model_dir,
        write_topics(folder / "topics.jsonl"),
        reward=probe_reward,
        num_rollout=1,
        image_overlay=lambda image: image.run_commands(f"pip install --no-index {wheel}"),
    )


def test_a_run_forks_from_the_warm_launcher_and_moves_into_its_overlay(
    home, tiny_model_dir, tmp_path, monkeypatch
):
    """Where this environment's warm launcher is ready, an overlay run's worker is forked from
    it and takes the overlay's packages itself: no cold start in the overlay's Python."""
    from palaestra.launch import warm
    from palaestra.launch.process import spawn_module, stop_process

    if sys.platform != "linux":
        pytest.skip("the warm launcher is Linux's")
    warm._close_all()
    (tmp_path / "sleeper_for_overlay.py").write_text(SLEEPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    first = spawn_module("sleeper_for_overlay", [], tmp_path / "sleeper.log")
    stop_process(first.pid, timeout=1.0, process=first)
    (launcher,) = warm._launchers.values()
    try:
        assert launcher.ready.wait(60), "the launcher never said it was ready"
        config = probe_config(tiny_model_dir, tmp_path, value=5)
        result = config.launch().result(timeout=600)
    finally:
        warm._close_all()
    run = home / "runs" / result.training_run_id
    log = (run / "train.log").read_text()
    assert "forked from this environment's warm launcher" in log, log
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_mean"] == 5.0  # the reward imported the overlay's package


ENTER_SHADOWED = """
import json, sys
import overlay_run_probe  # this environment's copy (a plain module, VALUE 0), imported first
from palaestra.launch.worker import enter_overlay
enter_overlay(json.loads(sys.argv[1]), [sys.argv[2]])
raise SystemExit("enter_overlay returned: it should have started the overlay's Python")
"""


def test_an_overlay_with_its_own_version_of_an_imported_module_starts_its_python(
    home, tiny_model_dir, tmp_path
):
    """A worker that imported a module the overlay holds another version of cannot take the
    overlay's: it starts over as the overlay's Python, whose module the reward then reads."""
    from palaestra.launch.training import create_run, prepare_overlay
    from palaestra.launch.worker import overlay_entry

    base = tmp_path / "base"
    base.mkdir()
    (base / "overlay_run_probe.py").write_text("VALUE = 0\n")
    run = create_run(probe_config(tiny_model_dir, tmp_path, value=9))
    entry = overlay_entry(prepare_overlay(run))
    path = [str(base), *(p for p in sys.path if p)]
    done = subprocess.run(
        [sys.executable, "-c", ENTER_SHADOWED, entry, str(run.path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "its own overlay_run_probe would come after" in done.stdout, done.stdout
    metrics = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_mean"] == 9.0  # the overlay's version, in the overlay's Python
