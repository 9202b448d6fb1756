"""A CUDA GPU: GRPO steps of a tiny model, the embedded model and models of Qwen3-4B's and
Qwen3.5-4B's shapes with random weights, trained by the code a user's run uses, and how far
bfloat16 strays from float32 there.

    python bench/gpu_check.py [--models tiny,embedded,qwen3-4b,qwen3.5-4b] [--steps 3]
                              [--engine auto] [--tokenizer DIR] [--json PATH]
    python bench/gpu_check.py --smoke   # tiny and both Qwen shapes scaled down, one small
                                        # float32 step each; on the CPU where torch sees no GPU
    python bench/gpu_check.py --plan-only H100   # the Qwen models' plans on a named GPU, and
                                                 # the fields each would train with; no GPU

A real run records its result under bench/results/gpu_check/ (``bench/results.py``).

For each model:
- **precision**: ``bench/precision.py``'s comparison on the GPU. One step's haiku answers are
  sampled by the torch engine in bfloat16 (a copy of float32 weights, as a run on a GPU samples),
  then scored in float32 and under bfloat16 autocast: the engine's log-probs against the float32
  pass, the learner's bfloat16 log-probs against float32, and the DAPO loss gradient's cosine.
- **training**: ``TrainConfig(...).train()`` with ``rollout_num_gpus=1``, once in bfloat16 and
  once in float32, on the built-in haiku dataset and the haiku reward. Per step: step, rollout
  and train seconds, generated tokens per second, loss, reward, and the gap between the
  sampler's and the learner's log-probs that every run logs (``sampler_logprob_abs_diff``).
  The first step is warm-up (kernel selection, allocator growth) and is reported apart.

``qwen3-4b`` and ``qwen3.5-4b`` (``bench/model_shapes.py``) are built from the catalogue's
shapes with random weights and no download, at full size on the GPU and scaled down (same
config class and layer kinds, every width /32) under ``--smoke``. Before training, each prints
``TrainConfig.plan()`` and takes the first of full fine-tuning or LoRA (``LORA_FIELDS``) that
the plan says fits the device, then the plan's peak beside the measured one
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``). ``--engine auto`` samples
with vLLM where it is installed and loads the architecture, with the torch engine otherwise.

The tiny model is a 4-layer Llama built in code around the embedded model's tokenizer (from
``--tokenizer``, or the embedded model's converted folder); its random weights never write a
haiku, so its reward is the number of distinct characters of an answer instead. The GPU's
measured bfloat16 matmul rate heads the report. Exits non-zero when a loss is not finite or a
log-prob gap exceeds its bound, so a broken CUDA path fails loudly.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import MODELS, build_model_dir
from precision import precision_report
from results import add_arguments, record, skip, smoke_defaults

# Bounds, in nats, for the checks that fail the script: bfloat16 has 8 bits of mantissa, so a
# log-prob near -5 moves by ~0.02 per rounding; means of a few hundredths are expected, and a
# mean above these bounds means something other than rounding (a wrong cast, a wrong kernel).
ENGINE_DIFF_MEAN_BOUND = 0.1
LEARNER_DIFF_MEAN_BOUND = 0.1


def haiku_reward(args, sample, **kwargs) -> float:
    from palaestra.rewards.haiku import score_haiku

    return score_haiku(sample.response)


def distinct_characters(text: str) -> float:
    """The tiny model's reward: its random weights never write a haiku (every answer would
    score -10 and no group would have an advantage), but its answers differ in this."""
    return len(set(text)) / 10


def distinct_reward(args, sample, **kwargs) -> float:
    return distinct_characters(sample.response)


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> float:
    """Measured rate of one ``size``-cubed product on the GPU: mean of 10 after 3 warm-ups."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * 10 / (time.perf_counter() - started) / 1e12


