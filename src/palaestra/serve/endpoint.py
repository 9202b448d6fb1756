"""Endpoint: a model (or a checkpoint of it) served over HTTP in its own process.

Every endpoint is recorded under ``<home>/endpoints`` (its files: ``palaestra.runs.endpoints``),
so any process can find it by name. Its server process is started and stopped with the same
helper that runs training (``palaestra.launch.process``).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from palaestra.checkpoints import Checkpoint, check_model_folder
from palaestra.launch.process import process_record, spawn_module, stop_process
from palaestra.models.config import ModelConfig
from palaestra.runs.endpoints import (
    EndpointFiles,
    endpoint_files,
    new_record,
    read_records,
    record_engine,
)
from palaestra.runs.liveness import pid_alive
from palaestra.runs.logs import last_lines
from palaestra.serve.guard import DEFAULT_MAX_REQUEST_BYTES
from palaestra.serve.targets import default_name
from palaestra.serve.vllm_server import (
    VLLM_SERVER,
    choose_engine,
    cuda_available,
    free_port,
    is_ready,
    serve_args,
    served_dtype,
    server_env,
    server_url,
)


class EndpointError(RuntimeError):
    """The endpoint's process died, never became ready, or answered a request with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_queued_requests: int = 256,  # serve.app.DEFAULT_MAX_QUEUED_REQUESTS
        engine: str = "auto",
        precision: str = "auto",
    ) -> Endpoint:
        """Serve ``model`` (the base weights, or ``checkpoint``'s: a Checkpoint or a path) in a
        new process. Returns once the port is bound; ``wait_until_ready`` waits for the model.

        An endpoint already serving ``name`` is reused, or with ``recreate_if_existing``
        stopped and replaced. Request bodies over ``max_request_bytes`` are refused (413), and
        requests beyond ``max_queued_requests`` waiting or generating at once get 503 with
        ``Retry-After``.

        ``engine``: ``"torch"``, palaestra's own server; ``"vllm"``, vLLM's (``vllm serve``,
        the ``vllm`` extra), which has its own request limits (the two above do not apply) and
        returns as soon as its process starts, its port known; ``"auto"``, vLLM on a machine
        with a CUDA GPU where it is installed, else torch.

        ``precision``: the dtype it samples in, as ``Recipe.precision`` names it; ``"auto"``
        is bfloat16 where the CPU multiplies it natively, else float32. vLLM's server gets it
        as its ``--dtype`` on a CPU, and on a GPU where it is named (``served_dtype``).
        """
        if precision not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"precision must be auto, float32 or bfloat16, got {precision!r}")
        engine = choose_engine(engine)
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint.from_path(checkpoint)
        if checkpoint is not None:
            check_model_folder(checkpoint.path)
        name = name or default_name(model, checkpoint)
        existing = cls._find(name)
        if existing is not None:
            if not recreate_if_existing:
                return existing
            existing.stop()

        files = endpoint_files(name)
        api_key = None if unauthenticated else f"pal-{secrets.token_urlsafe(24)}"
        files.write_key(api_key)
        if engine == "vllm":
            return cls._launch_vllm(files, model, checkpoint, host, port, api_key, precision)
        info = new_record(name, model.name, checkpoint, host, port, api_key is not None, files.log)
        files.write(info)
        files.write_spec(
            {
                "model": model.model_dump(),
                "checkpoint": info["checkpoint"],
                "host": host,
                "port": port,
                "max_request_bytes": max_request_bytes,
                "max_queued_requests": max_queued_requests,
                "precision": precision,
            }
        )
        # The key travels in the environment, not on the command line, where ps shows it.
        env = {"PALAESTRA_API_KEY": api_key} if api_key is not None else {}
        process = spawn_module("palaestra.serve.server", [str(files.spec)], files.log, env)
        info = {**info, **process_record(process)}
        files.update(**process_record(process))  # the server may have added its url already
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
    def _launch_vllm(
        cls,
        files: EndpointFiles,
        model: ModelConfig,
        checkpoint: Checkpoint | None,
        host: str,
        port: int | None,
        api_key: str | None,
        precision: str = "auto",
    ) -> Endpoint:
        """``vllm serve`` in a process of its own. The port is chosen here, so the record holds
        the URL at once; vLLM binds it after importing itself (tens of seconds)."""
        port = port or free_port(host)
        info = new_record(
            files.name, model.name, checkpoint, host, port, api_key is not None, files.log, "vllm"
        )
        info["url"] = server_url(host, port)
        folder = info["checkpoint"]
        cuda = cuda_available()
        env = server_env(api_key, cuda)
        args = serve_args(files.name, model, folder, host, port, served_dtype(precision, cuda))
        process = spawn_module(VLLM_SERVER, args, files.log, env)
        info = {**info, **process_record(process)}
        files.write(info)
        return cls(info, api_key, process)

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
        return [cls(record, endpoint_files(record["name"]).read_key()) for record in read_records()]

    @classmethod
    def _find(cls, name: str) -> Endpoint | None:
        files = endpoint_files(name)
        info = files.read()
        if info is None or not pid_alive(info.get("pid"), info.get("pid_start")):
            return None
        return cls(info, files.read_key())

    # -- state ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.info["url"] or self._reload()["url"]

    @property
    def engine(self) -> str:
        """``"torch"`` (palaestra's server) or ``"vllm"`` (``vllm serve``)."""
        return record_engine(self.info)

    @property
    def is_running(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            return False
        return pid_alive(self.info.get("pid"), self.info.get("pid_start"))

    def _reload(self) -> dict[str, Any]:
        self.info = {**self.info, **(endpoint_files(self.name).read() or {})}
        return self.info

    def log_tail(self, lines: int = 20) -> str:
        """The server's last ``lines`` lines of output ("" for a foreground server)."""
        log = self.info.get("log")
        return "\n".join(last_lines(log, lines)[0]) if log else ""

    def _raise_if_dead(self, what: str) -> None:
        if not self.is_running:
            raise EndpointError(
                f"endpoint {self.name} {what}: its process exited. Last lines of "
                f"{self.info.get('log')}:\n{self.log_tail()}"
            )

    def wait_until_ready(self, timeout: float = 15 * 60) -> Endpoint:
        """Wait until the model is loaded and answering (vLLM on a CPU takes minutes). Raises
        EndpointError with the server's last log lines if its process died, TimeoutError if
        ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            self._raise_if_dead("failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"endpoint {self.name} not ready after {timeout} s")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        """palaestra's server says so on ``/health``; vLLM's by listing the endpoint's name."""
        import httpx

        if self.engine == "vllm":
            return is_ready(self.url, self.name, self.api_key, self._http())
        try:
            return self._http().get("/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    # -- requests -------------------------------------------------------------------------

    def _http(self):
        """One client for every request and readiness poll: a new one builds an SSL context
        (about 40 ms of CPU loading the CA bundle), taken from the server it waits for."""
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(base_url=self.url, headers=headers)
        return self._client

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        response = self._http().post(path, json=body, timeout=timeout)
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
        stop_process(
            self.info.get("pid"),
            self.info.get("pid_start"),
            timeout=timeout,
            group=True,  # the server's own children (a vLLM engine) go with it
            ended=lambda: not self.is_running,
            process=self._process,
        )
        if self._client is not None:
            self._client.close()
            self._client = None
        endpoint_files(self.name).remove()

    def __repr__(self) -> str:
        return f"Endpoint({self.name!r}, url={self.info.get('url')!r})"
