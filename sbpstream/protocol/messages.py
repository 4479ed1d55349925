"""Typed SBP extended headers: one frozen dataclass per request and response of every opcode.

The wire format is the FlatBuffers schema ``schema/sbp.fbs``; the code in ``fbs/`` is generated
from it by ``flatc --python`` and is not an API. This module is: every message has

- ``encode() -> bytes``: the extended header (a FlatBuffers table, no size prefix, no file
  identifier), and
- ``decode(buf) -> Self``: the inverse. An empty buffer (``header_length = 0``) gives every field
  its default; anything undecodable raises :class:`BadHeaderError`, a batched request naming more
  than :data:`MAX_ITEMS_PER_REQUEST` items raises :class:`LimitExceededError`. Nothing else.

Messages are plain data: no I/O, sequences are tuples. ``REQUESTS`` and ``RESPONSES`` map each
opcode to its class and are derived from :data:`MESSAGES`. Per-item results carry their own
:class:`Status`; an OK status (code 0, no message, no detail) is not written at all, so the common
case costs no bytes and decodes to the shared :data:`STATUS_OK`.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

import flatbuffers

from sbpstream.protocol.errors import (
    BadHeaderError,
    LimitExceededError,
    SbpError,
    error_for,
)
from sbpstream.protocol.fbs import sbp_generated as G
from sbpstream.protocol.opcodes import Opcode

__all__ = [
    "MAX_ITEMS_PER_REQUEST",
    "MESSAGES",
    "REQUESTS",
    "RESPONSES",
    "STATUS_OK",
    "AllocateIdRequest",
    "AllocateIdResponse",
    "AppendItem",
    "AppendRequest",
    "AppendResponse",
    "AppendResult",
    "BufferAckRequest",
    "BufferAckResponse",
    "ClientRole",
    "CreateStreamItem",
    "CreateStreamResult",
    "CreateStreamsRequest",
    "CreateStreamsResponse",
    "DataNode",
    "DeleteStreamsRequest",
    "DeleteStreamsResponse",
    "DescribeRangeItem",
    "DescribeRangeResult",
    "DescribeRangesRequest",
    "DescribeRangesResponse",
    "DescribeStreamsRequest",
    "DescribeStreamsResponse",
    "FetchItem",
    "FetchRequest",
    "FetchResponse",
    "FetchResult",
    "GoAway",
    "GoAwayResponse",
    "Header",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "ListRangesRequest",
    "ListRangesResponse",
    "ListRangesResult",
    "Message",
    "PingRequest",
    "PingResponse",
    "ProducerState",
    "Range",
    "RangeOwner",
    "ReplicaNode",
    "ReportMetricsRequest",
    "ReportMetricsResponse",
    "SealItem",
    "SealRangesRequest",
    "SealRangesResponse",
    "SealResult",
    "Status",
    "Stream",
    "StreamOwner",
    "StreamRanges",
    "StreamResult",
    "SyncRangesRequest",
    "SyncRangesResponse",
    "SyncResult",
    "SystemErrorResponse",
    "TrimItem",
    "TrimResult",
    "TrimStreamsRequest",
    "TrimStreamsResponse",
    "UpdateStreamsRequest",
    "UpdateStreamsResponse",
    "decode_request",
    "decode_response",
]

MAX_ITEMS_PER_REQUEST: Final = 10_000
"""Most items one batched request may name (appends, fetches, streams, ranges, stream ids).

Why: one header may be up to 16 MiB, enough to name about a million items, and a server does work
and keeps state per item; the bound caps what a single frame can make a server do or buffer. It is
far above real batches (an SDK batches tens to hundreds), and it is checked on decode, before any
item is built, and on encode, so a sender learns of it before the peer does.
"""

_INITIAL_BUILDER_BYTES: Final = 1024  # most headers fit; the builder doubles when they do not

# What FlatBuffers' Python runtime raises on a truncated or malformed buffer (it reads out of
# bounds, unpacks past the end, checks number ranges with TypeError); UnicodeDecodeError is a
# ValueError. All of them become BadHeaderError.
_DECODE_ERRORS: Final = (struct.error, IndexError, ValueError, TypeError, OverflowError)
# What the builder raises when a value does not fit its field (an int16 metric above 32767, ...).
_ENCODE_ERRORS: Final = (struct.error, TypeError, OverflowError)


class ClientRole(enum.IntEnum):
    """HEARTBEAT's client_role. Unknown values from newer peers decode as UNSPECIFIED."""

    UNSPECIFIED = 0
    DATA_NODE = 1
    CLIENT = 2


# ----------------------------------------------------------------------------------------- helpers


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8") if raw else ""


def _ubytes(tab: Any, voffset: int) -> bytes:
    """A ``[ubyte]`` field as bytes, in one slice (the generated accessor reads byte by byte)."""
    o = tab.Offset(voffset)
    if not o:
        return b""
    start = tab.Vector(o)
    n = tab.VectorLen(o)
    buf = tab.Bytes
    if start + n > len(buf):
        raise BadHeaderError(f"a byte vector of {n} bytes overruns the {len(buf)}-byte header")
    return bytes(buf[start : start + n])


def _count(n: int, obj: Any, width: int = 4) -> int:
    """Check that a vector of ``n`` elements of ``width`` bytes can fit in the buffer at all.

    Cheap, and it keeps garbage lengths (up to 2**32) from driving a long loop.
    """
    size = len(obj._tab.Bytes)
    if n * width > size:
        raise BadHeaderError(f"a vector of {n} elements does not fit in the {size}-byte header")
    return n


def _items(n: int, obj: Any, width: int = 4) -> int:
    """:func:`_count` plus the bound on a batched request's items."""
    _count(n, obj, width)
    if n > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(
            f"{n} items in one request; at most {MAX_ITEMS_PER_REQUEST} are accepted"
        )
    return n


def _check_items(items: Sequence[object]) -> None:
    if len(items) > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(
            f"{len(items)} items in one request; at most {MAX_ITEMS_PER_REQUEST} are accepted"
        )


# Hot path: the items of APPEND and FETCH headers are read with struct directly (one vtable read
# per item, one unpack per present field), about ten times faster than the generated accessors,
# which re-read the vtable for every field. The round-trip tests pin them to the schema.
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I64 = struct.Struct("<q").unpack_from
_VTABLE_ENTRIES: Final[tuple[struct.Struct, ...]] = tuple(struct.Struct(f"<{n}H") for n in range(8))


def _slots(buf: Any, pos: int, count: int) -> tuple[int, ...]:
    """Offsets (0 = absent) of the first ``count`` fields of the table at ``pos``."""
    vtable = pos - _I32(buf, pos)[0]
    if vtable < 0:  # struct would read from the end of the buffer
        raise BadHeaderError(f"a vtable at {vtable} lies before the header")
    n: int = min(count, (_U16(buf, vtable)[0] - 4) >> 1)
    if n == count:
        full: tuple[int, ...] = _VTABLE_ENTRIES[count].unpack_from(buf, vtable + 4)
        return full
    if n <= 0:
        return (0,) * count
    entries: tuple[int, ...] = _VTABLE_ENTRIES[n].unpack_from(buf, vtable + 4)
    return entries + (0,) * (count - n)


def _table_vector(t: Any, voffset: int, request: bool) -> list[int]:
    """Positions of the tables in the vector field at vtable offset ``voffset`` of view ``t``."""
    tab = t._tab
    o = tab.Offset(voffset)
    if not o:
        return []
    start = tab.Vector(o)
    n = tab.VectorLen(o)
    if request:
        _items(n, t)
    else:
        _count(n, t)
    buf = tab.Bytes
    return [e + _U32(buf, e)[0] for e in range(start, start + 4 * n, 4)]


def _status_at(buf: Any, field: int) -> Status:
    view = G.Status()
    view.Init(buf, field + _U32(buf, field)[0])
    return Status._read(view)