def tiny_model_dir(tokenizer_dir: str, folder: Path) -> Path:
    """A 4-layer, 256-wide Llama with random weights around ``tokenizer_dir``'s tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


FULL = {"prompts": 8, "samples": 8, "max_tokens": 64, "precision": (4, 8, 48)}
LORA_FIELDS = {"lora_rank": 32, "lora_alpha": 64}
"""What a 4B model trains with where the plan says full fine-tuning does not fit one GPU: a
float32 learner holds ~16 bytes a parameter plus 4 for the KL reference (~75 GiB for 4B) before
activations and the engine's copy; LoRA holds the float32 base and only the adapters' moments."""
RANDOM_WEIGHTS = ("tiny", *MODELS)
"""Models whose random weights never write a haiku: rewarded by distinct characters."""

SMOKE = {"prompts": 2, "samples": 2, "max_tokens": 8, "precision": (1, 2, 8)}
"""A training step's prompts x samples and answer length, and the precision check's (prompts,
samples, answer length): the real run's and the smoke run's."""


def train_config(
    model_config, precision: str, steps: int, gpus: int, reward, size: dict, fields: dict
):
    """The TrainConfig of ``steps`` GRPO steps on ``gpus`` GPUs (0: the CPU), with ``fields``
    over the recipe's."""
    from palaestra import HuggingFaceDataset, Recipe, TrainConfig, builtin_dataset

    return TrainConfig(
        model=model_config,
        dataset=HuggingFaceDataset(
            hf_repo=str(builtin_dataset("haiku")),
            hf_split="train",
            input_column="keywords",
            prompt_template="Write a haiku about {input}.",
        ),
        recipe=Recipe(
            num_rollout=steps,
            rollout_batch_size=size["prompts"],
            n_samples_per_prompt=size["samples"],
            rollout_max_response_len=size["max_tokens"],
            lr=1e-5,
            rollout_num_gpus=gpus,
            precision=precision,
            save_interval=None,
            custom_rm_function=reward,
            **fields,
        ),
        name=f"gpu-check-{precision}",
    )


def fitting_fields(config_of, model_name: str) -> tuple[dict, object]:
    """The first of full fine-tuning and LoRA whose plan fits the device, and its plan;
    ``config_of(fields)`` gives the TrainConfig. Prints the plan and the choice."""
    for fields in ({}, LORA_FIELDS):
        plan = config_of(fields).plan()
        if plan.fits:
            break
        print(f"{model_name}: the plan of {fields or 'full fine-tuning'} does not fit; next")
    print(plan.table())
    print(
        f"{model_name}: training with {fields or 'full fine-tuning'}"
        + ("" if plan.fits else " (NO layout fits; trying anyway)")
    )
    return fields, plan


def plan_only(gpu: str, names: list[str], precision: str, steps: int) -> None:
    """Each catalogue Qwen model's plans on ``gpu``, full fine-tuning and LoRA, and which the
    check would train with: the choice made on a real GPU, made anywhere."""
    for name in names:
        if name not in MODELS:
            raise SystemExit(f"--plan-only: plans the Qwen models only ({', '.join(MODELS)})")
        model = MODELS[name][0]()
        for fields in ({}, LORA_FIELDS):
            config = train_config(model, precision, steps, 1, distinct_reward, FULL, fields)
            plan = config.plan(gpu=gpu)
            (row,) = plan.rows
            verdict = "fits" if plan.fits else "does NOT fit"
            print(
                f"{name} on {plan.device_name}, {fields or 'full fine-tuning'}: peak "
                f"{row.peak / 2**30:.1f} of {row.capacity / 2**30:.1f} GiB, {verdict}"
            )
            if plan.fits:
                print(f"{name}: would train with {fields or 'full fine-tuning'}")
                break


def train_rows(config_of, fields: dict, engine: str) -> tuple[list[dict], str, str | None]:
    """The metrics rows of the run in this process, the engine it sampled with, and why vLLM
    was left for the torch engine (None when it was not): under ``engine="auto"`` a run that
    fails on vLLM (an architecture it does not load) is run again on the torch engine."""
    from palaestra.engine.vllm_engine import vllm_available

    first = engine if engine != "auto" else ("vllm" if vllm_available() else "torch")
    try:
        rows = config_of({**fields, "rollout_engine": first}).train().metrics()
        return rows, first, None
    except Exception as error:
        if engine != "auto" or first != "vllm":
            raise
        why = f"{type(error).__name__}: {error}"[:300]
        print(f"vLLM failed ({why}); again on the torch engine")
    import gc

    gc.collect()  # what the failed engine held, before the torch engine's run allocates
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows = config_of({**fields, "rollout_engine": "torch"}).train().metrics()
    return rows, "torch", why


