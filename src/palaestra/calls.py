"""The one way palaestra calls user code: rewards, tools, environments, custom generate functions
and eval scorers are plain callables, ``def`` or ``async def``.

``call`` runs one from a coroutine: an ``async def`` on the running event loop, a plain function
on a thread pool (so slow ones overlap and the loop stays free; it sees the caller's context
variables, as with ``asyncio.to_thread``), an awaitable result awaited, all within an optional
timeout. Whatever it raises becomes a ``UserCodeError`` (or the caller's subclass of it) whose
message names the caller's context: which reward on which sample, which tool or environment
method in which episode and turn, which eval row. The original error is its ``__cause__``.
``call_blocking`` does the same from code that runs no event loop.

A timed-out plain function keeps its thread (a thread cannot be killed): callers that may time
out give it a pool of their own, and shut that down without waiting.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

Where = str | Callable[[], str]
"""The caller's context, or a function that says it when an error is raised (an episode's
turn changes while it runs)."""


class UserCodeError(RuntimeError):
    """User code raised, timed out or returned what it must not.

    The message is ``where`` (the caller's context and the function), then ``reason``;
    ``timed_out`` says whether the call ran past its timeout.
    """

    separator = " "
    """Between ``where`` and ``reason`` in the message."""

    def __init__(self, where: str, reason: str | None = None, timed_out: bool = False) -> None:
        super().__init__(where if reason is None else f"{where}{self.separator}{reason}")
        self.where = where
        self.reason = reason
        self.timed_out = timed_out


def name_of(fn: Any) -> str:
    """How errors name a callable: ``score``, ``Game.step``, ``Game`` (a class), or the type
    of a callable object."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name or type(fn).__qualname__


async def call(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    where: Where,
    timeout: float | None = None,
    timeout_name: str | None = None,
    threads: Executor | None = None,
    error: type[UserCodeError] = UserCodeError,
    passes: tuple[type[BaseException], ...] = (),
) -> Any:
    """``fn(*args, **kwargs)``, awaited if it is async or returns an awaitable.

    ``timeout``: seconds for the whole call (None: no limit), named in the error as
    ``timeout_name`` (the setting that sets it). ``threads``: the pool a plain function runs
    on (default: one shared pool). ``error``: the ``UserCodeError`` subclass raised, its
    message starting with ``where``. ``passes``: errors raised as they are, because they
    already name their context (an episode's own error, from the loop the function called).
    """
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args, **(kwargs or {}))
            else:
                bound = functools.partial(fn, *args, **(kwargs or {}))
                run = functools.partial(contextvars.copy_context().run, bound)
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(threads or shared_threads(), run)
            if inspect.isawaitable(value):  # a partial of an async function, say
                value = await value
    except passes:
        raise
    except Exception as cause:
        context = where() if callable(where) else where
        # A function's own TimeoutError (a client's) is not ours: only the deadline's is.
        if isinstance(cause, TimeoutError) and deadline.expired():
            named = f" ({timeout_name})" if timeout_name else ""
            raise error(context, f"timed out after {timeout} s{named}", timed_out=True) from cause
        raise error(context, f"raised {type(cause).__name__}: {cause}") from cause
    return value


def call_blocking(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    where: Where,
    timeout: float | None = None,
    error: type[UserCodeError] = UserCodeError,
) -> Any:
    """``call`` from code that runs no event loop (an eval's worker thread): a fresh loop for
    this one call, plain functions on the shared pool."""
    return asyncio.run(call(fn, args, kwargs, where=where, timeout=timeout, error=error))


_SHARED: ThreadPoolExecutor | None = None
_SHARED_LOCK = threading.Lock()


def shared_threads() -> ThreadPoolExecutor:
    """The pool plain functions run on when their caller keeps none of its own."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = ThreadPoolExecutor(32, thread_name_prefix="palaestra-user-code")
        return _SHARED
