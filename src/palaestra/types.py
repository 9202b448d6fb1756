"""The plain data that flows between stages, and the shape-suffix glossary.

Shape suffixes on tensor and list names say what each axis is:

    P   prompts in one step (``rollout_batch_size``)
    G   samples per prompt, one group (``n_samples_per_prompt``)
    B   flattened samples, B = P * G, ordered prompt-major (group after group)
    T   tokens

So ``rewards_P_G[p][g]`` is the reward of sample ``g`` of prompt ``p``, ``advantages_B`` is the
same data flattened, and ``mask_B_T`` marks the response tokens of each padded sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


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
    messages: list[dict[str, str]] = field(default_factory=list)
    """The prompt as chat messages."""
    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    response_logprobs: list[float] | None = None
    """The sampler's log-probs of ``response_token_ids``, when the engine kept them."""
    reward: float | None = None
    """Filled in after the reward function ran."""


@dataclass
class TrainBatch:
    """Right-padded token sequences of one step, ready for the policy's forward pass."""

    input_ids_B_T: torch.Tensor
    """Prompt followed by response tokens, padded on the right."""
    attention_mask_B_T: torch.Tensor
    """1 on real tokens (prompt and response), 0 on padding."""
    mask_B_T: torch.Tensor
    """1 where the *next-token prediction* at position t targets a response token.

    Aligned with the logits: ``mask_B_T[b, t] = 1`` means token ``t + 1`` of sequence ``b`` is a
    response token, so the log-prob of that token comes from the logits at position ``t``.
    """
    advantages_B: torch.Tensor
    """One advantage per sequence, broadcast over its response tokens."""
    sampler_logprobs_B_T: torch.Tensor | None = None
    """The sampler's log-prob of each response token, aligned like ``mask_B_T`` (position t
    holds token t + 1's), when the engine kept them for every sample."""
    old_logprobs_B_T: torch.Tensor | None = None
    """Log-probs under the policy that sampled the batch (the importance ratio's denominator),
    aligned like ``mask_B_T``; None: the policy being updated is that policy."""
    ref_logprobs_B_T: torch.Tensor | None = None
    """Log-probs under the KL reference, aligned like ``mask_B_T``, when a KL term is on."""

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        return TrainBatch(
            **{
                f.name: None if (value := getattr(self, f.name)) is None else value.to(device)
                for f in fields(self)
            }
        )
