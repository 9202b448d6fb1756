"""One episode's token sequence, kept exactly as sampled: the prompt's ids, then each turn's.

The model's turns are the engine's own ids (never decoded and re-tokenised), with their loss
mask 1 and the sampler's log-probs. What the environment says is rendered with the chat template
and only that difference is tokenised, with mask 0 and log-prob 0: the next turn is sampled
from exactly the sequence that will be trained on.

The difference is found by rendering the conversation twice, with and without the new
messages, the model's last reply standing in as a placeholder: templates that render earlier
turns the same whatever follows (ChatML and most others) have the first rendering as a prefix of
the second. The part of the template that closes the model's reply (``<|im_end|>\\n``) is the
environment's too, except the end token the model sampled itself.
"""

from __future__ import annotations

from typing import Any

from palaestra.rollout.tools import tools_system_text
from palaestra.types import Sample

_PLACEHOLDER = "\u2063palaestra-reply\u2063"


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn."""


class Transcript:
    """Prompt, model turns and environment messages of one episode, as tokens and as messages."""

    def __init__(
        self,
        tokenizer,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.max_tokens = max_tokens
        """Most tokens the sequence may hold (the context); None: no limit."""
        self.tools = None
        messages = [dict(m) for m in messages]
        if tools:
            if self._render(messages, True, tools) != self._render(messages, True):
                self.tools = tools  # the template renders them in its own format
            else:
                messages = _with_system_text(messages, tools_system_text(tools))
        self.prompt_messages = messages
        self.turns: list[dict[str, Any]] = []
        """Messages after the prompt, the model's marked ``"trained": True``."""
        self.prompt_ids: list[int] = self._encode(self._render(messages, True))
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] | None = []

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence: what the next turn is sampled from."""
        return self.prompt_ids + self.response_ids

    def room(self) -> int | None:
        """Tokens left before the context is full; None: no limit."""
        return None if self.max_tokens is None else self.max_tokens - len(self.token_ids)

    def add_model_turn(self, token_ids: list[int], logprobs: list[float] | None, text: str) -> None:
        """The model's reply: its sampled ids, trained on."""
        self.response_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
        else:
            self.logprobs = None  # the engine did not keep them: none for the whole episode
        self.turns.append({"role": "assistant", "content": text, "trained": True})

    def add_messages(self, messages: list[dict[str, Any]]) -> bool:
        """The environment's messages after the model's last reply, up to the next reply's
        generation prompt; False (and nothing added) when they would not fit the context."""
        if not self.turns or self.turns[-1]["role"] != "assistant":
            raise TemplateError("environment messages must follow a reply of the model")
        history = self.prompt_messages + [_plain(m) for m in self.turns[:-1]]
        history.append({"role": "assistant", "content": _PLACEHOLDER})
        before = self._render(history, False)
        after = self._render(history + [_plain(m) for m in messages], True)
        if not after.startswith(before) or _PLACEHOLDER not in before:
            raise TemplateError(
                "the chat template renders earlier turns differently once more messages follow, "
                "so turns cannot be appended as tokens; use a custom_generate_function that "
                "writes the environment's tokens itself"
            )
        closing = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        last = self.response_ids[-1:]
        ended = self.tokenizer.decode(last, skip_special_tokens=False) if last else ""
        if ended and closing.startswith(ended):
            closing = closing[len(ended) :]  # the model sampled the end of its turn itself
        ids = self._encode(closing + after[len(before) :])
        if self.max_tokens is not None and len(self.token_ids) + len(ids) > self.max_tokens:
            return False
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)
        self.turns += [{**m, "trained": False} for m in messages]
        return True

    def fill(self, sample: Sample) -> Sample:
        """``sample`` with this episode's prompt, tokens, mask, log-probs and messages."""
        sample.prompt = self.tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
        sample.prompt_token_ids = list(self.prompt_ids)
        sample.response_token_ids = list(self.response_ids)
        sample.loss_mask = list(self.loss_mask)
        sample.response_logprobs = None if self.logprobs is None else list(self.logprobs)
        sample.messages = [dict(m) for m in self.prompt_messages] + [dict(m) for m in self.turns]
        sample.response = self.tokenizer.decode(self.response_ids, skip_special_tokens=True)
        return sample

    def _render(self, messages: list[dict[str, Any]], generation: bool, tools=None) -> str:
        tools = tools if tools is not None else self.tools
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation,
            **({"tools": tools} if tools else {}),
            **self.kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "trained"}


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
