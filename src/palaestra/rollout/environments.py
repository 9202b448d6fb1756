"""The built-in episode loop in training: an environment (``palaestra.types.Environment``) and
tools, played by ``rollout/episode.py`` over the engine's token sequence and turned into a
custom generate function, so it runs behind the same batched client as any other.

The conversation is a ``Transcript``: the model's turns are the engine's own ids, trained on;
what the environment and the tools say is tokenised through the chat template, not trained on.
The environment's rewards add up in ``sample.metadata["environment_reward"]``, the default
reward with an environment.
"""

from __future__ import annotations

from typing import Any

from palaestra.rollout.episode import Reply, Rules, current_episode, play
from palaestra.rollout.tools import tool_schema
from palaestra.rollout.transcript import Transcript
from palaestra.types import Sample


def environment_reward(args, sample: Sample, **kwargs) -> float:
    """The sum of the rewards the episode's environment returned."""
    return float(sample.metadata.get("environment_reward", 0.0))


class EngineConversation:
    """An episode's conversation as one token sequence, its replies sampled by ``args.engine``
    (the batched turn client) with ``sampling_params``."""

    def __init__(self, args, sampling_params) -> None:
        self.args = args
        self.params = sampling_params
        self.transcript: Transcript | None = None

    def add(self, messages: list[dict[str, Any]]) -> bool:
        if self.transcript is None:
            args = self.args
            self.transcript = Transcript(
                args.tokenizer,
                messages,
                args.apply_chat_template_kwargs,
                [tool_schema(fn) for fn in args.tools],
                args.engine.max_context,
            )
            return True
        return self.transcript.add_messages(messages)

    async def generate(self) -> Reply | None:
        turn = await self.args.engine.generate(self.transcript.token_ids, self.params)
        if not turn.token_ids:
            return None  # the context is full
        self.transcript.add_model_turn(turn.token_ids, turn.logprobs, turn.text)
        return Reply(turn.text, turn.finish_reason)


async def run_environment(args, sample: Sample, sampling_params) -> Sample:
    """One episode of ``args.environment`` (if any) with ``args.tools``, as a custom generate
    function: ``args`` is the run's (recipe fields, ``engine``, ``tokenizer``)."""
    rules = Rules(
        args.environment,
        args.tools,
        args.max_turns,
        args.environment_timeout_s,
        "environment_timeout_s",
        args.tool_error,
    )
    conversation = EngineConversation(args, sampling_params)
    name = current_episode().name()
    outcome = await play(
        rules, conversation, sample.metadata, name, args.engine.threads, sample.messages
    )
    conversation.transcript.fill(sample)
    sample.status = outcome.status
    sample.finish_reason = outcome.finish_reason
    sample.metadata.update(outcome.metadata)
    sample.metadata["environment_reward"] = outcome.reward
    sample.metadata["turns"] = outcome.replies
    return sample
