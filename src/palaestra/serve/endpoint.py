"""Endpoint: a model (or a checkpoint of it) served over HTTP in its own process.

Every endpoint is recorded under ``<home>/endpoints``, so any process can find it by name:

    <name>.json   name, url, host, port, pid, pid_start, model, checkpoint, run_id, step,
                  started_at, log, authenticated (written by the launcher, url by the server)
    <name>.key    the API key, readable by the owner only (authenticated endpoints)
    <name>.log    the server's output
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from palaestra.atomic import write_bytes_atomic, write_json_atomic
from palaestra.home import palaestra_home
from palaestra.models.config import ModelConfig
from palaestra.runs.directory import pid_alive, process_start_time


class EndpointError(RuntimeError):
    """The endpoint's process died, never became ready, or answered a request with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def endpoints_root(home: Path | None = None) -> Path:
    root = (home or palaestra_home()) / "endpoints"
    root.mkdir(parents=True, exist_ok=True)
    return root


def default_name(model: ModelConfig, checkpoint: Any = None) -> str:
    """``<model>`` for the base model, ``<model>-<run id>-step<N>`` for a checkpoint."""
    parts = [model.name]
    if checkpoint is not None:
        parts += [
            checkpoint.run_id or Path(checkpoint.path).parent.parent.name,
            f"step{checkpoint.step}",
        ]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(parts)).strip("-")


def endpoint_record(
    name: str,
    model: ModelConfig,
    checkpoint: Any,
    host: str,
    port: int | None,
    authenticated: bool,
    log: Path | None,
) -> dict[str, Any]:
    """What ``<name>.json`` holds before the server has bound its port (``url`` and ``pid``
    come later)."""
    return {
        "name": name,
        "url": None,
        "host": host,
        "port": port,
        "pid": None,
        "pid_start": None,
        "model": model.name,
        "checkpoint": str(checkpoint.path) if checkpoint is not None else None,
        "run_id": checkpoint.run_id if checkpoint is not None else None,
        "step": checkpoint.step if checkpoint is not None else None,
        "started_at": time.time(),
        "log": str(log) if log is not None else None,
        "authenticated": authenticated,
    }


