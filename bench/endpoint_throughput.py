"""Generation throughput of an Endpoint at concurrency 1 and 8, through its HTTP API.

    python bench/endpoint_throughput.py [--requests 16] [--max-tokens 64] [--model SmolLM2_135M]

Launches an endpoint on the model (the embedded default unless told otherwise), sends the same
chat requests (haiku prompts, temperature 1, one seed each) first one at a time, then eight at a
time, and prints completion tokens per second for each, as a table and as JSON. Tokens are
counted from the responses' ``usage``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

TOPICS = [
    "rain",
    "the sea",
    "autumn leaves",
    "a train station",
    "snow",
    "the moon",
    "a cat",
    "spring",
    "a lighthouse",
    "coffee",
    "a bridge",
    "the desert",
    "fireflies",
    "a library",
    "mountains",
    "the wind",
]


def run(endpoint, requests: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    def one(i: int) -> int:
        reply = endpoint.chat_completion(
            [{"role": "user", "content": f"Write a haiku about {TOPICS[i % len(TOPICS)]}."}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
        )
        return reply["usage"]["completion_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    elapsed = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completion_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def main() -> None:
    import palaestra
    from palaestra import Endpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="SmolLM2_135M", help="a catalogue class name")
    args = parser.parse_args()

    model = getattr(palaestra, args.model)()
    endpoint = Endpoint.launch(model, name="bench-throughput", recreate_if_existing=True)
    try:
        endpoint.wait_until_ready(timeout=15 * 60)
        run(endpoint, 2, 8, 1)  # warm-up
        results = [run(endpoint, args.requests, args.max_tokens, c) for c in (1, 8)]
    finally:
        endpoint.stop()
    print(f"{'concurrency':>11}  {'requests':>8}  {'tokens':>6}  {'seconds':>7}  {'tokens/s':>8}")
    for r in results:
        print(
            f"{r['concurrency']:>11}  {r['requests']:>8}  {r['completion_tokens']:>6}  "
            f"{r['seconds']:>7}  {r['tokens_per_s']:>8}"
        )
    speedup = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"concurrency 8 / concurrency 1: {speedup:.2f}x")
    print(
        json.dumps(
            {
                "model": model.name,
                "max_tokens": args.max_tokens,
                "results": results,
                "speedup_8_over_1": round(speedup, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