def step_summary(row: dict, size: dict = FULL) -> dict:
    tokens = row["response_length_mean"] * size["prompts"] * size["samples"]
    keys = (
        "step",
        "step_s",
        "rollout_s",
        "train_s",
        "weight_sync_s",
        "loss",
        "grad_norm",
        "reward_mean",
    )
    summary = {k: row[k] for k in keys if k in row}
    summary["generated_tokens_per_s"] = tokens / row["rollout_s"]
    if "sampler_logprob_abs_diff" in row:
        summary["sampler_logprob_abs_diff"] = row["sampler_logprob_abs_diff"]
    return summary


def check_model(
    name: str,
    model_config,
    steps: int,
    device: str,
    precisions: list[str],
    size: dict = FULL,
    engine: str = "auto",
) -> dict:
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    weights = model_config.weights_path()
    tokenizer = load_tokenizer(weights, model_config.chat_template)
    model = load_causal_lm(weights, torch.float32).to(device)
    report: dict = {"model": name, "parameters": sum(p.numel() for p in model.parameters())}
    score = distinct_characters if name in RANDOM_WEIGHTS else None
    prompts, samples, max_tokens = size["precision"]
    report["precision"] = precision_report(
        model, tokenizer, prompts, samples, max_tokens, torch.bfloat16, score
    )
    del model
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    reward = distinct_reward if name in RANDOM_WEIGHTS else haiku_reward
    for precision in precisions:

        def config_of(fields: dict, precision=precision):
            gpus = 1 if cuda else 0
            return train_config(model_config, precision, steps, gpus, reward, size, fields)

        fields, plan = fitting_fields(config_of, f"{name} {precision}")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        rows, used, fallback = train_rows(config_of, fields, engine)
        wall_s = time.perf_counter() - started
        if used != plan.layout.engine:  # the plan of the engine that did sample
            plan = config_of({**fields, "rollout_engine": used}).plan()
        report[f"train_{precision}"] = {
            "wall_s": wall_s,
            "fields": fields,
            "engine": used,
            "vllm_failure": fallback,
            "plan_peak_gib": max(row.peak for row in plan.rows) / 2**30,
            "plan_fits": plan.fits,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
            "reserved_gpu_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else 0.0,
            "steps": [step_summary(row, size) for row in rows],
        }
    return report


def failures(report: dict) -> list[str]:
    found = []
    precision = report["precision"]
    if precision["engine_logprob_abs_diff_mean"] > ENGINE_DIFF_MEAN_BOUND:
        found.append(f"{report['model']}: engine log-probs stray from float32")
    if precision["logprob_abs_diff_mean"] > LEARNER_DIFF_MEAN_BOUND:
        found.append(f"{report['model']}: bfloat16 learner log-probs stray from float32")
    for key in [k for k in report if k.startswith("train_")]:
        for step in report[key]["steps"]:
            if not all(math.isfinite(step.get(k, math.nan)) for k in ("loss", "grad_norm")):
                found.append(f"{report['model']} {key} step {step['step']}: loss not finite")
    return found


