"""rollout/episode.py: one episode of an environment and tools over a scripted conversation
(no model, no tokenizer): what the conversation receives, how the episode ends, and errors
that name the episode, the turn and the function."""

from __future__ import annotations

import asyncio

import pytest

from palaestra.rollout.episode import EpisodeError, Reply, Rules, play
from palaestra.rollout.tools import ToolError
from palaestra.types import Step


class Scripted:
    """Replies from a script; records what was added. ``room``: messages added before the
    context counts as full (add returns False)."""

    def __init__(self, replies: list[str | Reply | None], room: int = 100) -> None:
        self.replies = list(replies)
        self.added: list[list[dict]] = []
        self.room = room

    def add(self, messages: list[dict]) -> bool:
        if len(self.added) >= self.room:
            return False
        self.added.append(messages)
        return True

    async def generate(self) -> Reply | None:
        reply = self.replies.pop(0)
        return Reply(reply, "stop") if isinstance(reply, str) else reply


class Guesses:
    """Two wrong guesses (0.25 each), then done with 1."""

    def start(self, row):
        self.replies = 0
        return f"Guess {row['topic']}"

    async def step(self, reply):
        self.replies += 1
        if self.replies == 3:
            return Step(reward=1.0, done=True, metadata={"last": reply})
        return Step("no", reward=0.25, metadata={"wrong": self.replies})


def episode(rules, conversation, opening=None, name="row 0"):
    return asyncio.run(play(rules, conversation, {"topic": "rain"}, name, opening=opening))


def test_an_environment_plays_until_done_and_its_rewards_add_up():
    chat = Scripted(["a", "b", "c"])
    outcome = episode(Rules(Guesses, max_turns=5), chat)
    assert chat.added == [
        [{"role": "user", "content": "Guess rain"}],
        [{"role": "user", "content": "no"}],
        [{"role": "user", "content": "no"}],
    ]
    assert (outcome.status, outcome.finish_reason, outcome.replies) == ("completed", "stop", 3)
    assert outcome.reward == 1.5  # 0.25 + 0.25 + 1.0
    assert outcome.metadata == {"wrong": 2, "last": "c"}


def test_max_turns_ends_the_episode_truncated_with_the_last_answer_added():
    chat = Scripted(["a", "b", "c"])
    outcome = episode(Rules(Guesses, max_turns=2), chat)
    assert (outcome.status, outcome.finish_reason, outcome.replies) == ("truncated", "length", 2)
    assert outcome.reward == 0.5  # two wrong guesses at 0.25
    assert len(chat.added) == 3  # the opening, then the answer to each reply


def test_a_full_context_or_an_abort_ends_the_episode():
    full = episode(Rules(Guesses), Scripted(["a", "b"], room=2))
    assert (full.status, full.replies) == ("truncated", 2)
    no_room = episode(Rules(Guesses), Scripted([None]))
    assert (no_room.status, no_room.finish_reason, no_room.replies) == ("truncated", "length", 0)
    aborted = episode(Rules(Guesses), Scripted([Reply("a", "abort")]))
    assert (aborted.status, aborted.finish_reason, aborted.replies) == ("aborted", "abort", 1)


def add(a: int, b: int) -> int:
    """Adds two numbers."""
    return a + b


def broken(x: str) -> str:
    """Always fails."""
    raise ValueError("boom")


def test_without_an_environment_tools_answer_until_a_reply_calls_none():
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    chat = Scripted([call, "It is 5."])
    opening = [{"role": "user", "content": "2 + 3?"}]
    outcome = episode(Rules(tools=[add]), chat, opening)
    assert chat.added == [opening, [{"role": "tool", "name": "add", "content": "5"}]]
    assert (outcome.status, outcome.replies, outcome.reward) == ("completed", 2, 0.0)


def test_a_failing_tool_answers_the_model_or_fails_naming_episode_turn_and_tool():
    call = '<tool_call>{"name": "broken", "arguments": {"x": "y"}}</tool_call>'
    chat = Scripted([call, "ok"])
    episode(Rules(tools=[broken], tool_error="message"), chat)
    assert chat.added[1] == [
        {"role": "tool", "name": "broken", "content": "Error: broken raised ValueError: boom"}
    ]
    with pytest.raises(ToolError) as failed:
        episode(Rules(tools=[broken], tool_error="fail"), Scripted([call]), name="episode 4")
    assert str(failed.value) == (
        'episode 4, turn 1: tool broken({"x": "y"}) raised ValueError: boom'
    )
    assert isinstance(failed.value.__cause__, ValueError)


class FailsOnSecondReply(Guesses):
    def step(self, reply):
        if self.replies == 1:
            raise ValueError("no such guess")
        self.replies += 1
        return Step("no")


class Slow(Guesses):
    async def step(self, reply):
        await asyncio.sleep(5)


class WrongStart:
    def start(self, row):
        return 3


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        (
            FailsOnSecondReply,
            "eval: row 2, turn 2: FailsOnSecondReply.step raised ValueError: no such guess",
        ),
        (Slow, "eval: row 2, turn 1: Slow.step timed out after 0.1 s (environment_timeout_s)"),
        (WrongStart, "eval: row 2, turn 0: WrongStart.start returned 3; messages are a string"),
    ],
)
def test_an_environment_that_fails_is_named_with_the_turn(environment, message):
    rules = Rules(environment, timeout=0.1, timeout_name="environment_timeout_s")
    with pytest.raises(EpisodeError) as failed:
        episode(rules, Scripted(["a", "b", "c"]), name="eval: row 2")
    assert str(failed.value).startswith(message)
