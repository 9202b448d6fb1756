"""Supervised fine-tuning data: a dataset row as tokens, with the assistant's tokens marked.

``loss_type="sft_loss"`` trains on demonstrations instead of samples: the row's
``output_column`` answer after its prompt, or every assistant turn of its ``messages_column``
conversation. Only assistant tokens carry loss; the prompt, system and user turns are context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from palaestra.types import Prompt, TrainBatch


@dataclass
class Demonstration:
    """One row to imitate: its tokens and which of them the model should learn to produce."""

    index: int
    """Position of the row in the loaded split."""
    token_ids: list[int]
    targets: list[bool]
    """``targets[t]``: token ``t`` is an assistant token (it carries loss)."""


def demonstration(prompt: Prompt, tokenizer, chat_template: bool, kwargs: dict) -> Demonstration:
    """``prompt``'s row as a Demonstration. With a chat template the conversation is rendered
    one assistant turn at a time, and a turn's tokens are what its rendering adds to the
    rendering of everything before it with the generation prompt."""
    messages = list(prompt.messages)
    where = f"row {prompt.index}"
    if not any(m["role"] == "assistant" for m in messages):
        if prompt.label is None:
            raise ValueError(
                f"{where}: loss_type='sft_loss' trains on the answer, but the row has no "
                "assistant message and no output_column value; set the dataset's output_column "
                "(or messages_column with assistant turns)"
            )
        messages.append({"role": "assistant", "content": str(prompt.label)})
    if not chat_template:
        if (
            messages[-1]["role"] != "assistant"
            or sum(m["role"] == "assistant" for m in messages) > 1
        ):
            raise ValueError(
                f"{where}: without a chat template, sft_loss trains on one final answer only"
            )
        context = tokenizer(prompt.text, add_special_tokens=True).input_ids
        answer = tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids
        answer = answer + [tokenizer.eos_token_id]
        return Demonstration(
            prompt.index, context + answer, [False] * len(context) + [True] * len(answer)
        )

    def render(turns: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    token_ids: list[int] = []
    targets: list[bool] = []
    done = ""  # the text rendered so far

    def add(text: str, target: bool) -> None:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        token_ids.extend(ids)
        targets.extend([target] * len(ids))

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (before.startswith(done) and through.startswith(before)):
            raise ValueError(
                f"{where}: the chat template does not render the conversation turn by turn "
                f"(the text up to assistant turn {i} changes when the turn is added), so the "
                "assistant's tokens cannot be told apart"
            )
        add(before[len(done) :], False)
        add(through[len(before) :], True)
        done = through
    return Demonstration(prompt.index, token_ids, targets)


def build_sft_batch(demos_B: Sequence[Demonstration], pad_id: int) -> TrainBatch:
    """Right-padded demonstrations; ``mask_B_T[b, t] = 1`` where token ``t + 1`` is a target,
    aligned with the next-token logits like an RL batch's response mask."""
    width = max(len(d.token_ids) for d in demos_B)
    B = len(demos_B)
    input_ids_B_T = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask_B_T = torch.zeros((B, width), dtype=torch.long)
    mask_B_T = torch.zeros((B, width), dtype=torch.float32)
    for b, demo in enumerate(demos_B):
        n = len(demo.token_ids)
        input_ids_B_T[b, :n] = torch.tensor(demo.token_ids)
        attention_mask_B_T[b, :n] = 1
        mask_B_T[b, : n - 1] = torch.tensor(demo.targets[1:], dtype=torch.float32)
    # Advantage 1: the policy-gradient plumbing is shared, the sft objective ignores it.
    return TrainBatch(input_ids_B_T, attention_mask_B_T, mask_B_T, torch.ones(B))
