"""The dashboard's HTTP side over real run directories: a completed and a failed tiny run, plus
eval and endpoint records written as the serving side writes them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest
from fastapi.testclient import TestClient

from palaestra import RunFailedError
from palaestra.dashboard.app import _finite, create_app
from palaestra.runs.directory import read_jsonl
from palaestra.runs.liveness import process_start_time
from tests.support.tiny_runs import count_lowercase, tiny_config, write_topics


async def nan_reward(args, sample, **kwargs) -> float:
    return float("nan")


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    """A home with a failed run, then a completed 3-step run, evals and endpoints."""
    home = tmp_path_factory.mktemp("dashboard") / "home"
    data = write_topics(home.parent / "topics.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        with pytest.raises(RunFailedError):
            tiny_config(tiny_model_dir, data, reward=nan_reward, num_rollout=1).train()
        time.sleep(0.05)  # the runs list orders by creation time
        done = tiny_config(tiny_model_dir, data, reward=count_lowercase).train()
    (failed_id,) = [p.name for p in (home / "runs").iterdir() if p.name != done.training_run_id]

    (home / "evals").mkdir()
    scored = {
        "id": "ev-run",
        "created_at": time.time(),
        "dataset": "topics.jsonl [train]",
        "endpoint": "tiny-ep",
        "model": "tiny",
        "checkpoint": str(done.latest_checkpoint().path),
        "run_id": done.training_run_id,
        "step": 3,
        "mean": 2.5,
        "total": 2,
        "rows": [
            {"prompt": "Say rain", "response": "rain <b>now</b>", "score": 3.0},
            {"prompt": "Say sun", "response": "sun", "score": 2.0},
        ],
    }
    base = {**scored, "id": "ev-base", "checkpoint": None, "run_id": None, "step": None}
    base["mean"] = 1.0
    for record in (scored, base):
        (home / "evals" / f"{record['id']}.json").write_text(json.dumps(record))

    (home / "endpoints").mkdir()
    exited = subprocess.Popen(["true"])
    exited.wait()
    me = os.getpid()
    endpoint = {
        "name": "tiny-ep",
        "url": "http://127.0.0.1:9999/v1",
        "host": "127.0.0.1",
        "port": 9999,
        "pid": me,
        "pid_start": process_start_time(me),
        "model": "tiny",
        "checkpoint": scored["checkpoint"],
        "run_id": done.training_run_id,
        "step": 3,
        "started_at": time.time(),
        "log": "/tmp/tiny-ep.log",
        "authenticated": True,
        "api_key": "sk-do-not-show",
    }
    gone = {**endpoint, "name": "gone", "pid": exited.pid, "pid_start": 1}
    reused = {**endpoint, "name": "reused", "pid_start": process_start_time(me) - 1}
    for record in (endpoint, gone, reused):
        (home / "endpoints" / f"{record['name']}.json").write_text(json.dumps(record))
    return {
        "client": TestClient(create_app(home)),
        "home": home,
        "done": done,
        "failed_id": failed_id,
    }


def test_runs_list_shows_state_progress_and_latest_reward(site):
    client, done = site["client"], site["done"]
    response = client.get("/api/runs")
    assert response.status_code == 200
    first, second = response.json()
    assert (first["run_id"], second["run_id"]) == (done.training_run_id, site["failed_id"])
    assert first["state"] == "completed" and second["state"] == "failed"
    assert (first["step"], first["total_steps"]) == (3, 3)
    assert first["model"] == "tiny" and first["dataset"] == "topics.jsonl [train]"
    assert first["reward_mean"] == pytest.approx(done.metrics()[-1]["reward_mean"])
    assert first["duration_s"] > 0
    assert "must be finite" in second["error"]
    only_failed = client.get("/api/runs", params={"status": "failed"}).json()
    assert [r["run_id"] for r in only_failed] == [site["failed_id"]]
    assert client.get("/api/runs", params={"status": "running"}).json() == []
    assert len(client.get("/api/runs", params={"limit": 1}).json()) == 1


def test_run_detail_has_recipe_checkpoints_evals_and_endpoints(site):
    client, done = site["client"], site["done"]
    run = client.get(f"/api/runs/{done.training_run_id}").json()
    assert run["checkpoints"] == [{"step": 3, "path": str(done.latest_checkpoint().path)}]
    assert run["config"]["recipe"]["num_rollout"] == 3
    assert (
        run["config"]["recipe"]["custom_rm_function"] == "tests.support.tiny_runs:count_lowercase"
    )
    assert [e["id"] for e in run["evals"]] == ["ev-run"]
    assert "rows" not in run["evals"][0]
    assert [e["name"] for e in run["endpoints"]] == ["tiny-ep"]
    failed = client.get(f"/api/runs/{site['failed_id']}").json()
    assert failed["state"] == "failed" and "RewardError" in failed["status"]["traceback"]


def test_metrics_and_samples_are_the_run_files(site):
    client, done = site["client"], site["done"]
    base = f"/api/runs/{done.training_run_id}"
    assert client.get(f"{base}/metrics").json() == read_jsonl(done.path / "metrics.jsonl")
    step_2 = client.get(f"{base}/samples", params={"step": 2}).json()
    on_disk = [row for row in read_jsonl(done.path / "samples.jsonl") if row["step"] == 2]
    assert step_2["step"] == 2 and step_2["steps"] == [1, 2, 3]
    assert step_2["samples"] == on_disk and len(on_disk) == 2 * 4
    latest = client.get(f"{base}/samples").json()
    assert latest["step"] == 3 and {s["step"] for s in latest["samples"]} == {3}
    # Runs trained in-process print to the caller, so there is no train.log to tail.
    assert client.get(f"{base}/log").text == ""


def test_unknown_runs_and_evals_are_404_naming_them(site):
    client = site["client"]
    response = client.get("/api/runs/no-such-run")
    assert response.status_code == 404 and "no-such-run" in response.json()["detail"]
    assert client.get("/api/runs/..%2Fevals/metrics").status_code == 404
    assert client.get("/api/evals/nope").status_code == 404
    assert client.get("/api/evals/..").status_code == 404


def test_endpoints_list_only_live_servers_and_never_their_keys(site):
    response = site["client"].get("/api/endpoints")
    (endpoint,) = response.json()
    assert endpoint["name"] == "tiny-ep" and endpoint["url"] == "http://127.0.0.1:9999/v1"
    assert endpoint["running"] is True and endpoint["authenticated"] is True
    assert "sk-do-not-show" not in response.text and "api_key" not in response.text


def test_evals_list_without_rows_and_one_eval_with_them(site):
    client = site["client"]
    listed = client.get("/api/evals").json()
    assert {e["id"] for e in listed} == {"ev-run", "ev-base"}
    assert all("rows" not in e for e in listed)
    full = client.get("/api/evals/ev-run").json()
    assert [row["score"] for row in full["rows"]] == [3.0, 2.0]


def test_pages_and_assets_are_served_and_the_app_is_read_only(site):
    client, run_id = site["client"], site["done"].training_run_id
    for path in ("/", f"/runs/{run_id}"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/static/app.js">' in page.text
    script = client.get("/static/chart.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert client.get("/api/runs").headers["cache-control"] == "no-store"
    assert client.post("/api/runs").status_code == 405
    assert client.delete(f"/api/runs/{run_id}").status_code == 405


def test_non_finite_numbers_become_null():
    assert _finite({"a": [1.0, math.nan], "b": math.inf, "c": "x"}) == {
        "a": [1.0, None],
        "b": None,
        "c": "x",
    }


def test_dashboard_binds_to_loopback_by_default():
    from palaestra.cli import build_parser

    args = build_parser().parse_args(["dashboard"])
    assert (args.host, args.port) == ("127.0.0.1", 8765)
