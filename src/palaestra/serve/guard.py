"""The endpoint's gate: who may send a request (the API key) and what a POST may send before
the app reads it.

Two plain ASGI middlewares in front of the app. A body larger than the limit is refused with 413 as
soon as its size is known (from Content-Length, or while it streams in, so the rest is never
read); a body that is not JSON by its content type gets 415; one that is not UTF-8 or not
JSON, or that nests deeper than any real request does, gets 400. Every refusal is in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``), and none of them reaches
the model. The body is parsed here only to check it (with the C parser, bounded by the
limit); the app then reads the same bytes.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""4 MiB: a chat request that fills a 128k-token context is well under 1 MiB of JSON."""
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted; chat messages with tool calls need < 10."""

JSON_TYPES = ("application/json",)


class RequestGuard:
    """Refuses oversized, non-JSON, non-UTF-8 and too deeply nested POST bodies."""

    def __init__(self, app: Any, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.app = app
        self.limit = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = {
            key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]
        }
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await refuse(send, 413, self._too_large(int(length)), "request_too_large")
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind and kind not in JSON_TYPES and not kind.endswith("+json"):
            message = f"the request body must be JSON (Content-Type: application/json), not {kind}"
            return await refuse(send, 415, message, "unsupported_media_type")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await refuse(send, 413, self._too_large(), "request_too_large")
            if not message.get("more_body", False):
                break
        problem = check_body(bytes(body))
        if problem is not None:
            return await refuse(send, 400, problem[0], problem[1])
        return await self.app(scope, replay(bytes(body), receive), send)

    def _too_large(self, size: int | None = None) -> str:
        told = f" ({size} bytes)" if size is not None else ""
        return (
            f"the request body{told} is over this endpoint's limit of {self.limit} bytes "
            "(max_request_bytes)"
        )


class RequireKey:
    """Refuses /v1/ requests without ``Authorization: Bearer <api_key>`` (401), comparing in
    constant time, before anything else reads them."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                what = "a wrong API key" if given else "no API key"
                message = (
                    f"this endpoint needs an API key and the request had {what}; "
                    "send it as 'Authorization: Bearer KEY'"
                )
                return await refuse(send, 401, message, "invalid_api_key")
        return await self.app(scope, receive, send)


def check_body(body: bytes) -> tuple[str, str] | None:
    """``(message, code)`` of what is wrong with a JSON request body, or None."""
    if not body.strip():
        return ("the request body is empty; send a JSON object", "invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        return (f"the request body is not valid UTF-8 (byte {error.start})", "invalid_encoding")
    try:
        value = json.loads(text)
    except RecursionError:
        return (f"the request body nests deeper than {MAX_DEPTH} levels", "too_deeply_nested")
    except json.JSONDecodeError as error:
        return (f"the request body is not valid JSON: {error}", "invalid_json")
    if depth(value) > MAX_DEPTH:
        return (f"the request body nests deeper than {MAX_DEPTH} levels", "too_deeply_nested")
    return None


def depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # deeper than the limit is already an answer
            stack.extend((child, level + 1) for child in children)
    return deepest


def replay(body: bytes, receive):
    """A ``receive`` that gives the app the body already read, then waits on the client."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def refuse(send, status: int, message: str, code: str) -> None:
    payload = json.dumps(error_body(status, message, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
