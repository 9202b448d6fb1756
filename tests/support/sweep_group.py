"""A group of runs (a sweep) made of real tiny runs, for the comparison and browser tests: three
trained variants of a 2 x 2 grid (the fourth recorded as skipped) and one run outside it."""

from __future__ import annotations

import time
from pathlib import Path

from palaestra import TrainConfig
from palaestra.runs.groups import write_group
from tests.support.tiny_runs import count_lowercase, gated_reward, tiny_config, write_topics

GRID = {"recipe.lr": [0.01, 0.001], "recipe.n_samples_per_prompt": [2, 4]}
AXES = list(GRID)
TRAINED = [(0.01, 2), (0.01, 4), (0.001, 2)]  # (0.001, 4) is recorded as skipped
GROUP_ID = "lr-sweep-20261204-101500-a1b2c3"
LABELS = [  # of the three variants side by side: both grid fields differ among them
    "recipe.lr=0.01, recipe.n_samples_per_prompt=2",
    "recipe.lr=0.01, recipe.n_samples_per_prompt=4",
    "recipe.lr=0.001, recipe.n_samples_per_prompt=2",
]


def fading_reward(args, sample, **kwargs) -> float:
    """``count_lowercase`` (0 to 8 here) less 10 a step: a run's mean reward falls every step,
    so its best (step 1) is never its last."""
    return count_lowercase(args, sample) - 10.0 * sample.step


def variant(model_dir: Path, data: Path, number: int, reward=fading_reward) -> TrainConfig:
    """Variant ``number`` (from 1) of the group: 2 steps, scored on an eval set each step."""
    lr, n = TRAINED[number - 1]
    base = tiny_config(model_dir, data, reward, num_rollout=2, lr=lr, n_samples_per_prompt=n)
    return base.model_copy(
        update={
            "recipe": base.recipe.model_copy(update={"eval_interval": 1}),
            "eval_dataset": base.dataset,
            "name": f"lr-sweep-v{number}",
            "group_id": GROUP_ID,
            "group_overrides": {"recipe.lr": lr, "recipe.n_samples_per_prompt": n},
            "group_axes": AXES,
        }
    )


def make_group(home: Path, model_dir: Path, live_last: bool = False) -> dict:
    """The group's three variants, its record, and a run outside it, in ``home`` (the caller
    sets PALAESTRA_HOME). With ``live_last`` the last variant is launched with
    ``gated_reward``, so it waits at step 2 while the others train here."""
    data = write_topics(home.parent / "topics.jsonl")
    live = variant(model_dir, data, 3, gated_reward).launch() if live_last else None
    run_ids = []
    for number in range(1, len(TRAINED) + 1 - bool(live)):
        run_ids.append(variant(model_dir, data, number).train().training_run_id)
        time.sleep(0.02)  # the runs list orders by creation time
    if live is not None:
        run_ids.append(live.training_run_id)
    skipped = {"recipe.lr": 0.001, "recipe.n_samples_per_prompt": 4}
    write_group(
        {
            "group_id": GROUP_ID,
            "name": "lr-sweep",
            "grid": GRID,
            "axes": AXES,
            "variants": [
                {"index": i, "run_id": run_id, "overrides": dict(zip(AXES, values, strict=True))}
                for i, (run_id, values) in enumerate(zip(run_ids, TRAINED, strict=True))
            ],
            "skipped": [{"overrides": skipped, "error": "variant 4 of 4: not today"}],
            "created_at": time.time(),
            "max_parallel": 1,
            "continue_on_error": True,
            "driver": None,
        },
        home,
    )
    outside = tiny_config(model_dir, data, fading_reward, num_rollout=2, lr=0.005).model_copy(
        update={"name": "baseline"}
    )
    return {
        "group_id": GROUP_ID,
        "run_ids": run_ids,
        "outside": outside.train().training_run_id,
        "live": live,
    }
