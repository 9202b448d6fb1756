"""palaestra.calls: user code called sync or async, within a timeout, its errors named."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from palaestra.calls import UserCodeError, call, call_blocking, name_of


class ToolFailed(UserCodeError):
    """A caller's own kind of error."""


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_plain_function_runs_on_the_given_pool_with_its_arguments():
    seen = {}

    def add(a, b, *, scale):
        seen["thread"] = threading.current_thread().name
        return (a + b) * scale

    with ThreadPoolExecutor(1, thread_name_prefix="given") as pool:
        value = run(call(add, (2, 3), {"scale": 10}, where="test", threads=pool))
    assert value == 50  # (2 + 3) * 10
    assert seen["thread"].startswith("given")


def test_an_async_function_runs_on_the_loop_and_an_awaitable_result_is_awaited():
    async def double(x):
        await asyncio.sleep(0)
        return 2 * x

    def later(x):  # a plain function that returns a coroutine
        return double(x)

    assert run(call(double, (4,), where="test")) == 8
    assert run(call(later, (5,), where="test")) == 10


def test_a_plain_function_sees_the_callers_context_variables():
    current = contextvars.ContextVar("current")

    async def caller():
        current.set("episode 3")
        return await call(lambda: current.get(), where="test")

    assert run(caller()) == "episode 3"


def test_a_timeout_names_the_context_the_seconds_and_the_setting():
    async def slow():
        await asyncio.sleep(5)

    started = time.monotonic()
    with pytest.raises(ToolFailed) as failed:
        run(
            call(
                slow,
                where="episode 1, turn 2: tool slow",
                timeout=0.1,
                timeout_name="environment_timeout_s",
                error=ToolFailed,
            )
        )
    assert str(failed.value) == (
        "episode 1, turn 2: tool slow timed out after 0.1 s (environment_timeout_s)"
    )
    assert failed.value.timed_out and isinstance(failed.value.__cause__, TimeoutError)
    assert time.monotonic() - started < 3


def test_a_hung_plain_function_fails_at_the_timeout_without_waiting_for_its_thread():
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        with pytest.raises(UserCodeError, match="timed out after 0.1 s$"):
            run(call(release.wait, (10,), where="reward", timeout=0.1, threads=pool))
        assert time.monotonic() - started < 3
        release.set()


def test_an_exception_is_wrapped_keeping_its_cause_and_naming_the_context():
    def broken(row):
        raise KeyError(row)

    with pytest.raises(UserCodeError) as failed:
        call_blocking(broken, ("answer",), where="eval: scoring row 7")
    assert str(failed.value) == "eval: scoring row 7 raised KeyError: 'answer'"
    assert failed.value.where == "eval: scoring row 7"
    assert failed.value.reason == "raised KeyError: 'answer'"
    assert not failed.value.timed_out
    assert isinstance(failed.value.__cause__, KeyError)


def test_a_functions_own_timeout_error_is_not_called_a_timeout():
    async def judge():
        raise TimeoutError("judge did not answer")

    with pytest.raises(UserCodeError) as failed:
        run(call(judge, where="reward", timeout=30))
    assert failed.value.reason == "raised TimeoutError: judge did not answer"
    assert not failed.value.timed_out


def test_the_context_is_read_when_the_error_happens():
    state = {"turn": 0}

    async def fails_late():
        state["turn"] = 2
        raise ValueError("no")

    with pytest.raises(UserCodeError, match="^episode 0, turn 2 raised ValueError: no$"):
        run(call(fails_late, where=lambda: f"episode 0, turn {state['turn']}"))


def test_errors_the_caller_passes_are_raised_as_they_are():
    inner = ToolFailed("episode 0, turn 1: tool add", "raised ValueError: x")

    async def raises_named():
        raise inner

    with pytest.raises(ToolFailed) as failed:
        run(call(raises_named, where="outer", error=ToolFailed, passes=(ToolFailed,)))
    assert failed.value is inner
    with pytest.raises(ToolFailed, match="^outer raised ToolFailed: episode 0"):
        run(call(raises_named, where="outer", error=ToolFailed))


def test_cancellation_is_not_wrapped():
    async def caller():
        task = asyncio.ensure_future(call(asyncio.sleep, (5,), where="test"))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        run(caller())


def test_names_of_callables():
    class Game:
        def step(self, reply): ...

        def __call__(self): ...

    assert name_of(Game) == "test_names_of_callables.<locals>.Game"
    assert name_of(Game().step) == "test_names_of_callables.<locals>.Game.step"
    assert name_of(Game()) == "test_names_of_callables.<locals>.Game"  # its type's name
    assert name_of(len) == "len"