class _FixedTable:
    """The layout of a scalar item table written whole: one ``struct.pack`` per item.

    The builder spends about ten Python calls per field; for the hundred items of an APPEND or
    FETCH header, :func:`_put_fixed_vector` instead writes the vector, a vtable shared by every
    item and the items, every scalar field present (defaults included), as one block.

    ``row`` is the table's struct format: the soffset to the vtable, then the fields in layout
    order (int64s first, so that a table starting at 4 mod 8 has them 8-aligned), then, for result
    items, the status's uoffset. ``fields`` maps each schema slot, by index, to its offset in the
    table. Items whose status is OK use a vtable without the status field (it reads as absent, so
    as OK); the others use a second vtable with it.
    """

    __slots__ = ("row", "size", "status_at", "vtable", "vtable_status")

    def __init__(self, row: str, fields: tuple[int, ...], status_slot: int = -1) -> None:
        inline = struct.calcsize(row)
        self.row = struct.Struct(f"{row}{-inline % 8}x")  # pad: the next table at 4 mod 8 too
        self.size = self.row.size
        assert row.startswith("<i") and all(4 <= f < inline for f in fields), row
        head = (4 + 2 * len(fields), inline)
        self.status_at = fields[status_slot] if status_slot >= 0 else 0
        ok = tuple(0 if slot == status_slot else f for slot, f in enumerate(fields))
        self.vtable = struct.pack(f"<{2 + len(fields)}H", *head, *ok)
        self.vtable_status = struct.pack(f"<{2 + len(fields)}H", *head, *fields)


def _put_fixed_vector(
    b: Any,
    layout: _FixedTable,
    rows: Sequence[tuple[int, ...]],
    statuses: Sequence[Status] | None = None,
) -> int:
    """Write a vector of ``rows`` (field values in layout order); returns its builder offset.

    ``statuses`` (result items only) are the items' statuses: the OK ones are not written, the
    others are built first, so that they lie after the block, where uoffsets can reach them.
    """
    n = len(rows)
    if n == 0:
        return 0
    errors = [0] * n if statuses is None else [0 if _is_ok(s) else s._build(b) for s in statuses]
    # The block starts 8-aligned: [n][n uoffsets][vtable][vtable with status, if needed][pad]
    # [table 0 (at 4 mod 8)][table 1]...
    vtable_at = 4 + 4 * n
    vtable_status_at = vtable_at + len(layout.vtable)
    first = vtable_status_at + (len(layout.vtable_status) if any(errors) else 0)
    first += (4 - first) % 8
    size = layout.size
    total = first + n * size
    b.assertNotNested()
    b.Prep(8, total)  # aligns the block's end, hence its start
    base = b.Offset() + total  # the block's start, counted from the end like builder offsets
    parts = [
        struct.pack(f"<{n + 1}I", n, *range(first - 4, first - 4 + n * (size - 4), size - 4)),
        layout.vtable,
        layout.vtable_status if any(errors) else b"",
    ]
    parts.append(bytes(first - sum(map(len, parts))))
    pack, pos = layout.row.pack, first
    if statuses is None:
        for row in rows:
            parts.append(pack(pos - vtable_at, *row))
            pos += size
    else:
        for row, error in zip(rows, errors, strict=True):
            if error:  # a uoffset to the status built above: from base - field to error
                parts.append(
                    pack(pos - vtable_status_at, *row, base - pos - layout.status_at - error)
                )
            else:
                parts.append(pack(pos - vtable_at, *row, 0))
            pos += size
    block = b"".join(parts)
    assert len(block) == total
    head = b.head - total
    b.Bytes[head : b.head] = block
    b.head = head
    return int(b.Offset())


def _put_str(b: Any, s: str) -> int:
    # 0 means "absent": the generated Add* functions skip an offset equal to the default 0.
    return b.CreateString(s) if s else 0


def _put_tables(b: Any, items: Sequence[_Table]) -> int:
    if not items:
        return 0
    offsets = [item._build(b) for item in items]
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _put_int64s(b: Any, values: Sequence[int]) -> int:
    if not values:
        return 0
    b.StartVector(8, len(values), 8)
    for v in reversed(values):
        b.PrependInt64(v)
    return int(b.EndVector())


def _put_opt(b: Any, value: _Table | None) -> int:
    return 0 if value is None else value._build(b)


def _is_ok(st: Status) -> bool:
    return st is STATUS_OK or (st.code == 0 and not st.message and not st.detail)


def _put_status(b: Any, st: Status) -> int:
    # An OK status is not written: it costs no bytes and decodes to STATUS_OK.
    return 0 if _is_ok(st) else st._build(b)


def _role(value: int) -> ClientRole:
    try:
        return ClientRole(value)
    except ValueError:
        return ClientRole.UNSPECIFIED


# ------------------------------------------------------------------------------------------- bases


class _Table:
    """A FlatBuffers table: ``_build`` writes it to a builder, ``_read`` reads a generated view."""

    __slots__ = ()

    def _build(self, b: Any) -> int:
        raise NotImplementedError

    @classmethod
    def _read(cls, t: Any) -> Self:
        raise NotImplementedError


class Header(_Table):
    """A table that is a whole extended header: it encodes to and decodes from bytes."""

    __slots__ = ()
    _FB: ClassVar[Any]  # the generated reader class of this table

    def encode(self) -> bytes:
        b = flatbuffers.Builder(_INITIAL_BUILDER_BYTES)
        try:
            b.Finish(self._build(b))
        except _ENCODE_ERRORS as exc:
            raise ValueError(f"cannot encode {type(self).__name__}: {exc}") from exc
        return bytes(b.Output())

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> Self:
        if len(buf) == 0:  # header_length = 0: every field at its default
            return cls()
        try:
            return cls._read(cls._FB.GetRootAs(buf, 0))
        except _DECODE_ERRORS as exc:
            raise BadHeaderError(f"undecodable {cls.__name__} header: {exc!r}") from exc


class Message(Header):
    """The header of one opcode's request or response."""

    __slots__ = ()
    OPCODE: ClassVar[Opcode]
    IS_RESPONSE: ClassVar[bool]


# ----------------------------------------------------------------------------------- shared values


@dataclass(frozen=True, slots=True)
class Status(_Table):
    """A result: ``code`` is an :class:`~sbpstream.protocol.errors.ErrorCode` value (0 = OK)."""

    code: int = 0
    message: str = ""
    detail: bytes = b""

    @property
    def ok(self) -> bool:
        return self.code == 0

    def error(self) -> SbpError:
        """The exception for this status (unknown codes give UnknownServerError)."""
        return error_for(self.code, self.message, self.detail)

    def raise_for_error(self) -> None:
        if self.code != 0:
            raise self.error()

    @classmethod
    def of(cls, exc: SbpError) -> Status:
        return cls(int(exc.code), exc.message, exc.detail)

    def _build(self, b: Any) -> int:
        message = _put_str(b, self.message)
        detail = b.CreateByteVector(self.detail) if self.detail else 0
        G.StatusStart(b)
        G.StatusAddCode(b, self.code)
        G.StatusAddMessage(b, message)
        G.StatusAddDetail(b, detail)
        return int(G.StatusEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.Code(), _text(t.Message()), _ubytes(t._tab, 8))


STATUS_OK: Final = Status()


def _status(t: Any) -> Status:
    return STATUS_OK if t is None else Status._read(t)


@dataclass(frozen=True, slots=True)
class DataNode(_Table):
    node_id: int = 0
    advertise_addr: str = ""  # host:port

    def _build(self, b: Any) -> int:
        addr = _put_str(b, self.advertise_addr)
        G.DataNodeStart(b)
        G.DataNodeAddNodeId(b, self.node_id)
        G.DataNodeAddAdvertiseAddr(b, addr)
        return int(G.DataNodeEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.NodeId(), _text(t.AdvertiseAddr()))


def _data_node(t: Any) -> DataNode | None:
    return None if t is None else DataNode._read(t)


