"""Headless Debian Chromium driven by playwright, and `palaestra dashboard` for it to open.

Playwright drives the system's ``chromium``; it never downloads a browser. Without one the
browser tests skip, unless PALAESTRA_REQUIRE_BROWSER is set (``.ci/run`` sets it), which makes a
missing browser an error. Screenshots go to $PALAESTRA_TEST_ARTIFACTS (default
build/test-artifacts/).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PALAESTRA_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_or_skip():
    """The chromium binary and ``playwright.sync_api``; called at a test module's top, it skips
    the module where either is missing (or fails it, under PALAESTRA_REQUIRE_BROWSER)."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).is_file():
        if os.environ.get("PALAESTRA_REQUIRE_BROWSER"):
            raise RuntimeError("PALAESTRA_REQUIRE_BROWSER is set but there is no chromium binary")
        pytest.skip("needs Debian's chromium (apt-get install chromium)", allow_module_level=True)
    return chromium, pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_dashboard(home: Path) -> tuple[subprocess.Popen, str]:
    """`palaestra dashboard` over ``home`` on a free port, and its URL once it accepts."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PALAESTRA_HOME": str(home)}
    server = subprocess.Popen(
        [sys.executable, "-m", "palaestra.cli", "dashboard", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise AssertionError(server.stdout.read().decode()) from None
            time.sleep(0.1)


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
