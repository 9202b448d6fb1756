"""A real vLLM server (``vllm serve``, its CPU build here) of the embedded model, called with the
``openai`` client. Runs in the vLLM venv: ``make test-vllm``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from palaestra.serve import Endpoint

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_a_checkpoint_served_by_vllm_answers_the_openai_client(tmp_path):
    """One real ``vllm serve`` (minutes on a CPU) of a full-weight checkpoint folder of the
    embedded model, written as a run's learner writes it. PALAESTRA_HOME is the caller's, so
    the embedded model converts once across runs."""
    import openai

    from palaestra import EvalConfig, LocalDataset, SmolLM2_135M
    from palaestra.models.loading import compute_dtype, load_causal_lm, load_tokenizer

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
        # It samples in the dtype palaestra's server would (vLLM's own "auto" is bfloat16 for
        # a float32 checkpoint, even on a CPU that only emulates it).
        lines = Path(endpoint.info["log"]).read_text().splitlines()
        engine_line = [line for line in lines if "Initializing a V1 LLM engine" in line][-1]
        assert f"dtype={compute_dtype('auto', 'cpu')}," in engine_line
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
