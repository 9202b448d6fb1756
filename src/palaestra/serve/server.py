"""The server process: bind the port, load the model, serve the app until told to stop.

``Endpoint.launch`` starts ``python -m palaestra.serve.server SPEC.json`` in its own session;
``palaestra serve`` runs ``serve`` in the foreground. Either way the port is bound before the
model loads, so the address is known (and written to the endpoint's registry file) at once and
``/health`` reports progress.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

from palaestra.checkpoints import Checkpoint, adapter_base, is_adapter_checkpoint
from palaestra.models.config import ModelConfig
from palaestra.serve.app import DEFAULT_MAX_QUEUED_REQUESTS, ServedModel, State, create_app
from palaestra.serve.batcher import Batcher
from palaestra.serve.guard import DEFAULT_MAX_REQUEST_BYTES
from palaestra.serve.targets import default_name, resolve_target


def load_served(
    name: str, model: ModelConfig, checkpoint: str | None, precision: str = "auto"
) -> ServedModel:
    """The model's weights (the checkpoint's, if given) behind a batcher, ready to serve,
    sampled in ``precision`` (``Recipe.precision``'s names)."""
    import torch

    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.models.loading import compute_dtype, load_causal_lm, load_tokenizer

    weights = checkpoint or model.weights_path()
    tokenizer = load_tokenizer(weights, model.chat_template, model.revision)
    if is_adapter_checkpoint(checkpoint):
        # A LoRA checkpoint holds adapters only: merge them into their base, in memory.
        from peft import PeftModel

        base = load_causal_lm(adapter_base(checkpoint), torch.float32, "cpu")
        lm = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    else:
        lm = load_causal_lm(weights, torch.float32, "cpu", model.revision, model.trust_remote_code)
    lm.eval()
    # Auto serves from a bfloat16 copy where the hardware multiplies bfloat16 natively (about
    # twice the tokens per second); the float32 weights are dropped once it is made.
    dtype = compute_dtype(precision, "cpu")
    engine = TorchEngine(lm, tokenizer, dtype=None if dtype == torch.float32 else dtype)
    return ServedModel(name, model, tokenizer, Batcher(engine.decoder()), engine.max_context)


def serve(
    name: str,
    model: ModelConfig,
    checkpoint: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    on_bound=None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    precision: str = "auto",
) -> None:
    """Serve until SIGTERM or Ctrl-C. ``on_bound(url)`` runs once the port is bound."""
    import uvicorn

    state = State(name, max_queued_requests)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.listen(128)
    bound = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    print(f"palaestra: serving {name} at {url} (loading the model ...)", flush=True)
    if on_bound is not None:
        on_bound(url)

    def load() -> None:
        started = time.monotonic()
        try:
            state.served = load_served(name, model, checkpoint, precision)
        except BaseException:
            traceback.print_exc()
            print("palaestra: the model failed to load; stopping", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        print(f"palaestra: {name} ready in {time.monotonic() - started:.1f} s", flush=True)

    threading.Thread(target=load, name="palaestra-load", daemon=True).start()
    app = create_app(state, api_key, max_request_bytes)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        if state.served is not None:
            state.served.batcher.close()
        if state.served is None:
            sys.exit(1)


def serve_in_foreground(
    target: str,
    host: str,
    port: int,
    name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
) -> None:
    """``palaestra serve``: serve ``target`` until Ctrl-C, listed among the endpoints."""
    from palaestra.runs.endpoints import endpoint_files, new_record
    from palaestra.runs.liveness import process_start_time

    model, checkpoint_path = resolve_target(target)
    checkpoint = Checkpoint.from_path(checkpoint_path) if checkpoint_path else None
    name = name or default_name(model, checkpoint)
    files = endpoint_files(name)
    info = new_record(name, model.name, checkpoint, host, port, api_key is not None, None)

    def on_bound(url: str) -> None:
        pid = os.getpid()
        files.write(
            {
                **info,
                "url": url,
                "port": int(url.rsplit(":", 1)[1]),
                "pid": pid,
                "pid_start": process_start_time(pid),
            }
        )

    try:
        serve(
            name,
            model,
            checkpoint_path,
            host,
            port,
            api_key,
            on_bound,
            max_request_bytes,
            max_queued_requests,
        )
    finally:
        files.record.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the endpoint process: ``python -m palaestra.serve.server SPEC``."""
    from palaestra.runs.endpoints import read_spec

    args = sys.argv[1:] if argv is None else argv
    files, spec = read_spec(args[0])

    def on_bound(url: str) -> None:
        files.update(url=url, port=int(url.rsplit(":", 1)[1]))

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    serve(
        spec["name"],
        ModelConfig(**spec["model"]),
        spec.get("checkpoint"),
        spec["host"],
        spec.get("port") or 0,
        os.environ.pop("PALAESTRA_API_KEY", None),
        on_bound,
        spec.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        spec.get("max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS),
        spec.get("precision", "auto"),
    )


if __name__ == "__main__":
    main()
