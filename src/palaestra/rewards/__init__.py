"""The reward contract: ``async def rm(args, sample, **kwargs) -> float`` (or a plain ``def``).

A step's rewards run concurrently. A reward that raises, times out, or returns something that is
not a finite number fails the run with an error naming the sample and showing its response.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from palaestra.calls import UserCodeError, call, name_of
from palaestra.types import Sample

RewardFn = Callable[..., Any]


class RewardError(UserCodeError):
    """A reward function failed on a sample; the message names the sample."""

    separator = "\n"  # after the sample's response


def resolve_reward(reward: RewardFn | str) -> RewardFn:
    """A callable from a callable or a ``"module:function"`` string."""
    if callable(reward):
        return reward
    module_name, _, attribute = str(reward).partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise RewardError(f"cannot import the reward {reward!r}: {error}") from error
    if not callable(target):
        raise RewardError(f"the reward {reward!r} is not callable")
    return target


def _describe(sample: Sample, reward: RewardFn, context: str = "") -> str:
    name = name_of(reward)
    response = sample.response if len(sample.response) <= 2000 else sample.response[:2000] + "..."
    return (
        f"reward function {name} on {context}sample {sample.group_index} of prompt "
        f"{sample.index} (step {sample.step})\nresponse: {response!r}"
    )


def check_reward(value: Any, sample: Sample, reward: RewardFn, context: str = "") -> float:
    """``value`` as a float, or a RewardError if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"{_describe(sample, reward, context)}\nreturned {value!r} "
            f"({type(value).__name__}); a reward must be a real number"
        )
    if not math.isfinite(float(value)):
        raise RewardError(
            f"{_describe(sample, reward, context)}\nreturned {value!r}; a reward must be finite"
        )
    return float(value)


class RewardScorer:
    """Scores samples with one reward function, for the length of a run.

    One event loop serves every step, so an async reward may keep loop-bound state (an HTTP
    client, a lock) from one step to the next. Plain functions run on the scorer's own threads
    so slow ones overlap; when a reward fails or times out the scorer abandons those threads
    instead of waiting for them, since a hung thread cannot be killed.
    """

    def __init__(
        self, reward: RewardFn | str, args: Any, timeout: float | None = None, threads: int = 32
    ) -> None:
        self.reward = resolve_reward(reward)
        self.args = args
        self.timeout = timeout
        self._runner = asyncio.Runner()
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="palaestra-reward")

    def score(self, samples: Sequence[Sample], context: str = "") -> list[float]:
        """Rewards of ``samples`` in order, computed concurrently. ``context`` prefixes the
        sample's description in errors (``"eval "``)."""
        try:
            return self._runner.run(self._score_all(samples, context))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._runner.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _score_all(self, samples: Sequence[Sample], context: str) -> list[float]:
        tasks = [asyncio.ensure_future(self._score_one(s, context)) for s in samples]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _score_one(self, sample: Sample, context: str) -> float:
        value = await call(
            self.reward,
            (self.args, sample),
            where=lambda: _describe(sample, self.reward, context),
            timeout=self.timeout,
            threads=self._threads,
            error=RewardError,
        )
        return check_reward(value, sample, self.reward, context)


def score_samples(
    reward: RewardFn | str, args: Any, samples: Sequence[Sample], timeout: float | None = None
) -> list[float]:
    """Score one batch of samples with a scorer made for the occasion."""
    with RewardScorer(reward, args, timeout) as scorer:
        return scorer.score(samples)
