"""Episodes: the one loop that plays an environment (``palaestra.types.Environment``) and tools
over any ``generate`` function, for training (token by token, on the engine:
``rollout/environments.py``) and for evals (messages, against an endpoint: ``evals.py``).

Per episode: the environment's ``start(row)`` gives the first messages; each turn the model
replies; a reply that calls tools gets their results as ``tool`` messages and replies again;
any other reply goes to the environment's ``step``, whose messages come next, until it says done
or ``max_turns`` replies were made (then the episode ends truncated, as it does when the context
is full). Without an environment, the opening messages are given and the first reply without a
tool call ends the episode. Every call of user code goes through ``palaestra.calls``, and an
error names the episode, the turn and the function.

Also here: which episode of a step a task plays (a context variable, so the code it calls can
name it) and the turn the engine hands back.
"""

from __future__ import annotations

import contextvars
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from palaestra.calls import UserCodeError, call, name_of
from palaestra.engine import SamplingParams
from palaestra.models.parsing import parse_response
from palaestra.rollout.tools import call_tool
from palaestra.types import Prompt, Step


class EpisodeError(UserCodeError):
    """A multi-turn episode failed; the message names the episode, the turn and the function."""


@dataclass
class Turn:
    """One reply of the model, as the engine sampled it."""

    token_ids: list[int]
    logprobs: list[float] | None
    """The sampler's log-prob of each of ``token_ids`` (None: the engine keeps none)."""
    text: str
    finish_reason: str
    """``"stop"``, ``"length"`` (``max_tokens`` or the context reached; no tokens at all when the
    context was already full) or ``"abort"``."""


@dataclass
class Episode:
    """Which episode a task runs, and how far it got: what errors and seeds are named by."""

    position: int
    """Its place in the step's samples (group after group)."""
    prompt: Prompt
    group_index: int
    params: SamplingParams
    turn: int = 0
    """Engine calls made so far: the turn it is in."""

    def name(self) -> str:
        return f"episode {self.position} (prompt {self.prompt.index}, sample {self.group_index})"

    def describe(self) -> str:
        return f"{self.name()}, turn {self.turn}"


_EPISODE: contextvars.ContextVar[Episode] = contextvars.ContextVar("palaestra_episode")


def current_episode() -> Episode:
    """The episode the calling task runs."""
    try:
        return _EPISODE.get()
    except LookupError:
        raise RuntimeError("only an episode of a multi-turn rollout can ask for a turn") from None


def episode_context(episode: Episode) -> contextvars.Context:
    """A copy of the current context in which ``current_episode()`` is ``episode``: the context
    to run its task in."""
    context = contextvars.copy_context()
    context.run(_EPISODE.set, episode)
    return context


@dataclass
class Reply:
    """One reply of the model, as an episode sees it."""

    text: str
    finish_reason: str
    """``"stop"``, ``"length"`` or ``"abort"`` (which ends the episode)."""


class Conversation(Protocol):
    """The model's side of an episode: where messages go and replies come from (the engine's
    token sequence in training, an endpoint's chat in evals)."""

    def add(self, messages: list[dict[str, Any]]) -> bool:
        """The opening messages (first), then the environment's or tools' after each reply;
        False (and nothing added) when they do not fit the context."""
        ...

    async def generate(self) -> Reply | None:
        """The model's next reply to everything so far; None when the context is full."""
        ...


@dataclass(frozen=True)
class Rules:
    """What an episode plays: the environment, the tools, and the limits."""

    environment: Callable[[], Any] | None = None
    """A class or factory called once per episode (None: the opening messages are given)."""
    tools: Sequence[Callable[..., Any]] = ()
    max_turns: int = 4
    """Most replies of the model in an episode."""
    timeout: float | None = None
    """Seconds each call of the environment or a tool may take (None: no limit)."""
    timeout_name: str | None = None
    """The setting that sets ``timeout``, named when a call runs past it."""
    tool_error: str = "fail"
    """A failing tool: ``"message"`` answers the model with the error, ``"fail"`` raises."""


