"""A real endpoint process under pressure: a flood past its queue gets 503s and loses nothing, a
huge request does not hold up anyone else, and a client that goes away frees its place."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.openai_errors import error_of
from tests.support.tiny_models import build_endless_model_dir
from tests.support.tiny_runs import serving

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_model_dir):
    """A real endpoint process that holds at most 2 requests at once."""
    with serving(tmp_path_factory.mktemp("guard-home"), tiny_model_dir, "guard",
                 max_queued_requests=2) as endpoint:  # fmt: skip
        yield endpoint


def test_a_flood_past_the_queue_gets_503_with_retry_after_and_nothing_is_lost(guarded):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "temperature": 1}

    def ask(_) -> httpx.Response:
        return httpx.post(f"{guarded.url}{CHAT}", json=body, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 2, statuses
    refused = [answer for answer in answers if answer.status_code == 503]
    assert refused, "16 requests at once into a queue of 2: some must be refused"
    for answer in refused:
        assert error_of(answer)["code"] == "overloaded"
        assert int(answer.headers["retry-after"]) >= 1
    for answer in answers:
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["finish_reason"] in {"stop", "length"}
    assert ask(0).status_code == 200  # room again once the flood has drained


def test_a_ten_megabyte_body_does_not_hold_up_the_server(guarded):
    endpoint = guarded
    host, port = endpoint.url.removeprefix("http://").split(":")
    # Told the size up front: refused at once, without reading the body.
    told = httpx.post(
        f"{endpoint.url}{CHAT}", content=b"x" * (10 * 1024 * 1024), headers=JSON, timeout=30
    )
    assert told.status_code == 413 and error_of(told)["code"] == "request_too_large"

    # Not told (chunked), and sent slowly: refused once 4 MiB have come in, while /health
    # keeps answering within a second throughout.
    answers: list[bytes] = []

    def upload() -> None:
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            chunk = b"x" * (256 * 1024)
            try:
                for _ in range(40):  # 10 MiB in 256 KiB chunks
                    conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed mid-upload
            conn.settimeout(10)
            try:
                answers.append(conn.recv(65536))
            except (ConnectionResetError, TimeoutError):
                answers.append(b"")

    sender = threading.Thread(target=upload)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{endpoint.url}/health", timeout=5).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    sender.join()
    assert slowest < 1.0
    assert answers and answers[0].startswith(b"HTTP/1.1 413"), answers[:1]
    assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == ("request_too_large")
    # And it still serves.
    ok = httpx.post(
        f"{endpoint.url}{CHAT}",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory):
    return build_endless_model_dir(tmp_path_factory.mktemp("endless"))


@pytest.fixture(scope="module")
def endless(tmp_path_factory, endless_dir):
    """A real endpoint process serving the model that never ends on its own."""
    with serving(tmp_path_factory.mktemp("endless-home"), endless_dir, "endless") as endpoint:
        yield endpoint


def test_a_stream_whose_client_disconnects_stops_generating(endless):
    hi = [{"role": "user", "content": "hi"}]
    long = {"messages": hi, "max_tokens": 8000, "stream": True}  # seconds of tokens
    with httpx.Client(base_url=endless.url, timeout=30) as client:
        with client.stream("POST", CHAT, json=long) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 5:
                    break
        # The connection is closed here, mid-stream. Had the server gone on generating the
        # long answer, this request would wait for the rest of its 8000 tokens.
        started = time.monotonic()
        short = client.post(CHAT, json={"messages": hi, "max_tokens": 1})
        waited = time.monotonic() - started
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert waited < 2.0, f"the short request waited {waited:.1f} s for the abandoned stream"


def test_a_plain_request_whose_client_gives_up_stops_generating(endless):
    hi = [{"role": "user", "content": "hi"}]
    long = {"messages": hi, "max_tokens": 8000}  # seconds of tokens, answered only at the end
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{endless.url}{CHAT}", json=long, timeout=1.0)  # the client gives up
    # The server notices within its poll (a quarter second) and drops the rows; had it gone on,
    # this request would wait for the rest of the 8000 tokens.
    started = time.monotonic()
    short = httpx.post(f"{endless.url}{CHAT}", json={"messages": hi, "max_tokens": 1}, timeout=30)
    waited = time.monotonic() - started
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert waited < 2.0, f"the short request waited {waited:.1f} s for the abandoned one"
