"""Retry bookkeeping shared by every caller of a server: the policy (exponential backoff under a
total deadline) and the state of one logical operation. The SDK (``sbpstream.client.retry``)
re-exports these; the PM caller (:mod:`sbpstream.net.pmcaller`) uses them for the SDK and the
data node alike."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

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
