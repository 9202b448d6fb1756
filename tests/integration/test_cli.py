"""The palaestra command against a real registry: a run trained from a TOML file, followed,
listed, inspected and stopped, plus a completed run trained in-process."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from palaestra.cli import follow_training, main
from palaestra.config_file import TrainFileError, load_train_file
from palaestra.launch.training import TrainingRun
from palaestra.runs.progress import progress_line
from palaestra.runs.registry import list_run_ids
from tests.support.tiny_runs import tiny_config, write_topics

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_model_dir):
    """A home holding one completed 3-step run; tests in this module add to it."""
    home = tmp_path_factory.mktemp("cli") / "home"
    data = write_topics(home.parent / "topics.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        config = tiny_config(tiny_model_dir, data).model_copy(update={"name": "done"})
        result = config.train()
        yield {"home": home, "data": data, "done": result, "model": tiny_model_dir}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_is_instant_and_imports_nothing_heavy():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "palaestra.cli", "--help"], capture_output=True, text=True, env=env
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    for command in ("train", "run", "dashboard"):
        assert f"    {command}" in done.stdout
    assert elapsed < 3.0, f"--help took {elapsed:.2f} s"  # ~0.1 s idle; slack for a busy CI box
    probe = (
        "import sys, palaestra.cli as c; c.build_parser().parse_args(['run', 'list']); "
        "print([m for m in ('torch', 'transformers', 'fastapi', 'pydantic') if m in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert loaded.stdout.strip() == "[]", loaded.stderr


def test_run_list_and_get_show_a_completed_run(registry, capsys):
    done = registry["done"]
    reward = done.metrics()[-1]["reward_mean"]
    code, out, _ = cli(capsys, "run", "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["RUN", "STATUS", "MODEL", "DATASET", "STEP"] + [
        "REWARD",
        "STARTED",
        "DURATION",
    ]
    assert row.split()[:5] == [done.training_run_id, "completed", "tiny", "topics.jsonl", "[train]"]
    assert row.split()[5:7] == ["3/3", f"{reward:+.3f}"]

    code, out, _ = cli(capsys, "run", "list", "--json")
    (listed,) = json.loads(out)
    assert listed["run_id"] == done.training_run_id and listed["reward_mean"] == reward
    assert cli(capsys, "run", "list", "--status", "failed")[1] == "no failed runs\n"

    code, out, _ = cli(capsys, "run", "get", done.training_run_id)
    assert code == 0
    assert "status     completed, step 3/3" in out
    assert "reward fn  tests.support.tiny_runs:count_lowercase" in out
    assert f"step 3      {done.latest_checkpoint().path}" in out
    code, out, _ = cli(capsys, "run", "get", "--json", done.training_run_id)
    assert json.loads(out)["checkpoints"] == [
        {"step": 3, "path": str(done.latest_checkpoint().path)}
    ]


def test_unknown_runs_and_finished_runs(registry, capsys):
    code, _, err = cli(capsys, "run", "get", "no-such-run")
    assert code == 1 and err.startswith("palaestra: no run 'no-such-run' under ")
    code, out, _ = cli(capsys, "run", "stop", registry["done"].training_run_id)
    assert code == 0 and out.endswith("is already completed (step 3)\n")


def test_follow_training_prints_one_progress_line_per_step(registry, capsys):
    assert follow_training(TrainingRun.from_id(registry["done"].training_run_id)) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" [")[0] for line in out[:3]] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "[" + "#" * 20 + "]" in out[2] and " s/step" in out[2]
    assert out[3] == f"completed 3 steps; checkpoint: {registry['done'].latest_checkpoint().path}"


def test_progress_line_shows_reward_spread_and_eta():
    line = progress_line(
        {"step": 6, "reward_mean": 0.5, "reward_std": 0.25, "step_s": 2.0},
        total=10,
        first_step=5,
        started=time.monotonic() - 2.0,
    )
    # One of five steps done since the run started: 20 % of the bar; 4 more steps at 2 s each.
    assert line == "step 6/10 [####----------------]  reward +0.500 ±0.250  2.0 s/step  eta 8 s"


def write_train_file(folder: Path, model: Path, data: Path, steps: int) -> Path:
    # A reward beside the file, named as module:function: the gated one from tests.support.
    (folder / "gate_rewards.py").write_text(
        "from tests.support.tiny_runs import gated_reward  # noqa: F401\n"
    )
    path = folder / "tiny.toml"
    path.write_text(
        textwrap.dedent(f"""
        name = "from-toml"

        [model]
        path = "{model}"
        name = "tiny"

        [dataset]
        path = "{data.name}"
        input_column = "topic"
        prompt_template = "Say {{input}}"

        [recipe]
        num_rollout = {steps}
        rollout_batch_size = 2
        n_samples_per_prompt = 4
        rollout_max_response_len = 8
        lr = 0.01
        reward_timeout_s = 120
        custom_rm_function = "gate_rewards:gated_reward"
    """)
    )
    return path


def test_train_from_toml_shows_steps_and_run_stop_stops_it(registry, capsys, tmp_path):
    data = write_topics(tmp_path / "topics.jsonl")
    path = write_train_file(tmp_path, registry["model"], data, steps=3)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(REPO)]),
        "COLUMNS": "200",
    }
    train = subprocess.Popen(
        [sys.executable, "-m", "palaestra.cli", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in train.stdout], daemon=True).start()

    def next_line_starting(prefix: str) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1).rstrip("\n")
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
        train.kill()
        raise AssertionError(f"no line starting {prefix!r}; stderr: {train.stderr.read()}")

    run_id = next_line_starting("run id: ").removeprefix("run id: ")
    assert run_id.startswith("from-toml-")
    assert next_line_starting("training tiny").startswith("training tiny: steps 1..3")
    step_1 = next_line_starting("step 1/3 ")
    reward = TrainingRun.from_id(run_id).metrics()[0]["reward_mean"]
    assert f"reward {reward:+.3f} ±" in step_1 and " s/step" in step_1

    # The run now waits at step 2 for a gate this test never opens: it is running. The progress
    # line comes from metrics.jsonl, written a moment before status.json takes the step.
    deadline = time.monotonic() + 30
    while TrainingRun.from_id(run_id).status_info().get("step") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, out, _ = cli(capsys, "run", "list", "--status", "running")
    (row,) = out.splitlines()[1:]
    assert row.split()[:2] == [run_id, "running"] and "1/3" in row.split()
    code, out, _ = cli(capsys, "run", "logs", run_id)
    assert "training tiny: steps 1..3" in out and "step 1/3  reward" in out

    code, out, _ = cli(capsys, "run", "stop", run_id)
    assert (code, out) == (0, f"run {run_id}: stopped at step 1\n")
    assert TrainingRun.from_id(run_id).status == "stopped"
    code, out, _ = cli(capsys, "run", "get", run_id)
    assert "status     stopped, step 1/3" in out
    code, out, _ = cli(capsys, "run", "logs", "-f", run_id)  # returns: the run has ended
    assert out.rstrip().endswith("palaestra: stopped")

    assert train.wait(timeout=30) == 1
    assert f"run {run_id} was stopped at step 1" in train.stderr.read()
    assert [m["step"] for m in TrainingRun.from_id(run_id).metrics()] == [1]


def test_train_file_errors_name_the_file_and_the_field(registry, capsys, tmp_path):
    runs_before = list_run_ids()
    data = write_topics(tmp_path / "topics.jsonl")
    path = write_train_file(tmp_path, registry["model"], data, steps=1)
    path.write_text(path.read_text().replace("num_rollout", "num_rolout"))
    code, _, err = cli(capsys, "train", str(path))
    assert code == 1
    assert f"{path}: [recipe] num_rolout: Extra inputs are not permitted" in err

    path.write_text('model = "NoSuchModel"\n[dataset]\nbuiltin = "haiku"\n')
    code, _, err = cli(capsys, "train", str(path))
    assert code == 1 and f"{path}: [model] no model 'NoSuchModel'" in err
    assert "SmolLM2-135M-Instruct" in err

    path.write_text('model = "SmolLM2-135M-Instruct"\nrecipes = {}\n[dataset]\n')
    with pytest.raises(TrainFileError, match=r"recipes: Extra inputs are not permitted"):
        load_train_file(path)
    assert list_run_ids() == runs_before


def test_example_train_file_names_a_catalogue_model_and_a_builtin_dataset():
    from palaestra.data import builtin_dataset
    from palaestra.models import SmolLM2_135M
    from palaestra.recipes import SmolLM2_135M_Recipe

    config = load_train_file(REPO / "examples" / "haiku.toml")
    assert isinstance(config.model, SmolLM2_135M)
    assert config.dataset.hf_repo == str(builtin_dataset("haiku"))
    assert config.dataset.hf_split == "train[:10]"
    assert type(config.recipe) is SmolLM2_135M_Recipe
    assert config.recipe.custom_rm_function == "palaestra.rewards.haiku:haiku_reward"
    assert config.recipe.apply_chat_template_kwargs == {"enable_thinking": False}
