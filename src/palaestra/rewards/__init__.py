"""The reward contract: ``async def rm(args, sample, **kwargs) -> float`` (or a plain ``def``).

A step's rewards run concurrently. A reward that raises, times out, or returns something that is
not a finite number fails the run with an error naming the sample and showing its response.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from palaestra.types import Sample

RewardFn = Callable[..., Any]


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names the sample."""


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


def _describe(sample: Sample, reward: RewardFn) -> str:
    name = getattr(reward, "__qualname__", repr(reward))
    response = sample.response if len(sample.response) <= 2000 else sample.response[:2000] + "..."
    return (
        f"reward function {name} on sample {sample.group_index} of prompt {sample.index} "
        f"(step {sample.step})\nresponse: {response!r}"
    )


def check_reward(value: Any, sample: Sample, reward: RewardFn) -> float:
    """``value`` as a float, or a RewardError if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"{_describe(sample, reward)}\nreturned {value!r} ({type(value).__name__}); "
            "a reward must be a real number"
        )
    if not math.isfinite(float(value)):
        raise RewardError(
            f"{_describe(sample, reward)}\nreturned {value!r}; a reward must be finite"
        )
    return float(value)


async def _score_one(reward: RewardFn, args: Any, sample: Sample, timeout: float | None) -> float:
    try:
        if inspect.iscoroutinefunction(reward):
            pending = reward(args, sample)
        else:
            # A plain function runs in a worker thread so slow ones (an HTTP call) overlap.
            pending = asyncio.to_thread(reward, args, sample)
        value = await asyncio.wait_for(pending, timeout)
        if inspect.isawaitable(value):  # a plain def that returned a coroutine
            value = await asyncio.wait_for(value, timeout)
    except TimeoutError as error:
        raise RewardError(f"{_describe(sample, reward)}\ntimed out after {timeout} s") from error
    except RewardError:
        raise
    except Exception as error:
        raise RewardError(
            f"{_describe(sample, reward)}\nraised {type(error).__name__}: {error}"
        ) from error
    return check_reward(value, sample, reward)


async def score_samples_async(
    reward: RewardFn, args: Any, samples: Sequence[Sample], timeout: float | None = None
) -> list[float]:
    """Rewards of ``samples`` in order, computed concurrently."""
    tasks = [asyncio.ensure_future(_score_one(reward, args, s, timeout)) for s in samples]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def score_samples(
    reward: RewardFn, args: Any, samples: Sequence[Sample], timeout: float | None = None
) -> list[float]:
    """Blocking form of :func:`score_samples_async`, for the training loop."""
    return asyncio.run(score_samples_async(reward, args, samples, timeout))
