"""Supervised fine-tuning as a sampler: the dataset's own answers stand in for sampled ones.

``loss_type="sft_loss"`` trains on demonstrations instead of samples: the row's
``output_column`` answer after its prompt, or every assistant turn of its ``messages_column``
conversation. A demonstration becomes a Sample whose ``loss_mask`` marks the assistant's tokens
(the prompt, system and user turns are context), so the learner trains on it like on any other
sample; the loop does not know the difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.recipes import Recipe
from palaestra.rollout.sampler import GroupSampler, prompt_order
from palaestra.types import Prompt, Rollout, Sample


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


def demonstration_sample(demo: Demonstration, prompt: Prompt, step: int) -> Sample:
    """``demo`` as a Sample: the tokens before its first target are the prompt, the rest the
    response, trained where they are targets. The first token can never be predicted, so it is
    context even when it is a target."""
    first = next((t for t, target in enumerate(demo.targets) if target), len(demo.targets))
    first = max(first, 1)
    return Sample(
        prompt=prompt.text,
        response=next(
            (m["content"] for m in reversed(prompt.messages) if m["role"] == "assistant"),
            "" if prompt.label is None else str(prompt.label),
        ),
        label=prompt.label,
        metadata=dict(prompt.metadata),
        index=prompt.index,
        group_index=0,
        step=step,
        messages=list(prompt.messages),
        prompt_token_ids=demo.token_ids[:first],
        response_token_ids=demo.token_ids[first:],
        loss_mask=[int(target) for target in demo.targets[first:]],
    )


class DemonstrationSampler:
    """``recipe.rollout_batch_size`` demonstrations a step, in the shuffled dataset order; weight
    updates and evaluation go to ``inner``, the sampler of the model being trained."""

    def __init__(
        self, demos: list[Demonstration], prompts: list[Prompt], recipe: Recipe, inner: GroupSampler
    ) -> None:
        self.demos = demos
        self.prompts = {p.index: p for p in prompts}
        self.recipe = recipe
        self.inner = inner

    def sample(self, step: int, cursor: int) -> Rollout:
        P = self.recipe.rollout_batch_size
        rows = prompt_order(len(self.demos), self.recipe.seed, cursor, P)
        trained_B = [
            demonstration_sample(self.demos[i], self.prompts[self.demos[i].index], step)
            for i in rows
        ]
        # Nothing was sampled: no traces to log, no rollout time.
        return Rollout([], trained_B, cursor + P, {"rollout_s": 0.0, "reward_s": 0.0})

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Any:
        return self.inner.update_weights(weights, version)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.inner.evaluate(step)

    def close(self) -> None:
        self.inner.close()
