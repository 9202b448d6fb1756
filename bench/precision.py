"""How close bfloat16 autocast stays to float32 on the embedded model: log-probs, loss, gradient.

    python bench/precision.py [--prompts 4] [--samples 8] [--max-tokens 48] [--json PATH]
    python bench/precision.py --smoke    # 1 prompt x 2 answers of 8 tokens

A real run records its result under bench/results/precision/ (``bench/results.py``).

Samples one GRPO step's worth of haiku answers (float32 sampling, seeded), then scores the same
batch with the learner's own forward pass (``train.scoring.score_tokens``) in float32 and under
bfloat16 autocast (float32 weights both times), and compares: the token log-probs (mean and
largest absolute difference, in nats, and the answers' mean negative log-likelihood), the
gradient of the step's DAPO loss with group-normalised advantages (cosine similarity and
relative norm difference, in float64), and the wall time of a forward and backward pass (the
second of two in each dtype). The loss's value itself is the same in both by construction:
with one update per rollout every importance ratio is 1, so it is minus the mean advantage.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from results import add_arguments, record, smoke_defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, prompts=1, samples=2, max_tokens=8)
    torch.set_num_threads(len(os.sched_getaffinity(0)))

    from palaestra import SmolLM2_135M
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    model_config = SmolLM2_135M()
    weights = model_config.weights_path()
    tokenizer = load_tokenizer(weights, model_config.chat_template)
    model = load_causal_lm(weights, torch.float32)
    report = precision_report(model, tokenizer, args.prompts, args.samples, args.max_tokens)
    print("| measure | value |\n|---|---|")
    for key, value in report.items():
        print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("logprob_abs_diff_mean", "grad_cosine", "forward_backward_s_bfloat16")
    record("precision", args, report, {key: round(report[key], 4) for key in keys})


def precision_report(
    model, tokenizer, prompts: int, samples: int, max_tokens: int, engine_dtype=None, score=None
) -> dict:
    """Sample a GRPO step's haiku answers from ``model`` (float32 weights, on its device; the
    engine in ``engine_dtype`` when given), then score them in float32 and under bfloat16
    autocast and compare log-probs, loss gradients and pass times. With ``engine_dtype``, the
    engine's own log-probs are also compared with the float32 pass. ``score`` (text -> reward)
    defaults to the haiku reward."""
    from palaestra import HuggingFaceDataset, builtin_dataset
    from palaestra.algo.advantages import compute_advantages
    from palaestra.algo.losses import LossScale, aggregate, ppo_clip_loss
    from palaestra.engine import SamplingParams
    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.recipes import Recipe
    from palaestra.rewards.haiku import score_haiku
    from palaestra.rollout.prompts import prepare_prompts
    from palaestra.rollout.single_turn import group_seed, single_turn
    from palaestra.train.batch import build_train_batch
    from palaestra.train.scoring import score_tokens

    device = next(model.parameters()).device
    dataset = HuggingFaceDataset(
        hf_repo=str(builtin_dataset("haiku")),
        hf_split=f"train[:{prompts}]",
        input_column="keywords",
        prompt_template="Write a haiku about {input}.",
    )
    prompts_P = prepare_prompts(dataset, tokenizer, {})
    recipe = Recipe(rollout_max_response_len=max_tokens, n_samples_per_prompt=samples)
    params_P = [
        SamplingParams(max_tokens, seed=group_seed(recipe.seed, 1, i))
        for i in range(len(prompts_P))
    ]
    engine = TorchEngine(model, tokenizer, dtype=engine_dtype)
    samples_B = single_turn(engine, prompts_P, params_P, samples, step=1)
    engine.close()
    score = score or score_haiku
    rewards_P_G = torch.tensor([score(s.response) for s in samples_B]).view(-1, samples)
    advantages_B = compute_advantages(rewards_P_G, "grpo", "group").view(-1)
    batch = build_train_batch(samples_B, advantages_B, tokenizer.pad_token_id).to(device)
    mask_B_T = batch.mask_B_T
    scale = LossScale(float(mask_B_T.sum()), len(samples_B), 1, max_tokens)

    results = {}
    # Twice each, keeping the second: the first pass in a dtype pays one-time kernel set-up.
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        started = time.perf_counter()
        logprobs_B_T, _ = score_tokens(model, batch, 1.0, dtype)
        per_token_B_T, _ = ppo_clip_loss(
            logprobs_B_T, logprobs_B_T.detach(), batch.advantages_B, 0.2, 0.2
        )
        aggregate(per_token_B_T, mask_B_T, "dapo", scale).backward()
        synchronize(device)
        seconds = time.perf_counter() - started
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
        name = str(dtype).removeprefix("torch.")
        results[name] = (logprobs_B_T.detach(), gradient.double(), seconds)
    model.zero_grad(set_to_none=True)

    fp32, bf16 = results["float32"], results["bfloat16"]
    scored_B_T = mask_B_T > 0
    diff_N = (bf16[0] - fp32[0])[scored_B_T].abs()
    cosine = (fp32[1] @ bf16[1]) / (fp32[1].norm() * bf16[1].norm())
    report = {
        "scored_tokens": int(mask_B_T.sum()),
        "logprob_abs_diff_mean": float(diff_N.mean()),
        "logprob_abs_diff_max": float(diff_N.max()),
        "nll_float32": -float(fp32[0][scored_B_T].mean()),
        "nll_bfloat16": -float(bf16[0][scored_B_T].mean()),
        "grad_cosine": float(cosine),
        "grad_norm_relative_diff": float((bf16[1].norm() - fp32[1].norm()) / fp32[1].norm()),
        "forward_backward_s_float32": round(fp32[2], 3),
        "forward_backward_s_bfloat16": round(bf16[2], 3),
    }
    if engine_dtype is not None:
        # The engine's log-probs (sampled in its own precision) against the float32 pass.
        sampler_N = (batch.sampler_logprobs_B_T - fp32[0])[scored_B_T].abs()
        report["engine_dtype"] = str(engine_dtype).removeprefix("torch.")
        report["engine_logprob_abs_diff_mean"] = float(sampler_N.mean())
        report["engine_logprob_abs_diff_max"] = float(sampler_N.max())
    return report


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
