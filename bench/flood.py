"""The endpoint under a flood: nothing lost, clean refusals, disconnects free their place.

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/flood.py [--requests 10000]
        [--concurrency 128] [--max-queued 64] [--max-tokens 16] [--model tiny|SmolLM2_135M]
    .venv/bin/python bench/flood.py --smoke    # 48 requests, 8 in flight, a queue of 4

A real run records its result under bench/results/flood/ (``bench/results.py``).

Launches an endpoint (by default the tiny 2-layer model that tests/support/tiny_models.py builds
in code; ``--model SmolLM2_135M`` serves the embedded SmolLM2) and sends it ``--requests`` chat
requests, ``--concurrency`` in flight at a time: half of them streamed, and a quarter of the
streams dropped by their client after two events, on purpose. Each request ends as one of

- answered: 200 with choices and a finish reason (a stream: a finish reason, then
  ``data: [DONE]``),
- refused: 429 or 503 with ``Retry-After`` and an error in OpenAI's shape (the client then
  waits as told before its next request),
- disconnected: the client closed the stream on purpose,
- lost: anything else (a connection error, another 5xx, a stream that ends without
  ``[DONE]``, a timeout).

Lost must be 0. The server's resident memory (VmRSS) is read after a warm-up and after the
flood, and the endpoint must still answer a normal request afterwards. Prints one summary line
(and the same as JSON). ``tests/integration/faults/test_flood.py`` runs a small flood through
``flood``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CHAT = "/v1/chat/completions"
TOPICS = ["rain", "the sea", "snow", "the moon", "a cat", "coffee", "a bridge", "mountains"]
OUTCOMES = ("answered", "refused", "disconnected", "lost")


@dataclass
class Tally:
    """What became of each request of a flood."""

    counts: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)
    """Why requests were lost: a few words each, e.g. ``"stream ended without [DONE]"``."""
    latencies_s: list[float] = field(default_factory=list)
    """Send to last byte, answered requests only."""

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def plan(i: int, max_tokens: int) -> tuple[dict, bool]:
    """Request ``i``'s body and whether its client drops it mid-stream: odd ones stream, and
    every fourth stream is dropped after two events."""
    stream = i % 2 == 1
    body = {
        "messages": [{"role": "user", "content": f"Write a haiku about {TOPICS[i % 8]}."}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        "stream": stream,
    }
    if stream and i % 4 == 3:
        body["stream_options"] = {"include_usage": True}
    return body, stream and i % 8 == 1


def refused_or_lost(response: httpx.Response) -> tuple[str, str]:
    """How a request that was not answered 200 ended: refused cleanly, or lost and why."""
    problem = refusal(response)
    return ("refused", response.headers["retry-after"]) if problem is None else ("lost", problem)


def refusal(response: httpx.Response) -> str | None:
    """None if ``response`` is a clean refusal (429/503, Retry-After, OpenAI's error shape,
    503 only for being overloaded), else what is wrong with it."""
    if response.status_code not in (429, 503):
        return f"HTTP {response.status_code}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} without an OpenAI error body"
    if set(error) != {"message", "type", "param", "code"}:
        return f"HTTP {response.status_code} error of shape {sorted(error)}"
    if response.status_code == 503 and error["code"] != "overloaded":
        return f"HTTP 503 {error['code']}"
    if not response.headers.get("retry-after", "").isdigit():
        return f"HTTP {response.status_code} without Retry-After"
    return None


async def one(client: httpx.AsyncClient, body: dict, drop: bool) -> tuple[str, str | None]:
    """(outcome, why it was lost or None) of one request."""
    if not body["stream"]:
        response = await client.post(CHAT, json=body)
        if response.status_code != 200:
            return refused_or_lost(response)
        choices = response.json().get("choices") or []
        if choices and all(c.get("finish_reason") in ("stop", "length") for c in choices):
            return "answered", None
        return "lost", "200 without choices or finish_reason"
    async with client.stream("POST", CHAT, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return refused_or_lost(response)
        events, finished, done = 0, False, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done:
                return "lost", "an event after [DONE]"
            events += 1
            if drop and events == 2:
                return "disconnected", None  # leaving the block closes the connection
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return "lost", f"error event: {event['error'].get('message', '')[:60]}"
            finished |= any(c.get("finish_reason") for c in event.get("choices", []))
    if not done:
        return "lost", "stream ended without [DONE]"
    return ("answered", None) if finished else ("lost", "stream without a finish_reason")


async def flood(
    url: str,
    requests: int,
    concurrency: int,
    max_tokens: int = 16,
    timeout_s: float = 120.0,
    honour_retry_after: bool = True,
) -> Tally:
    """Send ``requests`` chat requests to the endpoint at ``url``, ``concurrency`` at a time.

    ``concurrency`` clients each send their next request as soon as the last one ended (after
    ``Retry-After`` seconds when refused, if ``honour_retry_after``)."""
    tally = Tally()
    next_index = iter(range(requests))
    # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s), so no
    # request is sent on a connection the server is closing at that moment.
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in next_index:  # shared: each index is taken by exactly one client
            body, drop = plan(i, max_tokens)
            started = time.monotonic()
            try:
                outcome, detail = await one(client, body, drop)
            except httpx.HTTPError as error:
                kind = "stream" if body["stream"] else "whole"
                outcome, detail = "lost", f"{type(error).__name__} ({kind}: {error})"[:120]
            tally.counts[outcome] += 1
            if outcome == "answered":
                tally.latencies_s.append(time.monotonic() - started)
            elif outcome == "lost":
                tally.lost[detail] += 1
            elif outcome == "refused" and honour_retry_after:
                await asyncio.sleep(float(detail))

    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return tally


def tiny_model(folder: Path):
    """The tests' tiny model (built in code by tests/support/tiny_models.py), in ``folder``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from palaestra import ModelConfig
    from tests.support.tiny_models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ModelConfig(name="tiny", source=str(folder))


