"""Malformed requests get OpenAI-shaped errors before anything reaches the model (the app in
process), and a cancelled request frees its place in the batcher and the engine."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from palaestra.serve.app import State, create_app
from palaestra.serve.guard import MAX_DEPTH, check_body, depth
from tests.support.openai_errors import error_of
from tests.support.tiny_models import build_endless_model_dir

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"


class Unloaded(State):
    """An app state whose model never loads: a request that got past the checks would be
    answered 503 model_loading, so any other answer came from the checks."""


@pytest.fixture
def app():
    return TestClient(create_app(Unloaded("m"), max_request_bytes=1000))


@pytest.mark.parametrize(
    "content, headers, status, code",
    [
        (b'{"model": ', JSON, 400, "invalid_json"),
        (b"", JSON, 400, "invalid_json"),
        (b'{"model": "\xff\xfe"}', JSON, 400, "invalid_encoding"),
        # 65 arrays deep fits in the size limit but not the depth limit; 5000 deep would
        # overflow Python's own parser (RecursionError), caught the same way.
        (b'{"messages":' + b"[" * 65 + b"]" * 65 + b"}", JSON, 400, "too_deeply_nested"),
        (b'{"a": "' + b"x" * 2000 + b'"}', JSON, 413, "request_too_large"),
        (b"a=b", {"content-type": "application/x-www-form-urlencoded"}, 415, None),
        (b"a", {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ],
)
def test_malformed_bodies_get_openai_errors_before_the_model(app, content, headers, status, code):
    response = app.post(CHAT, content=content, headers=headers)
    assert response.status_code == status
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == (code or "unsupported_media_type")


def test_json_nested_thousands_deep_is_refused_not_crashed():
    problem = check_body(b"[" * 100_000 + b"]" * 100_000)
    assert problem == (
        f"the request body nests deeper than {MAX_DEPTH} levels",
        "too_deeply_nested",
    )
    # Hand-counted depths: a scalar 0, [] 1, {"a": [1]} 2, [[[]]] 3.
    assert [depth(v) for v in (5, [], {"a": [1]}, [[[]]])] == [0, 1, 2, 3]


def test_a_body_at_the_limit_passes_and_one_byte_more_does_not(app):
    head, tail = b'{"messages": [{"role": "user", "content": "', b'"}]}'
    body = head + b"x" * (1000 - len(head) - len(tail)) + tail
    assert len(body) == 1000
    # Past the checks: the model is not loaded, so the app answers 503 model_loading.
    response = app.post(CHAT, content=body, headers=JSON)
    assert response.status_code == 503 and error_of(response)["code"] == "model_loading"
    longer = head + b"x" * (1001 - len(head) - len(tail)) + tail
    assert app.post(CHAT, content=longer, headers=JSON).status_code == 413


def test_unknown_routes_and_methods_are_openai_errors(app):
    missing = app.get("/v1/embeddings")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found" and "/v1/embeddings" in missing.text
    wrong = app.delete(CHAT)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert error_of(wrong)["message"] == f"DELETE is not allowed on {CHAT}"


def test_an_unauthenticated_request_is_refused_before_its_body_is_read():
    locked = TestClient(create_app(Unloaded("m"), api_key="k", max_request_bytes=1000))
    huge = b'{"a": "' + b"x" * 5000 + b'"}'
    response = locked.post(CHAT, content=huge, headers=JSON)
    assert response.status_code == 401  # not 413: the key is checked first
    assert error_of(response)["code"] == "invalid_api_key"


# -- a client that goes away frees its place -------------------------------------------------


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory):
    return build_endless_model_dir(tmp_path_factory.mktemp("endless"))


def short_request(prompt, tag: int = 0, max_tokens: int = 1):
    from palaestra.engine import GenerationRequest, SamplingParams

    return GenerationRequest([*prompt, tag], 1, SamplingParams(max_tokens=max_tokens))


def test_a_cancelled_request_is_never_generated_if_its_pass_has_not_begun():
    import asyncio

    from palaestra.engine.padded_decoder import PassDecoder
    from palaestra.serve.batcher import Batcher

    gate, seen = threading.Event(), []

    def generate(requests):
        seen.append([r.token_ids[-1] for r in requests])
        gate.wait(10)
        return [[] for _ in requests]

    async def scenario(batcher: Batcher) -> None:
        first = asyncio.ensure_future(batcher.submit(short_request([], 1)))
        while not seen:  # the first pass has begun and is held at the gate
            await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.submit(short_request([], 2)))
        await asyncio.sleep(0.05)
        gone.cancel()  # what cancelling its handler does to its await
        await asyncio.sleep(0.05)
        assert batcher.in_flight == 1  # its place is free at once
        gate.set()
        await first
        await batcher.submit(short_request([], 3))

    batcher = Batcher(PassDecoder(generate))
    try:
        asyncio.run(scenario(batcher))
    finally:
        batcher.close()
    assert seen == [[1], [3]]  # request 2 was never generated


def test_a_cancelled_request_stops_mid_pass_while_its_batch_goes_on(endless_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from palaestra.engine import GenerationRequest, SamplingParams
    from palaestra.engine.torch_engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(endless_dir)
    engine = TorchEngine(model, AutoTokenizer.from_pretrained(endless_dir))
    prompt = engine.tokenizer("hi").input_ids
    cancel, sampled = threading.Event(), []

    def on_token(j: int, token: int) -> None:
        sampled.append(token)
        if len(sampled) == 3:
            cancel.set()

    cut, whole = engine.generate_requests(
        [
            GenerationRequest(prompt, 2, SamplingParams(50, seed=1), on_token, cancel),
            GenerationRequest(prompt, 1, SamplingParams(50, seed=2)),
        ]
    )
    # The cancelled request's two rows get tokens 1-2 on step one and 3-4 on step two; the flag
    # is set at token 3, so both end after step two with 2 tokens each. The other row goes on.
    assert [(len(c.token_ids), c.finish_reason) for c in cut] == [(2, "abort"), (2, "abort")]
    assert [(len(c.token_ids), c.finish_reason) for c in whole] == [(50, "length")]
    # No flag set: exactly what the engine generated before the flag existed.
    again = engine.generate_requests([GenerationRequest(prompt, 1, SamplingParams(50, seed=2))])
    assert again[0][0].token_ids == whole[0].token_ids


def test_cancelling_a_request_in_its_pass_lets_the_next_one_run_at_once(endless_dir):
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from palaestra.engine.padded_decoder import PassDecoder
    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.serve.batcher import Batcher

    model = AutoModelForCausalLM.from_pretrained(endless_dir)
    engine = TorchEngine(model, AutoTokenizer.from_pretrained(endless_dir))
    prompt = engine.tokenizer("hi").input_ids
    started = threading.Event()

    def generate(requests):
        started.set()
        return engine.generate_requests(requests)

    async def scenario(batcher: Batcher) -> float:
        long = asyncio.ensure_future(batcher.submit(short_request(prompt, max_tokens=8000)))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # well into its 8000 tokens (seconds of work)
        long.cancel()
        begun = time.monotonic()
        await batcher.submit(short_request(prompt))
        return time.monotonic() - begun

    batcher = Batcher(PassDecoder(generate))
    try:
        waited = asyncio.run(scenario(batcher))
    finally:
        batcher.close()
    # Without the cancel flag, the short request waits for the rest of the 8000 tokens.
    assert waited < 1.0 and batcher.cancelled == 1, waited
