"""Request deadlines on the PM: a request's ``timeout_ms`` bounds the work done on its behalf,
calls to data nodes included (docs/architecture.md, "Durability and failure")."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Iterator
from typing import Final

from sbpstream.protocol.errors import RequestTimeoutError

DN_CALL_TIMEOUT_S: Final = 2.0
"""A PM -> data node call (SYNC/SEAL/TRIM/DELETE/DESCRIBE) gives up after this. Short, because a
writer's SEAL_RANGES waits on it, and a node that slow is treated as unreachable."""

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "pm_request_deadline", default=None)


@contextlib.contextmanager
def request_deadline(timeout_ms: int) -> Iterator[None]:
    """Within this block, calls to data nodes end by the request's deadline (``timeout_ms`` from
    now; <= 0 sets none). Tasks started inside inherit it (contextvars)."""
    token = _deadline.set(time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None)
    try:
        yield
    finally:
        _deadline.reset(token)


@contextlib.asynccontextmanager
async def within(timeout_ms: int, what: str) -> AsyncIterator[None]:
    """Honour a request's ``timeout_ms`` (<= 0: none): the work inside is cancelled at the
    deadline and the request is answered TIMEOUT (retriable); calls to data nodes made inside
    take their bound from the same deadline (service.call_timeout)."""
    if timeout_ms <= 0:
        yield
        return
    with request_deadline(timeout_ms):
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                yield
        except TimeoutError:
            raise RequestTimeoutError(
                f"{what} did not finish within its timeout_ms {timeout_ms}") from None


DEADLINE_GRACE_S: Final = 0.05
"""A call bounded by its request's deadline ends this much after it, so that the request's own
deadline (``within``) fires first and the request is answered TIMEOUT, rather than the call
running out a moment earlier and the request answering a per-item error of that call."""


def call_timeout(default_s: float = 0.0) -> float:
    """The bound of one internal call: ``default_s`` (DN_CALL_TIMEOUT_S if 0), or less when the
    request that caused it has less time left (then just past its deadline: DEADLINE_GRACE_S;
    never below 1 ms)."""
    bound = default_s or DN_CALL_TIMEOUT_S
    deadline = _deadline.get()
    if deadline is None:
        return bound
    return max(0.001, min(bound, deadline - time.monotonic() + DEADLINE_GRACE_S))
