"""Retry bookkeeping for the error table's kinds (RETRIABLE / REDIRECT / FATAL).

The policy, the per-operation backoff state and the backoff observers live in the connection
layer (:mod:`sbpstream.net.retry`, shared with the data node's PM calls); they are re-exported
here for the SDK."""

from __future__ import annotations

from sbpstream.net.retry import (
    Attempts,
    BackoffObserver,
    RetryPolicy,
    backoff_observers,
    is_connection_error,
)
from sbpstream.protocol.errors import (
    ClientErrorCode,
    ErrorCode,
    SbpError,
)

__all__ = ["MOVE_CODES", "REFRESH_CODES", "Attempts", "BackoffObserver", "RetryPolicy",
           "backoff_observers", "is_connection_error", "retriable"]

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
