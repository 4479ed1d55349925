"""Retry bookkeeping shared by every caller of a server: the policy (exponential backoff under a
total deadline), the state of one logical operation, and the deadline of the call under way.
The SDK (``sbpstream.client.retry``) re-exports these; the PM caller
(:mod:`sbpstream.net.pmcaller`) uses them for the SDK and the data node alike.

**The call's deadline** (issue 33). An SDK call (an admin call, a batch of the producer) runs
under :func:`deadline_scope`: a monotonic instant kept in a context variable. Every wait below
it takes its bound from what is left (:func:`clip_timeout`): a connection's connect, TLS and
authentication (:class:`~sbpstream.net.client.ConnectionPool`), each request's wait for its
answer (:class:`~sbpstream.net.client.Connection`), each backoff (:class:`Attempts`), and the
``timeout_ms`` the request carries to the server. So a call returns or fails by its deadline,
whatever the per-attempt timeouts say. Code that runs without a scope (the servers) is bounded
by its own timeouts only.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final, TypeVar, cast

from sbpstream.protocol.errors import ClientTimeoutError, ConnectionClosedError


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How RETRIABLE errors are retried: exponential backoff under a total deadline."""

    deadline_ms: int = 30_000  # give up (raise the last error) after this long in total
    backoff_initial_ms: int = 10
    backoff_max_ms: int = 1_000
    backoff_multiplier: float = 2.0

    def backoff_ms(self, attempt: int) -> float:
        """The pause before retry number ``attempt`` (0-based)."""
        return float(
            min(self.backoff_max_ms, self.backoff_initial_ms * self.backoff_multiplier**attempt)
        )


# Called before every backoff sleep with (error, seconds waited so far, deadline in seconds), from
# the event loop's thread; must not block. The CLI uses it to say what it is waiting for.
BackoffObserver = Callable[[BaseException, float, float], None]
backoff_observers: list[BackoffObserver] = []


def is_connection_error(exc: BaseException) -> bool:
    """The peer could not be reached or did not answer in time (its connection is suspect)."""
    return isinstance(exc, ConnectionClosedError | ClientTimeoutError)


T = TypeVar("T")

_DEADLINE: ContextVar[float | None] = ContextVar("sbpstream_deadline", default=None)

MIN_SERVER_TIMEOUT_MS: Final = 1
"""The least ``timeout_ms`` a request carries when its call's deadline is (nearly) spent: 0 or less
would mean "the server's default" (30 s for an APPEND), the opposite of what is left."""


def current_deadline() -> float | None:
    """The monotonic instant the call under way must end by (None: no call deadline)."""
    return _DEADLINE.get()


def remaining_s() -> float | None:
    """Seconds left before the call's deadline (never negative; None: no call deadline)."""
    at = _DEADLINE.get()
    return None if at is None else max(0.0, at - time.monotonic())


@contextlib.contextmanager
def deadline_scope(at: float | None, *, replace: bool = False) -> Iterator[float | None]:
    """Run the block under the deadline ``at`` (a ``time.monotonic()`` instant). Nested scopes
    keep the earlier instant (an inner call cannot outlive its caller) unless ``replace`` (a
    background task working for one batch or call, with that one's deadline). ``at`` None keeps
    the current deadline (or, with ``replace``, runs without one). Yields the deadline in force."""
    outer = _DEADLINE.get()
    new = at if replace or outer is None else (outer if at is None else min(outer, at))
    token = _DEADLINE.set(new)
    try:
        yield new
    finally:
        _DEADLINE.reset(token)


def deadline_after(policy: RetryPolicy) -> float:
    """The deadline of a call starting now under ``policy`` (its ``deadline_ms`` from now)."""
    return time.monotonic() + policy.deadline_ms / 1000


def clip_timeout(timeout_s: float | None) -> float | None:
    """``timeout_s`` bounded by what is left of the call's deadline (as is without one)."""
    left = remaining_s()
    if left is None:
        return timeout_s
    return left if timeout_s is None else min(timeout_s, left)


def clip_timeout_ms(timeout_ms: int) -> int:
    """A request's ``timeout_ms`` bounded by what is left of the call's deadline (at least
    MIN_SERVER_TIMEOUT_MS): the server stops working for the call when the caller stops waiting."""
    left = remaining_s()
    if left is None:
        return timeout_ms
    left_ms = int(left * 1000)
    return max(MIN_SERVER_TIMEOUT_MS, min(timeout_ms, left_ms) if timeout_ms > 0 else left_ms)


async def within_deadline(aw: Awaitable[T], what: str) -> T:
    """Await ``aw`` (shielded: others may share it) until the call's deadline; then raise
    ClientTimeoutError naming ``what``."""
    if isinstance(aw, asyncio.Future) and aw.done():  # e.g. a connection's declared client id:
        return cast(T, aw.result())  # no shield, task or timer per request (issue 34)
    left = remaining_s()
    if left is None:
        return await asyncio.shield(aw)
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), left)
    except TimeoutError:
        # whoever else waits for it sees its outcome; unwatched, it must not warn at exit
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise ClientTimeoutError(f"{what}: no answer by the call's deadline") from None


class Attempts:
    """Backoff state of one logical operation: sleeps between attempts, gives up at the deadline.

    The deadline is ``policy.deadline_ms`` after ``start`` (default: now), and never later than
    the call's deadline (:func:`deadline_scope`) in force when the operation began."""

    __slots__ = ("_start", "count", "deadline", "policy")

    def __init__(self, policy: RetryPolicy, *, start: float | None = None) -> None:
        self.policy = policy
        self._start = time.monotonic() if start is None else start
        self.count = 0
        at = self._start + policy.deadline_ms / 1000
        outer = _DEADLINE.get()
        #: The monotonic instant this operation gives up at.
        self.deadline = at if outer is None else min(at, outer)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def backoff(self, err: BaseException) -> None:
        """Sleep before the next attempt; raise ``err`` instead when the deadline would pass."""
        delay_s = self.policy.backoff_ms(self.count) / 1000 * random.uniform(0.5, 1.0)
        if delay_s >= self.remaining_s:
            raise err
        self.count += 1
        for observe in backoff_observers:
            observe(err, self.elapsed_s, self.deadline - self._start)
        await asyncio.sleep(delay_s)
