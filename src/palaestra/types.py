"""The plain data that flows between stages, and the shape-suffix glossary. No torch: a reward
module that imports ``Sample`` stays light.

Shape suffixes on tensor and list names say what each axis is:

    P   prompts in one step (``rollout_batch_size``)
    G   samples per prompt, one group (``n_samples_per_prompt``)
    B   flattened samples, B = P * G, ordered prompt-major (group after group)
    T   tokens

So ``rewards_P_G[p][g]`` is the reward of sample ``g`` of prompt ``p``, ``advantages_B`` is the
same data flattened, and ``mask_B_T`` marks the response tokens of each padded sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass
class Prompt:
    """One dataset row made ready for generation."""

    index: int
    """Position of the row in the loaded split."""
    messages: list[dict[str, str]]
    """The chat messages the row became (system prompt, if any, then the user turn)."""
    text: str
    """What the model is fed: ``messages`` through the chat template, or the raw prompt."""
    label: Any = None
    """The row's ``output_column`` value, if the dataset names one."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's original columns."""
    token_ids: list[int] = field(default_factory=list)
    """``text`` tokenized, filled in by the trainer."""


@dataclass
class Completion:
    """What the rollout engine produced for one sample."""

    token_ids: list[int]
    """Generated tokens, including the end-of-sequence token when the model emitted one."""
    text: str
    """Decoded response, special tokens removed."""
    finish_reason: str
    """``"stop"`` (end-of-sequence or a stop string) or ``"length"`` (hit ``max_tokens``)."""
    logprobs: list[float] | None = None
    """The sampler's log-prob of each token in ``token_ids``, under the sampling temperature,
    when the engine keeps them."""


@dataclass
class Sample:
    """One sampled response to one prompt: what a reward function receives as ``sample``."""

    prompt: str
    """The rendered prompt text the model saw."""
    response: str
    """The decoded response text."""
    label: Any
    """The dataset row's ``output_column`` value (the reference answer), or None."""
    metadata: dict[str, Any]
    """The dataset row's columns; a reward function may add numeric fields to log them."""
    index: int
    """Index of the prompt's dataset row."""
    group_index: int
    """Position of this sample within its group (0 .. n_samples_per_prompt - 1)."""
    step: int = 0
    """The training step that sampled it."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The prompt as chat messages; for a multi-turn episode, the whole conversation: the
    prompt's messages, then each turn, the model's marked ``"trained": True``."""
    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    response_logprobs: list[float] | None = None
    """The sampler's log-probs of ``response_token_ids``, when the engine kept them."""
    loss_mask: list[int] | None = None
    """One 0/1 per response token: 1 where the model wrote the token and it is trained on, 0
    where something else did (an environment's reply in a multi-turn episode). None: every
    response token is the model's (single-turn)."""
    weight_version: int = 0
    """The policy version that sampled it: the step whose update the engine had loaded."""
    status: Literal["completed", "truncated", "aborted"] = "completed"
    """How a multi-turn episode ended: ``"completed"`` (done), ``"truncated"`` (out of turns or
    context; ``finish_reason`` is then ``"length"``) or ``"aborted"`` (never trained on)."""
    reward: float | None = None
    """Filled in after the reward function ran."""

    def response_mask(self) -> list[int]:
        """``loss_mask``, or all ones when the whole response is the model's."""
        if self.loss_mask is None:
            return [1] * len(self.response_token_ids)
        if len(self.loss_mask) != len(self.response_token_ids):
            raise ValueError(
                f"sample {self.group_index} of prompt {self.index}: loss_mask has "
                f"{len(self.loss_mask)} entries for {len(self.response_token_ids)} response tokens"
            )
        return self.loss_mask


@dataclass
class Step:
    """What an environment answers to one reply of the model."""

    messages: list[dict[str, Any]] | str = field(default_factory=list)
    """What the environment says next (a string: one user message); empty when it is done."""
    reward: float = 0.0
    """Reward for this reply; an episode's rewards add up."""
    done: bool = False
    """True ends the episode."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Merged into ``sample.metadata``, where a reward can read it and numbers are charted."""


class Environment(Protocol):
    """An episode of a multi-turn task: the first messages, then feedback on each reply.

    ``Recipe.environment`` (or ``EvalConfig.environment``) is a class or factory called with no
    arguments once per episode, so each episode keeps its own state on ``self``. Either method
    may be ``async def``.
    """

    def start(self, row: dict[str, Any]) -> list[dict[str, Any]] | str:
        """The episode's first messages, from its dataset row (a string: one user message)."""
        ...

    def step(self, reply: str) -> Step:
        """Feedback on the model's reply (its text, tool calls already answered)."""
        ...


@dataclass
class Rollout:
    """One step's scored samples, as the sampler hands them to the loop."""

    samples_B: list[Sample]
    """Every sample drawn this step, groups that dynamic sampling dropped included."""
    trained_B: list[Sample]
    """The samples to train on: whole groups, group after group."""
    cursor: int
    """Position in the dataset's endless shuffled order after this step's prompts."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the samples looked like (rewards, lengths) and how long they took."""
    prompt_states: list[str] = field(default_factory=list)
    """What became of each prompt the step took from the dataset order, in order (empty: each
    was trained): ``"trained"``,
    ``"dropped_dynamic"`` (its rewards all agreed), ``"dropped_surplus"`` (informative, but
    the step already had its groups) or ``"dropped_stale"`` (drawn by weights too old)."""
