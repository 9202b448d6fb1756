"""Nobody escapes the home: a run, eval, group or endpoint id from a URL or the command line
names a file inside its folder, or is refused (404, or an error exit naming it), and nothing
outside the home is read, written or signalled. And the servers bind this machine only unless
told otherwise."""

from __future__ import annotations

import inspect
import json
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from palaestra.runs.liveness import pid_alive, process_start_time

SECRET = "planted-secret-7f3a"


def plant(folder: Path, sleeper: subprocess.Popen) -> None:
    """Everything a run, group, eval or endpoint record holds, with ``SECRET`` in each file and
    a live process (``sleeper``) named as the run's and the endpoint's."""
    process = {"pid": sleeper.pid, "pid_start": process_start_time(sleeper.pid)}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run_id": SECRET, "model": {"name": SECRET}}))
    (folder / "status.json").write_text(json.dumps({"state": "running", "step": 1, **process}))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "secret": SECRET}) + "\n")
    (folder / "samples.jsonl").write_text(json.dumps({"step": 1, "prompt": SECRET}) + "\n")
    (folder / "train.log").write_text(f"{SECRET}\n")
    (folder / "group.json").write_text(json.dumps({"group_id": SECRET, "variants": []}))
    # <name>.json beside the folder: an eval record and an endpoint record in one.
    record = {"id": SECRET, "name": SECRET, "url": "http://127.0.0.1:9/v1", **process}
    folder.with_suffix(".json").write_text(json.dumps(record))
    (folder / "driver.log").write_text(f"{SECRET}\n")


@pytest.fixture
def sleeper():
    process = subprocess.Popen(["sleep", "120"])
    yield process
    alive = pid_alive(process.pid, process_start_time(process.pid))
    process.kill()
    process.wait()
    assert alive, "a planted record's process was signalled"


@pytest.fixture
def escapes(home, tmp_path, sleeper) -> list[str]:
    """Ids that would reach planted files: inside the home but outside its folder
    (``../planted`` from runs/, groups/; ``planted.json`` beside evals/, endpoints/), outside
    the home (``../../outside``), and absolute paths; plus names with slashes and dots."""
    for folder in (home / "runs", home / "groups", home / "evals", home / "endpoints"):
        folder.mkdir(parents=True)
    plant(home / "planted", sleeper)
    plant(tmp_path / "outside", sleeper)
    return [
        "../planted",
        "../../outside",
        str(tmp_path / "outside"),
        str(home / "planted"),
        "..",
        ".",
        "planted/../../planted",
        "./../planted",
        ".hidden",
    ]


@pytest.fixture
def client(home) -> TestClient:
    from palaestra.dashboard.app import create_app

    return TestClient(create_app())


def encoded(item: str) -> str:
    """``item`` with every character percent-encoded (``..`` as ``%2e%2e``): what reaches the
    router is the id itself, not a path the client has resolved."""
    return "".join(f"%{byte:02x}" for byte in item.encode())


ROUTES = [
    "/api/runs/{}",
    "/api/runs/{}/metrics",
    "/api/runs/{}/samples",
    "/api/runs/{}/log",
    "/api/evals/{}",
    "/api/groups/{}",
]


def test_dashboard_routes_refuse_ids_outside_their_folder(client, escapes):
    for route in ROUTES:
        for item in escapes:
            response = client.get(route.format(encoded(item)))
            assert response.status_code == 404, (route, item, response.text)
            assert SECRET not in response.text, (route, item)
            # Slashes encoded, or left as they are (the client resolves dot segments: ``.``
            # may become the runs list): never anything planted.
            for path in (quote(item, safe=""), item):
                assert SECRET not in client.get(route.format(path)).text, (route, path)


def test_compare_refuses_ids_outside_the_runs_folder(client, escapes):
    for item in escapes:
        for query in (f"runs={quote(item, safe='')}", f"run={quote(item, safe='')}"):
            response = client.get(f"/api/compare?{query}")
            assert response.status_code == 404, (query, response.text)
            assert SECRET not in response.text
    # An escape among real ids is refused too, naming the bad one.
    response = client.get("/api/compare", params={"runs": "../../outside,../planted"})
    assert response.status_code == 404 and "../../outside" in response.json()["detail"]


def test_static_files_stay_in_the_static_folder(client):
    from palaestra.dashboard import app

    source = Path(app.__file__).read_text()
    for path in ("../app.py", "../../cli.py", "..%2fapp.py", "%2e%2e%2fapp.py", "%2e%2e/app.py"):
        response = client.get(f"/static/{path}")
        assert response.status_code == 404, path
        assert "def create_app" not in response.text and source not in response.text


def test_the_store_refuses_ids_outside_their_folder(home, escapes):
    from palaestra.runs import export, groups
    from palaestra.runs.endpoints import endpoint_files
    from palaestra.runs.evals import read_eval
    from palaestra.runs.handles import RunView
    from palaestra.runs.records import log_tail, run_detail, run_samples
    from palaestra.runs.registry import open_run, run_directory

    for item in [*escapes, "planted\n"]:
        for read in (open_run, run_directory, RunView.from_id, run_detail, run_samples, log_tail):
            with pytest.raises(KeyError, match="is not a run id"):
                read(item)
        for read in (groups.group_path, groups.read_group, groups.group_detail):
            with pytest.raises(KeyError, match="is not a group id"):
                read(item)
        with pytest.raises(KeyError, match="no eval"):
            read_eval(item)
        with pytest.raises(KeyError, match="no run or group"):
            export.metrics_table(item)
        with pytest.raises(ValueError, match="is not an endpoint name"):
            endpoint_files(item)


def test_an_endpoint_name_cannot_write_outside_the_endpoints_folder(home, tmp_path, sleeper):
    from palaestra.runs.endpoints import endpoint_files

    for name in ("../../written", str(tmp_path / "written"), "a/b"):
        with pytest.raises(ValueError, match="is not an endpoint name"):
            endpoint_files(name).write({"name": name})
    assert not list(tmp_path.rglob("written*")) and not (home / "endpoints" / "a").exists()


CLI = [
    ["run", "get", "{}"],
    ["run", "get", "--json", "{}"],
    ["run", "logs", "{}"],
    ["run", "stop", "{}"],
    ["run", "export", "{}"],
    ["run", "export", "--format", "jsonl", "{}"],
    ["group", "get", "{}"],
    ["group", "get", "--json", "{}"],
    ["group", "stop", "{}"],
    ["endpoint", "stop", "{}"],
]


def test_cli_refuses_ids_outside_their_folder(escapes, capsys):
    """An error exit naming the id, nothing of the planted files shown, the planted process
    left alone (``sleeper`` checks it)."""
    from palaestra.cli import main

    for command in CLI:
        for item in [*escapes, "/etc"]:
            argv = [item if part == "{}" else part for part in command]
            assert main(argv) == 1, argv
            out, err = capsys.readouterr()
            assert item in err and SECRET not in out + err, (argv, out, err)
            assert out == "", argv


def test_servers_bind_this_machine_by_default():
    from palaestra.cli import build_parser
    from palaestra.serve import Endpoint
    from palaestra.serve.server import serve

    assert build_parser().parse_args(["serve", "some-model"]).host == "127.0.0.1"
    assert build_parser().parse_args(["dashboard"]).host == "127.0.0.1"
    assert inspect.signature(Endpoint.launch).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