def print_report(report: dict) -> None:
    print(f"\n## {report['model']} ({report['parameters'] / 1e6:.1f} M parameters)")
    print("| precision check | value |\n|---|---|")
    for key, value in report["precision"].items():
        print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
    for key in [k for k in report if k.startswith("train_")]:
        run = report[key]
        print(
            f"\n{key} ({run['engine']} engine, {run['fields'] or 'full fine-tuning'}): "
            f"{run['wall_s']:.1f} s in all; plan peak {run['plan_peak_gib']:.2f} GiB, measured "
            f"{run['peak_gpu_mib'] / 1024:.2f} GiB allocated, "
            f"{run['reserved_gpu_mib'] / 1024:.2f} GiB reserved on GPU"
        )
        print(
            "| step | step s | rollout s | train s | sync s | tok/s | loss | grad norm "
            "| reward | gap |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in run["steps"]:
            print(
                f"| {s['step']} | {s['step_s']:.2f} | {s['rollout_s']:.2f} | {s['train_s']:.2f} "
                f"| {s.get('weight_sync_s', float('nan')):.2f} "
                f"| {s['generated_tokens_per_s']:.0f} | {s['loss']:.4f} | {s['grad_norm']:.3f} "
                f"| {s['reward_mean']:.2f} "
                f"| {s.get('sampler_logprob_abs_diff', float('nan')):.4f} |"
            )


def gpu_headline(head: dict, reports: list[dict]) -> dict:
    """The GPU, its bfloat16 rate, and each model's median step time per precision."""
    headline = {"GPU": head["gpu"], "bf16 TFLOP/s": round(head["bf16_matmul_tflops"], 1)}
    for report in reports:
        for key in [k for k in report if k.startswith("train_")]:
            steps = report[key]["steps"][1:] or report[key]["steps"]  # the first warms up
            seconds = sorted(s["step_s"] for s in steps)[len(steps) // 2]
            headline[f"{report['model']} {key.removeprefix('train_')} step s"] = round(seconds, 2)
    return headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,embedded")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--engine", default="auto", choices=("auto", "torch", "vllm"), help="rollout engine"
    )
    parser.add_argument("--tokenizer", default=None, help="folder with the tokenizer for tiny")
    parser.add_argument("--precisions", default="bfloat16,float32", help="training runs to make")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--cpu", action="store_true", help="run the same checks on the CPU (to try the script)"
    )
    parser.add_argument("--plan-only", metavar="GPU", default=None, help="plan on GPU, no run")
    add_arguments(parser)
    args = parser.parse_args()
    if args.plan_only:
        names = [n for n in args.models.split(",") if n in MODELS] or list(MODELS)
        return plan_only(args.plan_only, names, args.precisions.split(",")[0], args.steps)
    smoke_defaults(args, parser, models="tiny,qwen3-4b,qwen3.5-4b", steps=1, precisions="float32")
    if args.smoke and not args.cpu and not torch.cuda.is_available():
        skip("the GPU", "torch sees no CUDA GPU: the checks run on the CPU")
        args.cpu = True
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU; torch sees none (--cpu tries it on the CPU)")
    size = SMOKE if args.smoke else FULL

    from palaestra import ModelConfig, SmolLM2_135M

    head = {
        "gpu": "none (--cpu)" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bf16_matmul_tflops": 0.0 if args.cpu else matmul_tflops(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(head))
    reports = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            if name == "tiny":
                tokenizer_dir = args.tokenizer or SmolLM2_135M().weights_path()
                folder = tiny_model_dir(tokenizer_dir, Path(scratch) / "tiny")
                model_config = ModelConfig.from_pretrained(folder, name="tiny-llama")
            elif name == "embedded":
                model_config = SmolLM2_135M()
            elif name in MODELS:
                tokenizer_dir = args.tokenizer or SmolLM2_135M().weights_path()
                scaled = args.smoke or args.cpu  # a 4B model is never built on the CPU
                folder = Path(scratch) / name
                build_model_dir(name, tokenizer_dir, folder, scaled, device)
                model_config = ModelConfig.from_pretrained(folder, name=name)
            else:
                known = ", ".join(("tiny", "embedded", *MODELS))
                raise SystemExit(f"--models: unknown model {name!r} ({known})")
            precisions = args.precisions.split(",")
            report = check_model(
                name, model_config, args.steps, device, precisions, size, args.engine
            )
            print_report(report)
            reports.append(report)
    problems = [p for r in reports for p in failures(r)]
    if args.json:
        args.json.write_text(json.dumps({**head, "models": reports}, indent=2) + "\n")
    headline = gpu_headline(head, reports) | {"checks": "FAILED" if problems else "passed"}
    record("gpu_check", args, {**head, "models": reports, "problems": problems}, headline)
    if problems:
        raise SystemExit("FAILED: " + "; ".join(problems))
    print("\nall checks passed")


if __name__ == "__main__":
    main()
