"""The reward contract: concurrency, plain and async functions, and failures naming samples."""

import asyncio
import math
import time

import pytest

from palaestra.rewards import RewardError, RewardScorer, resolve_reward, score_samples
from palaestra.rewards.haiku import count_syllables, haiku_reward, score_haiku
from palaestra.types import Sample


def _samples(responses):
    return [
        Sample(prompt="p", response=r, label=None, metadata={}, index=7, group_index=g, step=3)
        for g, r in enumerate(responses)
    ]


def test_async_rewards_run_concurrently():
    async def slow(args, sample, **kwargs):
        await asyncio.sleep(0.3)
        return len(sample.response)

    started = time.monotonic()
    rewards = score_samples(slow, None, _samples(["a", "bb", "ccc", "dddd", "eeeee", "f"] * 2))
    assert rewards == [1.0, 2.0, 3.0, 4.0, 5.0, 1.0] * 2
    # Twelve 0.3 s calls one after another would take 3.6 s.
    assert time.monotonic() - started < 1.5


def test_plain_def_and_args_reach_the_function():
    def reward(args, sample):
        return args["bonus"] + sample.group_index

    assert score_samples(reward, {"bonus": 10}, _samples(["x", "y"])) == [10.0, 11.0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("high", "returned 'high' (str)"),
        (None, "returned None"),
        (math.nan, "must be finite"),
        (True, "returned True (bool)"),
    ],
)
def test_bad_return_values_name_the_sample(value, message):
    def reward(args, sample):
        return value

    with pytest.raises(RewardError) as error:
        score_samples(reward, None, _samples(["first", "the second response"]))
    text = str(error.value)
    assert message in text
    assert "sample 0 of prompt 7 (step 3)" in text
    assert "response: 'first'" in text


def test_raising_reward_names_the_sample_and_shows_the_response():
    async def reward(args, sample):
        if sample.group_index == 1:
            raise KeyError("missing")
        return 0.0

    with pytest.raises(RewardError) as error:
        score_samples(reward, None, _samples(["ok", "broken response"]))
    assert "sample 1 of prompt 7" in str(error.value)
    assert "'broken response'" in str(error.value)
    assert "raised KeyError" in str(error.value)
    assert isinstance(error.value.__cause__, KeyError)


def test_timeout_fails_the_sample():
    async def reward(args, sample):
        await asyncio.sleep(5)

    with pytest.raises(RewardError, match="timed out after 0.2 s"):
        score_samples(reward, None, _samples(["x"]), timeout=0.2)


def test_hung_plain_reward_fails_at_the_timeout_without_waiting_for_its_thread():
    def reward(args, sample):
        time.sleep(3)
        return 0.0

    started = time.monotonic()
    with pytest.raises(RewardError, match="timed out after 0.2 s"):
        score_samples(reward, None, _samples(["x"]), timeout=0.2)
    assert time.monotonic() - started < 1.5


def test_a_rewards_own_timeout_error_is_not_called_ours():
    async def reward(args, sample):
        raise TimeoutError("judge did not answer")

    with pytest.raises(RewardError, match="raised TimeoutError: judge did not answer"):
        score_samples(reward, None, _samples(["x"]), timeout=30)


def test_async_state_survives_from_one_step_to_the_next():
    state = {}

    async def reward(args, sample):
        # A loop-bound object made at the first step, used again later, as an HTTP client is.
        lock = state.setdefault("lock", asyncio.Lock())
        async with lock:
            return 1.0

    with RewardScorer(reward, None) as scorer:
        assert scorer.score(_samples(["a", "b"])) == [1.0, 1.0]
        assert scorer.score(_samples(["c"])) == [1.0]


def test_eval_context_appears_in_errors():
    with RewardScorer(lambda args, sample: "bad", None) as scorer:
        with pytest.raises(RewardError, match="on eval sample 0 of prompt 7"):
            scorer.score(_samples(["x"]), context="eval ")


def test_resolve_reward_by_name():
    reward = resolve_reward("palaestra.rewards.haiku:haiku_reward")
    assert reward is haiku_reward
    thinking = (
        "<think>five seven five</think>An old silent pond\nA frog jumps into the pond\nSplash"
    )
    # "Splash" is 1 syllable against 5: distance 4; the thinking is not scored.
    assert score_samples(reward, None, _samples([thinking, "just one line"])) == [-4.0, -10.0]
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward("palaestra.rewards.haiku:nope")


def test_haiku_scorer_matches_the_tutorial():
    # CMU: "an"=1 "old"=1 "silent"=2 "pond"=1 -> 5; "a"=1 "frog"=1 "jumps"=1 "into"=2 "the"=1
    # "pond"=1 -> 7; "splash"=1 "silence"=2 "again"=2 -> 5.
    haiku = "An old silent pond\nA frog jumps into the pond\nSplash! Silence again."
    assert [count_syllables(line) for line in haiku.split("\n")] == [5, 7, 5]
    assert score_haiku(haiku) == 0.0
    # Two lines: the format failure score.
    assert score_haiku("one line\nanother") == -10.0
    # Line counts 1, 7, 5 -> distance 4.
    assert score_haiku("Pond\nA frog jumps into the pond\nSplash! Silence again.") == -4.0
    # Unknown word: vowel groups, minus a silent final e: "zorblate" -> o, a, e = 3 - 1 = 2.
    assert count_syllables("zorblate") == 2
