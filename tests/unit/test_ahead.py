"""Sampling ahead of training (``Recipe.max_staleness``) and the rollout ledger, through the
loop with a fake backend: how far ahead the sampler draws, which weights draw each step,
stale groups dropped, and every prompt position settled exactly once across a crash."""

from __future__ import annotations

import json
import threading
import time

import pytest

from palaestra import LocalDataset, ModelConfig, Recipe, TrainConfig
from palaestra.runs.directory import RunDirectory
from palaestra.train.ahead import drop_stale
from palaestra.train.ledger import RolloutLedger, ledger_problems
from palaestra.train.loop import run_training
from palaestra.types import Rollout, Sample

G = 2


class Crash(RuntimeError):
    pass


def group(step: int, cursor: int, version: int) -> list[Sample]:
    return [
        Sample(
            prompt=f"p{cursor}",
            response=f"r{g}",
            label=None,
            metadata={},
            index=cursor,
            group_index=g,
            step=step,
            prompt_token_ids=[1, 2],
            response_token_ids=[3] * (g + 1),
            weight_version=version,
            reward=float(2 * g),
        )
        for g in range(G)
    ]


class DrawingSampler:
    """One group a step from the prompt at the cursor; records which step it drew with which
    weight version, in the order it drew them (from the ahead thread)."""

    def __init__(self) -> None:
        self.version = 0
        self.drawn: list[tuple[int, int, int]] = []
        self.changed = threading.Condition()

    def sample(self, step: int, cursor: int) -> Rollout:
        samples = group(step, cursor, self.version)
        with self.changed:
            self.drawn.append((step, cursor, self.version))
            self.changed.notify_all()
        metrics = {"reward_mean": 1.0, "reward_std": 1.0}
        return Rollout(samples, samples, cursor + 1, metrics, ["trained"])

    def update_weights(self, weights, version: int) -> None:
        self.version = version

    def evaluate(self, step: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class WaitingLearner:
    """Before training step s, waits until the sampler has drawn as far ahead as it may
    (step s + k, or the last step) and notes the furthest step drawn."""

    def __init__(self, sampler: DrawingSampler, k: int, last: int, crash_at=None) -> None:
        self.sampler, self.k, self.last, self.crash_at = sampler, k, last, crash_at
        self.furthest: dict[int, int] = {}
        self.trained: list[int] = []

    def train_step(self, samples_B, advantages_B) -> dict:
        step = samples_B[0].step
        if step == self.crash_at:
            raise Crash(f"killed in the update of step {step}")
        want = min(step + self.k, self.last)
        with self.sampler.changed:
            self.sampler.changed.wait_for(
                lambda: max(s for s, _, _ in self.sampler.drawn) >= want, timeout=10
            )
        time.sleep(0.05)  # room for a draw beyond the limit to show, were there one
        self.furthest[step] = max(s for s, _, _ in self.sampler.drawn)
        self.trained += [s.index for s in samples_B[::G]]
        return {"loss": 0.0}

    def weights(self):
        return {"w": len(self.trained)}

    def save(self, folder) -> None:
        (folder / "weights.txt").write_text("x")

    def load(self, folder) -> None:
        pass


def make_config(tiny_model_dir, prompts_file, **fields) -> TrainConfig:
    recipe = Recipe(
        **(
            dict(
                num_rollout=5,
                save_interval=2,
                rollout_batch_size=1,
                n_samples_per_prompt=G,
                scale_rewards="none",
            )
            | fields
        )
    )
    return TrainConfig(
        model=ModelConfig.from_pretrained(tiny_model_dir, name="tiny"),
        dataset=LocalDataset(path=str(prompts_file), input_column="topic"),
        recipe=recipe,
    )


def backend_of(k: int, last: int, crash_at=None, record=None):
    def build(config, start):
        sampler = DrawingSampler()
        learner = WaitingLearner(sampler, k, last, crash_at)
        if record is not None:
            record.append((sampler, learner))
        return sampler, learner

    return build


@pytest.mark.parametrize("k", [1, 2])
def test_sampler_draws_k_steps_ahead_and_no_further(tmp_path, tiny_model_dir, prompts_file, k):
    config = make_config(tiny_model_dir, prompts_file, max_staleness=k)
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    built: list = []
    run_training(config, run, backend_of(k, 5, record=built))
    sampler, learner = built[0]
    # While step s trains, steps up to s + k are drawn, never s + k + 1.
    assert learner.furthest == {s: min(s + k, 5) for s in range(1, 6)}
    # Step s was drawn by the weights of step s - k - 1 (0: the start) at the latest, since it
    # was drawn while step s - k trained (before its update, version s - k, was loaded).
    versions = {step: version for step, _, version in sampler.drawn}
    assert versions == {s: max(s - k - 1, 0) for s in range(1, 6)}
    metrics = run.metrics()
    # Behind the learner (version s - 1) by s - 1 - max(s - k - 1, 0) = min(s - 1, k).
    assert [m["sample_staleness_mean"] for m in metrics] == [min(s - 1, k) for s in range(1, 6)]
    assert [m["stale_dropped_groups"] for m in metrics] == [0] * 5
    # Each step's samples record the version that drew them.
    assert [r["weight_version"] for r in run.samples(step=5)] == [versions[5]] * G


def test_a_stale_group_is_dropped_and_counted():
    trained = group(7, 0, version=3) + group(7, 1, version=4)
    rollout = Rollout(trained, trained, 3, {}, ["trained", "dropped_dynamic", "trained"])
    # The learner holds version 6, k = 2: the oldest kept is version 4, so the group of
    # version 3 (position 0) is dropped and the one of version 4 (position 2) kept.
    kept = drop_stale(rollout, learner_version=6, max_staleness=2, G=G)
    assert [s.index for s in kept.trained_B] == [1, 1]
    assert kept.prompt_states == ["dropped_stale", "dropped_dynamic", "trained"]
    assert kept.metrics["stale_dropped_groups"] == 1
    assert kept.metrics["sample_staleness_mean"] == 2.0  # 6 - 4


def test_ledger_ranges_and_what_a_resume_keeps():
    ledger = RolloutLedger()
    first = Rollout([], [], 3, {}, ["trained", "dropped_dynamic", "dropped_dynamic"])
    ledger.settle(1, 0, first)
    ledger.issued(2, 3)
    ledger.sampled(2, 3, 5)  # replaces step 2's issued entry
    ledger.issued(3, 5)
    entries = ledger.to_json()
    assert entries == [
        [0, 1, "trained", 1],
        [1, 3, "dropped_dynamic", 1],
        [3, 5, "sampled", 2],
        [5, None, "issued", 3],
    ]
    assert ledger_problems(entries, 3) == []
    # A checkpoint at cursor 3: what was in flight is forgotten, to be drawn again.
    assert RolloutLedger.resumed(entries, 3).to_json() == entries[:2]
    assert ledger_problems(entries[:1], 3) == ["positions 1..2 never settled"]
    twice = entries[:2] + [[2, 4, "trained", 2]]
    assert ledger_problems(twice, 4) == ["positions 2..2 settled twice"]


@pytest.mark.parametrize("k", [0, 2])
def test_crash_and_resume_settle_every_position_once(tmp_path, tiny_model_dir, prompts_file, k):
    config = make_config(tiny_model_dir, prompts_file, max_staleness=k, num_rollout=6)
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(Crash):
        run_training(config, run, backend_of(k, 6, crash_at=4))
    saved = json.loads((run.checkpoint_paths()[-1][1] / "trainer_state.json").read_text())
    assert saved["step"] == 2 and saved["cursor"] == 2
    in_flight = [e for e in saved["ledger"] if e[2] in ("issued", "sampled")]
    # With k = 2, steps 3 and 4 were being drawn ahead when step 2 saved.
    assert sorted(e[3] for e in in_flight) == ([3, 4] if k else [])

    built: list = []
    run_training(config, run, backend_of(k, 6, record=built), resume=True)
    _, learner = built[0]
    final = json.loads((run.checkpoint_paths()[-1][1] / "trainer_state.json").read_text())
    assert final["cursor"] == 6
    assert ledger_problems(final["ledger"], 6) == []
    assert [e[:3] for e in final["ledger"]] == [[p, p + 1, "trained"] for p in range(6)]
    # The resumed run trained positions 2..5 (prompt index = position here), each once.
    assert learner.trained == [2, 3, 4, 5]


def test_prompt_states_name_what_dynamic_sampling_did():
    from palaestra.rollout.sampler import prompt_states

    samples = group(1, 0, 0) + group(1, 1, 0) + group(1, 2, 0)
    for sample, reward in zip(samples, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], strict=True):
        sample.reward = reward
    # Group 0 (1, 0) trained; group 1 (1, 1) has no signal; group 2 (0, 1) has signal but the
    # step already had its one group.
    assert prompt_states(samples, samples[:2], G) == [
        "trained",
        "dropped_dynamic",
        "dropped_surplus",
    ]
