"""Reading a model's raw response text: thinking, visible content and tool calls."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A function call the model asked for, as written inside ``<tool_call>`` tags."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedResponse:
    """A response split into what the user sees, the reasoning, and any tool calls."""

    content: str
    """The visible answer: the text with thinking and tool-call blocks removed, stripped."""
    thinking: str | None = None
    """Text inside the thinking tags, or None when the model did not think."""
    tool_calls: list[ToolCall] = field(default_factory=list)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_response(
    text: str, think_open: str = "<think>", think_close: str = "</think>"
) -> ParsedResponse:
    """Split ``text`` into content, thinking and tool calls.

    A thinking block left open (the response was cut off while reasoning) counts as all
    thinking and no content, so a reward never scores half a thought as an answer. Some chat
    templates put the opening tag in the prompt, so a lone closing tag also ends a thought.
    """
    thinking = None
    opened = text.find(think_open)
    closed = text.find(think_close)
    if opened != -1 and (closed == -1 or closed < opened):
        thinking, text = text[opened + len(think_open) :], text[:opened]
    elif opened != -1:
        thinking = text[opened + len(think_open) : closed]
        text = text[:opened] + text[closed + len(think_close) :]
    elif closed != -1:
        thinking, text = text[:closed], text[closed + len(think_close) :]
    if thinking is not None:
        thinking = thinking.strip()

    tool_calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            continue  # malformed calls stay visible in the content, where a reward can see them
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments") or {}
            tool_calls.append(
                ToolCall(call["name"], arguments if isinstance(arguments, dict) else {})
            )
            text = text.replace(raw, "", 1)
    if tool_calls:
        text = re.sub(r"<tool_call>\s*</tool_call>", "", text)
    return ParsedResponse(content=text.strip(), thinking=thinking, tool_calls=tool_calls)
