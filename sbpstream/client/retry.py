"""Retry bookkeeping for the error table's kinds (RETRIABLE / REDIRECT / FATAL).

The policy, the per-operation backoff state and the backoff observers live in the connection
layer (:mod:`sbpstream.net.retry`, shared with the data node's PM calls); they are re-exported
here for the SDK."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from sbpstream.net.retry import (
    Attempts,
    BackoffObserver,
    RetryPolicy,
    backoff_observers,
    clip_timeout,
    clip_timeout_ms,
    current_deadline,
    deadline_after,
    deadline_scope,
    is_connection_error,
    remaining_s,
    within_deadline,
)
from sbpstream.protocol.errors import (
    ClientErrorCode,
    ErrorCode,
    SbpError,
)

__all__ = ["MOVE_CODES", "REFRESH_CODES", "Attempts", "BackoffObserver", "RetryPolicy",
           "backoff_observers", "bounded_calls", "clip_timeout", "clip_timeout_ms",
           "current_deadline", "deadline_after", "deadline_scope", "is_connection_error",
           "remaining_s", "retriable", "within_deadline"]

C = TypeVar("C", bound=type)

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


def retriable(exc: BaseException) -> bool:
    return isinstance(exc, SbpError) and exc.retriable


def bounded_calls(policy_of: Callable[[Any], RetryPolicy]) -> Callable[[C], C]:
    """A class decorator: each public ``async def`` of the class runs under a call deadline
    (:func:`deadline_scope`) of its instance's retry policy (``policy_of(self)``) from when it is
    called, so every wait inside (connects, requests, backoffs, PM lookups) ends by then and the
    call returns or fails within ``retry_deadline_ms`` (issue 33). A call made inside another
    keeps the outer, earlier deadline. Signatures and docstrings stay (the sync twin is
    generated from them)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def call(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            with deadline_scope(deadline_after(policy_of(self))):
                return await fn(self, *args, **kwargs)

        return call

    def decorate(cls: C) -> C:
        for name, fn in list(vars(cls).items()):
            if not name.startswith("_") and inspect.iscoroutinefunction(fn):
                setattr(cls, name, wrap(fn))
        return cls

    return decorate
