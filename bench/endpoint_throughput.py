"""Generation throughput of an Endpoint at concurrency 1 and 8, through its HTTP API.

    python bench/endpoint_throughput.py [--requests 16] [--max-tokens 64] [--model SmolLM2_135M]
    python bench/endpoint_throughput.py --smoke   # 2 requests of 8 tokens, 16-token long ones

A real run records its result under bench/results/endpoint_throughput/ (``bench/results.py``).

Launches an endpoint on the model (the embedded default unless told otherwise), sends the same
chat requests (haiku prompts, temperature 1, one seed each) first one at a time, then eight at a
time, then one at a time without seeds, and prints completion tokens per second for each, as a
table and as JSON. Tokens are counted from the responses' ``usage``. (A seeded or greedy row is
computed so that its reply repeats whatever shares its passes, which costs a lone request time;
an unseeded one alone takes the fastest path.)

Then the latency of a short request (8 tokens, greedy): three times alone, then three times
while four long requests (384 tokens each) generate; it prints the medians and their ratio, and
checks that the long requests were still generating when each short one was answered.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from results import add_arguments, record, smoke_defaults

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


def run(
    endpoint, requests: int, max_tokens: int, concurrency: int, seeded: bool = True
) -> dict[str, float]:
    def one(i: int) -> int:
        reply = endpoint.chat_completion(
            [{"role": "user", "content": f"Write a haiku about {TOPICS[i % len(TOPICS)]}."}],
            max_tokens=max_tokens,
            temperature=1.0,
            **({"seed": i} if seeded else {}),
        )
        return reply["usage"]["completion_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    elapsed = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "seeded": seeded,
        "requests": requests,
        "completion_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def short_latency(endpoint) -> float:
    started = time.monotonic()
    endpoint.chat_completion(
        [{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0
    )
    return time.monotonic() - started


def latency_among_long(endpoint, long_tokens: int = 384, settle_s: float = 2.0) -> dict[str, float]:
    """Median latency of a short request alone and while four long ones generate."""
    alone = statistics.median(short_latency(endpoint) for _ in range(3))
    finished: list[float] = []

    def long(i: int) -> int:
        reply = endpoint.chat_completion(
            [{"role": "user", "content": f"Tell a very long story about {TOPICS[i]}."}],
            max_tokens=long_tokens,
            temperature=1.0,
            seed=100 + i,
        )
        finished.append(time.monotonic())
        return reply["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as pool:
        longs = [pool.submit(long, i) for i in range(4)]
        time.sleep(settle_s)  # the long requests are prefilled and decoding
        among, answered = [], []
        for _ in range(3):
            among.append(short_latency(endpoint))
            answered.append(time.monotonic())
        long_tokens_done = [future.result() for future in longs]
    return {
        "short_alone_s": round(alone, 3),
        "short_among_long_s": round(statistics.median(among), 3),
        "ratio": round(statistics.median(among) / alone, 2),
        "long_completion_tokens": long_tokens_done,
        "longs_still_running_at_last_short": sum(t > answered[-1] for t in finished),
    }


def main() -> None:
    import palaestra
    from palaestra import Endpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="SmolLM2_135M", help="a catalogue class name")
    parser.add_argument("--long-tokens", type=int, default=384, help="of the long requests")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, requests=2, max_tokens=8, long_tokens=16)

    model = getattr(palaestra, args.model)()
    endpoint = Endpoint.launch(model, name="bench-throughput", recreate_if_existing=True)
    try:
        endpoint.wait_until_ready(timeout=15 * 60)
        run(endpoint, 2, 8, 1)  # warm-up
        results = [run(endpoint, args.requests, args.max_tokens, c) for c in (1, 8)]
        # A seeded row is computed so that its reply repeats whatever shares its passes, which
        # costs a lone request time; an unseeded one alone takes the fastest path.
        results.append(run(endpoint, args.requests, args.max_tokens, 1, seeded=False))
        latency = latency_among_long(endpoint, args.long_tokens, 0.2 if args.smoke else 2.0)
    finally:
        endpoint.stop()
    columns = ("concurrency", "seeded", "requests", "tokens", "seconds", "tokens/s")
    widths = (11, 6, 8, 6, 7, 8)
    print("  ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for r in results:
        print(
            f"{r['concurrency']:>11}  {str(r['seeded']):>6}  {r['requests']:>8}  "
            f"{r['completion_tokens']:>6}  {r['seconds']:>7}  {r['tokens_per_s']:>8}"
        )
    speedup = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"concurrency 8 / concurrency 1 (both seeded): {speedup:.2f}x")
    print(
        f"short request (8 tokens): {latency['short_alone_s']} s alone, "
        f"{latency['short_among_long_s']} s among 4 long ones ({latency['ratio']}x); "
        f"{latency['longs_still_running_at_last_short']} of 4 long ones still running then"
    )
    figures = {
        "model": model.name,
        "max_tokens": args.max_tokens,
        "results": results,
        "speedup_8_over_1": round(speedup, 2),
        "latency": latency,
    }
    print(json.dumps(figures))
    headline = {
        "tokens/s at 1": results[0]["tokens_per_s"],
        "tokens/s at 8": results[1]["tokens_per_s"],
        "8 / 1": round(speedup, 2),
        "short among long / alone": latency["ratio"],
    }
    record("endpoint_throughput", args, figures, headline)


if __name__ == "__main__":
    main()