def summary(args, tally: Tally, rss: tuple[int, int], wall_s: float) -> dict:
    before, after = rss
    return {
        "model": args.model,
        "sent": sum(tally.counts.values()),
        **{outcome: tally.counts[outcome] for outcome in OUTCOMES},
        "lost_why": dict(tally.lost),
        "p50_s": round(tally.percentile(0.50), 3),
        "p99_s": round(tally.percentile(0.99), 3),
        "rss_before_mb": round(before / 2**20, 1),
        "rss_after_mb": round(after / 2**20, 1),
        "rss_change": round(after / before - 1, 4),
        "wall_s": round(wall_s, 1),
        "concurrency": args.concurrency,
        "max_queued_requests": args.max_queued,
        "max_tokens": args.max_tokens,
    }


def main() -> None:
    import tempfile

    # Here, not at the top: tests/integration/faults/test_flood.py loads this file without
    # bench/ on the path.
    from results import add_arguments, record, smoke_defaults

    import palaestra
    from palaestra import Endpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-queued", type=int, default=64, help="the endpoint's queue bound")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny", help="tiny, or a catalogue class name")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, requests=48, concurrency=8, max_queued=4)

    with tempfile.TemporaryDirectory() as folder:
        if args.model == "tiny":
            model = tiny_model(Path(folder))
        else:
            model = getattr(palaestra, args.model)()
        endpoint = Endpoint.launch(
            model,
            name="bench-flood",
            recreate_if_existing=True,
            max_queued_requests=args.max_queued,
        )
        try:
            endpoint.wait_until_ready(timeout=15 * 60)
            pid = endpoint.info["pid"]
            # Warm-up: a small flood of the same mix, so allocator pools and caches are full.
            asyncio.run(
                flood(endpoint.url, 4 * args.concurrency, args.concurrency, args.max_tokens)
            )
            before = rss_bytes(pid)
            started = time.monotonic()
            tally = asyncio.run(
                flood(endpoint.url, args.requests, args.concurrency, args.max_tokens)
            )
            wall_s = time.monotonic() - started
            time.sleep(1.0)  # let abandoned requests' last tokens drain
            after = rss_bytes(pid)
            normal = endpoint.chat_completion(
                [{"role": "user", "content": "Write a haiku about rain."}], max_tokens=8
            )
            assert normal["choices"][0]["finish_reason"] in ("stop", "length"), normal
        finally:
            endpoint.stop()

    result = summary(args, tally, (before, after), wall_s)
    print(f"command: {shlex.join(['python', *sys.argv])}")
    print(
        f"flood of {result['sent']} chat requests at {args.concurrency} in flight "
        f"(max_queued_requests {args.max_queued}, max_tokens {args.max_tokens}, "
        f"model {args.model}): answered {result['answered']}, refused cleanly "
        f"{result['refused']}, disconnected {result['disconnected']}, lost {result['lost']}; "
        f"answered p50 {result['p50_s']} s, p99 {result['p99_s']} s; server RSS "
        f"{result['rss_before_mb']} MB before, {result['rss_after_mb']} MB after "
        f"({result['rss_change']:+.1%}); wall {result['wall_s']} s; a normal request after: 200"
    )
    print(json.dumps(result))
    headline = {
        "requests": result["sent"],
        "lost": result["lost"],
        "refused": result["refused"],
        "p99 s": result["p99_s"],
        "RSS change %": round(100 * result["rss_change"], 1),
    }
    record("flood", args, result, headline)
    if result["lost"]:
        sys.exit(f"lost {result['lost']} requests: {result['lost_why']}")


if __name__ == "__main__":
    main()
