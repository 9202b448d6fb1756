"""Endpoint records: the one module that writes and reads ``<home>/endpoints``.

    <name>.json   name, url, host, port, pid, pid_start, model, checkpoint, run_id, step,
                  started_at, log, authenticated, engine ("torch": palaestra's server, "vllm":
                  `vllm serve`) (written by the launcher, url by the server)
    <name>.key    the API key, readable by the owner only (authenticated endpoints)
    <name>.log    the server's output
    <name>.spec   what the server process serves (model, checkpoint, host, port); not *.json,
                  because the folder's *.json files are the records

A record names a running server until it is removed; one whose process died is skipped by
every reader (its pid is checked together with the process's start time).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palaestra.atomic import write_bytes_atomic, write_json_atomic
from palaestra.home import palaestra_home
from palaestra.runs.directory import read_json
from palaestra.runs.liveness import pid_alive
from palaestra.runs.registry import SAFE_NAME

ENDPOINT_FIELDS = (
    "name",
    "url",
    "host",
    "port",
    "pid",
    "model",
    "checkpoint",
    "run_id",
    "step",
    "started_at",
    "log",
    "authenticated",
    "engine",
)
"""What an endpoint record may show; anything else in its file (a key, a token) never leaves."""


@dataclass(frozen=True)
class EndpointFiles:
    """The files of the endpoint ``name`` in the endpoints folder ``root``."""

    root: Path
    name: str

    @property
    def record(self) -> Path:
        return self.root / f"{self.name}.json"

    @property
    def key(self) -> Path:
        return self.root / f"{self.name}.key"

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"

    @property
    def spec(self) -> Path:
        return self.root / f"{self.name}.spec"

    def read(self) -> dict[str, Any] | None:
        """The record, or None when there is none (or it is being replaced)."""
        return read_json(self.record)

    def write(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.record, record)

    def update(self, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the record (the launcher and the server each add theirs)."""
        record = {**(self.read() or {}), **fields}
        self.write(record)
        return record

    def read_key(self) -> str | None:
        return self.key.read_text().strip() if self.key.is_file() else None

    def write_key(self, api_key: str | None) -> None:
        """Keep ``api_key`` readable by its owner only; None removes an old one."""
        self.key.unlink(missing_ok=True)
        if api_key is not None:
            write_bytes_atomic(self.key, api_key.encode())
            self.key.chmod(0o600)

    def write_spec(self, spec: dict[str, Any]) -> None:
        write_json_atomic(self.spec, {**spec, "name": self.name, "record": str(self.record)})

    def remove(self) -> None:
        """Forget the endpoint: its record, key and spec go; its log stays for reading."""
        for path in (self.record, self.key, self.spec):
            path.unlink(missing_ok=True)


def endpoints_root(home: Path | None = None) -> Path:
    root = (home or palaestra_home()) / "endpoints"
    root.mkdir(parents=True, exist_ok=True)
    return root


def endpoint_files(name: str, home: Path | None = None) -> EndpointFiles:
    """The files of endpoint ``name``; ValueError unless the name is a plain file name (a name
    from the command line or a caller never reaches, or writes, outside the endpoints folder)."""
    if not SAFE_NAME.match(name):
        raise ValueError(
            f"{name!r} is not an endpoint name (letters, digits, '.', '_' and '-'; not starting "
            "with '.' or '-')"
        )
    return EndpointFiles(endpoints_root(home), name)


def read_spec(path: str | Path) -> tuple[EndpointFiles, dict[str, Any]]:
    """The spec a server process was started with, and the files of its endpoint."""
    spec = json.loads(Path(path).read_text())
    return EndpointFiles(Path(spec["record"]).parent, spec["name"]), spec


def new_record(
    name: str,
    model: str,
    checkpoint: Any,
    host: str,
    port: int | None,
    authenticated: bool,
    log: Path | None,
    engine: str = "torch",
) -> dict[str, Any]:
    """What ``<name>.json`` holds before the server has bound its port (``url`` and ``pid``
    come later). ``checkpoint`` is a palaestra.checkpoints.Checkpoint or None; ``engine`` the
    server that serves it."""
    return {
        "name": name,
        "url": None,
        "host": host,
        "port": port,
        "pid": None,
        "pid_start": None,
        "model": model,
        "checkpoint": str(checkpoint.path) if checkpoint is not None else None,
        "run_id": checkpoint.run_id if checkpoint is not None else None,
        "step": checkpoint.step if checkpoint is not None else None,
        "started_at": time.time(),
        "log": str(log) if log is not None else None,
        "authenticated": authenticated,
        "engine": engine,
    }


def endpoint_running(record: dict[str, Any]) -> bool:
    """Its server process is alive and is still the process that wrote the record."""
    pid = record.get("pid")
    return isinstance(pid, int) and pid_alive(pid, record.get("pid_start"))


def read_records(home: Path | None = None, running_only: bool = True) -> list[dict[str, Any]]:
    """Whole endpoint records (running ones unless ``running_only=False``), newest first, each
    with ``name`` filled from its file name where missing."""
    root = (home or palaestra_home()) / "endpoints"
    found = []
    for path in root.glob("*.json") if root.is_dir() else ():
        record = read_json(path)
        if record is not None and (not running_only or endpoint_running(record)):
            found.append({**record, "name": record.get("name") or path.stem})
    found.sort(key=lambda e: e.get("started_at") or 0, reverse=True)
    return found


def list_endpoints(home: Path | None = None, running_only: bool = True) -> list[dict[str, Any]]:
    """What may be shown of each endpoint (ENDPOINT_FIELDS) with ``running`` set: running ones
    unless ``running_only=False``, newest first."""
    return [
        {
            **{key: record.get(key) for key in ENDPOINT_FIELDS},
            "engine": record_engine(record),
            "running": endpoint_running(record),
        }
        for record in read_records(home, running_only)
    ]


def record_engine(record: dict[str, Any]) -> str:
    """The server behind a record; records written before vLLM could serve are torch's."""
    return record.get("engine") or "torch"
