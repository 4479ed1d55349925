"""Bounded waiting for a condition: the one way tests wait for something to become true.

Tests never sleep and then assert: they poll a condition until it holds or a bound passes, and
the bound is a hang guard (generous, far above the expected time), never a measurement.

    value = eventually(lambda: proc.poll() is not None, timeout=10)
    leader = await eventually_async(find_leader, timeout=20, interval=0.1)

The condition's truthy result is returned, so a probe can hand back what it found. A condition
may raise one of ``retry_on`` (default: none) while the system is not ready yet; the last such
exception is chained to the final AssertionError.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_INTERVAL_S = 0.05


Describe = str | Callable[[], str]
"""What is awaited: a text, or a callable giving it at the failure (the state then, e.g.
"acked 3500, received 3400")."""


def _failure(
    what: Describe, timeout: float, last: object, error: BaseException | None
) -> AssertionError:
    detail = f"; last error: {error!r}" if error is not None else f"; last value: {last!r}"
    text = what if isinstance(what, str) else what()
    return AssertionError(f"{text} not true within {timeout}s{detail}")


def eventually(
    condition: Callable[[], T],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = DEFAULT_INTERVAL_S,
    what: Describe = "condition",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``condition`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = condition()
        except retry_on as e:
            error = e
        else:
            if value:
                return value
            last, error = value, None
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last, error) from error
        time.sleep(interval)


async def eventually_async(
    condition: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = DEFAULT_INTERVAL_S,
    what: Describe = "condition",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """The asyncio twin of :func:`eventually`: ``condition`` may be sync or a coroutine
    function; the loop keeps running between tries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            result = condition()
            value: T = await result if inspect.isawaitable(result) else result  # type: ignore[assignment]
        except retry_on as e:
            error = e
        else:
            if value:
                return value
            last, error = value, None
        if loop.time() >= deadline:
            raise _failure(what, timeout, last, error) from error
        await asyncio.sleep(interval)
