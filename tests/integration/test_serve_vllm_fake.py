"""What palaestra does around ``vllm serve`` (records, readiness, keys, stopping), with a stand-in
server process (tests/support/fake_vllm_server.py), so it runs in seconds without vLLM."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from palaestra import ModelConfig
from palaestra.cli import main
from palaestra.runs.endpoints import list_endpoints
from palaestra.serve import Endpoint, vllm_server

FAKE_SERVER = "tests.support.fake_vllm_server"


@pytest.fixture
def base(tmp_path) -> ModelConfig:
    """A local model folder (vLLM is never started: only its folder's path matters)."""
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return ModelConfig(name="base", source=str(folder), default_max_tokens=24)


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """vLLM "installed" as tests/support/fake_vllm_server.py, on a CPU; returns the file in which
    the fake writes what it was started with."""
    import palaestra.serve.endpoint

    seen = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(seen))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_server, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_server, "VLLM_SERVER", FAKE_SERVER)
    monkeypatch.setattr(palaestra.serve.endpoint, "VLLM_SERVER", FAKE_SERVER)
    return seen


def test_a_launched_vllm_endpoint_is_recorded_ready_keyed_and_stopped(home, base, fake_vllm):
    endpoint = Endpoint.launch(base, name="on-fake", unauthenticated=False, engine="vllm")
    try:
        assert endpoint.wait_until_ready(timeout=60) is endpoint
        found = Endpoint.get("on-fake")
        assert (found.engine, found.url, found.api_key) == ("vllm", endpoint.url, endpoint.api_key)
        assert [e["engine"] for e in list_endpoints()] == ["vllm"]
        seen = json.loads(fake_vllm.read_text())
        assert endpoint.api_key not in " ".join(seen["argv"])  # ps shows the command line
        assert seen["env"]["VLLM_API_KEY"] == endpoint.api_key
        assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
        wrong = {"Authorization": "Bearer pal-wrong"}
        assert httpx.get(f"{endpoint.url}/v1/models", headers=wrong).status_code == 401
    finally:
        endpoint.stop()
    assert not endpoint.is_running and Endpoint.list() == []
    assert not (home / "endpoints" / "on-fake.key").exists()


def test_palaestra_serve_engine_vllm_is_listed_while_it_runs_and_stops(home, base, fake_vllm):
    exit_status = []
    argv = ["serve", base.source, "--engine", "vllm", "--name", "fg", "--port", "0"]
    foreground = threading.Thread(target=lambda: exit_status.append(main(argv)))
    foreground.start()
    try:
        deadline = time.monotonic() + 60
        while not [e for e in Endpoint.list() if e.name == "fg"]:
            assert foreground.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        endpoint = Endpoint.get("fg").wait_until_ready(timeout=60)
        assert endpoint.engine == "vllm" and endpoint.api_key is None
        assert json.loads(fake_vllm.read_text())["env"]["VLLM_API_KEY"] == ""  # open
        endpoint.stop()  # as `palaestra endpoint stop fg` does
    finally:
        foreground.join(timeout=60)
    assert exit_status == [0]  # asked to stop: not a failure
    assert Endpoint.list() == []