@dataclass(frozen=True, slots=True)
class ReplicaNode(_Table):
    data_node: DataNode = DataNode()
    is_primary: bool = False

    def _build(self, b: Any) -> int:
        node = self.data_node._build(b)
        G.ReplicaNodeStart(b)
        G.ReplicaNodeAddDataNode(b, node)
        G.ReplicaNodeAddIsPrimary(b, self.is_primary)
        return int(G.ReplicaNodeEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        node = t.DataNode()
        return cls(DataNode() if node is None else DataNode._read(node), bool(t.IsPrimary()))


@dataclass(frozen=True, slots=True)
class Range(_Table):
    """``[start_offset, end_offset)`` of a stream; ``end_offset = -1`` while writable."""

    stream_id: int = 0
    range_index: int = 0
    start_offset: int = 0
    next_offset: int = 0
    end_offset: int = -1
    replica_nodes: tuple[ReplicaNode, ...] = ()

    @property
    def sealed(self) -> bool:
        return self.end_offset >= 0

    def _build(self, b: Any) -> int:
        replicas = _put_tables(b, self.replica_nodes)
        G.RangeStart(b)
        G.RangeAddStreamId(b, self.stream_id)
        G.RangeAddRangeIndex(b, self.range_index)
        G.RangeAddStartOffset(b, self.start_offset)
        G.RangeAddNextOffset(b, self.next_offset)
        G.RangeAddEndOffset(b, self.end_offset)
        G.RangeAddReplicaNodes(b, replicas)
        return int(G.RangeEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.ReplicaNodesLength(), t)
        return cls(
            t.StreamId(),
            t.RangeIndex(),
            t.StartOffset(),
            t.NextOffset(),
            t.EndOffset(),
            tuple([ReplicaNode._read(t.ReplicaNodes(j)) for j in range(n)]),
        )


def _range(t: Any) -> Range | None:
    return None if t is None else Range._read(t)


def _ranges(t: Any) -> tuple[Range, ...]:
    n = _count(t.RangesLength(), t)
    return tuple([Range._read(t.Ranges(j)) for j in range(n)])


@dataclass(frozen=True, slots=True)
class Stream(_Table):
    stream_id: int = 0
    replica_nums: int = 0
    retention_period_ms: int = 0
    start_offset: int = 0  # project: the trim point

    def _build(self, b: Any) -> int:
        G.StreamStart(b)
        G.StreamAddStreamId(b, self.stream_id)
        G.StreamAddReplicaNums(b, self.replica_nums)
        G.StreamAddRetentionPeriodMs(b, self.retention_period_ms)
        G.StreamAddStartOffset(b, self.start_offset)
        return int(G.StreamEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), t.ReplicaNums(), t.RetentionPeriodMs(), t.StartOffset())


def _stream(t: Any) -> Stream | None:
    return None if t is None else Stream._read(t)


@dataclass(frozen=True, slots=True)
class ProducerState(_Table):
    """The highest sequence one idempotent producer reached in a sealed range."""

    producer_id: int = -1
    producer_epoch: int = -1
    last_sequence: int = -1
    last_base_offset: int = -1

    def _build(self, b: Any) -> int:
        G.ProducerStateStart(b)
        G.ProducerStateAddProducerId(b, self.producer_id)
        G.ProducerStateAddProducerEpoch(b, self.producer_epoch)
        G.ProducerStateAddLastSequence(b, self.last_sequence)
        G.ProducerStateAddLastBaseOffset(b, self.last_base_offset)
        return int(G.ProducerStateEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.ProducerId(), t.ProducerEpoch(), t.LastSequence(), t.LastBaseOffset())


@dataclass(frozen=True, slots=True)
class StreamOwner(_Table):
    """LIST_RANGES by stream."""

    stream_id: int = 0

    def _build(self, b: Any) -> int:
        G.StreamOwnerStart(b)
        G.StreamOwnerAddStreamId(b, self.stream_id)
        return int(G.StreamOwnerEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId())


RangeOwner = StreamOwner | DataNode
"""LIST_RANGES lists the ranges of a stream (StreamOwner) or of every stream on a data node."""


def _put_owner(b: Any, owner: RangeOwner) -> int:
    off = owner._build(b)
    kind = G.RangeOwner.StreamOwner if isinstance(owner, StreamOwner) else G.RangeOwner.DataNode
    G.RangeOwnerEntryStart(b)
    G.RangeOwnerEntryAddOwnerType(b, kind)
    G.RangeOwnerEntryAddOwner(b, off)
    return int(G.RangeOwnerEntryEnd(b))


def _read_owner(entry: Any) -> RangeOwner:
    kind = entry.OwnerType()
    tab = entry.Owner()
    if tab is None:
        raise BadHeaderError("a LIST_RANGES owner entry has no owner")
    view: Any
    if kind == G.RangeOwner.StreamOwner:
        view = G.StreamOwner()
        view.Init(tab.Bytes, tab.Pos)
        return StreamOwner._read(view)
    if kind == G.RangeOwner.DataNode:
        view = G.DataNode()
        view.Init(tab.Bytes, tab.Pos)
        return DataNode._read(view)
    raise BadHeaderError(f"unknown LIST_RANGES owner type {kind}")


# ------------------------------------------------------------------------------------ system error


@dataclass(frozen=True, slots=True)
class SystemErrorResponse(Header):
    """The header of a system error frame (flags 0x07), for any opcode."""

    _FB = G.SystemErrorResponse
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.SystemErrorResponseStart(b)
        G.SystemErrorResponseAddStatus(b, status)
        return int(G.SystemErrorResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_status(t.Status()))


# ------------------------------------------------------------------------------------ PING, GOAWAY


