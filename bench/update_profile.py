"""Where one GRPO update's time goes: the learner's ``train_step`` on a step's worth of
samples, timed, then profiled by op and summed into kinds of work beside the update's floor.

    python bench/update_profile.py [--prompts 4] [--samples 8] [--response-tokens 48]
    python bench/update_profile.py --smoke     # one small update, printed, not recorded

The update is the learner a user's run builds (``train.learner.Learner`` over the embedded
SmolLM2-135M-Instruct, float32 master weights, fused AdamW) with ``bench/grpo_step.py``'s
settings: DAPO loss, no KL, one optimiser step, micro-batches of ``--micro-batch`` sequences,
in the recipe's precision (``--precision``, auto by default). The samples are what a rollout of
``--prompts`` x ``--samples`` would hand it: token ids drawn with a fixed seed, prompts of
``--prompt-tokens`` tokens, responses of half to all of ``--response-tokens`` tokens, the
sampler's log-probs attached (so, as in a run, no scoring pass replaces them) and advantages
that sum to zero per group.

It runs ``--warmup`` untimed updates, then ``--repeats`` timed ones (the median is the figure),
then one more under ``torch.profiler``. The profile's self CPU time of every op is summed by
kind (``KINDS``: matrix products, attention, log-probs over the vocabulary, norms, elementwise,
casts and copies, the optimiser, allocation); the table gives each kind's share and seconds
scaled to the unprofiled median (the profiler's own overhead spreads over every op). The floor
is the update's FLOPs (3 x a forward over every token, ``flops.step_flops``) at the measured
matmul peak of the precision it computes in.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS: list[tuple[str, tuple[str, ...]]] = [
    # (kind, substrings of aten op names), first match wins: order matters.
    ("optimiser", ("adam", "_foreach", "clip_grad", "linalg_vector_norm")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "bmm")),
    ("log-probs (vocabulary)", ("log_softmax", "logsumexp", "gather", "nll_loss", "cross_entropy")),
    ("matrix products", ("::mm", "addmm", "matmul", "linear", "mkldnn", "::dot")),
    ("norms", ("rms_norm", "layer_norm", "rsqrt", "::pow", "::mean")),
    ("casts and copies", ("::to", "_to_copy", "copy_", "clone", "contiguous", "::cat")),
    ("allocation", ("empty", "zeros", "ones", "fill_", "zero_", "resize_", "full")),
    (
        "elementwise",
        ("::mul", "::add", "::sub", "::div", "silu", "::neg", "::exp", "where", "sigmoid", "sum"),
    ),
]


def kind_of(op: str) -> str:
    for kind, needles in KINDS:
        if any(needle in op for needle in needles):
            return kind
    return "other"


def parse_args() -> argparse.Namespace:
    from results import add_arguments, smoke_defaults

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="groups in the step")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--response-tokens", type=int, default=48, help="the longest response")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per pass")
    parser.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--model", default="SmolLM2_135M", help="a palaestra catalogue name")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(
        args, parser, prompts=1, samples=2, response_tokens=8, prompt_tokens=8, repeats=1
    )
    return args


async def no_reward(args, sample, **kwargs) -> float:
    return 0.0  # the update never calls it; a Recipe names one


def step_samples(args, vocab: int) -> tuple[list, list[float]]:
    """A rollout's samples and advantages, drawn with a fixed seed."""
    from palaestra.types import Sample

    draw = random.Random(0)
    samples, advantages = [], []
    for group in range(args.prompts):
        prompt = [draw.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        lows = max(1, args.response_tokens // 2)
        for index in range(args.samples):
            length = draw.randint(lows, args.response_tokens)
            response = [draw.randrange(3, vocab) for _ in range(length)]
            samples.append(
                Sample(
                    "",
                    "",
                    None,
                    {},
                    group,
                    index,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=[-2.0] * len(response),
                )
            )
        scores = [draw.gauss(0.0, 1.0) for _ in range(args.samples)]
        mean = statistics.fmean(scores)
        advantages += [score - mean for score in scores]
    return samples, advantages


def build_learner(args):
    import palaestra
    from palaestra import Recipe
    from palaestra.models.loading import load_causal_lm, load_tokenizer
    from palaestra.train.learner import Learner

    recipe = Recipe(
        lr=1e-6,
        max_grad_norm=1.0,
        train_micro_batch_size=args.micro_batch,
        loss_type="dapo",
        kl_loss_coef=0.0,
        num_steps_per_rollout=1,
        precision=args.precision,
        custom_rm_function=no_reward,
    )
    model = getattr(palaestra, args.model)()
    weights = model.weights_path()
    tokenizer = load_tokenizer(weights, model.chat_template, model.revision)
    policy = load_causal_lm(weights, revision=model.revision).train()
    return Learner(policy, recipe, None, tokenizer), len(tokenizer)


def profile_kinds(learner, samples, advantages) -> dict[str, float]:
    """Self CPU seconds by kind over one profiled update."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner.train_step(samples, advantages)
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        kind = kind_of(event.key)
        seconds[kind] = seconds.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    return seconds


def main() -> None:
    import torch
    from flops import ModelShape, step_flops
    from results import measure_peaks, record

    args = parse_args()
    torch.set_num_threads(args.threads)
    learner, vocab = build_learner(args)
    samples, advantages = step_samples(args, vocab)
    for _ in range(args.warmup):
        learner.train_step(samples, advantages)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        learner.train_step(samples, advantages)
        times.append(time.perf_counter() - started)
    update_s = statistics.median(times)
    kinds = profile_kinds(learner, samples, advantages)
    profiled = sum(kinds.values())

    peaks = measure_peaks(args.smoke)
    precision = str(learner.dtype).removeprefix("torch.")
    shape = ModelShape.from_config(learner.model.config)
    sequences = [(len(s.prompt_token_ids), len(s.response_token_ids)) for s in samples]
    flops = step_flops(shape, sequences, [])["train"]
    floor_s = flops / (peaks[precision] * 1e9)
    rows = sorted(kinds.items(), key=lambda item: -item[1])
    print(f"update: {update_s:.2f} s (median of {len(times)}), {precision}, floor {floor_s:.2f} s")
    print(f"{'kind':26} {'share':>7} {'seconds':>8}")
    for kind, spent in rows:
        print(f"{kind:26} {spent / profiled:7.1%} {update_s * spent / profiled:8.2f}")
    figures = {
        "precision": precision,
        "samples": len(samples),
        "trained_tokens": sum(p + r for p, r in sequences),
        "update_s": update_s,
        "update_s_all": times,
        "floor_s": floor_s,
        "update_over_floor": update_s / floor_s,
        "kinds_s": {kind: update_s * spent / profiled for kind, spent in rows},
        "threads": args.threads,
    }
    headline = {
        "update (s)": round(update_s, 2),
        "update / floor": round(update_s / floor_s, 2),
        **{kind: f"{spent / profiled:.0%}" for kind, spent in rows[:5]},  # the largest kinds
    }
    record("update_profile", args, figures, headline, peaks)


if __name__ == "__main__":
    main()
