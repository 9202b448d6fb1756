"""The built-in episode loop: an environment (``palaestra.types.Environment``) and tools, turned
into a custom generate function, so it runs behind the same batched client as any other.

Per episode: the environment's ``start(row)`` gives the first messages; each turn the model
replies; a reply that calls tools gets their results as ``tool`` messages and replies again;
any other reply goes to the environment's ``step``, whose messages come next, until it says done
or ``max_turns`` replies were sampled (then the episode ends truncated, as it does when the
context is full). Without an environment, the dataset's prompt opens the episode and the first
reply without a tool call ends it. The environment's rewards add up in
``sample.metadata["environment_reward"]``, the default reward with an environment.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable
from typing import Any

from palaestra.models.parsing import parse_response
from palaestra.rollout.episode import EpisodeError, Turn, current_episode
from palaestra.rollout.tools import call_tool, tool_schema
from palaestra.rollout.transcript import Transcript
from palaestra.types import Sample, Step


def environment_reward(args, sample: Sample, **kwargs) -> float:
    """The sum of the rewards the episode's environment returned."""
    return float(sample.metadata.get("environment_reward", 0.0))


async def run_environment(args, sample: Sample, sampling_params) -> Sample:
    """One episode of ``args.environment`` (if any) with ``args.tools``, as a custom generate
    function: ``args`` is the run's (recipe fields, ``engine``, ``tokenizer``)."""
    threads = args.engine.threads
    env = None
    if args.environment is not None:
        env = await _call(args.environment, (), args, threads, "factory")
        first = await _call(env.start, (sample.metadata,), args, threads, "start")
        messages = _messages(first, env, "start")
    else:
        messages = sample.messages
    tools = {_name(fn): fn for fn in args.tools}
    transcript = Transcript(
        args.tokenizer,
        messages,
        args.apply_chat_template_kwargs,
        [tool_schema(fn) for fn in args.tools],
        args.engine.max_context,
    )
    rewards, status, turn = 0.0, "truncated", None
    for _ in range(args.max_turns):
        turn = await args.engine.generate(transcript.token_ids, sampling_params)
        if not turn.token_ids:
            break  # the context is full
        transcript.add_model_turn(turn.token_ids, turn.logprobs, turn.text)
        if turn.finish_reason == "abort":
            status = "aborted"
            break
        next_messages, step = await _respond(args, env, tools, turn, threads)
        if step is not None:
            rewards += float(step.reward)
            sample.metadata.update(step.metadata)
        if (step is None and not next_messages) or (step is not None and step.done):
            status = "completed"
            break
        if not transcript.add_messages(next_messages):
            break  # what the environment said does not fit the context
    transcript.fill(sample)
    sample.status = status
    sample.finish_reason = (
        "length" if status == "truncated" else getattr(turn, "finish_reason", "stop")
    )
    sample.metadata["environment_reward"] = rewards
    sample.metadata["turns"] = sum(m.get("trained", False) for m in transcript.turns)
    return sample


async def _respond(args, env, tools: dict[str, Callable], turn: Turn, threads):
    """What follows the model's reply: tool results (no step), the environment's step, or
    nothing (no environment, no tool call: the episode is done)."""
    calls = parse_response(turn.text).tool_calls if tools else []
    if calls:
        where = current_episode().describe()
        results = [
            await call_tool(
                call, tools, args.environment_timeout_s, threads, where, args.tool_error
            )
            for call in calls
        ]
        messages = [
            {"role": "tool", "name": call.name, "content": result}
            for call, result in zip(calls, results, strict=True)
        ]
        return messages, None
    if env is None:
        return [], None
    step = await _call(env.step, (turn.text,), args, threads, "step")
    if not isinstance(step, Step):
        raise _error(env, "step", f"returned {type(step).__name__}; it must return a Step")
    if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real):
        raise _error(env, "step", f"returned reward {step.reward!r}; it must be a number")
    messages = _messages(step.messages, env, "step") if not step.done else []
    return messages, step


async def _call(fn: Callable, call_args: tuple, args, threads, what: str) -> Any:
    """``fn(*call_args)``, sync on a thread or async, within the environment timeout."""
    timeout = args.environment_timeout_s
    try:
        async with asyncio.timeout(timeout):
            if inspect.iscoroutinefunction(fn):
                value = await fn(*call_args)
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(threads, lambda: fn(*call_args))
            if inspect.isawaitable(value):
                value = await value
    except TimeoutError as error:
        raise _error(fn, what, f"timed out after {timeout} s (environment_timeout_s)") from error
    except Exception as error:
        raise _error(fn, what, f"raised {type(error).__name__}: {error}") from error
    return value


def _messages(value: Any, env, what: str) -> list[dict[str, Any]]:
    """An environment's messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        return [dict(m) for m in value]
    raise _error(
        env,
        what,
        f"returned {value!r:.120}; messages are a string or a list of "
        "{'role': ..., 'content': str} dicts",
    )


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _error(target: Any, what: str, message: str) -> EpisodeError:
    owner = getattr(target, "__self__", target)
    cls = owner if isinstance(owner, type) else type(owner)
    name = cls.__qualname__ if what == "factory" else f"{cls.__qualname__}.{what}"
    if what == "factory" and not isinstance(owner, type):
        name = _name(target)
    return EpisodeError(f"{current_episode().describe()}: {name} {message}")
