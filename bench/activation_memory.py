"""What the lean SwiGLU and RMSNorm (``models/lean_layers.py``) save in a learner update, and
what they cost: the same updates with and without them, side by side.

    python bench/activation_memory.py [--device cpu|cuda] [--precisions float32,bfloat16]
                                      [--prompts 4] [--samples 8] [--prompt-tokens 30]
                                      [--response-tokens 40] [--micro-batch 16] [--rounds 3]
    python bench/activation_memory.py --smoke   # 2 layers, 2 short answers, one round

A real run records its result under bench/results/activation_memory/ (``bench/results.py``).

The model has the embedded model's shape (SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9
heads over 3 key/value heads, vocabulary 49152, tied head) with random weights, so nothing is
loaded; the batch is ``--prompts`` groups of ``--samples`` answers of fixed lengths to random
prompts, as ``bench/grpo_step.py``'s step has. Each update is ``Learner.update``, the code a
run's learner calls: DAPO loss, one AdamW step, micro-batches of ``--micro-batch``.

Per mode (``lean``: as a run trains; ``stock``: the same update with transformers' own MLP and
norm forwards) and precision, it reports:
- the activations autograd keeps for one micro-batch's backward (distinct storages, parameters
  excluded), in MiB;
- on CUDA, the update's peak allocated memory (``torch.cuda.max_memory_allocated``) above what
  was allocated before it (weights, gradients' and optimiser's state included);
- the update's seconds, median of ``--rounds`` (modes alternate round by round);
- on a CPU, the float32 matmul peak (``flops.matmul_peak_gflops``) before and after, since
  timings mean little without the machine's speed at the time.

On a CPU the process's peak resident memory is not reported per mode: it only ever rises, and
glibc's heap keeps freed memory, so one process cannot compare two modes by it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from results import add_arguments, record, smoke_defaults


def embedded_shape_model(device: str, layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(device)


def synthetic_batch(args):
    from palaestra.train.batch import build_train_batch
    from palaestra.types import Sample

    generator = torch.Generator().manual_seed(0)
    samples = []
    for group in range(args.prompts):
        prompt = torch.randint(0, 49152, (args.prompt_tokens,), generator=generator).tolist()
        for index in range(args.samples):
            response = torch.randint(0, 49152, (args.response_tokens,), generator=generator)
            samples.append(
                Sample(
                    "",
                    "",
                    None,
                    {},
                    group,
                    index,
                    prompt_token_ids=prompt,
                    response_token_ids=response.tolist(),
                )
            )
    advantages = torch.randn(len(samples), generator=generator)
    return build_train_batch(samples, advantages, pad_id=0)


def saved_mib(model, batch, recipe, dtype) -> float:
    """MiB autograd keeps for the backward of the first micro-batch's scoring pass."""
    from palaestra.train.batch import micro_batches
    from palaestra.train.scoring import score_tokens

    micro = micro_batches(batch, recipe.train_micro_batch_size)[0].to(model.device)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = score_tokens(model, micro, recipe.rollout_temperature, dtype)
    del logprobs
    return total / 2**20


def main() -> None:
    import palaestra.train.scoring as scoring
    from palaestra.recipes import Recipe
    from palaestra.train.learner import Learner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--response-tokens", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30, help="of the embedded model's 30")
    parser.add_argument("--json", default=None)
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(
        args,
        parser,
        layers=2,
        prompts=1,
        samples=2,
        prompt_tokens=4,
        response_tokens=4,
        micro_batch=2,
        rounds=1,
    )

    lean_layers = scoring.lean_layers
    modes = {"lean": lean_layers, "stock": lambda model, **options: contextlib.nullcontext(0)}
    cuda = args.device.startswith("cuda")
    peaks = []
    if not cuda:
        from flops import matmul_peak_gflops

        peaks.append(matmul_peak_gflops(torch.float32))
    model = embedded_shape_model(args.device, args.layers)
    batch = synthetic_batch(args)
    rows = []
    for precision in args.precisions.split(","):
        recipe = Recipe(
            train_micro_batch_size=args.micro_batch,
            loss_type="dapo",
            precision=precision,
            lr=1e-6,
            max_grad_norm=1.0,
        )
        learner = Learner(model, recipe)
        results = {mode: {"seconds": []} for mode in modes}
        for mode, context in modes.items():
            scoring.lean_layers = context
            results[mode]["saved_mib"] = saved_mib(model, batch, recipe, learner.dtype)
            learner.update(batch)  # warm-up: kernels chosen, optimiser state made
        for _ in range(args.rounds):
            for mode, context in modes.items():
                scoring.lean_layers = context
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                started = time.perf_counter()
                learner.update(batch)
                if cuda:
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
                    results[mode]["peak_above_mib"] = peak
                results[mode]["seconds"].append(time.perf_counter() - started)
        scoring.lean_layers = lean_layers
        for mode, result in results.items():
            rows.append(
                {
                    "precision": precision,
                    "mode": mode,
                    "saved_mib": round(result["saved_mib"], 1),
                    "peak_above_mib": round(result.get("peak_above_mib", float("nan")), 1),
                    "update_s": round(statistics.median(result["seconds"]), 3),
                    "update_s_all": [round(s, 3) for s in result["seconds"]],
                }
            )
        del learner

    name = torch.cuda.get_device_name() if cuda else "cpu"
    if not cuda:
        peaks.append(matmul_peak_gflops(torch.float32))
    print(f"device {name}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if peaks:
        print(f"float32 matmul peak GFLOP/s (before / after): {peaks[0]:.0f} / {peaks[1]:.0f}")
    print(
        "| precision | mode | activations kept (MiB) | update peak above start (MiB) | update s |"
    )
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['precision']} | {row['mode']} | {row['saved_mib']} | "
            f"{row['peak_above_mib']} | {row['update_s']} |"
        )
    report = {
        "device": name,
        "torch": torch.__version__,
        "float32_matmul_gflops": peaks,
        "args": {k: str(v) if k == "results_dir" else v for k, v in vars(args).items()},
        "rows": rows,
    }
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    headline = {f"{r['precision']} {r['mode']} kept MiB": r["saved_mib"] for r in rows}
    headline |= {f"{r['precision']} {r['mode']} update s": r["update_s"] for r in rows}
    record("activation_memory", args, report, headline, {"float32": max(peaks)} if peaks else None)


if __name__ == "__main__":
    main()
