"""The one error table of SBP (design.md section 2, "Error codes"). No I/O.

Every code has a name, a meaning and one exception class, and every class sits on two axes:

- **Who is at fault** (h11's Local/RemoteProtocolError, asyncpg's InterfaceError/PostgresError):
  :class:`ClientSideError` is raised by this process's client and has a client-only code
  (:class:`ClientErrorCode`, 90-119; a server never originates one, it only passes one on when
  its own call to another node failed that way); :class:`ServerError` is a wire code
  (:class:`ErrorCode`) a server answered with, either :class:`RequestError` (the request, or where
  it was sent, is at fault: change it before sending it again) or :class:`ServerFaultError` (the
  server or the cluster behind it failed a request that was fine).
- **Whether a retry helps**: :class:`RetriableError` (the same request may succeed later, possibly
  after refreshing metadata), :class:`RedirectError` (send it elsewhere: ``detail`` says where) or
  :class:`FatalError` (retrying cannot help). ``kind``, ``retriable`` and ``redirect`` say the
  same for code that holds a code rather than a class.

The table :data:`ERRORS` is *derived* from the classes, refuses duplicates, and maps unknown codes
to :class:`UnknownServerError`. Codes are added, never renumbered.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import ClassVar, Final


class ErrorKind(enum.Enum):
    NONE = "none"
    RETRIABLE = "retriable"
    REDIRECT = "redirect"
    FATAL = "fatal"


class ErrorCode(enum.IntEnum):
    """Wire codes: ``Status.code`` and ``GoAway.code`` values."""

    # --- the spec's codes
    NONE = 0
    UNKNOWN = 1
    INVALID_REQUEST = 2
    UNSUPPORTED_VERSION = 3
    PM_NOT_LEADER = 5
    # --- 6-29 protocol and generic
    UNSUPPORTED_OPERATION = 6
    CHECKSUM_MISMATCH = 7
    LIMIT_EXCEEDED = 8
    TIMEOUT = 9
    BAD_HEADER = 10
    SHUTTING_DOWN = 11
    TOO_MANY_REQUESTS = 12
    INTERNAL_ERROR = 13
    THROTTLED = 14
    # --- 30-59 data node and storage
    STREAM_NOT_FOUND = 30
    STREAM_DELETED = 31
    RANGE_NOT_FOUND = 32
    RANGE_SEALED = 33
    NOT_PRIMARY = 34
    OFFSET_OUT_OF_RANGE = 35
    OFFSET_MISMATCH = 36
    CORRUPT_BATCH = 37
    OUT_OF_ORDER_SEQUENCE = 38
    REPLICA_UNAVAILABLE = 39
    STORAGE_FULL = 40
    STORAGE_ERROR = 41
    RANGE_ALREADY_EXISTS = 42
    PRODUCER_FENCED = 43
    OFFSET_TRIMMED = 44
    FETCH_SESSION_ID_NOT_FOUND = 45
    INVALID_FETCH_SESSION_EPOCH = 46
    # --- 60-89 placement manager
    NOT_ENOUGH_DATA_NODES = 60
    DATA_NODE_NOT_FOUND = 61
    INVALID_STREAM_CONFIG = 62
    METADATA_ERROR = 63
    FENCED_LEADER = 64
    # --- 80-83 security (docs/security.md)
    AUTHENTICATION_REQUIRED = 80
    AUTHORIZATION_FAILED = 81
    TOKEN_EXPIRED = 82
    AUTHENTICATION_FAILED = 83
    # --- 84-89 consumer groups (project)
    ILLEGAL_GENERATION = 84
    UNKNOWN_MEMBER = 85
    GROUP_NOT_EMPTY = 86


class ClientErrorCode(enum.IntEnum):
    """90-119: raised by a client, never originated by a server (no wire code takes these)."""

    CONNECTION_CLOSED = 90
    CLIENT_TIMEOUT = 91
    NO_PM_REACHABLE = 92
    PROTOCOL_VIOLATION = 93
    CLIENT_CLOSED = 94
    PRODUCER_CLOSED = 95


AnyErrorCode = ErrorCode | ClientErrorCode


class SbpError(Exception):
    """Base of every SBP error. ``code`` is its code; ``kind`` says whether to retry."""

    code: ClassVar[AnyErrorCode] = ErrorCode.UNKNOWN
    kind: ClassVar[ErrorKind] = ErrorKind.FATAL
    meaning: ClassVar[str] = "an unexpected server error"

    def __init__(self, message: str = "", detail: bytes = b"") -> None:
        super().__init__(message or self.meaning)
        self.message = message or self.meaning
        self.detail = detail

    @property
    def retriable(self) -> bool:
        return self.kind is ErrorKind.RETRIABLE

    @property
    def redirect(self) -> bool:
        return self.kind is ErrorKind.REDIRECT

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


# ---- whether a retry helps (every concrete class derives from exactly one)


class RetriableError(SbpError):
    """The same request may succeed later, possibly after refreshing metadata."""

    kind = ErrorKind.RETRIABLE


class RedirectError(SbpError):
    """Send the request elsewhere: ``detail`` says where (empty when unknown)."""

    kind = ErrorKind.REDIRECT


class FatalError(SbpError):
    """Retrying the same request cannot help."""

    kind = ErrorKind.FATAL


# ---- who is at fault (every concrete class derives from exactly one leaf of these)


class ClientSideError(SbpError):
    """Raised by this process's client, never received: a :class:`ClientErrorCode`."""

    code: ClassVar[ClientErrorCode]


