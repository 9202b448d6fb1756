"""Generation throughput of the embedded model: plain transformers, the torch engine, an Endpoint.

    python bench/generation.py [--requests 16] [--max-tokens 64] [--concurrency 8] [--rounds 1]
                               [--endpoint] [--vllm float32,bfloat16] [--json PATH]
    python bench/generation.py --smoke     # 2 requests of 8 tokens; vLLM float32 where installed

The vLLM modes need vLLM's venv: ``make setup-vllm``, then ``.venv-vllm/bin/python
bench/generation.py --rounds 3 --vllm float32,bfloat16``. A real run records its result under
bench/results/generation/ (``bench/results.py``).

Every mode answers the same chat requests ("Write a haiku about {topic}." with the haiku test
split's topics, request i seeded with i, temperature 1, top-p 1, no top-k) on SmolLM2-135M-Instruct,
and is timed by completion tokens per second:

- ``plain-generate``: ``model.generate`` one request at a time, float32. The baseline.
- ``engine-fp32``: the engine's decoder, at most ``--concurrency`` requests generating at once,
  the next joining as soon as one ends.
- ``engine-bf16``: the same, the engine sampling from a bfloat16 copy of the weights (when the
  installed ``TorchEngine`` takes ``dtype``).
- ``endpoint`` (with ``--endpoint``): chat completions over HTTP, ``--concurrency`` in flight.
- ``vllm-<dtype>`` (with ``--vllm``, where vLLM is installed: ``make setup-vllm`` makes a venv
  with its CPU build): palaestra's vLLM engine, the same requests in one call, vLLM running at
  most ``--concurrency`` of them at once (``max_num_seqs``). Its start is not timed.

Tokens are counted from the outputs: generate's new tokens up to and including the first
end-of-sequence token, the engine's completion token ids, the endpoint's ``usage``. Each mode
answers one untimed warm-up request first; ``--rounds N`` then runs every mode N times in turn
(never two at once) and reports each mode's best and median. Prints a markdown table, then JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from results import add_arguments, record, skip, smoke_defaults


@dataclass(frozen=True)
class Request:
    seed: int
    messages: list[dict[str, str]]
    token_ids: list[int]
    """The chat-templated prompt, tokenised as the endpoint tokenises it."""


@dataclass(frozen=True)
class Mode:
    name: str
    concurrency: int
    run: Callable[[list[Request]], int]
    """Answers the requests; returns how many completion tokens they produced."""


def haiku_requests(tokenizer, count: int) -> list[Request]:
    from palaestra import builtin_dataset

    lines = (Path(builtin_dataset("haiku")) / "test.jsonl").read_text().splitlines()
    topics = [json.loads(line)["keywords"] for line in lines if line.strip()]
    requests = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Write a haiku about {topics[i % len(topics)]}."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes its own special tokens.
        token_ids = tokenizer(text, add_special_tokens=False).input_ids
        requests.append(Request(i, messages, token_ids))
    return requests


def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion, as the torch engine counts them."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def plain_generate(model, tokenizer, max_tokens: int) -> Mode:
    stop = eos_ids(model, tokenizer)

    @torch.inference_mode()
    def run(requests: list[Request]) -> int:
        tokens = 0
        for request in requests:
            torch.manual_seed(request.seed)
            input_ids = torch.tensor([request.token_ids])
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,  # off: the engine and the endpoint sample from the whole vocabulary
                max_new_tokens=max_tokens,
                eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
            )
            new = output[0, input_ids.shape[1] :].tolist()
            ends = [i for i, token in enumerate(new) if token in stop]
            tokens += ends[0] + 1 if ends else len(new)
        return tokens

    return Mode("plain-generate", 1, run)


def engine_mode(name: str, engine, max_tokens: int, concurrency: int) -> Mode:
    from palaestra.engine import GenerationRequest, SamplingParams

    def run(requests: list[Request]) -> int:
        # At most ``concurrency`` rows generate at once; the next request joins the moment one
        # ends (continuous batching), as ``concurrency`` clients of a server would keep it fed.
        decoder = engine.decoder(max_batch=concurrency)
        futures = [
            decoder.add(
                GenerationRequest(r.token_ids, 1, SamplingParams(max_tokens, 1.0, 1.0, seed=r.seed))
            )
            for r in requests
        ]
        while decoder.busy:
            decoder.step()
        decoder.close()
        return sum(len(c.token_ids) for f in futures for c in f.result())

    return Mode(name, concurrency, run)


def vllm_mode(name: str, engine, max_tokens: int, concurrency: int) -> Mode:
    from palaestra.engine import GenerationRequest, SamplingParams

    def run(requests: list[Request]) -> int:
        batch = [
            GenerationRequest(r.token_ids, 1, SamplingParams(max_tokens, 1.0, 1.0, seed=r.seed))
            for r in requests
        ]
        return sum(len(c.token_ids) for group in engine.generate_requests(batch) for c in group)

    return Mode(name, concurrency, run)


def endpoint_mode(endpoint, max_tokens: int, concurrency: int) -> Mode:
    def one(request: Request) -> int:
        reply = endpoint.chat_completion(
            request.messages, max_tokens=max_tokens, temperature=1.0, seed=request.seed
        )
        return reply["usage"]["completion_tokens"]

    def run(requests: list[Request]) -> int:
        with ThreadPoolExecutor(concurrency) as pool:
            return sum(pool.map(one, requests))

    return Mode("endpoint", concurrency, run)


def measure(modes: list[Mode], requests: list[Request], rounds: int) -> dict[str, list[dict]]:
    """Each mode's rounds, after one untimed warm-up request per mode; modes take turns."""
    for mode in modes:
        mode.run(requests[:1])
    results: dict[str, list[dict]] = {mode.name: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            started = time.perf_counter()
            tokens = mode.run(requests)
            seconds = time.perf_counter() - started
            results[mode.name].append(
                {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds}
            )
    return results


def summarise(modes: list[Mode], results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for mode in modes:
        runs = results[mode.name]
        rates = [r["tokens_per_s"] for r in runs]
        rows.append(
            {
                "mode": mode.name,
                "concurrency": mode.concurrency,
                "seconds_median": round(statistics.median(r["seconds"] for r in runs), 3),
                "tokens_per_s_best": round(max(rates), 1),
                "tokens_per_s_median": round(statistics.median(rates), 1),
                "rounds": [{**r, "tokens_per_s": round(r["tokens_per_s"], 1)} for r in runs],
            }
        )
    base = rows[0]
    for row in rows:
        row["ratio_best"] = round(row["tokens_per_s_best"] / base["tokens_per_s_best"], 2)
        row["ratio_median"] = round(row["tokens_per_s_median"] / base["tokens_per_s_median"], 2)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| mode | concurrency | tokens | seconds (median) | tokens/s (median) | tokens/s (best) "
        "| vs plain-generate (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        # Seeds fix the samples, so every round should produce the same number of tokens.
        low = min(r["tokens"] for r in row["rounds"])
        high = max(r["tokens"] for r in row["rounds"])
        tokens = str(low) if low == high else f"{low}-{high}"
        lines.append(
            f"| {row['mode']} | {row['concurrency']} | {tokens} | {row['seconds_median']} "
            f"| {row['tokens_per_s_median']} | {row['tokens_per_s_best']} "
            f"| {row['ratio_median']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    import transformers

    from palaestra import Endpoint, SmolLM2_135M
    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="of the engines and endpoint")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--endpoint", action="store_true", help="also time an Endpoint")
    parser.add_argument("--vllm", default="", help="vLLM engine dtypes to time, e.g. float32")
    parser.add_argument("--json", type=Path, help="also write the JSON results here")
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, requests=2, max_tokens=8, concurrency=2, vllm="float32")
    from palaestra.engine.vllm_engine import vllm_available

    if args.vllm and not vllm_available():
        if not args.smoke:
            parser.error("--vllm needs vLLM: make setup-vllm, then run with .venv-vllm/bin/python")
        skip(f"vllm-{args.vllm}", "vLLM is not installed here; .venv-vllm has it")
        args.vllm = ""

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    config = SmolLM2_135M()
    weights = config.weights_path()
    tokenizer = load_tokenizer(weights, config.chat_template, config.revision)
    model = load_causal_lm(weights, torch.float32, "cpu", config.revision)
    model.eval()
    requests = haiku_requests(tokenizer, args.requests)

    fp32 = TorchEngine(model, tokenizer)
    modes = [
        plain_generate(model, tokenizer, args.max_tokens),
        engine_mode("engine-fp32", fp32, args.max_tokens, args.concurrency),
    ]
    bf16 = "dtype" in inspect.signature(TorchEngine).parameters
    if bf16:
        engine = TorchEngine(model, tokenizer, dtype=torch.bfloat16)
        modes.append(engine_mode("engine-bf16", engine, args.max_tokens, args.concurrency))
    else:
        print("engine-bf16 skipped: this TorchEngine takes no dtype")

    vllm_engines = []
    for dtype in filter(None, args.vllm.split(",")):
        from palaestra.engine.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            weights, tokenizer, dtype=dtype, max_model_len=1024, max_num_seqs=args.concurrency
        )
        vllm_engines.append(engine)
        modes.append(vllm_mode(f"vllm-{dtype}", engine, args.max_tokens, args.concurrency))

    endpoint = None
    try:
        if args.endpoint:
            # Ready before any timing starts; it idles while the in-process modes run.
            endpoint = Endpoint.launch(
                config, unauthenticated=True, recreate_if_existing=True, name="bench-generation"
            )
            endpoint.wait_until_ready(timeout=15 * 60)
            modes.append(endpoint_mode(endpoint, args.max_tokens, args.concurrency))
        results = measure(modes, requests, args.rounds)
    finally:
        if endpoint is not None:
            endpoint.stop()
        for engine in vllm_engines:
            engine.close()

    rows = summarise(modes, results)
    report = {
        "model": config.name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "engine_bf16": bf16,
        "results": rows,
    }
    print(markdown(rows))
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    headline = {f"{row['mode']} tokens/s": row["tokens_per_s_median"] for row in rows}
    record("generation", args, report, headline)


if __name__ == "__main__":
    main()
