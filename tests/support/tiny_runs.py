"""Short real runs of the tiny model for the training, CLI, dashboard and browser tests.

Rewards defined here reach a launched run's process by name (``tests.support.tiny_runs``):
the run's worker gets this process's ``sys.path``, the repository root included, as its
PYTHONPATH.

``gated_reward`` lets a test hold a launched run at step 2 until it opens the gate (a file in
the run's palaestra home), so "while the run is running" is a state a test can count on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import pytest

from palaestra import LocalDataset, ModelConfig, Recipe, TrainConfig

TOPICS = ["rain", "snow", "sun", "wind", "moon", "sea"]


def count_lowercase(args, sample, **kwargs) -> float:
    """About a quarter of a random tiny model's characters: rewards differ within a group."""
    return float(sum(c.islower() for c in sample.response))


def gate_path() -> Path:
    return Path(os.environ["PALAESTRA_HOME"]) / "gate-open"


async def gated_reward(args, sample, **kwargs) -> float:
    """``count_lowercase``, but steps after the first wait until ``gate_path()`` exists."""
    while sample.step >= 2 and not gate_path().exists():
        await asyncio.sleep(0.05)
    return count_lowercase(args, sample)


def write_topics(path: Path) -> Path:
    path.write_text("".join(json.dumps({"topic": t}) + "\n" for t in TOPICS))
    return path


def tiny_config(model_dir: Path, data: Path, reward=count_lowercase, **recipe) -> TrainConfig:
    fields = dict(
        num_rollout=3,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        rollout_max_response_len=8,
        lr=1e-2,
        reward_timeout_s=120,
        custom_rm_function=reward,
    )
    return TrainConfig(
        model=ModelConfig.from_pretrained(model_dir, name="tiny"),
        dataset=LocalDataset(path=str(data), input_column="topic", prompt_template="Say {input}"),
        recipe=Recipe(**(fields | recipe)),
    )


def with_metrics(model_dir: Path, data: Path, metrics, **fields) -> TrainConfig:
    """A 3-step ``tiny_config`` whose metrics go to ``metrics`` (trackers)."""
    base = tiny_config(model_dir, data, num_rollout=3)
    return TrainConfig(
        model=base.model, dataset=base.dataset, recipe=base.recipe, metrics=metrics, **fields
    )


def make_config(model_dir: Path, data: Path, reward=count_lowercase, **recipe) -> TrainConfig:
    """One step of 2 prompts x 4 samples of at most 8 tokens, rewarded by ``count_lowercase``."""
    fields = dict(
        num_rollout=1,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        rollout_max_response_len=8,
        lr=1e-2,
        custom_rm_function=reward,
    )
    return TrainConfig(
        model=ModelConfig.from_pretrained(model_dir, name="tiny"),
        dataset=LocalDataset(path=str(data), input_column="topic", prompt_template="Say {input}"),
        recipe=Recipe(**(fields | recipe)),
    )


def wait_for(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def serving(home: Path, model_dir: Path, name: str, **launch):
    """A real endpoint process over the model in ``model_dir``, its records under ``home``,
    ready to answer; stopped on exit."""
    from palaestra.serve import Endpoint

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        model = ModelConfig(name=name, source=str(model_dir))
        endpoint = Endpoint.launch(model, name=name, **launch)
        try:
            endpoint.wait_until_ready(timeout=120)
            yield endpoint
        finally:
            endpoint.stop()
