"""The OpenAI-compatible HTTP app: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``
and ``/health``.

Requests are validated here (each error names its field, in OpenAI's error shape, with a 4xx
status) and turned into ``GenerationRequest``s for the ``Batcher``, which runs concurrent
requests through one generation pass. The model loads in the background, so the port answers at
once: ``/health`` says 503 until the model is ready, then 200.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.models.config import ModelConfig
from palaestra.serve.batcher import Batcher
from palaestra.serve.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    RequestGuard,
    RequireKey,
    error_body,
)
from palaestra.serve.streaming import EventStream, stream_requests
from palaestra.serve.targets import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE
from palaestra.types import Completion


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = error_body(self.status, self.message, self.code, self.param)
        return JSONResponse(body, status_code=self.status, headers=headers or self.headers)


class _Request(BaseModel):
    # Strict: "temperature": "hot" or "n": "2" is an error naming the field, not a guess.
    # Unknown fields are ignored, as clients send options this server has no use for.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[_TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]


@dataclass
class ServedModel:
    """What the app serves once loading is done."""

    name: str
    """The id clients pass as ``model``."""
    config: ModelConfig
    """How to read responses (thinking tags)."""
    tokenizer: Any
    batcher: Batcher
    max_context: int


DEFAULT_MAX_QUEUED_REQUESTS = 256
"""Requests waiting or generating at once before new ones are refused (503, Retry-After)."""


class State:
    """The app's mutable state: the model, once loaded, and how many requests it may hold."""

    def __init__(self, name: str, max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        self.name = name
        self.served: ServedModel | None = None
        self.started = int(time.time())


def create_app(
    state: State, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """The app over ``state``; ``api_key`` required on /v1/ when set; request bodies over
    ``max_request_bytes`` refused (413)."""
    app = FastAPI(title="palaestra", docs_url=None, redoc_url=None, openapi_url=None)
    # Plain ASGI middleware (a BaseHTTPMiddleware would hide a client's disconnect from the
    # handlers). The key check is added last, so it runs first: a request without the key is
    # refused before its body is read.
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, error: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        # Unknown routes (404) and methods (405) in the same shape as every other error.
        if error.status_code == 404:
            message = f"no route {request.url.path}; this endpoint serves /v1/chat/completions, "
            message += "/v1/completions, /v1/models and /health"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        headers = dict(error.headers) if error.headers else None  # 405 says what is allowed
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return APIError(error.status_code, message, code=code).response(headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(
                400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json"
            ).response()
        where = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(where) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.get("/health")
    async def health():
        if state.served is None:
            return JSONResponse({"status": "loading", "model": state.name}, status_code=503)
        batcher = state.served.batcher
        return {
            "status": "ok",
            "model": state.name,
            "passes": batcher.passes,
            "rows": batcher.rows,
            "prefix_tokens": batcher.prefix_tokens,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.name,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "palaestra",
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        served = _served(state, body.model)
        messages = [m.as_dict() for m in body.messages]
        try:
            text = served.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as error:  # the template's own message says what it disliked
            raise APIError(
                400, f"messages: the chat template failed: {error}", param="messages"
            ) from None
        # The template writes its own special tokens.
        prompt_ids = served.tokenizer(text, add_special_tokens=False).input_ids
        request = _generation_request(served, body, prompt_ids)
        if body.stream:
            return _stream(served, [request], "chatcmpl", body, len(prompt_ids), chat=True)
        completions = await unless_gone(http, served.batcher.submit(request))
        return _Reply("chatcmpl", served.name, len(prompt_ids), completions).chat(served.config)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        served = _served(state, body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        ids = [served.tokenizer(p).input_ids for p in prompts]
        requests = [_generation_request(served, body, prompt_ids) for prompt_ids in ids]
        prompt_tokens = sum(len(i) for i in ids)
        if body.stream:
            return _stream(served, requests, "cmpl", body, prompt_tokens, chat=False)
        submitted = asyncio.gather(*(served.batcher.submit(r) for r in requests))
        results = await unless_gone(http, submitted)
        flat = [c for completions_n in results for c in completions_n]
        return _Reply("cmpl", served.name, prompt_tokens, flat).text()

    return app


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_gone(http: Request, work: Awaitable, poll_s: float = 0.25):
    """``work``'s result, or, if the client disconnects first, ``work`` cancelled (its rows
    leave the batch at the next token) and ClientGone raised: nobody is left to answer. The
    server stops a streaming response itself; a plain one it never does."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()
            raise ClientGone()


def _served(state: State, model: str | None) -> ServedModel:
    if state.served is None:
        raise APIError(
            503,
            "the model is still loading; poll /health until it answers 200",
            code="model_loading",
        )
    if model is not None and model != state.name:
        raise APIError(
            404,
            f"model {model!r} is not served here; this endpoint serves {state.name!r}",
            param="model",
            code="model_not_found",
        )
    batcher = state.served.batcher
    if batcher.in_flight >= state.max_queued_requests:
        # Bounded: a flood gets a clean refusal it can retry instead of an ever longer wait.
        retry = max(1, math.ceil(batcher.last_pass_s))
        raise APIError(
            503,
            f"this endpoint already holds {batcher.in_flight} requests (max_queued_requests="
            f"{state.max_queued_requests}); retry after {retry} s",
            code="overloaded",
            headers={"Retry-After": str(retry)},
        )
    return state.served


def _generation_request(served: ServedModel, body: _Request, prompt_ids: list[int]):
    """What to generate for ``body``; what it leaves out comes from the model's defaults."""
    config = served.config
    room = served.max_context - len(prompt_ids)
    asked = body.max_completion_tokens or body.max_tokens
    if room < 1 or (asked is not None and asked > room):
        raise APIError(
            400,
            f"max_tokens: the prompt has {len(prompt_ids)} tokens and the model's context is "
            f"{served.max_context}, so at most {max(room, 0)} new tokens fit "
            f"(asked for {asked if asked is not None else 'any'})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = SamplingParams(
        max_tokens=asked or min(config.default_max_tokens or DEFAULT_MAX_TOKENS, room),
        temperature=first_set(body.temperature, config.default_temperature, DEFAULT_TEMPERATURE),
        top_p=body.top_p,
        seed=body.seed,
        stop=stop,
    )
    return GenerationRequest(token_ids=list(prompt_ids), n=body.n, params=params)


def first_set(*values):
    return next(value for value in values if value is not None)


def _include_usage(body: _Request) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _stream(
    served: ServedModel, requests, prefix: str, body: _Request, prompt_tokens: int, chat: bool
) -> EventStream:
    """Server-sent events that carry each token as it is sampled."""
    head = {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": served.name,
        "object": "chat.completion.chunk" if chat else "text_completion",
    }

    def chunk(index: int, delta: dict[str, Any] | None, finish_reason: str | None):
        if chat:
            choice = {"index": index, "delta": delta or {}}
        else:
            choice = {"index": index, "text": (delta or {}).get("content", "")}
        return {**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}]}

    def usage(completions: list[Completion]) -> dict[str, Any]:
        return {**head, "choices": [], "usage": _usage(prompt_tokens, completions)}

    events = stream_requests(
        served.batcher,
        requests,
        served.tokenizer,
        served.config.parse_response if chat else None,
        chunk,
        usage if _include_usage(body) else None,
    )
    return EventStream(events)


def _usage(prompt_tokens: int, completions: list[Completion]) -> dict[str, int]:
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Reply:
    """One request's completions, written as a whole response."""

    def __init__(self, prefix: str, model: str, prompt_tokens: int, completions: list[Completion]):
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.model = model
        self.created = int(time.time())
        self.completions = completions
        self.usage = _usage(prompt_tokens, completions)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chat(self, config: ModelConfig) -> dict[str, Any]:
        choices = []
        for index, completion in enumerate(self.completions):
            parsed = config.parse_response(completion.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.thinking is not None:
                message["reasoning_content"] = parsed.thinking
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": completion.finish_reason,
                }
            )
        return {**self._head("chat.completion"), "choices": choices, "usage": self.usage}

    def text(self) -> dict[str, Any]:
        choices = [
            {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(self.completions)
        ]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage}
