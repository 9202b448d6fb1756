"""The plan against a real run: the embedded model trained with ``SmolLM2_135M_Recipe`` on the
built-in haiku dataset, its peak resident memory (VmHWM) beside ``TrainConfig.plan()``'s peak.

    python bench/plan_check.py [--steps 3] [--precision auto|float32|bfloat16] [--json PATH]
    python bench/plan_check.py --smoke     # one step: the same comparison, printed, not recorded
    python bench/plan_check.py --activations [--precision ...]
    python bench/plan_check.py --runtime

The run is ``TrainConfig.train()`` in a child process of its own (so its high-water mark is
the run's, not this script's), with the palaestra home of this machine, the embedded model
converted beforehand (the conversion's own peak is not the run's). Memory, not time: the
machine's load does not change it.

``--activations`` measures what ``plan.ACTIVATION_ELEMENTS`` models: the bytes autograd saves
for the backward of one micro-batch of the learner's pass (``train.scoring.score_tokens``,
parameters excluded), on a model of the embedded shape with random weights, at two response
lengths, and prints the bytes per token and layer and the elements per token and layer.

``--runtime`` measures what ``plan.CPU_RUNTIME_BYTES`` models: the resident memory of a process
that has imported what a run imports and prepared the embedded model's tokenizer and prompts,
just before a run would load the model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def config(steps: int, precision: str, save_optim: bool = True):
    from palaestra import (
        HuggingFaceDataset,
        SmolLM2_135M,
        SmolLM2_135M_Recipe,
        TrainConfig,
        builtin_dataset,
    )

    dataset = HuggingFaceDataset(
        hf_repo=str(builtin_dataset("haiku")),
        hf_split="train[:10]",
        input_column="keywords",
        output_column="text",
        prompt_template="Write a haiku about {input}.",
    )
    recipe = SmolLM2_135M_Recipe(
        num_rollout=steps,
        precision=precision,
        custom_rm_function="palaestra.rewards.haiku:haiku_reward",
        apply_chat_template_kwargs='{"enable_thinking": false}',
        no_save_optim=not save_optim,
    )
    return TrainConfig(model=SmolLM2_135M(), dataset=dataset, recipe=recipe)


def peak_rss() -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(steps: int, precision: str, save_optim: bool) -> None:
    config(steps, precision, save_optim).train()
    print(json.dumps({"peak_rss": peak_rss()}))


def activations(precision: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from palaestra.models.loading import compute_dtype
    from palaestra.train.batch import build_train_batch
    from palaestra.train.scoring import score_tokens
    from palaestra.types import Sample

    torch.manual_seed(0)
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            num_attention_heads=9,
            num_key_value_heads=3,
            **shape,
            tie_word_embeddings=True,
        )
    )
    dtype = compute_dtype(precision, "cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}
    for response in (24, 120):
        samples = [
            Sample(
                "",
                "",
                None,
                {},
                0,
                i,
                prompt_token_ids=list(range(1, 39)),
                response_token_ids=list(range(100 + i, 100 + i + response)),
            )
            for i in range(8)
        ]
        batch = build_train_batch(samples, torch.ones(8), pad_id=0)
        seen, total = set(params), 0

        def pack(tensor, seen=seen):
            nonlocal total
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in seen:
                seen.add(pointer)
                total += tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs, _ = score_tokens(model, batch, 1.0, dtype)
        tokens = 38 + 8 * response  # one group: its prompt once, then 8 answers
        sizes[tokens] = total
        del logprobs
    (t1, b1), (t2, b2) = sorted(sizes.items())
    per_token_layer = (b2 - b1) / (t2 - t1) / 30
    width = 2 if dtype == torch.bfloat16 else 4
    print(
        f"{precision} ({dtype}): {sizes} bytes saved; {per_token_layer:.0f} bytes per token and "
        f"layer = {per_token_layer / width:.0f} elements (hidden 576, MLP 1536)"
    )


def runtime() -> None:
    import transformers  # noqa: F401  (what a run imports before its model)

    from palaestra import SmolLM2_135M
    from palaestra.backends import local  # noqa: F401
    from palaestra.models.loading import load_tokenizer
    from palaestra.rollout.prompts import prepare_prompts
    from palaestra.train import loop  # noqa: F401

    run = config(1, "auto")
    tokenizer = load_tokenizer(SmolLM2_135M().weights_path(), None, None)
    prepare_prompts(run.dataset, tokenizer, run.recipe.apply_chat_template_kwargs)
    with open("/proc/self/status") as lines:
        rss = next(int(line.split()[1]) for line in lines if line.startswith("VmRSS:"))
    print(f"resident before the model loads: {rss / 1024:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--json")
    parser.add_argument("--activations", action="store_true")
    parser.add_argument("--runtime", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    from results import add_arguments, record, smoke_defaults

    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, steps=1)
    if args.activations:
        return activations(args.precision)
    if args.runtime:
        return runtime()
    if args.child:
        return child(args.steps, args.precision, save_optim=not args.smoke)
    from palaestra import SmolLM2_135M

    SmolLM2_135M().weights_path()  # convert the GGUF now, outside the measured process
    plan = config(args.steps, args.precision).plan()
    print(plan.table())
    command = [sys.executable, __file__, "--child", "--steps", str(args.steps)]
    command += ["--precision", args.precision] + (["--smoke"] if args.smoke else [])
    # The run's own lines and any error go straight to stderr; stdout carries the peak.
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]
    planned = plan.rows[0].peak
    result = {
        "precision": args.precision,
        "steps": args.steps,
        "planned_peak_bytes": planned,
        "measured_peak_rss_bytes": measured,
        "planned_over_measured": round(planned / measured, 3),
    }
    print(json.dumps(result, indent=2))
    headline = {
        "planned peak (GiB)": round(planned / 2**30, 2),
        "measured peak RSS (GiB)": round(measured / 2**30, 2),
        "planned / measured": result["planned_over_measured"],
    }
    record("plan_check", args, result, headline)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
