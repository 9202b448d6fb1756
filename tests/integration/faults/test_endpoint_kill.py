"""An endpoint process killed with SIGKILL: its record says so at once, and launching again with
``recreate_if_existing`` serves the same name."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from palaestra import ModelConfig
from palaestra.runs.endpoints import list_endpoints
from palaestra.serve import Endpoint


def test_a_killed_endpoint_reads_as_gone_and_comes_back_on_its_name(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PALAESTRA_HOME", str(tmp_path / "home"))
    model = ModelConfig(name="tiny", source=str(tiny_model_dir))
    first = Endpoint.launch(model, name="phoenix")
    try:
        first.wait_until_ready(timeout=120)
        os.kill(first.info["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while first.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        # As soon as anyone looks: not running, not listed, not found by name.
        assert not first.is_running
        assert [e["name"] for e in list_endpoints()] == []
        everything = list_endpoints(running_only=False)
        assert [(e["name"], e["running"]) for e in everything] == [("phoenix", False)]
        with pytest.raises(KeyError, match="no running endpoint 'phoenix'"):
            Endpoint.get("phoenix")
        # Refused, or (when the kill tears the socket down just as we connect) reset: either
        # way nothing answers.
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(f"{first.url}/health", timeout=2)

        second = Endpoint.launch(model, name="phoenix", recreate_if_existing=True)
        second.wait_until_ready(timeout=120)
        assert second.info["pid"] != first.info["pid"]
        assert Endpoint.get("phoenix").url == second.url
        reply = second.chat([{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply["content"] is not None
    finally:
        for endpoint in Endpoint.list():
            endpoint.stop()
