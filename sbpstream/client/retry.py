"""Retry bookkeeping for the error table's kinds (RETRIABLE / REDIRECT / FATAL)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from sbpstream.client.types import RetryPolicy
from sbpstream.protocol.errors import (
    ClientErrorCode,
    ClientTimeoutError,
    ConnectionClosedError,
    ErrorCode,
    SbpError,
)

# Errors after which the writer stops writing to the range and asks the PM to seal it: the
# primary is gone, is no longer the primary, or the range no longer takes writes.
MOVE_CODES: frozenset[int] = frozenset(
    {
        ErrorCode.RANGE_SEALED,
        ErrorCode.NOT_PRIMARY,
        ErrorCode.REPLICA_UNAVAILABLE,
        ErrorCode.SHUTTING_DOWN,
        ClientErrorCode.CONNECTION_CLOSED,
        ClientErrorCode.CLIENT_TIMEOUT,
    }
)
# Errors after which cached range metadata is stale and must be read again from the PM.
REFRESH_CODES: frozenset[int] = MOVE_CODES | {ErrorCode.RANGE_NOT_FOUND}


# Called before every backoff sleep with (error, seconds waited so far, deadline in seconds), from
# the event loop's thread; must not block. The CLI uses it to say what it is waiting for.
BackoffObserver = Callable[[BaseException, float, float], None]
backoff_observers: list[BackoffObserver] = []


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionClosedError | ClientTimeoutError)


class Attempts:
    """Backoff state of one logical operation: sleeps between attempts, gives up at the deadline."""

    __slots__ = ("_start", "count", "policy")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._start = time.monotonic()
        self.count = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.policy.deadline_ms / 1000 - self.elapsed_s)

    async def backoff(self, err: BaseException) -> None:
        """Sleep before the next attempt; raise ``err`` instead when the deadline would pass."""
        delay_s = self.policy.backoff_ms(self.count) / 1000 * random.uniform(0.5, 1.0)
        if delay_s >= self.remaining_s:
            raise err
        self.count += 1
        for observe in backoff_observers:
            observe(err, self.elapsed_s, self.policy.deadline_ms / 1000)
        await asyncio.sleep(delay_s)


def retriable(exc: BaseException) -> bool:
    return isinstance(exc, SbpError) and exc.retriable