class ServerError(SbpError):
    """A server answered with this wire code (:class:`ErrorCode`)."""

    code: ClassVar[ErrorCode]


class RequestError(ServerError):
    """The request, or where it was sent, is at fault: change it before sending it again."""


class ServerFaultError(ServerError):
    """The server, or the cluster behind it, failed a request that was itself fine."""


# ---- the spec's codes


class UnknownServerError(ServerFaultError, FatalError):
    """An unexpected server error; also every code this table does not know."""

    code = ErrorCode.UNKNOWN
    meaning = "an unexpected server error"


class InvalidRequestError(RequestError, FatalError):
    code = ErrorCode.INVALID_REQUEST
    meaning = "the request is invalid"


class UnsupportedVersionError(RequestError, FatalError):
    code = ErrorCode.UNSUPPORTED_VERSION
    meaning = "the request's version is not supported"


class PmNotLeaderError(RequestError, RedirectError):
    code = ErrorCode.PM_NOT_LEADER
    meaning = "this PM is not the leader; detail holds the leader's host:port (empty when unknown)"


# ---- 6-29 protocol and generic


class UnsupportedOperationError(RequestError, FatalError):
    code = ErrorCode.UNSUPPORTED_OPERATION
    meaning = "this server's role does not serve the opcode"


class ChecksumMismatchError(RequestError, RetriableError):
    code = ErrorCode.CHECKSUM_MISMATCH
    meaning = "the frame payload CRC did not match"


class LimitExceededError(RequestError, FatalError):
    code = ErrorCode.LIMIT_EXCEEDED
    meaning = "a protocol or server limit was exceeded"


class RequestTimeoutError(ServerFaultError, RetriableError):
    code = ErrorCode.TIMEOUT
    meaning = "the server timed out the request"


TimeoutError_ = RequestTimeoutError  # the name it was first exported under


class BadHeaderError(RequestError, FatalError):
    code = ErrorCode.BAD_HEADER
    meaning = "the extended header could not be decoded or has an unknown format"


class ShuttingDownError(ServerFaultError, RetriableError):
    code = ErrorCode.SHUTTING_DOWN
    meaning = "the server is shutting down; retry elsewhere or later"


class TooManyRequestsError(RequestError, RetriableError):
    code = ErrorCode.TOO_MANY_REQUESTS
    meaning = "too many requests in flight on the connection"


class InternalError(ServerFaultError, RetriableError):
    code = ErrorCode.INTERNAL_ERROR
    meaning = "the server failed internally"


class ThrottledError(RequestError, RetriableError):
    code = ErrorCode.THROTTLED
    meaning = "a quota was exceeded; back off"


