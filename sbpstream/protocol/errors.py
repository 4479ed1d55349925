"""The one error table of SBP (design.md section 2, "Error codes"). No I/O.

Every wire code has a name, a meaning and a kind: RETRIABLE (the same request may succeed later,
possibly after refreshing metadata), REDIRECT (send it elsewhere: ``detail`` says where) or FATAL
(retrying cannot help). Each code has exactly one exception class; the table below is *derived*
from the classes, refuses duplicates, and maps unknown codes to :class:`UnknownServerError`.
Codes are added, never renumbered.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final


class ErrorKind(enum.Enum):
    NONE = "none"
    RETRIABLE = "retriable"
    REDIRECT = "redirect"
    FATAL = "fatal"


class ErrorCode(enum.IntEnum):
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
    # --- 60-89 placement manager
    NOT_ENOUGH_DATA_NODES = 60
    DATA_NODE_NOT_FOUND = 61
    INVALID_STREAM_CONFIG = 62
    METADATA_ERROR = 63
    FENCED_LEADER = 64
    # --- 90-119 client side only (never on the wire)
    CONNECTION_CLOSED = 90
    CLIENT_TIMEOUT = 91
    NO_PM_REACHABLE = 92
    PROTOCOL_VIOLATION = 93
    CLIENT_CLOSED = 94
    PRODUCER_CLOSED = 95


class SbpError(Exception):
    """Base of every SBP error. ``code`` is the wire code; ``kind`` says whether to retry."""

    code: ClassVar[ErrorCode] = ErrorCode.UNKNOWN
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


def _err(
    name: str, code: ErrorCode, kind: ErrorKind, meaning: str, base: type[SbpError] = SbpError
) -> type[SbpError]:
    cls = type(name, (base,), {"code": code, "kind": kind, "meaning": meaning, "__doc__": meaning})
    return cls


_R, _D, _F = ErrorKind.RETRIABLE, ErrorKind.REDIRECT, ErrorKind.FATAL
C = ErrorCode

UnknownServerError = _err("UnknownServerError", C.UNKNOWN, _F, "an unexpected server error")
InvalidRequestError = _err("InvalidRequestError", C.INVALID_REQUEST, _F, "the request is invalid")
UnsupportedVersionError = _err(
    "UnsupportedVersionError", C.UNSUPPORTED_VERSION, _F, "the request's version is not supported"
)
PmNotLeaderError = _err(
    "PmNotLeaderError",
    C.PM_NOT_LEADER,
    _D,
    "this PM is not the leader; detail holds the leader's host:port (empty when unknown)",
)
UnsupportedOperationError = _err(
    "UnsupportedOperationError",
    C.UNSUPPORTED_OPERATION,
    _F,
    "this server's role does not serve the opcode",
)
ChecksumMismatchError = _err(
    "ChecksumMismatchError", C.CHECKSUM_MISMATCH, _R, "the frame payload CRC did not match"
)
LimitExceededError = _err(
    "LimitExceededError", C.LIMIT_EXCEEDED, _F, "a protocol or server limit was exceeded"
)
TimeoutError_ = _err("RequestTimeoutError", C.TIMEOUT, _R, "the server timed out the request")
BadHeaderError = _err(
    "BadHeaderError",
    C.BAD_HEADER,
    _F,
    "the extended header could not be decoded or has an unknown format",
)
ShuttingDownError = _err(
    "ShuttingDownError",
    C.SHUTTING_DOWN,
    _R,
    "the server is shutting down; retry elsewhere or later",
)
TooManyRequestsError = _err(
    "TooManyRequestsError", C.TOO_MANY_REQUESTS, _R, "too many requests in flight on the connection"
)
InternalError = _err("InternalError", C.INTERNAL_ERROR, _R, "the server failed internally")
ThrottledError = _err("ThrottledError", C.THROTTLED, _R, "a quota was exceeded; back off")
StreamNotFoundError = _err("StreamNotFoundError", C.STREAM_NOT_FOUND, _F, "no such stream")
StreamDeletedError = _err("StreamDeletedError", C.STREAM_DELETED, _F, "the stream was deleted")
RangeNotFoundError = _err(
    "RangeNotFoundError",
    C.RANGE_NOT_FOUND,
    _R,
    "the data node does not hold that range; refresh metadata",
)
RangeSealedError = _err(
    "RangeSealedError",
    C.RANGE_SEALED,
    _R,
    "the range is sealed; refresh metadata and write to the next range",
)
NotPrimaryError = _err(
    "NotPrimaryError", C.NOT_PRIMARY, _R, "this data node is not the range's primary"
)
OffsetOutOfRangeError = _err(
    "OffsetOutOfRangeError",
    C.OFFSET_OUT_OF_RANGE,
    _F,
    "the offset is outside the stream's or range's bounds",
)
OffsetMismatchError = _err(
    "OffsetMismatchError",
    C.OFFSET_MISMATCH,
    _F,
    "the batch does not start at the range's next offset",
)
CorruptBatchError = _err(
    "CorruptBatchError",
    C.CORRUPT_BATCH,
    _F,
    "the record batch failed its length, magic or CRC check",
)
OutOfOrderSequenceError = _err(
    "OutOfOrderSequenceError",
    C.OUT_OF_ORDER_SEQUENCE,
    _F,
    "an idempotent producer's sequence has a gap",
)
ReplicaUnavailableError = _err(
    "ReplicaUnavailableError",
    C.REPLICA_UNAVAILABLE,
    _R,
    "a replica could not be reached; the writer should seal and move on",
)
StorageFullError = _err("StorageFullError", C.STORAGE_FULL, _R, "the data node's disk is full")
StorageError = _err("StorageError", C.STORAGE_ERROR, _R, "the data node's storage failed")
RangeAlreadyExistsError = _err(
    "RangeAlreadyExistsError",
    C.RANGE_ALREADY_EXISTS,
    _F,
    "the range already exists with different bounds",
)
ProducerFencedError = _err(
    "ProducerFencedError", C.PRODUCER_FENCED, _F, "a newer epoch of this producer id exists"
)
OffsetTrimmedError = _err(
    "OffsetTrimmedError", C.OFFSET_TRIMMED, _F, "the records at that offset were trimmed away"
)
NotEnoughDataNodesError = _err(
    "NotEnoughDataNodesError",
    C.NOT_ENOUGH_DATA_NODES,
    _R,
    "not enough live data nodes for the requested replicas",
)
DataNodeNotFoundError = _err(
    "DataNodeNotFoundError", C.DATA_NODE_NOT_FOUND, _F, "no such data node"
)
InvalidStreamConfigError = _err(
    "InvalidStreamConfigError",
    C.INVALID_STREAM_CONFIG,
    _F,
    "replica_nums or retention_period_ms is invalid",
)
MetadataError = _err("MetadataError", C.METADATA_ERROR, _R, "the PM's metadata store failed; retry")
FencedLeaderError = _err(
    "FencedLeaderError", C.FENCED_LEADER, _D, "the PM lost its leadership while writing"
)
ConnectionClosedError = _err(
    "ConnectionClosedError", C.CONNECTION_CLOSED, _R, "the connection closed before the response"
)
ClientTimeoutError = _err(
    "ClientTimeoutError", C.CLIENT_TIMEOUT, _R, "no response within the client's timeout"
)
NoPmReachableError = _err(
    "NoPmReachableError", C.NO_PM_REACHABLE, _R, "no placement manager could be reached"
)
ProtocolViolationError = _err(
    "ProtocolViolationError", C.PROTOCOL_VIOLATION, _F, "the peer broke the framing rules"
)

ClientClosedError = _err(
    "ClientClosedError", C.CLIENT_CLOSED, _F, "the client was closed; create a new one"
)
ProducerClosedError = _err(
    "ProducerClosedError", C.PRODUCER_CLOSED, _F,
    "the producer was closed; nothing more can be sent",
)


def _build_table() -> dict[ErrorCode, type[SbpError]]:
    table: dict[ErrorCode, type[SbpError]] = {}
    for cls in _all_subclasses(SbpError):
        if cls.code in table:
            raise AssertionError(
                f"duplicate error class for {cls.code!r}: {cls} and {table[cls.code]}"
            )
        table[cls.code] = cls
    return table


def _all_subclasses(cls: type[SbpError]) -> list[type[SbpError]]:
    out: list[type[SbpError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS: Final[dict[ErrorCode, type[SbpError]]] = _build_table()


def error_class(code: int) -> type[SbpError]:
    """The exception class for a wire code; unknown codes map to UnknownServerError."""
    try:
        return ERRORS[ErrorCode(code)]
    except (ValueError, KeyError):
        return UnknownServerError


def error_for(code: int, message: str = "", detail: bytes = b"") -> SbpError:
    cls = error_class(code)
    if cls is UnknownServerError and code != ErrorCode.UNKNOWN:
        message = f"unknown error code {code}: {message}"
    return cls(message, detail)


def kind_of(code: int) -> ErrorKind:
    if code == ErrorCode.NONE:
        return ErrorKind.NONE
    return error_class(code).kind
