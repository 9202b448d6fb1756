"""Tools a model may call: plain Python functions (sync or async, typed, with a docstring), their
JSON schemas for the chat template, and one call of a tool (through ``palaestra.calls``).

The schema is the OpenAI/Hermes function format that chat templates with tool support render
(``tokenizer.apply_chat_template(messages, tools=...)``). A template without tool support
ignores ``tools``; then the schemas go into the system message instead, with the
``<tool_call>{...}</tool_call>`` format that ``parse_response`` reads.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from palaestra.calls import UserCodeError
from palaestra.calls import call as call_user_code
from palaestra.models.parsing import ToolCall

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


class ToolError(UserCodeError):
    """A tool failed, or was described wrongly; the message names the episode, turn and tool."""


def tool_schema(fn: Callable) -> dict[str, Any]:
    """``fn``'s function schema: name, the docstring's first paragraph, typed parameters (the
    docstring's ``Args:`` lines describe them)."""
    name = getattr(fn, "__name__", None)
    doc = inspect.getdoc(fn)
    if not name or not doc:
        raise ToolError(f"tool {fn!r} needs a name and a docstring: the model reads them")
    hints = typing.get_type_hints(fn)
    described = _argument_docs(doc)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise ToolError(f"tool {name}: parameter {param.name!r} has no type annotation")
        prop = _json_type(hints[param.name], f"tool {name}: parameter {param.name!r}")
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": summary, "parameters": parameters},
    }


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {
            "type": _JSON_TYPES.get(type(typing.get_args(hint)[0]), "string"),
            "enum": list(typing.get_args(hint)),
        }
    if hint is list or origin is list:
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
    raise ToolError(
        f"{where}: type {hint!r} has no JSON schema; use int, float, str, bool, list or dict"
    )


def _argument_docs(doc: str) -> dict[str, str]:
    """``name: text`` lines under an ``Args:`` heading (Google style)."""
    match = re.search(
        r"^\s*(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M
    )
    if not match:
        return {}
    lines = re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$", match.group(1), re.M)
    return {name: text.strip() for name, text in lines}


def tools_system_text(schemas: list[dict[str, Any]]) -> str:
    """The tools as system-prompt text, for chat templates that do not render ``tools``."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "You may call functions to help you answer. They are described in <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, reply with a JSON object of its name and arguments in tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


async def call_tool(
    call: ToolCall,
    tools: dict[str, Callable],
    timeout: float | None,
    threads: Executor | None,
    where: str,
    on_error: str,
) -> str:
    """The result of ``call`` as text for the model. A tool that raises, times out or is
    unknown fails with a ToolError naming ``where`` (episode and turn) and the tool, or with
    ``on_error="message"`` answers the model with the error instead."""
    fn = tools.get(call.name)
    named = f"{where}: tool {call.name}({json.dumps(call.arguments)})"
    try:
        if fn is None:
            known = ", ".join(tools)
            raise ToolError(
                named, f"raised LookupError: no tool named {call.name!r}; tools: {known}"
            )
        value = await call_user_code(
            fn,
            kwargs=call.arguments,
            where=named,
            timeout=timeout,
            threads=threads,
            error=ToolError,
        )
    except ToolError as error:
        if on_error == "message":
            return f"Error: {call.name} {error.reason}"
        raise
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        raise ToolError(
            f"{where}: tool {call.name} returned {type(value).__name__} {value!r:.100}; a tool "
            "returns text or JSON data (str, number, bool, list, dict, None)"
        ) from None
