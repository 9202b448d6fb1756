"""Metrics mirrored to experiment trackers: real trackio and W&B (offline) runs read back with
the trackers' own storage, and trackers that fail or hang (fakes behind the config's ``open``).

The three tiny runs start together in one fixture, each in its own process (train.log is that
process's stdout), so the file costs about one run plus the end-of-run wait on a hung tracker.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from palaestra import TrackioConfig, WandbConfig
from tests.support.tiny_runs import with_metrics, write_topics

WARNING = "palaestra: warning: metrics mirror to "
HANG_S = 120.0


class RaisingClient:
    def log(self, data, step=None) -> None:
        raise ConnectionError("the tracker went away")

    def finish(self) -> None:
        pass


class HangingClient:
    def log(self, data, step=None) -> None:
        time.sleep(HANG_S)

    def finish(self) -> None:
        pass


class RaisingTracker(TrackioConfig):
    """A tracker whose run opens but whose every log call raises."""

    def open(self, run):
        return RaisingClient()


class HangingTracker(TrackioConfig):
    """A tracker whose log call never comes back within the run."""

    def open(self, run):
        return HangingClient()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Three 3-step runs, launched side by side: one mirrored to trackio (as a sweep variant),
    one to W&B offline, one to a trackio server with no write token, a tracker that raises at
    each log and one that hangs."""
    root = tmp_path_factory.mktemp("trackers")
    data = write_topics(root / "topics.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(root / "home"))
        patch.setenv("TRACKIO_DIR", str(root / "trackio"))
        patch.setenv("WANDB_SILENT", "true")
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("OMP_NUM_THREADS", "2")  # three tiny runs side by side, not oversubscribed
        patch.delenv("TRACKIO_WRITE_TOKEN", raising=False)
        patch.delenv("WANDB_API_KEY", raising=False)
        configs = {
            "trackio": with_metrics(
                tiny_model_dir,
                data,
                TrackioConfig(project="mirror-test"),
                group_id="sweep-1",
                group_overrides={"recipe.lr": 0.01},
            ),
            "wandb": with_metrics(
                tiny_model_dir,
                data,
                [WandbConfig(project="mirror-test", mode="offline", dir=str(root / "wb"))],
            ),
            "failing": with_metrics(
                tiny_model_dir,
                data,
                [
                    TrackioConfig(project="no-token", server_url="http://127.0.0.1:9"),
                    RaisingTracker(project="raises"),
                    HangingTracker(project="hangs"),
                ],
            ),
        }
        started = time.monotonic()
        launched = {kind: config.launch() for kind, config in configs.items()}
        try:
            results = {kind: run.result(timeout=HANG_S) for kind, run in launched.items()}
        finally:
            for run in launched.values():
                run.stop(timeout=10)  # nothing to do once ended; a test that failed stops here
        yield {
            "results": results,
            "elapsed_s": time.monotonic() - started,
            "trackio_dir": root / "trackio",
            "wandb_dir": root / "wb",
        }


def expected_values(row: dict) -> dict:
    """The numbers of a metrics.jsonl row a tracker should hold (worked out here, not with the
    mirror's own filter): all but the step (the x-axis) and the time (trackers stamp their own)."""
    return {
        key: value
        for key, value in row.items()
        if key not in ("step", "time")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


READ_TRACKIO = """
import json, sys
import trackio
from trackio.sqlite_storage import SQLiteStorage

project = sys.argv[1]
runs = {run.name: run.config for run in trackio.Api().runs(project)}
logs = {name: SQLiteStorage.get_logs(project, name) for name in runs}
print(json.dumps({"configs": runs, "logs": logs}, default=str))
"""


def test_a_trackio_mirror_holds_every_step_of_metrics_jsonl(runs):
    result = runs["results"]["trackio"]
    rows = result.metrics()
    assert [row["step"] for row in rows] == [1, 2, 3]
    # trackio fixes its storage folder when it is imported: read it in a fresh interpreter.
    env = {**os.environ, "TRACKIO_DIR": str(runs["trackio_dir"])}
    proc = subprocess.run(
        [sys.executable, "-c", READ_TRACKIO, "mirror-test"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored = json.loads(proc.stdout.splitlines()[-1])
    run_id = result.training_run_id
    assert list(stored["configs"]) == [run_id]  # named by the run id
    logs = stored["logs"][run_id]
    assert [log["step"] for log in logs] == [1, 2, 3]
    assert [log["reward_mean"] for log in logs] == [row["reward_mean"] for row in rows]
    for log, row in zip(logs, rows, strict=True):
        mirrored = {k: v for k, v in log.items() if k not in ("step", "timestamp")}
        assert mirrored == expected_values(row)
    config = stored["configs"][run_id]
    assert config["_Group"] == "sweep-1"  # the sweep, by default
    assert config["recipe.lr"] == 0.01  # the variant's grid value, flat
    assert config["run_id"] == run_id
    assert config["recipe"]["num_rollout"] == 3
    assert config["metrics"] == [TrackioConfig(project="mirror-test").describe()]


def wandb_records(path: Path):
    """The records of a W&B run's ``.wandb`` file: a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks, each ``crc32c:u32 length:u16 type:u8`` then data; type 1 is a
    whole record, 2/3/4 the first/middle/last piece of one), each a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zero padding up to the block's end
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_a_wandb_offline_mirror_holds_every_step_of_metrics_jsonl(runs):
    result = runs["results"]["wandb"]
    rows = result.metrics()
    assert [row["step"] for row in rows] == [1, 2, 3]
    (path,) = runs["wandb_dir"].glob("wandb/offline-run-*/run-*.wandb")
    history, run_records = {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            history[record.history.step.num] = {
                key: value for key, value in values.items() if not key.startswith("_")
            }
        elif kind == "run":
            run_records.append(record.run)
    assert sorted(history) == [1, 2, 3]
    assert [history[step]["reward_mean"] for step in (1, 2, 3)] == [
        row["reward_mean"] for row in rows
    ]
    for row in rows:
        assert history[row["step"]] == expected_values(row)
    run = run_records[0]
    assert run.run_id == run.display_name == result.training_run_id
    assert run.project == "mirror-test"
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for item in run.config.update
    }
    assert config["run_id"] == result.training_run_id
    assert config["metrics"][0]["kind"] == "wandb"


def test_failing_and_hanging_trackers_never_fail_or_slow_the_run(runs):
    result = runs["results"]["failing"]
    assert [row["step"] for row in result.metrics()] == [1, 2, 3]
    assert result.status == "completed"
    # Each tracker is warned about once, in one line that names it and what went wrong.
    log = (result.path / "train.log").read_text()
    warnings = [line for line in log.splitlines() if line.startswith(WARNING)]
    assert len(warnings) == 3, warnings
    (no_token,) = [w for w in warnings if "(project 'no-token')" in w]
    assert "ValueError while opening its run" in no_token and "write token" in no_token
    (raises,) = [w for w in warnings if "(project 'raises')" in w]
    assert "ConnectionError while logging: the tracker went away" in raises
    (hangs,) = [w for w in warnings if "(project 'hangs')" in w]
    assert "still busy when the run ended" in hangs
    # The hung tracker held neither a step nor the end of the run: one of its log calls takes
    # HANG_S (120 s), and the three runs together took about one run plus the 10 s close wait.
    assert max(row["step_s"] for row in result.metrics()) < HANG_S / 4
    assert runs["elapsed_s"] < HANG_S * 3 / 4, runs["elapsed_s"]