@dataclass
class Outcome:
    """How an episode ended."""

    status: str = "truncated"
    """``"completed"``, ``"truncated"`` (``max_turns`` replies, or the context full) or
    ``"aborted"``."""
    finish_reason: str = "length"
    reward: float = 0.0
    """The sum of the environment's rewards."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The environment's steps' metadata, merged."""
    replies: int = 0


async def play(
    rules: Rules,
    conversation: Conversation,
    row: dict[str, Any],
    name: str,
    threads: Executor | None = None,
    opening: list[dict[str, Any]] | None = None,
) -> Outcome:
    """One episode of ``rules`` over ``conversation``: ``row`` opens the environment's episode
    (without one, ``opening`` is the conversation's start). Errors are named
    ``<name>, turn N: <function>``; plain functions run on ``threads``."""
    game = _Game(rules, name, threads)
    env = None
    if rules.environment is not None:
        env = await game.call(rules.environment, (), "factory")
        opening = _messages(await game.call(env.start, (row,), "start"), game, env.start, "start")
    conversation.add(list(opening or []))
    tools = {getattr(fn, "__name__", None) or name_of(fn): fn for fn in rules.tools}
    outcome = Outcome()
    while outcome.replies < rules.max_turns:
        game.turn += 1
        reply = await conversation.generate()
        if reply is None:
            break  # the context is full
        outcome.replies += 1
        outcome.finish_reason = reply.finish_reason
        if reply.finish_reason == "abort":
            outcome.status = "aborted"
            break
        messages, step = await _respond(game, env, tools, reply)
        if step is not None:
            outcome.reward += float(step.reward)
            outcome.metadata.update(step.metadata)
        if (step is None and not messages) or (step is not None and step.done):
            outcome.status = "completed"
            break
        if not conversation.add(messages):
            break  # what the environment said does not fit the context
    if outcome.status == "truncated":
        outcome.finish_reason = "length"
    return outcome


@dataclass
class _Game:
    rules: Rules
    name: str
    threads: Executor | None
    turn: int = 0

    def where(self, target: Any, what: str) -> str:
        """``episode ..., turn N: Class.method`` (or the factory's name)."""
        owner = getattr(target, "__self__", target)
        cls = owner if isinstance(owner, type) else type(owner)
        function = cls.__qualname__ if what == "factory" else f"{cls.__qualname__}.{what}"
        if what == "factory" and not isinstance(owner, type):
            function = name_of(target)
        return f"{self.name}, turn {self.turn}: {function}"

    async def call(self, fn: Callable, args: tuple, what: str) -> Any:
        return await call(
            fn,
            args,
            where=self.where(fn, what),
            timeout=self.rules.timeout,
            timeout_name=self.rules.timeout_name,
            threads=self.threads,
            error=EpisodeError,
        )


async def _respond(game: _Game, env, tools: dict[str, Callable], reply: Reply):
    """What follows the model's reply: tool results (no step), the environment's step, or
    nothing (no environment, no tool call: the episode is done)."""
    calls = parse_response(reply.text).tool_calls if tools else []
    if calls:
        rules, where = game.rules, f"{game.name}, turn {game.turn}"
        results = [
            await call_tool(call, tools, rules.timeout, game.threads, where, rules.tool_error)
            for call in calls
        ]
        messages = [
            {"role": "tool", "name": call.name, "content": result}
            for call, result in zip(calls, results, strict=True)
        ]
        return messages, None
    if env is None:
        return [], None
    step = await game.call(env.step, (reply.text,), "step")
    where = game.where(env.step, "step")
    if not isinstance(step, Step):
        raise EpisodeError(where, f"returned {type(step).__name__}; it must return a Step")
    if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real):
        raise EpisodeError(where, f"returned reward {step.reward!r}; it must be a number")
    messages = _messages(step.messages, game, env.step, "step") if not step.done else []
    return messages, step


def _messages(value: Any, game: _Game, fn: Callable, what: str) -> list[dict[str, Any]]:
    """An environment's messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        return [dict(m) for m in value]
    raise EpisodeError(
        game.where(fn, what),
        f"returned {value!r:.120}; messages are a string or a list of "
        "{'role': ..., 'content': str} dicts",
    )
