"""A multi-turn GRPO step against a single-turn step of the same size, side by side.

    python bench/multiturn.py [--turns 4] [--turn-tokens 16] [--rounds 2] [--json out.json]
    python bench/multiturn.py --smoke     # 1 x 2 episodes of 2 short turns, one step a side

A real run records its result under bench/results/multiturn/ (``bench/results.py``).

Both sides run what a training step runs (``GroupSampler.sample``, then
``Learner.train_step`` and the weight sync) on the embedded SmolLM2-135M-Instruct, built by the
local backend's own functions, on the same ``--prompts`` (4) haiku prompts x ``--samples`` (4)
samples (16 sequences):

- multi-turn: 16 episodes of an environment that asks for another haiku after each reply,
  ``--turns`` replies of ``--turn-tokens`` tokens each; every turn is one batched engine call
  over the episodes, each turn's context (prompt, earlier turns, feedback) prefilled anew;
- single-turn, same sampled tokens: 16 replies of ``--turns`` x ``--turn-tokens`` tokens each;

- single-turn, same sequence: 16 replies as long as a multi-turn episode's whole response
  (its replies and the environment's messages), so the learner trains on as many tokens.

The first single-turn side samples as many tokens as the multi-turn one; the second trains on
as many. The engines ignore end-of-sequence tokens (a bench-only change) so that every reply
runs to its limit and the counts match exactly. Sides alternate, one step at a time, after
``--warmup`` untimed steps each (1; the multi-turn side makes at least one); the summary
gives the median of ``--rounds`` timed steps and the ratio of the multi-turn step to each
single-turn one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from results import add_arguments, record, smoke_defaults

from palaestra import LocalDataset, Recipe, SmolLM2_135M, TrainConfig, builtin_dataset
from palaestra.types import Step


class AnotherHaiku:
    """Asks for another haiku after each reply; never done (the turn limit ends it)."""

    def start(self, row):
        return f"Write a haiku about {row['keywords']}."

    def step(self, reply):
        return Step("Write another one.", reward=float(len(set(reply))))


def reply_variety(args, sample, **kwargs) -> float:
    return float(len(set(sample.response)))


def build(recipe: Recipe):
    """The sampler and learner of a run of ``recipe``, as the local backend builds them."""
    from palaestra.backends.building import (
        make_engine,
        make_learner,
        make_sampler,
        prepare_data,
        starting_weights,
        tokenizer_of,
    )
    from palaestra.train.state import resolve_start

    dataset = LocalDataset(
        path=str(builtin_dataset("haiku")),
        hf_split="train[:8]",
        input_column="keywords",
        prompt_template="Write a haiku about {input}.",
    )
    config = TrainConfig(model=SmolLM2_135M(), dataset=dataset, recipe=recipe)
    start = resolve_start(None, recipe.num_rollout, [], False)
    tokenizer = tokenizer_of(config, start)
    learner = make_learner(config, start, tokenizer, "cpu")
    engine = make_engine(config, learner.model, tokenizer, starting_weights(config, start))
    engine.eos_ids = []  # every reply runs to its max_tokens: equal token counts on both sides
    return make_sampler(config, engine, prepare_data(config, tokenizer)), learner


def one_step(sampler, learner, step: int) -> dict[str, float]:
    from palaestra.train.loop import step_advantages

    started = time.monotonic()
    rollout = sampler.sample(step, cursor=0)
    sampled = time.monotonic()
    learner.train_step(rollout.trained_B, step_advantages(rollout.trained_B, sampler.recipe))
    sampler.update_weights(learner.weights(), version=step)
    done = time.monotonic()
    samples = rollout.trained_B
    return {
        "step_s": done - started,
        "rollout_s": sampled - started,
        "train_s": done - sampled,
        "sampled_tokens": sum(sum(s.response_mask()) for s in samples),
        "response_tokens": sum(len(s.response_token_ids) for s in samples),
        "trained_sequence_tokens": sum(
            len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--json", default=None)
    add_arguments(parser)
    options = parser.parse_args()
    smoke_defaults(
        options, parser, turns=2, turn_tokens=4, rounds=1, warmup=0, prompts=1, samples=2
    )
    os.environ.setdefault("PALAESTRA_HOME", tempfile.mkdtemp(prefix="palaestra-bench-"))
    P, G = options.prompts, options.samples
    common = dict(
        rollout_batch_size=P,
        n_samples_per_prompt=G,
        lr=1e-6,
        train_micro_batch_size=P * G,
        custom_rm_function=reply_variety,
    )
    sides = {
        "multi-turn": build(
            Recipe(
                environment=AnotherHaiku,
                max_turns=options.turns,
                rollout_max_response_len=options.turn_tokens,
                **common,
            )
        ),
        "single-turn, same sampled": build(
            Recipe(rollout_max_response_len=options.turns * options.turn_tokens, **common)
        ),
    }
    # One untimed multi-turn step gives the response length the third side matches.
    multi_sampler, multi_learner = sides["multi-turn"]
    warm = one_step(multi_sampler, multi_learner, 1)
    response = warm["response_tokens"] // (P * G)
    sides["single-turn, same sequence"] = build(
        Recipe(rollout_max_response_len=int(response), **common)
    )
    results: dict[str, list[dict]] = {name: [] for name in sides}
    made = {name: int(name == "multi-turn") for name in sides}  # steps each side has made
    for round_ in range(options.warmup + options.rounds):
        timed = round_ >= options.warmup
        for name, (sampler, learner) in sides.items():
            if not timed and made[name] > round_:
                continue  # warmed up above
            made[name] += 1
            row = one_step(sampler, learner, made[name])
            if timed:
                results[name].append(row)
            label = f"{name:26s} step {made[name]}{'' if timed else ' (warm-up)'}: "
            print(label + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    summary = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for name, rows in results.items()
    }
    ratios = {
        name: summary["multi-turn"]["step_s"] / row["step_s"]
        for name, row in summary.items()
        if name != "multi-turn"
    }
    print()
    print("| side | step s | rollout s | train s | sampled tokens | sequence tokens |")
    print("|---|---|---|---|---|---|")
    for name, row in summary.items():
        print(
            f"| {name} | {row['step_s']:.1f} | {row['rollout_s']:.1f} | {row['train_s']:.1f} | "
            f"{row['sampled_tokens']:.0f} | {row['trained_sequence_tokens']:.0f} |"
        )
    print()
    for name, ratio in ratios.items():
        print(f"multi-turn step / {name} step: {ratio:.2f}x")
    options_json = {k: str(v) if k == "results_dir" else v for k, v in vars(options).items()}
    figures = {"options": options_json, "summary": summary, "ratios": ratios}
    if options.json:
        with open(options.json, "w") as out:
            json.dump(figures, out, indent=2)
    headline = {"multi-turn step s": round(summary["multi-turn"]["step_s"], 2)}
    headline |= {f"vs {name}": round(ratio, 2) for name, ratio in ratios.items()}
    record("multiturn", options, figures, headline)


if __name__ == "__main__":
    main()