@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """PING carries no fields; PONG echoes the request's header bytes undecoded."""

    OPCODE = Opcode.PING
    IS_RESPONSE = False
    _FB = G.PingRequest

    def _build(self, b: Any) -> int:
        G.PingRequestStart(b)
        return int(G.PingRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class PingResponse(Message):
    OPCODE = Opcode.PING
    IS_RESPONSE = True
    _FB = G.PingResponse

    def _build(self, b: Any) -> int:
        G.PingResponseStart(b)
        return int(G.PingResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class GoAway(Message):
    """Sent by either side on stream id 0; the sender finishes requests up to last_stream_id."""

    OPCODE = Opcode.GOAWAY
    IS_RESPONSE = False
    _FB = G.GoAway
    code: int = 0
    message: str = ""
    last_stream_id: int = 0x7FFF_FFFF  # default: every request already sent will be finished

    def _build(self, b: Any) -> int:
        message = _put_str(b, self.message)
        G.GoAwayStart(b)
        G.GoAwayAddCode(b, self.code)
        G.GoAwayAddMessage(b, message)
        G.GoAwayAddLastStreamId(b, self.last_stream_id)
        return int(G.GoAwayEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.Code(), _text(t.Message()), t.LastStreamId())


@dataclass(frozen=True, slots=True)
class GoAwayResponse(Message):
    """Never sent (GOAWAY is not answered); it exists so every opcode has a response table."""

    OPCODE = Opcode.GOAWAY
    IS_RESPONSE = True
    _FB = G.GoAwayResponse
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.GoAwayResponseStart(b)
        G.GoAwayResponseAddStatus(b, status)
        return int(G.GoAwayResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_status(t.Status()))


# --------------------------------------------------------------------------------------- HEARTBEAT


@dataclass(frozen=True, slots=True)
class HeartbeatRequest(Message):
    OPCODE = Opcode.HEARTBEAT
    IS_RESPONSE = False
    _FB = G.HeartbeatRequest
    client_id: str = ""
    client_role: ClientRole = ClientRole.UNSPECIFIED
    data_node: DataNode | None = None  # None for SDK clients

    def _build(self, b: Any) -> int:
        client_id = _put_str(b, self.client_id)
        node = _put_opt(b, self.data_node)
        G.HeartbeatRequestStart(b)
        G.HeartbeatRequestAddClientId(b, client_id)
        G.HeartbeatRequestAddClientRole(b, self.client_role)
        G.HeartbeatRequestAddDataNode(b, node)
        return int(G.HeartbeatRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_text(t.ClientId()), _role(t.ClientRole()), _data_node(t.DataNode()))


@dataclass(frozen=True, slots=True)
class HeartbeatResponse(Message):
    OPCODE = Opcode.HEARTBEAT
    IS_RESPONSE = True
    _FB = G.HeartbeatResponse
    client_id: str = ""
    client_role: ClientRole = ClientRole.UNSPECIFIED
    data_node: DataNode | None = None
    status: Status = STATUS_OK  # PM_NOT_LEADER: detail = the leader's host:port

    def _build(self, b: Any) -> int:
        client_id = _put_str(b, self.client_id)
        node = _put_opt(b, self.data_node)
        status = _put_status(b, self.status)
        G.HeartbeatResponseStart(b)
        G.HeartbeatResponseAddClientId(b, client_id)
        G.HeartbeatResponseAddClientRole(b, self.client_role)
        G.HeartbeatResponseAddDataNode(b, node)
        G.HeartbeatResponseAddStatus(b, status)
        return int(G.HeartbeatResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(
            _text(t.ClientId()),
            _role(t.ClientRole()),
            _data_node(t.DataNode()),
            _status(t.Status()),
        )


# ------------------------------------------------------------------------------------- ALLOCATE_ID


@dataclass(frozen=True, slots=True)
class AllocateIdRequest(Message):
    OPCODE = Opcode.ALLOCATE_ID
    IS_RESPONSE = False
    _FB = G.AllocateIdRequest
    timeout_ms: int = 0
    host: str = ""

    def _build(self, b: Any) -> int:
        host = _put_str(b, self.host)
        G.AllocateIdRequestStart(b)
        G.AllocateIdRequestAddTimeoutMs(b, self.timeout_ms)
        G.AllocateIdRequestAddHost(b, host)
        return int(G.AllocateIdRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.TimeoutMs(), _text(t.Host()))


@dataclass(frozen=True, slots=True)
class AllocateIdResponse(Message):
    OPCODE = Opcode.ALLOCATE_ID
    IS_RESPONSE = True
    _FB = G.AllocateIdResponse
    id: int = -1  # a data node id (int32); -1 = none allocated
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.AllocateIdResponseStart(b)
        G.AllocateIdResponseAddId(b, self.id)
        G.AllocateIdResponseAddStatus(b, status)
        return int(G.AllocateIdResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.Id(), _status(t.Status()))


# ------------------------------------------------------------------------------------------ APPEND


@dataclass(frozen=True, slots=True)
class AppendItem(_Table):
    """One record batch of the payload: ``batch_length`` bytes, in item order."""

    stream_id: int = 0
    request_index: int = 0
    batch_length: int = 0
    range_index: int = -1  # project: -1 = the stream's writable range

    def _build(self, b: Any) -> int:
        G.AppendItemStart(b)
        G.AppendItemAddStreamId(b, self.stream_id)
        G.AppendItemAddRequestIndex(b, self.request_index)
        G.AppendItemAddBatchLength(b, self.batch_length)
        G.AppendItemAddRangeIndex(b, self.range_index)
        return int(G.AppendItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls._read_at(t._tab.Bytes, t._tab.Pos)

    @classmethod
    def _read_at(cls, buf: Any, pos: int) -> Self:
        o0, o1, o2, o3 = _slots(buf, pos, 4)
        return cls(
            _I64(buf, pos + o0)[0] if o0 else 0,
            _I32(buf, pos + o1)[0] if o1 else 0,
            _I32(buf, pos + o2)[0] if o2 else 0,
            _I32(buf, pos + o3)[0] if o3 else -1,
        )


# stream_id@4 request_index@12 batch_length@16 range_index@20; 24 bytes.
_APPEND_ITEM: Final = _FixedTable("<iqiii", (4, 12, 16, 20))


@dataclass(frozen=True, slots=True)
class AppendRequest(Message):
    OPCODE = Opcode.APPEND
    IS_RESPONSE = False
    _FB = G.AppendRequest
    timeout_ms: int = 0
    items: tuple[AppendItem, ...] = ()  # the spec's append_requests
    replication: bool = False  # project: primary -> secondary, base offsets already assigned
    committed_offset: int = -1  # project: the primary's committed offset (replication only)

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        rows = [(i.stream_id, i.request_index, i.batch_length, i.range_index) for i in self.items]
        items = _put_fixed_vector(b, _APPEND_ITEM, rows)
        G.AppendRequestStart(b)
        G.AppendRequestAddTimeoutMs(b, self.timeout_ms)
        G.AppendRequestAddAppendRequests(b, items)
        G.AppendRequestAddReplication(b, self.replication)
        G.AppendRequestAddCommittedOffset(b, self.committed_offset)
        return int(G.AppendRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        buf, read = t._tab.Bytes, AppendItem._read_at
        return cls(
            t.TimeoutMs(),
            tuple([read(buf, pos) for pos in _table_vector(t, 6, request=True)]),
            bool(t.Replication()),
            t.CommittedOffset(),
        )


@dataclass(frozen=True, slots=True)
class AppendResult(_Table):
    stream_id: int = 0
    request_index: int = 0
    base_offset: int = -1  # -1 = not appended
    stream_append_time_ms: int = 0
    status: Status = STATUS_OK
    next_offset: int = -1  # project: the offset after the batch

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.AppendResultStart(b)
        G.AppendResultAddStreamId(b, self.stream_id)
        G.AppendResultAddRequestIndex(b, self.request_index)
        G.AppendResultAddBaseOffset(b, self.base_offset)
        G.AppendResultAddStreamAppendTimeMs(b, self.stream_append_time_ms)
        G.AppendResultAddStatus(b, status)
        G.AppendResultAddNextOffset(b, self.next_offset)
        return int(G.AppendResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls._read_at(t._tab.Bytes, t._tab.Pos)

    @classmethod
    def _read_at(cls, buf: Any, pos: int) -> Self:
        o0, o1, o2, o3, o4, o5 = _slots(buf, pos, 6)
        return cls(
            _I64(buf, pos + o0)[0] if o0 else 0,
            _I32(buf, pos + o1)[0] if o1 else 0,
            _I64(buf, pos + o2)[0] if o2 else -1,
            _I64(buf, pos + o3)[0] if o3 else 0,
            _status_at(buf, pos + o4) if o4 else STATUS_OK,
            _I64(buf, pos + o5)[0] if o5 else -1,
        )


# stream_id@4 base_offset@12 stream_append_time_ms@20 next_offset@28 request_index@36
# status@40 (a uoffset); 44 bytes + 4 of padding.
_APPEND_RESULT: Final = _FixedTable("<iqqqqiI", (4, 36, 12, 20, 40, 28), status_slot=4)


@dataclass(frozen=True, slots=True)
class AppendResponse(Message):
    OPCODE = Opcode.APPEND
    IS_RESPONSE = True
    _FB = G.AppendResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[AppendResult, ...] = ()  # the spec's append_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        rows = [
            (i.stream_id, i.base_offset, i.stream_append_time_ms, i.next_offset, i.request_index)
            for i in self.items
        ]
        items = _put_fixed_vector(b, _APPEND_RESULT, rows, [i.status for i in self.items])
        G.AppendResponseStart(b)
        G.AppendResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.AppendResponseAddStatus(b, status)
        G.AppendResponseAddAppendResponses(b, items)
        return int(G.AppendResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        buf, read = t._tab.Bytes, AppendResult._read_at
        items = tuple([read(buf, pos) for pos in _table_vector(t, 8, request=False)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ------------------------------------------------------------------------------------------- FETCH


@dataclass(frozen=True, slots=True)
class FetchItem(_Table):
    stream_id: int = 0
    request_index: int = 0
    fetch_offset: int = 0
    batch_max_bytes: int = 0
    range_index: int = -1  # project: -1 = whichever range holds fetch_offset

    def _build(self, b: Any) -> int:
        G.FetchItemStart(b)
        G.FetchItemAddStreamId(b, self.stream_id)
        G.FetchItemAddRequestIndex(b, self.request_index)
        G.FetchItemAddFetchOffset(b, self.fetch_offset)
        G.FetchItemAddBatchMaxBytes(b, self.batch_max_bytes)
        G.FetchItemAddRangeIndex(b, self.range_index)
        return int(G.FetchItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls._read_at(t._tab.Bytes, t._tab.Pos)

    @classmethod
    def _read_at(cls, buf: Any, pos: int) -> Self:
        o0, o1, o2, o3, o4 = _slots(buf, pos, 5)
        return cls(
            _I64(buf, pos + o0)[0] if o0 else 0,
            _I32(buf, pos + o1)[0] if o1 else 0,
            _I64(buf, pos + o2)[0] if o2 else 0,
            _I32(buf, pos + o3)[0] if o3 else 0,
            _I32(buf, pos + o4)[0] if o4 else -1,
        )


# stream_id@4 fetch_offset@12 request_index@20 batch_max_bytes@24 range_index@28; 32 bytes.
_FETCH_ITEM: Final = _FixedTable("<iqqiii", (4, 20, 12, 24, 28))


@dataclass(frozen=True, slots=True)
class FetchRequest(Message):
    OPCODE = Opcode.FETCH
    IS_RESPONSE = False
    _FB = G.FetchRequest
    max_wait_ms: int = 0
    min_bytes: int = 0
    items: tuple[FetchItem, ...] = ()  # the spec's fetch_requests
    session_id: int = 0  # project (fetch sessions, later): 0 = no session
    session_epoch: int = -1  # project (fetch sessions, later)
    forgotten: tuple[int, ...] = ()  # project (fetch sessions, later): stream ids to drop
    window_bytes: int = 0  # project: > 0 = a subscription (flow control, BUFFER_ACK)

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        _check_items(self.forgotten)
        rows = [
            (i.stream_id, i.fetch_offset, i.request_index, i.batch_max_bytes, i.range_index)
            for i in self.items
        ]
        items = _put_fixed_vector(b, _FETCH_ITEM, rows)
        forgotten = _put_int64s(b, self.forgotten)
        G.FetchRequestStart(b)
        G.FetchRequestAddMaxWaitMs(b, self.max_wait_ms)
        G.FetchRequestAddMinBytes(b, self.min_bytes)
        G.FetchRequestAddFetchRequests(b, items)
        G.FetchRequestAddSessionId(b, self.session_id)
        G.FetchRequestAddSessionEpoch(b, self.session_epoch)
        G.FetchRequestAddForgotten(b, forgotten)
        G.FetchRequestAddWindowBytes(b, self.window_bytes)
        return int(G.FetchRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        buf, read = t._tab.Bytes, FetchItem._read_at
        n_forgotten = _items(t.ForgottenLength(), t, 8)
        return cls(
            t.MaxWaitMs(),
            t.MinBytes(),
            tuple([read(buf, pos) for pos in _table_vector(t, 8, request=True)]),
            t.SessionId(),
            t.SessionEpoch(),
            tuple([t.Forgotten(j) for j in range(n_forgotten)]),
            t.WindowBytes(),
        )


@dataclass(frozen=True, slots=True)
class FetchResult(_Table):
    """One stream's part of a response frame: ``batch_length`` payload bytes, in item order."""

    stream_id: int = 0
    request_index: int = 0
    batch_length: int = 0
    status: Status = STATUS_OK
    start_offset: int = -1  # project: the stream's first readable offset
    high_watermark: int = -1  # project: the committed end, the next offset readable
    range_end_offset: int = -1  # project: end of the sealed range served; -1 = writable

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.FetchResultStart(b)
        G.FetchResultAddStreamId(b, self.stream_id)
        G.FetchResultAddRequestIndex(b, self.request_index)
        G.FetchResultAddBatchLength(b, self.batch_length)
        G.FetchResultAddStatus(b, status)
        G.FetchResultAddStartOffset(b, self.start_offset)
        G.FetchResultAddHighWatermark(b, self.high_watermark)
        G.FetchResultAddRangeEndOffset(b, self.range_end_offset)
        return int(G.FetchResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls._read_at(t._tab.Bytes, t._tab.Pos)

    @classmethod
    def _read_at(cls, buf: Any, pos: int) -> Self:
        o0, o1, o2, o3, o4, o5, o6 = _slots(buf, pos, 7)
        return cls(
            _I64(buf, pos + o0)[0] if o0 else 0,
            _I32(buf, pos + o1)[0] if o1 else 0,
            _I32(buf, pos + o2)[0] if o2 else 0,
            _status_at(buf, pos + o3) if o3 else STATUS_OK,
            _I64(buf, pos + o4)[0] if o4 else -1,
            _I64(buf, pos + o5)[0] if o5 else -1,
            _I64(buf, pos + o6)[0] if o6 else -1,
        )


# stream_id@4 start_offset@12 high_watermark@20 range_end_offset@28 request_index@36
# batch_length@40 status@44 (a uoffset); 48 bytes.
_FETCH_RESULT: Final = _FixedTable("<iqqqqiiI", (4, 36, 40, 44, 12, 20, 28), status_slot=3)


@dataclass(frozen=True, slots=True)
class FetchResponse(Message):
    OPCODE = Opcode.FETCH
    IS_RESPONSE = True
    _FB = G.FetchResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[FetchResult, ...] = ()  # the spec's fetch_responses

    def chunks(
        self, payload: bytes | bytearray | memoryview
    ) -> Iterator[tuple[FetchResult, memoryview]]:
        """Each item with its slice of the frame's payload (the batches back to back, in item
        order, ``batch_length`` bytes each)."""
        mv = memoryview(payload)
        at = 0
        for item in self.items:
            yield item, mv[at : at + item.batch_length]
            at += item.batch_length

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        rows = [
            (
                i.stream_id,
                i.start_offset,
                i.high_watermark,
                i.range_end_offset,
                i.request_index,
                i.batch_length,
            )
            for i in self.items
        ]
        items = _put_fixed_vector(b, _FETCH_RESULT, rows, [i.status for i in self.items])
        G.FetchResponseStart(b)
        G.FetchResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.FetchResponseAddStatus(b, status)
        G.FetchResponseAddFetchResponses(b, items)
        return int(G.FetchResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        buf, read = t._tab.Bytes, FetchResult._read_at
        items = tuple([read(buf, pos) for pos in _table_vector(t, 8, request=False)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# -------------------------------------------------------------------------------------- BUFFER_ACK


@dataclass(frozen=True, slots=True)
class BufferAckRequest(Message):
    """Project opcode (flow control): the client has processed ``bytes_acked`` more payload
    bytes of the subscription ``fetch_request_id`` (its FETCH's request id on this connection);
    ``cancel`` ends that subscription instead."""

    OPCODE = Opcode.BUFFER_ACK
    IS_RESPONSE = False
    _FB = G.BufferAckRequest
    bytes_acked: int = 0
    fetch_request_id: int = -1  # project
    cancel: bool = False  # project

    def _build(self, b: Any) -> int:
        G.BufferAckRequestStart(b)
        G.BufferAckRequestAddBytesAcked(b, self.bytes_acked)
        G.BufferAckRequestAddFetchRequestId(b, self.fetch_request_id)
        G.BufferAckRequestAddCancel(b, self.cancel)
        return int(G.BufferAckRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.BytesAcked(), t.FetchRequestId(), bool(t.Cancel()))


@dataclass(frozen=True, slots=True)
class BufferAckResponse(Message):
    """The answer to every BUFFER_ACK: OK, or why the ack was refused (nothing changed then)."""

    OPCODE = Opcode.BUFFER_ACK
    IS_RESPONSE = True
    _FB = G.BufferAckResponse
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        G.BufferAckResponseStart(b)
        G.BufferAckResponseAddStatus(b, status)
        return int(G.BufferAckResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_status(t.Status()))


# ------------------------------------------------------------------------------------- LIST_RANGES


@dataclass(frozen=True, slots=True)
class ListRangesRequest(Message):
    OPCODE = Opcode.LIST_RANGES
    IS_RESPONSE = False
    _FB = G.ListRangesRequest
    timeout_ms: int = 0
    items: tuple[RangeOwner, ...] = ()  # the spec's range_owners

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        if self.items:
            offsets = [_put_owner(b, owner) for owner in self.items]
            b.StartVector(4, len(offsets), 4)
            for off in reversed(offsets):
                b.PrependUOffsetTRelative(off)
            owners = int(b.EndVector())
        else:
            owners = 0
        G.ListRangesRequestStart(b)
        G.ListRangesRequestAddTimeoutMs(b, self.timeout_ms)
        G.ListRangesRequestAddRangeOwners(b, owners)
        return int(G.ListRangesRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.RangeOwnersLength(), t)
        return cls(t.TimeoutMs(), tuple([_read_owner(t.RangeOwners(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class ListRangesResult(_Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        ranges = _put_tables(b, self.ranges)
        G.ListRangesResultStart(b)
        G.ListRangesResultAddStreamId(b, self.stream_id)
        G.ListRangesResultAddStatus(b, status)
        G.ListRangesResultAddRanges(b, ranges)
        return int(G.ListRangesResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), _status(t.Status()), _ranges(t))


@dataclass(frozen=True, slots=True)
class ListRangesResponse(Message):
    OPCODE = Opcode.LIST_RANGES
    IS_RESPONSE = True
    _FB = G.ListRangesResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[ListRangesResult, ...] = ()  # the spec's list_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.ListRangesResponseStart(b)
        G.ListRangesResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.ListRangesResponseAddStatus(b, status)
        G.ListRangesResponseAddListResponses(b, items)
        return int(G.ListRangesResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.ListResponsesLength(), t)
        items = tuple([ListRangesResult._read(t.ListResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ------------------------------------------------------------------------------------- SEAL_RANGES


@dataclass(frozen=True, slots=True)
class SealItem(_Table):
    stream_id: int = 0
    range_index: int = 0
    end_offset: int = -1  # project: -1 = stop and report your end; >= 0 = sealed at this end

    def _build(self, b: Any) -> int:
        G.SealItemStart(b)
        G.SealItemAddStreamId(b, self.stream_id)
        G.SealItemAddRangeIndex(b, self.range_index)
        G.SealItemAddEndOffset(b, self.end_offset)
        return int(G.SealItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), t.RangeIndex(), t.EndOffset())


@dataclass(frozen=True, slots=True)
class SealRangesRequest(Message):
    OPCODE = Opcode.SEAL_RANGES
    IS_RESPONSE = False
    _FB = G.SealRangesRequest
    timeout_ms: int = 0
    items: tuple[SealItem, ...] = ()  # the spec's ranges

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.SealRangesRequestStart(b)
        G.SealRangesRequestAddTimeoutMs(b, self.timeout_ms)
        G.SealRangesRequestAddRanges(b, items)
        return int(G.SealRangesRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.RangesLength(), t)
        return cls(t.TimeoutMs(), tuple([SealItem._read(t.Ranges(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class SealResult(_Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()  # DN: (sealed,); PM: (sealed, new writable)
    producers: tuple[ProducerState, ...] = ()  # project: highest sequence per producer

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        ranges = _put_tables(b, self.ranges)
        producers = _put_tables(b, self.producers)
        G.SealResultStart(b)
        G.SealResultAddStreamId(b, self.stream_id)
        G.SealResultAddStatus(b, status)
        G.SealResultAddRanges(b, ranges)
        G.SealResultAddProducers(b, producers)
        return int(G.SealResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.ProducersLength(), t)
        producers = tuple([ProducerState._read(t.Producers(j)) for j in range(n)])
        return cls(t.StreamId(), _status(t.Status()), _ranges(t), producers)


@dataclass(frozen=True, slots=True)
class SealRangesResponse(Message):
    OPCODE = Opcode.SEAL_RANGES
    IS_RESPONSE = True
    _FB = G.SealRangesResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[SealResult, ...] = ()  # the spec's seal_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.SealRangesResponseStart(b)
        G.SealRangesResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.SealRangesResponseAddStatus(b, status)
        G.SealRangesResponseAddSealResponses(b, items)
        return int(G.SealRangesResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.SealResponsesLength(), t)
        items = tuple([SealResult._read(t.SealResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ------------------------------------------------------------------------------------- SYNC_RANGES


@dataclass(frozen=True, slots=True)
class StreamRanges(_Table):
    stream_id: int = 0
    ranges: tuple[Range, ...] = ()

    def _build(self, b: Any) -> int:
        ranges = _put_tables(b, self.ranges)
        G.StreamRangesStart(b)
        G.StreamRangesAddStreamId(b, self.stream_id)
        G.StreamRangesAddRanges(b, ranges)
        return int(G.StreamRangesEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), _ranges(t))


@dataclass(frozen=True, slots=True)
class SyncRangesRequest(Message):
    OPCODE = Opcode.SYNC_RANGES
    IS_RESPONSE = False
    _FB = G.SyncRangesRequest
    timeout_ms: int = 0
    items: tuple[StreamRanges, ...] = ()  # the spec's stream_ranges

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.SyncRangesRequestStart(b)
        G.SyncRangesRequestAddTimeoutMs(b, self.timeout_ms)
        G.SyncRangesRequestAddStreamRanges(b, items)
        return int(G.SyncRangesRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.StreamRangesLength(), t)
        return cls(t.TimeoutMs(), tuple([StreamRanges._read(t.StreamRanges(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class SyncResult(_Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        ranges = _put_tables(b, self.ranges)
        G.SyncResultStart(b)
        G.SyncResultAddStreamId(b, self.stream_id)
        G.SyncResultAddStatus(b, status)
        G.SyncResultAddRanges(b, ranges)
        return int(G.SyncResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), _status(t.Status()), _ranges(t))


@dataclass(frozen=True, slots=True)
class SyncRangesResponse(Message):
    OPCODE = Opcode.SYNC_RANGES
    IS_RESPONSE = True
    _FB = G.SyncRangesResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[SyncResult, ...] = ()  # the spec's sync_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.SyncRangesResponseStart(b)
        G.SyncRangesResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.SyncRangesResponseAddStatus(b, status)
        G.SyncRangesResponseAddSyncResponses(b, items)
        return int(G.SyncRangesResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.SyncResponsesLength(), t)
        items = tuple([SyncResult._read(t.SyncResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# --------------------------------------------------------------------------------- DESCRIBE_RANGES


@dataclass(frozen=True, slots=True)
class DescribeRangeItem(_Table):
    stream_id: int = 0
    range_index: int = 0

    def _build(self, b: Any) -> int:
        G.DescribeRangeItemStart(b)
        G.DescribeRangeItemAddStreamId(b, self.stream_id)
        G.DescribeRangeItemAddRangeIndex(b, self.range_index)
        return int(G.DescribeRangeItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), t.RangeIndex())


@dataclass(frozen=True, slots=True)
class DescribeRangesRequest(Message):
    OPCODE = Opcode.DESCRIBE_RANGES
    IS_RESPONSE = False
    _FB = G.DescribeRangesRequest
    timeout_ms: int = 0
    items: tuple[DescribeRangeItem, ...] = ()  # the spec's ranges

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.DescribeRangesRequestStart(b)
        G.DescribeRangesRequestAddTimeoutMs(b, self.timeout_ms)
        G.DescribeRangesRequestAddRanges(b, items)
        return int(G.DescribeRangesRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.RangesLength(), t)
        return cls(t.TimeoutMs(), tuple([DescribeRangeItem._read(t.Ranges(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class DescribeRangeResult(_Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    range: Range | None = None

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        range_ = _put_opt(b, self.range)
        G.DescribeRangeResultStart(b)
        G.DescribeRangeResultAddStreamId(b, self.stream_id)
        G.DescribeRangeResultAddStatus(b, status)
        G.DescribeRangeResultAddRange(b, range_)
        return int(G.DescribeRangeResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), _status(t.Status()), _range(t.Range()))


@dataclass(frozen=True, slots=True)
class DescribeRangesResponse(Message):
    OPCODE = Opcode.DESCRIBE_RANGES
    IS_RESPONSE = True
    _FB = G.DescribeRangesResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[DescribeRangeResult, ...] = ()  # the spec's describe_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.DescribeRangesResponseStart(b)
        G.DescribeRangesResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.DescribeRangesResponseAddStatus(b, status)
        G.DescribeRangesResponseAddDescribeResponses(b, items)
        return int(G.DescribeRangesResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.DescribeResponsesLength(), t)
        items = tuple([DescribeRangeResult._read(t.DescribeResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ---------------------------------------------------------------------------------- CREATE_STREAMS


@dataclass(frozen=True, slots=True)
class CreateStreamItem(_Table):
    replica_nums: int = 0
    retention_period_ms: int = 0

    def _build(self, b: Any) -> int:
        G.CreateStreamItemStart(b)
        G.CreateStreamItemAddReplicaNums(b, self.replica_nums)
        G.CreateStreamItemAddRetentionPeriodMs(b, self.retention_period_ms)
        return int(G.CreateStreamItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.ReplicaNums(), t.RetentionPeriodMs())


@dataclass(frozen=True, slots=True)
class CreateStreamsRequest(Message):
    OPCODE = Opcode.CREATE_STREAMS
    IS_RESPONSE = False
    _FB = G.CreateStreamsRequest
    timeout_ms: int = 0
    items: tuple[CreateStreamItem, ...] = ()  # the spec's streams

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.CreateStreamsRequestStart(b)
        G.CreateStreamsRequestAddTimeoutMs(b, self.timeout_ms)
        G.CreateStreamsRequestAddStreams(b, items)
        return int(G.CreateStreamsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.StreamsLength(), t)
        return cls(t.TimeoutMs(), tuple([CreateStreamItem._read(t.Streams(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class CreateStreamResult(_Table):
    stream: Stream | None = None
    replica_nums: int = 0  # the spec repeats these beside `stream`: the same values
    retention_period_ms: int = 0
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        stream = _put_opt(b, self.stream)
        status = _put_status(b, self.status)
        G.CreateStreamResultStart(b)
        G.CreateStreamResultAddStream(b, stream)
        G.CreateStreamResultAddReplicaNums(b, self.replica_nums)
        G.CreateStreamResultAddRetentionPeriodMs(b, self.retention_period_ms)
        G.CreateStreamResultAddStatus(b, status)
        return int(G.CreateStreamResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_stream(t.Stream()), t.ReplicaNums(), t.RetentionPeriodMs(), _status(t.Status()))


@dataclass(frozen=True, slots=True)
class CreateStreamsResponse(Message):
    OPCODE = Opcode.CREATE_STREAMS
    IS_RESPONSE = True
    _FB = G.CreateStreamsResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[CreateStreamResult, ...] = ()  # the spec's create_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.CreateStreamsResponseStart(b)
        G.CreateStreamsResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.CreateStreamsResponseAddStatus(b, status)
        G.CreateStreamsResponseAddCreateResponses(b, items)
        return int(G.CreateStreamsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.CreateResponsesLength(), t)
        items = tuple([CreateStreamResult._read(t.CreateResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ---------------------------------------------------------------------- DELETE / UPDATE / DESCRIBE


@dataclass(frozen=True, slots=True)
class StreamResult(_Table):
    """The spec's deleted_stream / updated_stream / stream, with its status."""

    stream: Stream | None = None
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        stream = _put_opt(b, self.stream)
        status = _put_status(b, self.status)
        G.StreamResultStart(b)
        G.StreamResultAddStream(b, stream)
        G.StreamResultAddStatus(b, status)
        return int(G.StreamResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_stream(t.Stream()), _status(t.Status()))


@dataclass(frozen=True, slots=True)
class DeleteStreamsRequest(Message):
    OPCODE = Opcode.DELETE_STREAMS
    IS_RESPONSE = False
    _FB = G.DeleteStreamsRequest
    timeout_ms: int = 0
    items: tuple[Stream, ...] = ()  # the spec's streams; only stream_id is read

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.DeleteStreamsRequestStart(b)
        G.DeleteStreamsRequestAddTimeoutMs(b, self.timeout_ms)
        G.DeleteStreamsRequestAddStreams(b, items)
        return int(G.DeleteStreamsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.StreamsLength(), t)
        return cls(t.TimeoutMs(), tuple([Stream._read(t.Streams(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class DeleteStreamsResponse(Message):
    OPCODE = Opcode.DELETE_STREAMS
    IS_RESPONSE = True
    _FB = G.DeleteStreamsResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's delete_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.DeleteStreamsResponseStart(b)
        G.DeleteStreamsResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.DeleteStreamsResponseAddStatus(b, status)
        G.DeleteStreamsResponseAddDeleteResponses(b, items)
        return int(G.DeleteStreamsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.DeleteResponsesLength(), t)
        items = tuple([StreamResult._read(t.DeleteResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


@dataclass(frozen=True, slots=True)
class UpdateStreamsRequest(Message):
    OPCODE = Opcode.UPDATE_STREAMS
    IS_RESPONSE = False
    _FB = G.UpdateStreamsRequest
    timeout_ms: int = 0
    items: tuple[Stream, ...] = ()  # the spec's streams

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.UpdateStreamsRequestStart(b)
        G.UpdateStreamsRequestAddTimeoutMs(b, self.timeout_ms)
        G.UpdateStreamsRequestAddStreams(b, items)
        return int(G.UpdateStreamsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.StreamsLength(), t)
        return cls(t.TimeoutMs(), tuple([Stream._read(t.Streams(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class UpdateStreamsResponse(Message):
    OPCODE = Opcode.UPDATE_STREAMS
    IS_RESPONSE = True
    _FB = G.UpdateStreamsResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's update_responses

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.UpdateStreamsResponseStart(b)
        G.UpdateStreamsResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.UpdateStreamsResponseAddStatus(b, status)
        G.UpdateStreamsResponseAddUpdateResponses(b, items)
        return int(G.UpdateStreamsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.UpdateResponsesLength(), t)
        items = tuple([StreamResult._read(t.UpdateResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


@dataclass(frozen=True, slots=True)
class DescribeStreamsRequest(Message):
    """``stream_ids`` empty lists every stream, ``limit`` per page, from ``continuation``."""

    OPCODE = Opcode.DESCRIBE_STREAMS
    IS_RESPONSE = False
    _FB = G.DescribeStreamsRequest
    timeout_ms: int = 0
    stream_ids: tuple[int, ...] = ()
    limit: int = 0  # project: page size; 0 = the server's default
    continuation: int = -1  # project: -1 = first page; else the previous response's value

    def _build(self, b: Any) -> int:
        _check_items(self.stream_ids)
        ids = _put_int64s(b, self.stream_ids)
        G.DescribeStreamsRequestStart(b)
        G.DescribeStreamsRequestAddTimeoutMs(b, self.timeout_ms)
        G.DescribeStreamsRequestAddStreamIds(b, ids)
        G.DescribeStreamsRequestAddLimit(b, self.limit)
        G.DescribeStreamsRequestAddContinuation(b, self.continuation)
        return int(G.DescribeStreamsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.StreamIdsLength(), t, 8)
        ids = tuple([t.StreamIds(j) for j in range(n)])
        return cls(t.TimeoutMs(), ids, t.Limit(), t.Continuation())


@dataclass(frozen=True, slots=True)
class DescribeStreamsResponse(Message):
    OPCODE = Opcode.DESCRIBE_STREAMS
    IS_RESPONSE = True
    _FB = G.DescribeStreamsResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's describe_responses
    continuation: int = -1  # project: -1 = no more pages

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.DescribeStreamsResponseStart(b)
        G.DescribeStreamsResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.DescribeStreamsResponseAddStatus(b, status)
        G.DescribeStreamsResponseAddDescribeResponses(b, items)
        G.DescribeStreamsResponseAddContinuation(b, self.continuation)
        return int(G.DescribeStreamsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.DescribeResponsesLength(), t)
        items = tuple([StreamResult._read(t.DescribeResponses(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items, t.Continuation())


# ------------------------------------------------------------------------------------ TRIM_STREAMS


@dataclass(frozen=True, slots=True)
class TrimItem(_Table):
    stream_id: int = 0
    trim_offset: int = 0

    def _build(self, b: Any) -> int:
        G.TrimItemStart(b)
        G.TrimItemAddStreamId(b, self.stream_id)
        G.TrimItemAddTrimOffset(b, self.trim_offset)
        return int(G.TrimItemEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(t.StreamId(), t.TrimOffset())


@dataclass(frozen=True, slots=True)
class TrimStreamsRequest(Message):
    OPCODE = Opcode.TRIM_STREAMS
    IS_RESPONSE = False
    _FB = G.TrimStreamsRequest
    timeout_ms: int = 0
    items: tuple[TrimItem, ...] = ()  # the spec's trimmed_streams

    def _build(self, b: Any) -> int:
        _check_items(self.items)
        items = _put_tables(b, self.items)
        G.TrimStreamsRequestStart(b)
        G.TrimStreamsRequestAddTimeoutMs(b, self.timeout_ms)
        G.TrimStreamsRequestAddTrimmedStreams(b, items)
        return int(G.TrimStreamsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _items(t.TrimmedStreamsLength(), t)
        return cls(t.TimeoutMs(), tuple([TrimItem._read(t.TrimmedStreams(j)) for j in range(n)]))


@dataclass(frozen=True, slots=True)
class TrimResult(_Table):
    stream: Stream | None = None  # the spec's trimmed_stream
    status: Status = STATUS_OK
    range: Range | None = None  # the stream's smallest range after the trim

    def _build(self, b: Any) -> int:
        stream = _put_opt(b, self.stream)
        status = _put_status(b, self.status)
        range_ = _put_opt(b, self.range)
        G.TrimResultStart(b)
        G.TrimResultAddTrimmedStream(b, stream)
        G.TrimResultAddStatus(b, status)
        G.TrimResultAddRange(b, range_)
        return int(G.TrimResultEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_stream(t.TrimmedStream()), _status(t.Status()), _range(t.Range()))


@dataclass(frozen=True, slots=True)
class TrimStreamsResponse(Message):
    OPCODE = Opcode.TRIM_STREAMS
    IS_RESPONSE = True
    _FB = G.TrimStreamsResponse
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[TrimResult, ...] = ()  # the spec's streams

    def _build(self, b: Any) -> int:
        status = _put_status(b, self.status)
        items = _put_tables(b, self.items)
        G.TrimStreamsResponseStart(b)
        G.TrimStreamsResponseAddThrottleTimeMs(b, self.throttle_time_ms)
        G.TrimStreamsResponseAddStatus(b, status)
        G.TrimStreamsResponseAddStreams(b, items)
        return int(G.TrimStreamsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        n = _count(t.StreamsLength(), t)
        items = tuple([TrimResult._read(t.Streams(j)) for j in range(n)])
        return cls(t.ThrottleTimeMs(), _status(t.Status()), items)


# ---------------------------------------------------------------------------------- REPORT_METRICS


@dataclass(frozen=True, slots=True)
class ReportMetricsRequest(Message):
    """A data node's load, with the spec's types (int16 fields must fit: the sender saturates).

    ``uring_*`` are the data node's I/O executor figures (task rate, in flight, pending, latency).
    """

    OPCODE = Opcode.REPORT_METRICS
    IS_RESPONSE = False
    _FB = G.ReportMetricsRequest
    data_node: DataNode | None = None
    disk_in_rate: int = 0
    disk_out_rate: int = 0
    disk_free_space: int = 0
    disk_unindexed_data_size: int = 0
    memory_used: int = 0
    uring_task_rate: int = 0
    uring_inflight_task_cnt: int = 0
    uring_pending_task_cnt: int = 0
    uring_task_avg_latency: int = 0
    network_append_rate: int = 0
    network_fetch_rate: int = 0
    network_failed_append_rate: int = 0
    network_failed_fetch_rate: int = 0
    network_append_avg_latency: int = 0
    network_fetch_avg_latency: int = 0
    range_missing_replica_cnt: int = 0
    range_active_cnt: int = 0

    def _build(self, b: Any) -> int:
        node = _put_opt(b, self.data_node)
        G.ReportMetricsRequestStart(b)
        G.ReportMetricsRequestAddDataNode(b, node)
        G.ReportMetricsRequestAddDiskInRate(b, self.disk_in_rate)
        G.ReportMetricsRequestAddDiskOutRate(b, self.disk_out_rate)
        G.ReportMetricsRequestAddDiskFreeSpace(b, self.disk_free_space)
        G.ReportMetricsRequestAddDiskUnindexedDataSize(b, self.disk_unindexed_data_size)
        G.ReportMetricsRequestAddMemoryUsed(b, self.memory_used)
        G.ReportMetricsRequestAddUringTaskRate(b, self.uring_task_rate)
        G.ReportMetricsRequestAddUringInflightTaskCnt(b, self.uring_inflight_task_cnt)
        G.ReportMetricsRequestAddUringPendingTaskCnt(b, self.uring_pending_task_cnt)
        G.ReportMetricsRequestAddUringTaskAvgLatency(b, self.uring_task_avg_latency)
        G.ReportMetricsRequestAddNetworkAppendRate(b, self.network_append_rate)
        G.ReportMetricsRequestAddNetworkFetchRate(b, self.network_fetch_rate)
        G.ReportMetricsRequestAddNetworkFailedAppendRate(b, self.network_failed_append_rate)
        G.ReportMetricsRequestAddNetworkFailedFetchRate(b, self.network_failed_fetch_rate)
        G.ReportMetricsRequestAddNetworkAppendAvgLatency(b, self.network_append_avg_latency)
        G.ReportMetricsRequestAddNetworkFetchAvgLatency(b, self.network_fetch_avg_latency)
        G.ReportMetricsRequestAddRangeMissingReplicaCnt(b, self.range_missing_replica_cnt)
        G.ReportMetricsRequestAddRangeActiveCnt(b, self.range_active_cnt)
        return int(G.ReportMetricsRequestEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(
            _data_node(t.DataNode()),
            t.DiskInRate(),
            t.DiskOutRate(),
            t.DiskFreeSpace(),
            t.DiskUnindexedDataSize(),
            t.MemoryUsed(),
            t.UringTaskRate(),
            t.UringInflightTaskCnt(),
            t.UringPendingTaskCnt(),
            t.UringTaskAvgLatency(),
            t.NetworkAppendRate(),
            t.NetworkFetchRate(),
            t.NetworkFailedAppendRate(),
            t.NetworkFailedFetchRate(),
            t.NetworkAppendAvgLatency(),
            t.NetworkFetchAvgLatency(),
            t.RangeMissingReplicaCnt(),
            t.RangeActiveCnt(),
        )


@dataclass(frozen=True, slots=True)
class ReportMetricsResponse(Message):
    OPCODE = Opcode.REPORT_METRICS
    IS_RESPONSE = True
    _FB = G.ReportMetricsResponse
    data_node: DataNode | None = None
    status: Status = STATUS_OK

    def _build(self, b: Any) -> int:
        node = _put_opt(b, self.data_node)
        status = _put_status(b, self.status)
        G.ReportMetricsResponseStart(b)
        G.ReportMetricsResponseAddDataNode(b, node)
        G.ReportMetricsResponseAddStatus(b, status)
        return int(G.ReportMetricsResponseEnd(b))

    @classmethod
    def _read(cls, t: Any) -> Self:
        return cls(_data_node(t.DataNode()), _status(t.Status()))


# -------------------------------------------------------------------------------------- registries

MESSAGES: Final[tuple[type[Message], ...]] = (
    PingRequest,
    PingResponse,
    GoAway,
    GoAwayResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    AllocateIdRequest,
    AllocateIdResponse,
    AppendRequest,
    AppendResponse,
    FetchRequest,
    FetchResponse,
    BufferAckRequest,
    BufferAckResponse,
    ListRangesRequest,
    ListRangesResponse,
    SealRangesRequest,
    SealRangesResponse,
    SyncRangesRequest,
    SyncRangesResponse,
    DescribeRangesRequest,
    DescribeRangesResponse,
    CreateStreamsRequest,
    CreateStreamsResponse,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    UpdateStreamsRequest,
    UpdateStreamsResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    TrimStreamsRequest,
    TrimStreamsResponse,
    ReportMetricsRequest,
    ReportMetricsResponse,
)


def _registry(is_response: bool) -> dict[Opcode, type[Message]]:
    table: dict[Opcode, type[Message]] = {}
    for cls in MESSAGES:
        if cls.IS_RESPONSE is not is_response:
            continue
        if cls.OPCODE in table:
            raise AssertionError(f"two classes for {cls.OPCODE!r}: {table[cls.OPCODE]} and {cls}")
        table[cls.OPCODE] = cls
    return table


REQUESTS: Final[dict[Opcode, type[Message]]] = _registry(is_response=False)
RESPONSES: Final[dict[Opcode, type[Message]]] = _registry(is_response=True)


def decode_request(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a request header; an opcode without a request class raises KeyError."""
    return REQUESTS[Opcode(opcode)].decode(buf)


def decode_response(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a response header; an opcode without a response class raises KeyError.

    A system error frame (flag 0x04) carries :class:`SystemErrorResponse` whatever the opcode:
    decode it with ``SystemErrorResponse.decode``.
    """
    return RESPONSES[Opcode(opcode)].decode(buf)
