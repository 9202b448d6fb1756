"""The metrics mirror in process (order, a full queue, which values go out) and the tracker
config classes: fields, the run config, a missing client, training files."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
from pydantic import ValidationError

from palaestra import DashboardMetricConfig, TrackioConfig, WandbConfig
from palaestra.config_file import TrainFileError, load_train_file
from palaestra.trackers import import_client
from palaestra.trackers.mirror import Mirror, Trackers, numeric_values
from tests.support.tiny_runs import tiny_config, with_metrics

WARNING = "palaestra: warning: metrics mirror to "


class RecordingClient:
    def __init__(self, gate=None) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.finished = False
        self.gate = gate

    def log(self, data, step=None) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


def test_a_mirror_logs_rows_in_order_then_finishes(capsys):
    client = RecordingClient()
    trackers = Trackers([Mirror("fake", lambda: client)])
    for step in (1, 2, 3):
        trackers.log({"step": step, "reward_mean": step / 2, "label": "x", "kl": None})
    trackers.close(timeout_s=5)
    assert client.logged == [
        (1, {"reward_mean": 0.5}),
        (2, {"reward_mean": 1.0}),
        (3, {"reward_mean": 1.5}),
    ]
    assert client.finished
    assert capsys.readouterr().out == ""


def test_a_full_queue_drops_rows_with_one_warning(capsys):
    gate = threading.Event()
    client = RecordingClient(gate)
    mirror = Mirror("slow", lambda: client, queue_rows=2)
    started = time.monotonic()
    for step in range(1, 11):
        mirror.log(step, {"x": float(step)})
    assert time.monotonic() - started < 1  # never blocked
    gate.set()
    Trackers([mirror]).close(timeout_s=5)
    steps = [step for step, _ in client.logged]
    # The thread holds at most one row while it waits at the gate, and two wait in the queue.
    assert steps[:2] == [1, 2] and len(steps) <= 3 and client.finished
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(WARNING + "slow: it is not keeping up")


def test_only_finite_numbers_are_mirrored():
    row = {
        "step": 4,
        "time": 1.7e9,
        "reward_mean": 0.5,
        "zero_std_groups": 2,
        "kl": None,
        "note": "text",
        "loss": float("nan"),
        "grad_norm": float("inf"),
        "flag": True,
    }
    assert numeric_values(row) == {"reward_mean": 0.5, "zero_std_groups": 2}


def test_the_config_names_a_misspelt_tracker_field(tiny_model_dir, prompts_file):
    with pytest.raises(ValidationError, match="projekt"):
        TrackioConfig(project="p", projekt="q")
    with pytest.raises(ValidationError, match="tgas"):
        with_metrics(tiny_model_dir, prompts_file, {"kind": "wandb", "project": "p", "tgas": []})
    with pytest.raises(ValidationError, match="mode"):
        WandbConfig(project="p", mode="sometimes")


def test_metrics_in_the_run_config(tiny_model_dir, prompts_file):
    def described(metrics):
        return with_metrics(tiny_model_dir, prompts_file, metrics).to_json_dict()["metrics"]

    assert described(None) == []
    assert described(DashboardMetricConfig()) == [{"kind": "dashboard"}]
    assert tiny_config(tiny_model_dir, prompts_file).metrics == DashboardMetricConfig()
    both = described(
        [
            {"kind": "trackio", "project": "a"},
            WandbConfig(project="b", entity="team", tags=["grpo"]),
        ]
    )
    assert both[0] == {
        "kind": "trackio",
        "project": "a",
        "name": None,
        "group": None,
        "space_id": None,
        "server_url": None,
    }
    assert both[1] == {
        "kind": "wandb",
        "project": "b",
        "group": None,
        "entity": "team",
        "name": None,
        "mode": None,
        "dir": None,
        "tags": ["grpo"],
    }
    # A self-hosted server's write token stays out of config.json.
    (secret,) = described(
        TrackioConfig(project="a", server_url="http://host:7860/?write_token=s3cret&x=1")
    )
    assert secret["server_url"] == "http://host:7860/?x=1"


def test_a_missing_tracker_client_is_named_before_training(
    monkeypatch, tiny_model_dir, prompts_file
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    config = with_metrics(tiny_model_dir, prompts_file, WandbConfig(project="p"))
    with pytest.raises(ImportError, match=re.escape("pip install 'palaestra[wandb]'")):
        config.validate_here()
    # The same words if the run's own process lacks it (the mirror warns with them).
    with pytest.raises(ImportError, match=re.escape("pip install 'palaestra[wandb]'")):
        import_client("wandb")


def test_a_training_file_chooses_trackers(tmp_path, tiny_model_dir, prompts_file):
    path = tmp_path / "recipe.toml"
    head = f"""
model = {{ path = "{tiny_model_dir}" }}
[dataset]
path = "{prompts_file}"
input_column = "topic"
"""
    path.write_text(
        head
        + '[[metrics]]\nkind = "trackio"\nproject = "a"\n'
        + '[[metrics]]\nkind = "wandb"\nproject = "b"\nmode = "offline"\n'
    )
    config = load_train_file(path)
    assert config.metrics == [
        TrackioConfig(project="a"),
        WandbConfig(project="b", mode="offline"),
    ]
    path.write_text(head + '[[metrics]]\nkind = "trackio"\nprojet = "a"\n')
    with pytest.raises(TrainFileError, match="projet"):
        load_train_file(path)
