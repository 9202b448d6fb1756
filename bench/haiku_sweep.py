"""The sweep behind the embedded model's recipe preset: which learning rate, temperature and
response length make the haiku tutorial learn in its 30 steps.

Each variant is the tutorial's training as a user runs it (``TrainConfig.train()``: the first 10
training topics, 4 prompts x 8 samples per step, ``SmolLM2_135M_Recipe`` with only the swept
fields changed) for 30 steps, scored every 10 steps on the test split's 60 topics (never
trained on; one answer each, sampled as in training, the same seed per topic at every
evaluation). The base model is scored the same way once per (temperature, length).

    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/haiku_sweep.py [--steps 30] [--only 1,4]
        [--row 3e-5,0.8,24] [--seeds 42,1] [--set dynamic_sampling=false]
    PALAESTRA_HOME=$(mktemp -d) .venv/bin/python bench/haiku_sweep.py --smoke
        # the first row, one step of 2 x 2 answers of 8 tokens, scored on 4 test topics

A real run records its result under bench/results/haiku_sweep/ (``bench/results.py``).

Columns: the test score before training and after 10, 20 and 30 steps; over the last 5 steps'
training samples, the mean reward, the share of answers three lines long and the share cut at
the length limit; seconds per step. A JSON copy goes to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

from results import add_arguments, record, smoke_defaults

from palaestra import (
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)
from palaestra.rewards.haiku import score_haiku

# (lr, temperature, max response tokens): the chosen defaults first, then one factor at a time
# away from them, then the preset as it was before this sweep (the last row).
GRID = [
    (3e-5, 0.8, 24),
    (3e-5, 0.8, 28),
    (1e-5, 0.8, 24),
    (3e-5, 1.0, 24),
    (3e-5, 0.8, 48),
    (2e-6, 1.0, 48),
]

SMOKE_RECIPE = dict(
    rollout_batch_size=2,
    n_samples_per_prompt=2,
    rollout_max_response_len=8,
    train_micro_batch_size=4,
)
"""What a smoke run of a bench built on the tutorial changes in its recipe: one small step."""

model = SmolLM2_135M()


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(builtin_dataset("haiku"))
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


async def haiku_rm(args, sample, **kwargs) -> float:
    return score_haiku(model.parse_response(sample.response).content)


def three_lines(text: str) -> bool:
    content = model.parse_response(text).content
    return len([line for line in content.strip().split("\n") if line.strip()]) == 3


def config_for(
    lr: float,
    temperature: float,
    length: int,
    steps: int,
    seed: int,
    smoke: bool = False,
    name: str | None = None,
    **fields,
) -> TrainConfig:
    """The tutorial's evaluated run with the swept fields set; ``fields`` are further recipe
    fields (another bench's, e.g. ``max_staleness``) and ``name`` the run's name."""
    # A smoke run: one small step, scored on 4 test topics after it.
    small = SMOKE_RECIPE | {"eval_interval": 1} if smoke else {}
    recipe = (
        dict(
            num_rollout=steps,
            n_samples_per_prompt=8,
            eval_interval=10,
            save_interval=None,
            apply_chat_template_kwargs='{"enable_thinking": false}',
            custom_rm_function=haiku_rm,
            lr=lr,
            rollout_temperature=temperature,
            rollout_max_response_len=length,
            seed=seed,
        )
        | small
        | fields
    )
    return TrainConfig(
        model=model,
        dataset=HaikuDataset(hf_split="train[:10]"),
        eval_dataset=HaikuDataset(hf_split="test[:4]" if smoke else "test"),
        recipe=SmolLM2_135M_Recipe(**recipe),
        name=name or f"sweep-lr{lr:g}-t{temperature:g}-len{length}-seed{seed}",
    )


def base_score(config: TrainConfig) -> float:
    """The untrained model's test score, sampled exactly as the runs' evaluations sample."""
    from palaestra.backends.local import build_local
    from palaestra.train.state import Start, TrainerState

    sampler, _ = build_local(config, Start(None, TrainerState(0, 0)))
    try:
        return sampler.evaluate(0)["eval_reward_mean"]
    finally:
        sampler.close()


def summarise(result, steps: int) -> dict:
    metrics = {row["step"]: row for row in result.metrics()}
    last = [s for s in result.samples() if s["step"] > steps - 5]
    evals = {
        step: row["eval_reward_mean"] for step, row in metrics.items() if "eval_reward_mean" in row
    }
    return {
        "eval": evals,
        "train_reward_last5": statistics.fmean(s["reward"] for s in last),
        "three_lines_last5": statistics.fmean(three_lines(s["response"]) for s in last),
        "cut_last5": statistics.fmean(s["finish_reason"] == "length" for s in last),
        "step_s": statistics.median(row["step_s"] for row in metrics.values()),
        "run_id": result.training_run_id,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", help="comma-separated 1-based rows of the grid")
    parser.add_argument(
        "--row", action="append", help="a variant outside the grid: LR,TEMPERATURE,LENGTH"
    )
    parser.add_argument("--seeds", default="42", help="comma-separated run seeds (default 42)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="another recipe field for every variant, VALUE as in palaestra sweep --grid "
        "(true, 4, 1e-5, grpo); repeatable",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("haiku-sweep.json"), help="JSON after each variant"
    )
    add_arguments(parser)
    args = parser.parse_args()
    smoke_defaults(args, parser, steps=1, only="1", out=None)
    rows = GRID
    if args.only:
        rows = [GRID[int(i) - 1] for i in args.only.split(",")]
    if args.row:
        rows = [(float(a), float(b), int(c)) for a, b, c in (r.split(",") for r in args.row)]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    fields = parse_fields(args.set)

    bases: dict[tuple[float, int], float] = {}
    results = []
    for (lr, temperature, length), seed in itertools.product(rows, seeds):
        config = config_for(lr, temperature, length, args.steps, seed, args.smoke, **fields)
        if (temperature, length) not in bases:
            bases[temperature, length] = base_score(config)
        started = time.monotonic()
        summary = summarise(config.train(), args.steps)
        summary |= {
            "lr": lr,
            "temperature": temperature,
            "max_tokens": config.recipe.rollout_max_response_len,  # a smoke run's is shorter
            "seed": seed,
            "fields": fields,
            "base": bases[temperature, length],
            "wall_s": time.monotonic() - started,
        }
        results.append(summary)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=2))
        print(json.dumps(summary), flush=True)

    print()
    print(
        "| lr | temperature | max tokens | seed | test score: base / 10 / 20 / 30 steps "
        f"| last 5 steps: reward / three lines / cut | s per step |   ({describe(fields)})"
    )
    print("| ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in results:
        evals = " / ".join(f"{r['eval'].get(s, float('nan')):+.2f}" for s in (10, 20, 30))
        print(
            f"| {r['lr']:g} | {r['temperature']:g} | {r['max_tokens']} | {r['seed']} | "
            f"{r['base']:+.2f} / {evals} | {r['train_reward_last5']:+.2f} / "
            f"{r['three_lines_last5']:.0%} / {r['cut_last5']:.0%} | {r['step_s']:.1f} |"
        )
    record("haiku_sweep", args, {"variants": results}, sweep_headline(results))


def parse_fields(pairs: list[str]) -> dict:
    """``["dynamic_sampling=false", "lr=1e-5"]`` as recipe fields, each VALUE read as
    ``palaestra sweep --grid`` reads one (a TOML value, else text). A pair without ``=`` or a
    value is a ValueError naming it."""
    from palaestra.cli import CommandError, parse_grid

    fields = {}
    for pair in pairs:
        try:
            ((name, values),) = parse_grid([pair]).items()
        except CommandError:
            raise ValueError(f"--set {pair!r}: expected FIELD=VALUE") from None
        fields[name] = values[0] if len(values) == 1 else values
    return fields


def sweep_headline(results: list[dict]) -> dict:
    """The first variant's (the preset's, unless --only or --row chose others) scores, the
    mean over the seeds it ran with."""
    first = results[0]
    same = [
        r
        for r in results
        if (r["lr"], r["temperature"], r["max_tokens"])
        == (first["lr"], first["temperature"], first["max_tokens"])
    ]
    last = max(first["eval"], default=None)
    return {
        "variant (lr, temperature, tokens)": f"{first['lr']:g}, {first['temperature']:g}, "
        f"{first['max_tokens']}",
        "seeds": len(same),
        "test score before": round(first["base"], 2),
        f"after {last} steps": round(statistics.fmean(r["eval"][last] for r in same), 2)
        if last
        else "n/a",
        "three lines, last 5 steps": round(
            statistics.fmean(r["three_lines_last5"] for r in same), 2
        ),
        "s per step": round(statistics.median(r["step_s"] for r in same), 1),
        "other fields": describe(first.get("fields", {})),
    }


def describe(fields: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in fields.items()) or "none"


if __name__ == "__main__":
    main()
