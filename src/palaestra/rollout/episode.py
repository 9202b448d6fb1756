"""An episode of a multi-turn rollout: which one a task plays and how far it got, the turn the
engine hands back, and the error that names them. The episode a task plays is a context
variable, so the code it calls (a turn client, a tool, an environment) can name it."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from palaestra.engine import SamplingParams
from palaestra.types import Prompt


class EpisodeError(RuntimeError):
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

    def describe(self) -> str:
        return (
            f"episode {self.position} (prompt {self.prompt.index}, sample {self.group_index}), "
            f"turn {self.turn}"
        )


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
