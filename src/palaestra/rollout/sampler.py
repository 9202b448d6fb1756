"""The sampler: a step's prompts in, scored sample groups out, on one engine.

It owns what producing samples takes: the data order (an endless sequence of shuffled epochs,
addressed by a cursor the loop keeps), the engine, the rollout function, the reward and DAPO's
dynamic sampling (drop groups whose rewards all agree, and with over-sampling draw further
rounds of prompts until the step has its groups). The loop sees four methods: ``sample``,
``update_weights``, ``evaluate`` and ``close``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from palaestra.algo.advantages import informative_groups
from palaestra.engine import RolloutEngine, SamplingParams
from palaestra.recipes import Recipe
from palaestra.rewards import RewardScorer
from palaestra.rollout.single_turn import RolloutFn, group_seed, single_turn
from palaestra.types import Prompt, Rollout, Sample


class GroupSampler:
    """Scored groups from ``engine``: ``recipe.rollout_batch_size`` prompts a step, each with
    ``recipe.n_samples_per_prompt`` samples, scored by ``scorer`` (which it closes)."""

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: list[Prompt],
        recipe: Recipe,
        scorer: RewardScorer | None,
        eval_prompts: list[Prompt] | None = None,
        rollout_fn: RolloutFn = single_turn,
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.recipe = recipe
        self.scorer = scorer
        self.eval_prompts = eval_prompts or []
        self.rollout_fn = rollout_fn

    def sample(self, step: int, cursor: int) -> Rollout:
        """The step's groups, drawn from the dataset order at ``cursor``."""
        recipe = self.recipe
        P, G = recipe.rollout_batch_size, recipe.n_samples_per_prompt
        dynamic = recipe.dynamic_sampling
        rounds = recipe.dynamic_sampling_max_rounds if recipe.over_sampling_batch_size else 1
        samples_B: list[Sample] = []
        kept_B: list[Sample] = []
        rollout_s = reward_s = 0.0
        rounds_run = 0
        while rounds_run < rounds:
            rounds_run += 1
            n = recipe.over_sampling_batch_size or P
            rows = prompt_order(len(self.prompts), recipe.seed, cursor, n)
            prompts_P = [self.prompts[i] for i in rows]
            # A group's seed comes from its position in the dataset order: unique in the run.
            params_P = [self._params(group_seed(recipe.seed, step, cursor + i)) for i in range(n)]
            cursor += n
            t0 = time.monotonic()
            new_B = self.rollout_fn(self.engine, prompts_P, params_P, G, step)
            t1 = time.monotonic()
            self._score(new_B)
            rollout_s, reward_s = rollout_s + t1 - t0, reward_s + time.monotonic() - t1
            samples_B += new_B
            kept_B += keep_informative(new_B, G) if dynamic else new_B
            if len(kept_B) >= P * G:
                break
        metrics = rollout_metrics(samples_B, G)
        if dynamic:
            metrics["dropped_groups"] = (len(samples_B) - len(kept_B)) // G
            metrics["sampling_rounds"] = rounds_run
        metrics |= {"rollout_s": rollout_s, "reward_s": reward_s}
        states = prompt_states(samples_B, kept_B[: P * G], G)
        return Rollout(samples_B, kept_B[: P * G], cursor, metrics, states)

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Any:
        """Load ``weights`` into the engine; the engine's attestation of the sync, if it
        attests (``engine.attest``: a pool of remote engines does)."""
        return self.engine.update_weights(weights, version)

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean reward of one sample per eval prompt; each prompt's seed is the same at every
        step, so steps compare fairly."""
        if not self.eval_prompts:
            return {}
        seed = self.recipe.seed
        params_P = [self._params(group_seed(seed, 0, p.index)) for p in self.eval_prompts]
        samples = self.rollout_fn(self.engine, self.eval_prompts, params_P, 1, step)
        return {"eval_reward_mean": statistics.fmean(self._score(samples, "eval "))}

    def close(self) -> None:
        try:
            if self.scorer is not None:
                self.scorer.close()
        finally:
            self.engine.close()

    def _params(self, seed: int) -> SamplingParams:
        recipe = self.recipe
        return SamplingParams(
            recipe.rollout_max_response_len,
            recipe.rollout_temperature,
            recipe.rollout_top_p,
            seed=seed,
        )

    def _score(self, samples: list[Sample], context: str = "") -> list[float]:
        if self.scorer is None:
            raise ValueError("sampling for training needs a reward: set recipe.custom_rm_function")
        rewards = self.scorer.score(samples, context=context)
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = reward
        return rewards


def prompt_order(num_rows: int, seed: int, cursor: int, count: int) -> list[int]:
    """Row indices ``cursor .. cursor + count`` of an endless sequence of shuffled epochs.

    Each epoch is a fresh permutation seeded by ``(seed, epoch)``, so any position can be
    recomputed from the cursor alone: a resumed run continues exactly where it stopped.
    """
    indices: list[int] = []
    position = cursor
    while len(indices) < count:
        epoch, offset = divmod(position, num_rows)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator).tolist()
        taken = order[offset : offset + count - len(indices)]
        indices += taken
        position += len(taken)
    return indices


def keep_informative(samples_B: list[Sample], G: int) -> list[Sample]:
    """The samples of the groups whose rewards differ (DAPO's dynamic sampling)."""
    rewards_P_G = torch.tensor([s.reward for s in samples_B]).view(-1, G)
    keep_P = informative_groups(rewards_P_G).tolist()
    return [s for b, s in enumerate(samples_B) if keep_P[b // G]]


def prompt_states(samples_B: list[Sample], trained_B: list[Sample], G: int) -> list[str]:
    """What became of each group of ``samples_B`` (one per prompt, in the data order): trained,
    dropped by dynamic sampling, or informative but beyond the step's groups."""
    trained = {id(s) for s in trained_B}
    states = []
    for start in range(0, len(samples_B), G):
        group = samples_B[start : start + G]
        if id(group[0]) in trained:
            states.append("trained")
        else:
            states.append("dropped_surplus" if keep_informative(group, G) else "dropped_dynamic")
    return states


def rollout_metrics(samples_B: list[Sample], G: int) -> dict[str, float]:
    """What the step's samples looked like (all of them, dropped groups too): rewards, groups
    without signal, lengths."""
    rewards_B = [s.reward for s in samples_B]
    rewards_P_G = torch.tensor(rewards_B, dtype=torch.float32).view(-1, G)
    lengths_B = [len(s.response_token_ids) for s in samples_B]
    return {
        "reward_mean": statistics.fmean(rewards_B),
        "reward_std": statistics.pstdev(rewards_B),
        "reward_min": min(rewards_B),
        "reward_max": max(rewards_B),
        # Groups whose rewards all agree have zero advantage: no gradient from them.
        "zero_std_groups": int((~informative_groups(rewards_P_G)).sum()),
        "response_length_mean": statistics.fmean(lengths_B),
        "response_length_max": max(lengths_B),
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples_B) / len(samples_B),
    }
