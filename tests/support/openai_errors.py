"""Reading an OpenAI-shaped error body, as the served app answers every refused request."""

from __future__ import annotations


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]