class Endpoint:
    """A handle on a served model: its ``url``, its ``api_key`` (None when unauthenticated),
    ``chat`` to talk to it, ``stop`` to end it."""

    def __init__(self, info: dict[str, Any], api_key: str | None = None, process=None) -> None:
        self.info = info
        self.name: str = info["name"]
        self.api_key = api_key
        self._process = process
        self._client = None

    # -- finding and starting ------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        model: ModelConfig,
        checkpoint: Any = None,
        *,
        name: str | None = None,
        unauthenticated: bool = True,
        recreate_if_existing: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        bind_timeout: float = 60.0,
    ) -> Endpoint:
        """Serve ``model`` (the base weights, or ``checkpoint``'s: a Checkpoint or a path) in a
        new process. Returns once the port is bound; ``wait_until_ready`` waits for the model.

        An endpoint already serving ``name`` is reused, or with ``recreate_if_existing``
        stopped and replaced.
        """
        from palaestra.runs.handles import Checkpoint

        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint.from_path(checkpoint)
        if checkpoint is not None and not any(
            (Path(checkpoint.path) / f).is_file() for f in ("config.json", "adapter_config.json")
        ):
            raise FileNotFoundError(
                f"checkpoint {checkpoint.path} has neither config.json nor adapter_config.json"
            )
        name = name or default_name(model, checkpoint)
        existing = cls._find(name)
        if existing is not None:
            if not recreate_if_existing:
                return existing
            existing.stop()

        root = endpoints_root()
        record, log = root / f"{name}.json", root / f"{name}.log"
        key_file = root / f"{name}.key"
        key_file.unlink(missing_ok=True)
        api_key = None if unauthenticated else f"pal-{secrets.token_urlsafe(24)}"
        if api_key is not None:
            write_bytes_atomic(key_file, api_key.encode())
            key_file.chmod(0o600)
        info = endpoint_record(name, model, checkpoint, host, port, api_key is not None, log)
        write_json_atomic(record, info)
        # Not *.json: the folder's *.json files are endpoint records.
        spec = root / f"{name}.spec"
        write_json_atomic(
            spec,
            {
                "name": name,
                "model": model.model_dump(),
                "checkpoint": info["checkpoint"],
                "host": host,
                "port": port,
                "record": str(record),
            },
        )
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        if api_key is not None:
            env["PALAESTRA_API_KEY"] = api_key  # not on the command line, where ps shows it
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "palaestra.serve.server", str(spec)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        info = {**info, "pid": process.pid, "pid_start": process_start_time(process.pid)}
        write_json_atomic(record, {**json.loads(record.read_text()), **info})
        endpoint = cls(info, api_key, process)
        deadline = time.monotonic() + bind_timeout
        while endpoint._reload().get("url") is None:
            endpoint._raise_if_dead("did not start")
            if time.monotonic() > deadline:
                endpoint.stop()
                raise EndpointError(f"endpoint {name} did not bind a port within {bind_timeout} s")
            time.sleep(0.05)
        return endpoint

    @classmethod
    def get(cls, name: str) -> Endpoint:
        """The running endpoint called ``name``."""
        endpoint = cls._find(name)
        if endpoint is None:
            running = ", ".join(e.name for e in cls.list()) or "none"
            raise KeyError(f"no running endpoint {name!r} (running: {running})")
        return endpoint

    @classmethod
    def list(cls) -> list[Endpoint]:
        """Every running endpoint, newest first."""
        found = [cls._find(p.stem) for p in endpoints_root().glob("*.json")]
        endpoints = [e for e in found if e is not None]
        return sorted(endpoints, key=lambda e: e.info.get("started_at", 0), reverse=True)

    @classmethod
    def _find(cls, name: str) -> Endpoint | None:
        record = endpoints_root() / f"{name}.json"
        try:
            info = json.loads(record.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if not pid_alive(info.get("pid"), info.get("pid_start")):
            return None
        key_file = record.with_suffix(".key")
        api_key = key_file.read_text().strip() if key_file.is_file() else None
        return cls(info, api_key)

    # -- state ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.info["url"] or self._reload()["url"]

    @property
    def is_running(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            return False
        return pid_alive(self.info.get("pid"), self.info.get("pid_start"))

    def _reload(self) -> dict[str, Any]:
        record = endpoints_root() / f"{self.name}.json"
        try:
            self.info = {**self.info, **json.loads(record.read_text())}
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        return self.info

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.info["log"]).read_text(errors="replace")
        except (FileNotFoundError, KeyError, TypeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _raise_if_dead(self, what: str) -> None:
        if not self.is_running:
            raise EndpointError(
                f"endpoint {self.name} {what}: its process exited. Last lines of "
                f"{self.info.get('log')}:\n{self.log_tail()}"
            )

    def wait_until_ready(self, timeout: float = 15 * 60) -> Endpoint:
        """Wait until the model is loaded and answering. Raises EndpointError with the server's
        last log lines if its process died, TimeoutError if ``timeout`` seconds pass first."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_dead("failed")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"endpoint {self.name} not ready after {timeout} s")
            time.sleep(0.2)

    # -- requests -------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(base_url=self.url, headers=headers)
        response = self._client.post(path, json=body, timeout=timeout)
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise EndpointError(
                f"{self.name}{path} answered {response.status_code}: {message}",
                response.status_code,
            )
        return response.json()

    def chat(
        self, messages: list[dict[str, Any]], timeout: float = 600, **extra: Any
    ) -> dict[str, Any]:
        """The assistant's reply message (``content``, and ``reasoning_content`` when the model
        thought). ``extra`` goes into the request body: ``max_tokens``, ``temperature``,
        ``chat_template_kwargs``... ``chat_completion`` returns the whole response."""
        return self.chat_completion(messages, timeout, **extra)["choices"][0]["message"]

    def chat_completion(
        self, messages: list[dict[str, Any]], timeout: float = 600, **extra: Any
    ) -> dict[str, Any]:
        """The whole ``/v1/chat/completions`` response."""
        body = {"model": self.name, "messages": messages, **extra}
        return self._post("/v1/chat/completions", body, timeout)

    def complete(self, prompt: str, timeout: float = 600, **extra: Any) -> str:
        """Raw text completion of ``prompt`` (no chat template)."""
        return self.completion(prompt, timeout, **extra)["choices"][0]["text"]

    def completion(self, prompt: str, timeout: float = 600, **extra: Any) -> dict[str, Any]:
        """The whole ``/v1/completions`` response."""
        body = {"model": self.name, "prompt": prompt, **extra}
        return self._post("/v1/completions", body, timeout)

    # -- stopping -------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """End the server (SIGTERM, then SIGKILL after ``timeout``) and forget it."""
        pid, start = self.info.get("pid"), self.info.get("pid_start")
        if pid_alive(pid, start):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.is_running:
                time.sleep(0.1)
            if self.is_running:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._process is not None:
            self._process.wait()
        if self._client is not None:
            self._client.close()
            self._client = None
        root = endpoints_root()
        for suffix in (".json", ".key", ".spec"):
            (root / f"{self.name}{suffix}").unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"Endpoint({self.name!r}, url={self.info.get('url')!r})"