# ---- 30-59 data node and storage


class StreamNotFoundError(RequestError, FatalError):
    code = ErrorCode.STREAM_NOT_FOUND
    meaning = "no such stream"


class StreamDeletedError(RequestError, FatalError):
    code = ErrorCode.STREAM_DELETED
    meaning = "the stream was deleted"


class RangeNotFoundError(RequestError, RetriableError):
    code = ErrorCode.RANGE_NOT_FOUND
    meaning = "the data node does not hold that range; refresh metadata"


class RangeSealedError(RequestError, RetriableError):
    code = ErrorCode.RANGE_SEALED
    meaning = "the range is sealed; refresh metadata and write to the next range"


class NotPrimaryError(RequestError, RetriableError):
    code = ErrorCode.NOT_PRIMARY
    meaning = "this data node is not the range's primary"


class OffsetOutOfRangeError(RequestError, FatalError):
    code = ErrorCode.OFFSET_OUT_OF_RANGE
    meaning = "the offset is outside the stream's or range's bounds"


class OffsetMismatchError(RequestError, FatalError):
    code = ErrorCode.OFFSET_MISMATCH
    meaning = "the batch does not start at the range's next offset"


class CorruptBatchError(RequestError, FatalError):
    code = ErrorCode.CORRUPT_BATCH
    meaning = "the record batch failed its length, magic or CRC check"


class OutOfOrderSequenceError(RequestError, FatalError):
    code = ErrorCode.OUT_OF_ORDER_SEQUENCE
    meaning = "an idempotent producer's sequence has a gap"


class ReplicaUnavailableError(ServerFaultError, RetriableError):
    code = ErrorCode.REPLICA_UNAVAILABLE
    meaning = "a replica could not be reached; the writer should seal and move on"


class StorageFullError(ServerFaultError, RetriableError):
    code = ErrorCode.STORAGE_FULL
    meaning = "the data node's disk is full"


class StorageError(ServerFaultError, RetriableError):
    code = ErrorCode.STORAGE_ERROR
    meaning = "the data node's storage failed"


class RangeAlreadyExistsError(RequestError, FatalError):
    code = ErrorCode.RANGE_ALREADY_EXISTS
    meaning = "the range already exists with different bounds"


class ProducerFencedError(RequestError, FatalError):
    code = ErrorCode.PRODUCER_FENCED
    meaning = "a newer epoch of this producer id exists"


class OffsetTrimmedError(RequestError, FatalError):
    code = ErrorCode.OFFSET_TRIMMED
    meaning = "the records at that offset were trimmed away"


class FetchSessionIdNotFoundError(RequestError, RetriableError):
    code = ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    meaning = "no fetch session of that id on this node: start a full session again"


class InvalidFetchSessionEpochError(RequestError, RetriableError):
    code = ErrorCode.INVALID_FETCH_SESSION_EPOCH
    meaning = "the fetch session's epoch is not the one expected: start a full session again"


# ---- 60-89 placement manager


class NotEnoughDataNodesError(ServerFaultError, RetriableError):
    code = ErrorCode.NOT_ENOUGH_DATA_NODES
    meaning = "not enough live data nodes for the requested replicas"


class DataNodeNotFoundError(RequestError, FatalError):
    code = ErrorCode.DATA_NODE_NOT_FOUND
    meaning = "no such data node"


class InvalidStreamConfigError(RequestError, FatalError):
    code = ErrorCode.INVALID_STREAM_CONFIG
    meaning = "replica_nums or retention_period_ms is invalid"


class MetadataError(ServerFaultError, RetriableError):
    code = ErrorCode.METADATA_ERROR
    meaning = "the PM's metadata store failed; retry"


class FencedLeaderError(ServerFaultError, RedirectError):
    code = ErrorCode.FENCED_LEADER
    meaning = "the PM lost its leadership while writing"


# ---- 80-83 security


class AuthenticationRequiredError(RequestError, FatalError):
    code = ErrorCode.AUTHENTICATION_REQUIRED
    meaning = "auth is on: authenticate (AUTHENTICATE) before anything but PING"


class AuthorizationFailedError(RequestError, FatalError):
    code = ErrorCode.AUTHORIZATION_FAILED
    meaning = "the principal's ACLs do not allow this operation on this resource"


class TokenExpiredError(RequestError, RetriableError):
    code = ErrorCode.TOKEN_EXPIRED
    meaning = "the connection's token expired: authenticate again, then retry"


class AuthenticationFailedError(RequestError, FatalError):
    code = ErrorCode.AUTHENTICATION_FAILED
    meaning = "unknown user, wrong password, or a forged token"


# ---- 84-89 consumer groups


class IllegalGenerationError(RequestError, FatalError):
    code = ErrorCode.ILLEGAL_GENERATION
    meaning = ("the member's generation is not the group's, or the stream is not assigned to it; "
               "heartbeat for the current generation before committing again")


class UnknownMemberError(RequestError, FatalError):
    code = ErrorCode.UNKNOWN_MEMBER
    meaning = "no such member in the group (it left or missed its session timeout); rejoin"


class GroupNotEmptyError(RequestError, FatalError):
    code = ErrorCode.GROUP_NOT_EMPTY
    meaning = "the group has live members; stop them first"


# ---- 90-119 client side only


class ConnectionClosedError(ClientSideError, RetriableError):
    code = ClientErrorCode.CONNECTION_CLOSED
    meaning = "the connection closed before the response"


class ClientTimeoutError(ClientSideError, RetriableError):
    code = ClientErrorCode.CLIENT_TIMEOUT
    meaning = "no response within the client's timeout"


class NoPmReachableError(ClientSideError, RetriableError):
    code = ClientErrorCode.NO_PM_REACHABLE
    meaning = "no placement manager could be reached"


class ProtocolViolationError(ClientSideError, FatalError):
    code = ClientErrorCode.PROTOCOL_VIOLATION
    meaning = "the peer broke the framing rules"


class ClientClosedError(ClientSideError, FatalError):
    code = ClientErrorCode.CLIENT_CLOSED
    meaning = "the client was closed; create a new one"


class ProducerClosedError(ClientSideError, FatalError):
    code = ClientErrorCode.PRODUCER_CLOSED
    meaning = "the producer was closed; nothing more can be sent"


# ---- the table, derived from the classes above

def concrete_errors() -> list[type[SbpError]]:
    """Every class below SbpError that sets its own code (the groups do not), once each."""
    seen: dict[type[SbpError], None] = {}
    todo = list(SbpError.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue  # reached again through its other base
        seen[cls] = None
        todo.extend(cls.__subclasses__())
    return [c for c in seen if "code" in vars(c)]


def build_table(classes: Iterable[type[SbpError]]) -> dict[int, type[SbpError]]:
    """Code to class; raises AssertionError when two classes claim one code."""
    table: dict[int, type[SbpError]] = {}
    for cls in classes:
        if cls.code in table:
            raise AssertionError(
                f"duplicate error class for {cls.code!r}: {cls} and {table[cls.code]}"
            )
        table[cls.code] = cls
    return table


ERRORS: Final[Mapping[int, type[SbpError]]] = build_table(concrete_errors())
"""Code (an :class:`ErrorCode` or :class:`ClientErrorCode` member) to its class."""


def error_class(code: int) -> type[SbpError]:
    """The exception class for a code; unknown codes map to UnknownServerError."""
    return ERRORS.get(code, UnknownServerError)


def error_for(code: int, message: str = "", detail: bytes = b"") -> SbpError:
    cls = error_class(code)
    if cls is UnknownServerError and code != ErrorCode.UNKNOWN:
        message = f"unknown error code {code}: {message}"
    return cls(message, detail)


def kind_of(code: int) -> ErrorKind:
    if code == ErrorCode.NONE:
        return ErrorKind.NONE
    return error_class(code).kind


def code_name(code: int) -> str:
    """The name of a wire or client-side code (``NONE`` for 0), or ``code N`` when unknown."""
    if code == ErrorCode.NONE:
        return ErrorCode.NONE.name
    cls = ERRORS.get(code)
    return cls.code.name if cls is not None else f"code {code}"
