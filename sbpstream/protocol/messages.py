"""Typed SBP extended headers: one frozen dataclass per request and response of every opcode.

The wire format is the FlatBuffers schema ``schema/sbp.fbs``, and it is the only statement of it:
each class below is bound to the schema table of its name by :mod:`.fbtable`, which checks the
class's fields (names, order, defaults) against the schema at import and gives it its codec and
frozen-dataclass methods, compiled ahead of time into ``_precompiled.py`` (:mod:`.codegen`). A
class declares its fields, one line each; ``@request``/``@response`` also register it for its
opcode and refuse a second class for the same one. The flatc-generated code in ``fbs/`` is not
imported here: the tests use it as an independent reader of what this module writes.

Every table has

- ``encode() -> bytes``: the table as a FlatBuffers root (no size prefix, no file identifier);
  for a message, the extended header, and
- ``decode(buf) -> Self``: the inverse. An empty buffer (``header_length = 0``) gives every field
  its default; anything undecodable raises :class:`BadHeaderError`, a batched request naming more
  than :data:`MAX_ITEMS_PER_REQUEST` items raises :class:`LimitExceededError`. Nothing else.

Messages are plain data: no I/O, sequences are tuples. ``REQUESTS`` and ``RESPONSES`` map each
opcode to its class, ``MESSAGES`` lists them in definition order. Per-item results carry their own
:class:`Status`; an OK status (code 0, no message, no detail) is not written at all, so the common
case costs no bytes and decodes to the shared :data:`STATUS_OK`. The items of APPEND and FETCH
are written by a fixed-layout fast path (``fixed=True``, see :class:`.fbtable.FixedLayout`).
"""

from __future__ import annotations

import enum
import functools
import pkgutil
from collections.abc import Callable, Iterator
from typing import ClassVar, Final, TypeVar, dataclass_transform

from sbpstream.protocol import rangelist
from sbpstream.protocol.errors import LimitExceededError, SbpError, error_for
from sbpstream.protocol.fbtable import Codec, Table, frozen_dataclass, parse_schema, put_tables
from sbpstream.protocol.opcodes import Opcode

__all__ = [
    "MAX_ITEMS_PER_REQUEST", "MESSAGES", "REQUESTS", "RESPONSES", "STATUS_OK", "AclEntry",
    "AllocateIdRequest", "AllocateIdResponse", "AppendItem", "AppendRequest", "AppendResponse",
    "AppendResult", "AuthenticateRequest", "AuthenticateResponse", "BufferAckRequest",
    "BufferAckResponse", "ClientRole", "ConnectionsRequest", "ConnectionsResponse",
    "CreateStreamItem", "CreateStreamResult", "CreateStreamsRequest", "CreateStreamsResponse",
    "DataNode", "DeleteGroupRequest", "DeleteGroupResponse", "DeleteQuotasRequest",
    "DeleteQuotasResponse", "DeleteStreamsRequest", "DeleteStreamsResponse",
    "DescribeGroupsRequest", "DescribeGroupsResponse", "DescribeQuotasRequest",
    "DescribeQuotasResponse", "DescribeRangeItem", "DescribeRangeResult", "DescribeRangesRequest",
    "DescribeRangesResponse", "DescribeStreamsRequest", "DescribeStreamsResponse", "FetchItem",
    "FetchRequest", "FetchResponse", "FetchResult", "GoAway", "GoAwayResponse", "GroupDescription",
    "GroupHeartbeatRequest", "GroupHeartbeatResponse", "GroupMember", "GroupResult", "Header",
    "HeartbeatRequest", "HeartbeatResponse", "InfoRequest", "InfoResponse", "JoinGroupRequest",
    "JoinGroupResponse", "LeaveGroupRequest", "LeaveGroupResponse", "ListGroupsRequest",
    "ListGroupsResponse", "ListRangesRequest", "ListRangesResponse", "ListRangesResult",
    "ManageAclsRequest", "ManageAclsResponse", "ManageUsersRequest", "ManageUsersResponse",
    "Message", "NameItem", "OffsetCommitItem", "OffsetCommitRequest", "OffsetCommitResponse",
    "OffsetCommitResult", "OffsetFetchRequest", "OffsetFetchResponse", "OffsetFetchResult",
    "PingRequest", "PingResponse", "ProducerState", "Quota", "QuotaCounter", "QuotaCountersRequest",
    "QuotaCountersResponse", "QuotaResult", "Range", "RangeOwner", "ReplicaNode",
    "ReportMetricsRequest", "ReportMetricsResponse", "ResetOffsetsRequest", "ResetOffsetsResponse",
    "SealItem", "SealRangesRequest", "SealRangesResponse", "SealResult", "SetQuotasRequest",
    "SetQuotasResponse", "StatsRequest", "StatsResponse", "Status", "Stream", "StreamOwner",
    "StreamRanges", "StreamResult", "SyncRangesRequest", "SyncRangesResponse", "SyncResult",
    "SystemErrorResponse", "TrimItem", "TrimResult", "TrimStreamsRequest", "TrimStreamsResponse",
    "UpdateStreamsRequest", "UpdateStreamsResponse", "UserEntry", "WhoamiRequest", "WhoamiResponse",
    "decode_request", "decode_response",
]  # fmt: skip

MAX_ITEMS_PER_REQUEST: Final = 10_000
"""Most items one batched request may name (appends, fetches, streams, ranges, stream ids).

Why: one header may be up to 16 MiB, enough to name about a million items, and a server does work
and keeps state per item; the bound caps what a single frame can make a server do or buffer. It is
far above real batches (an SDK batches tens to hundreds), and it is checked on decode, before any
item is built, and on encode, so a sender learns of it before the peer does.
"""

# The schema ships as package data: read once at import (pkgutil: also from a zip or wheel),
# never afterwards; encoding and decoding do no I/O.
_SCHEMA_TEXT: Final = pkgutil.get_data("sbpstream.protocol", "schema/sbp.fbs")
assert _SCHEMA_TEXT is not None, "sbpstream/protocol/schema/sbp.fbs is missing from the package"
_CODEC: Final = Codec(parse_schema(_SCHEMA_TEXT.decode()))


def _check_items(n: int) -> None:
    """The bound on every vector of a request (checked on encode and on decode)."""
    if n > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(
            f"{n} items in one request; at most {MAX_ITEMS_PER_REQUEST} are accepted"
        )


class ClientRole(enum.IntEnum):
    """HEARTBEAT's client_role. Unknown values from newer peers decode as UNSPECIFIED."""

    UNSPECIFIED = 0
    DATA_NODE = 1
    CLIENT = 2


class Header(Table):
    """A table that is a whole extended header."""

    __slots__ = ()


class Message(Header):
    """The header of one opcode's request or response."""

    __slots__ = ()
    OPCODE: ClassVar[Opcode]
    IS_RESPONSE: ClassVar[bool]


_T = TypeVar("_T", bound=Table)
_M = TypeVar("_M", bound=Message)
_MESSAGES: list[type[Message]] = []
REQUESTS: Final[dict[Opcode, type[Message]]] = {}
RESPONSES: Final[dict[Opcode, type[Message]]] = {}


@dataclass_transform(frozen_default=True)
def table(*, fixed: bool = False, omit_default: bool = False, **renames: str) -> Callable[
    [type[_T]], type[_T]
]:  # fmt: skip
    """Make the class a frozen, slotted dataclass bound to the schema table of its name.

    ``renames`` maps a field to its schema name (``items="append_requests"``); ``fixed`` writes
    vectors of this table in one block; ``omit_default`` leaves a value equal to ``cls()`` out.
    """

    def bind(cls: type[_T]) -> type[_T]:
        cls = frozen_dataclass(cls)
        _CODEC.bind(cls, renames=renames, fixed=fixed, omit_default=omit_default)
        return cls

    return bind


def _message(opcode: Opcode, is_response: bool, renames: dict[str, str]) -> Callable[
    [type[_M]], type[_M]
]:  # fmt: skip
    registry = RESPONSES if is_response else REQUESTS

    def bind(cls: type[_M]) -> type[_M]:
        if opcode in registry:
            raise TypeError(f"two classes for {opcode!r}: {registry[opcode]} and {cls}")
        cls = frozen_dataclass(cls)
        cls.OPCODE, cls.IS_RESPONSE = opcode, is_response
        _CODEC.bind(cls, renames=renames, limit=None if is_response else _check_items)
        registry[opcode] = cls
        _MESSAGES.append(cls)
        return cls

    return bind


@dataclass_transform(frozen_default=True)
def request(opcode: Opcode, **renames: str) -> Callable[[type[_M]], type[_M]]:
    """:func:`table` for the request of ``opcode``; every vector is bounded by
    :data:`MAX_ITEMS_PER_REQUEST`."""
    return _message(opcode, False, renames)


@dataclass_transform(frozen_default=True)
def response(opcode: Opcode, **renames: str) -> Callable[[type[_M]], type[_M]]:
    """:func:`table` for the response of ``opcode`` (bounded by the header's size only)."""
    return _message(opcode, True, renames)


# ----------------------------------------------------------------------------------- shared values


@table(omit_default=True)
class Status(Table):
    """A result: ``code`` is an :class:`~sbpstream.protocol.errors.ErrorCode` value (0 = OK)."""

    code: int = 0
    message: str = ""
    detail: bytes = b""  # PM_NOT_LEADER: the leader's host:port

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


STATUS_OK: Final = Status()


@table()
class DataNode(Table):
    node_id: int = 0
    advertise_addr: str = ""  # host:port


@table()
class ReplicaNode(Table):
    data_node: DataNode = DataNode()  # always written; absent reads as DataNode()
    is_primary: bool = False


@table()
class Range(Table):
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


@table()
class Stream(Table):
    stream_id: int = 0
    replica_nums: int = 0
    retention_period_ms: int = 0
    start_offset: int = 0  # project: the trim point
    name: str = ""  # project: the stream's unique name; "" = unnamed


@table()
class ProducerState(Table):
    """The highest sequence one idempotent producer reached in a sealed range."""

    producer_id: int = -1
    producer_epoch: int = -1
    last_sequence: int = -1
    last_base_offset: int = -1


@table()
class StreamOwner(Table):
    """LIST_RANGES by stream."""

    stream_id: int = 0


RangeOwner = StreamOwner | DataNode
"""LIST_RANGES lists the ranges of a stream (StreamOwner) or of every stream on a data node."""


@table()
class SystemErrorResponse(Header):
    """The header of a system error frame (flags 0x07), for any opcode."""

    status: Status = STATUS_OK


# ------------------------------------------------------------------------------------ PING, GOAWAY


@request(Opcode.PING)
class PingRequest(Message):
    """PING carries no fields; PONG echoes the request's header bytes undecoded."""


@response(Opcode.PING)
class PingResponse(Message):
    pass


@request(Opcode.GOAWAY)
class GoAway(Message):
    """Sent by either side on stream id 0; the sender finishes requests up to last_stream_id."""

    code: int = 0
    message: str = ""
    last_stream_id: int = 0x7FFF_FFFF  # default: every request already sent will be finished


@response(Opcode.GOAWAY)
class GoAwayResponse(Message):
    """Never sent (GOAWAY is not answered); it exists so every opcode has a response table."""

    status: Status = STATUS_OK


# --------------------------------------------------------------------------------------- HEARTBEAT


@request(Opcode.HEARTBEAT)
class HeartbeatRequest(Message):
    client_id: str = ""
    client_role: ClientRole = ClientRole.UNSPECIFIED
    data_node: DataNode | None = None  # None for SDK clients
    committed_ranges: tuple[Range, ...] = ()  # project: a data node's committed next offsets


@response(Opcode.HEARTBEAT)
class HeartbeatResponse(Message):
    client_id: str = ""
    client_role: ClientRole = ClientRole.UNSPECIFIED
    data_node: DataNode | None = None
    status: Status = STATUS_OK  # PM_NOT_LEADER: detail = the leader's host:port


# ------------------------------------------------------------------------------------- ALLOCATE_ID


@request(Opcode.ALLOCATE_ID)
class AllocateIdRequest(Message):
    timeout_ms: int = 0
    host: str = ""


@response(Opcode.ALLOCATE_ID)
class AllocateIdResponse(Message):
    id: int = -1  # a data node id (int32); -1 = none allocated
    status: Status = STATUS_OK


# ------------------------------------------------------------------------------------------ APPEND


@table(fixed=True)
class AppendItem(Table):
    """One record batch of the payload: ``batch_length`` bytes, in item order."""

    stream_id: int = 0
    request_index: int = 0
    batch_length: int = 0
    range_index: int = -1  # project: -1 = the stream's writable range


@request(Opcode.APPEND, items="append_requests")
class AppendRequest(Message):
    timeout_ms: int = 0
    items: tuple[AppendItem, ...] = ()  # the spec's append_requests
    replication: bool = False  # project: primary -> secondary, base offsets already assigned
    committed_offset: int = -1  # project: the primary's committed offset (replication only)
    # project: replication of several ranges in one request: item i's range committed offset
    # (then committed_offset is -1); empty: committed_offset holds for every item
    committed_offsets: tuple[int, ...] = ()


@table(fixed=True)
class AppendResult(Table):
    stream_id: int = 0
    request_index: int = 0
    base_offset: int = -1  # -1 = not appended
    stream_append_time_ms: int = 0
    status: Status = STATUS_OK
    next_offset: int = -1  # project: the offset after the batch


@response(Opcode.APPEND, items="append_responses")
class AppendResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[AppendResult, ...] = ()  # the spec's append_responses


# ------------------------------------------------------------------------------------------- FETCH


@table(fixed=True)
class FetchItem(Table):
    stream_id: int = 0
    request_index: int = 0
    fetch_offset: int = 0
    batch_max_bytes: int = 0
    range_index: int = -1  # project: -1 = whichever range holds fetch_offset


@request(Opcode.FETCH, items="fetch_requests")
class FetchRequest(Message):
    max_wait_ms: int = 0
    min_bytes: int = 0
    items: tuple[FetchItem, ...] = ()  # the spec's fetch_requests
    session_id: int = 0  # project (fetch sessions): 0 = none, else the session
    session_epoch: int = -1  # project: -1 = no session / close it, 0 = full, N = the next
    forgotten: tuple[int, ...] = ()  # project (fetch sessions): stream ids to drop
    window_bytes: int = 0  # project (flow control, later): 0 = no window


@table(fixed=True)
class FetchResult(Table):
    """One stream's part of a response frame: ``batch_length`` payload bytes, in item order."""

    stream_id: int = 0
    request_index: int = 0
    batch_length: int = 0
    status: Status = STATUS_OK
    start_offset: int = -1  # project: the stream's first readable offset
    high_watermark: int = -1  # project: the committed end, the next offset readable
    range_end_offset: int = -1  # project: end of the sealed range served; -1 = writable


@response(Opcode.FETCH, items="fetch_responses")
class FetchResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[FetchResult, ...] = ()  # the spec's fetch_responses
    session_id: int = 0  # project (fetch sessions): the session served; 0 = none

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


# -------------------------------------------------------------------------------------- BUFFER_ACK


@request(Opcode.BUFFER_ACK)
class BufferAckRequest(Message):
    """Project opcode (flow control): the client has processed ``bytes_acked`` more bytes of the
    subscription opened by its FETCH ``fetch_request_id`` on this connection; ``cancel`` ends it."""

    bytes_acked: int = 0
    fetch_request_id: int = -1
    cancel: bool = False


@response(Opcode.BUFFER_ACK)
class BufferAckResponse(Message):
    """The answer to every BUFFER_ACK: OK, or why the ack was refused (nothing changed then)."""

    status: Status = STATUS_OK


# ------------------------------------------------------------------------------------- LIST_RANGES


# A consumer of many streams asks LIST_RANGES of all of them at once: a fast path (same bytes)
_CODEC.union_vector_writer("RangeOwnerEntry", functools.partial(
    rangelist.put_stream_owners, owner=StreamOwner, kind=1,  # StreamOwner: RangeOwner's first
    fallback=_CODEC.builder_vector_writer("RangeOwnerEntry")))


@request(Opcode.LIST_RANGES, items="range_owners")
class ListRangesRequest(Message):
    timeout_ms: int = 0
    items: tuple[RangeOwner, ...] = ()  # the spec's range_owners


@table()
class ListRangesResult(Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()


def _status_omitted(s: Status) -> bool:
    return s is STATUS_OK or (s.code, s.message, s.detail) == (0, "", b"")


# A node's whole listing is hundreds of thousands of results: written by a fast path (same bytes)
_CODEC.vector_writer(ListRangesResult, functools.partial(
    rangelist.put_results, is_ok=_status_omitted,
    fallback=functools.partial(put_tables, build=ListRangesResult.SCHEMA.build)))
# ... and read by one (the same objects as the generic reader's)
_CODEC.vector_reader(ListRangesResult, rangelist.ResultsReader(
    ListRangesResult, Range, ReplicaNode, DataNode, Status.SCHEMA.read).read)


@response(Opcode.LIST_RANGES, items="list_responses")
class ListRangesResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[ListRangesResult, ...] = ()  # the spec's list_responses


# ------------------------------------------------------------------------------------- SEAL_RANGES


@table()
class SealItem(Table):
    stream_id: int = 0
    range_index: int = 0
    end_offset: int = -1  # project: -1 = stop and report your end; >= 0 = sealed at this end


@request(Opcode.SEAL_RANGES, items="ranges")
class SealRangesRequest(Message):
    timeout_ms: int = 0
    items: tuple[SealItem, ...] = ()  # the spec's ranges


@table()
class SealResult(Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()  # DN: (sealed,); PM: (sealed, new writable)
    producers: tuple[ProducerState, ...] = ()  # project: highest sequence per producer


@response(Opcode.SEAL_RANGES, items="seal_responses")
class SealRangesResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[SealResult, ...] = ()  # the spec's seal_responses


# ------------------------------------------------------------------------------------- SYNC_RANGES


@table()
class StreamRanges(Table):
    stream_id: int = 0
    ranges: tuple[Range, ...] = ()


# PM creates send SYNC_RANGES of up to thousands of ranges: the same writer (same bytes)
_CODEC.vector_writer(StreamRanges, functools.partial(
    rangelist.put_results, is_ok=_status_omitted, status=False,
    fallback=functools.partial(put_tables, build=StreamRanges.SCHEMA.build)))


@request(Opcode.SYNC_RANGES, items="stream_ranges")
class SyncRangesRequest(Message):
    timeout_ms: int = 0
    items: tuple[StreamRanges, ...] = ()  # the spec's stream_ranges


@table()
class SyncResult(Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    ranges: tuple[Range, ...] = ()


# SyncResult is laid out as ListRangesResult is (stream_id, status, ranges): the same fast paths
_CODEC.vector_writer(SyncResult, functools.partial(
    rangelist.put_results, is_ok=_status_omitted,
    fallback=functools.partial(put_tables, build=SyncResult.SCHEMA.build)))
_CODEC.vector_reader(SyncResult, rangelist.ResultsReader(
    SyncResult, Range, ReplicaNode, DataNode, Status.SCHEMA.read).read)


@response(Opcode.SYNC_RANGES, items="sync_responses")
class SyncRangesResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[SyncResult, ...] = ()  # the spec's sync_responses


# --------------------------------------------------------------------------------- DESCRIBE_RANGES


@table()
class DescribeRangeItem(Table):
    stream_id: int = 0
    range_index: int = 0
    digest_end_offset: int = -1  # >= 0: a data node also answers a digest (sbpstream check)
    digest_start_offset: int = -1


@request(Opcode.DESCRIBE_RANGES, items="ranges")
class DescribeRangesRequest(Message):
    timeout_ms: int = 0
    items: tuple[DescribeRangeItem, ...] = ()  # the spec's ranges


@table()
class DescribeRangeResult(Table):
    stream_id: int = 0
    status: Status = STATUS_OK
    range: Range | None = None
    digest: str = ""  # hex BLAKE2b-128 of [digest_start_offset, digest_end_offset)
    digest_start_offset: int = -1
    digest_end_offset: int = -1


@response(Opcode.DESCRIBE_RANGES, items="describe_responses")
class DescribeRangesResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[DescribeRangeResult, ...] = ()  # the spec's describe_responses


# ---------------------------------------------------------------------------------- CREATE_STREAMS


@table()
class CreateStreamItem(Table):
    replica_nums: int = 0
    retention_period_ms: int = 0
    name: str = ""  # project: a unique name for the stream; "" = unnamed


@request(Opcode.CREATE_STREAMS, items="streams")
class CreateStreamsRequest(Message):
    timeout_ms: int = 0
    items: tuple[CreateStreamItem, ...] = ()  # the spec's streams


@table()
class CreateStreamResult(Table):
    stream: Stream | None = None
    replica_nums: int = 0  # the spec repeats these beside `stream`: the same values
    retention_period_ms: int = 0
    status: Status = STATUS_OK


# A create answers up to thousands of items: written by a fast path (same bytes)
_CODEC.vector_writer(CreateStreamResult, functools.partial(
    rangelist.put_create_results, is_ok=_status_omitted,
    fallback=functools.partial(put_tables, build=CreateStreamResult.SCHEMA.build)))


@response(Opcode.CREATE_STREAMS, items="create_responses")
class CreateStreamsResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[CreateStreamResult, ...] = ()  # the spec's create_responses


# ---------------------------------------------------------------------- DELETE / UPDATE / DESCRIBE


@table()
class StreamResult(Table):
    """The spec's deleted_stream / updated_stream / stream, with its status."""

    stream: Stream | None = None
    status: Status = STATUS_OK


# DESCRIBE_STREAMS of a many-stream consumer's streams: a fast path (same bytes)
_CODEC.vector_writer(StreamResult, functools.partial(
    rangelist.put_stream_results, is_ok=_status_omitted,
    fallback=functools.partial(put_tables, build=StreamResult.SCHEMA.build)))


@request(Opcode.DELETE_STREAMS, items="streams")
class DeleteStreamsRequest(Message):
    timeout_ms: int = 0
    items: tuple[Stream, ...] = ()  # the spec's streams; only stream_id is read


@response(Opcode.DELETE_STREAMS, items="delete_responses")
class DeleteStreamsResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's delete_responses


@request(Opcode.UPDATE_STREAMS, items="streams")
class UpdateStreamsRequest(Message):
    timeout_ms: int = 0
    items: tuple[Stream, ...] = ()  # the spec's streams


@response(Opcode.UPDATE_STREAMS, items="update_responses")
class UpdateStreamsResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's update_responses


@request(Opcode.DESCRIBE_STREAMS)
class DescribeStreamsRequest(Message):
    """``stream_ids`` (and ``name``) describe those streams; with neither, a page of every
    stream (or of those named with ``name_prefix``), ``limit`` per page, from ``continuation``."""

    timeout_ms: int = 0
    stream_ids: tuple[int, ...] = ()
    limit: int = 0  # project: page size; 0 = the server's default
    continuation: int = -1  # project: -1 = first page; else the previous response's value
    name: str = ""  # project: also describe the stream of this name (after the ids)
    name_prefix: str = ""  # project: list the streams whose name starts with this, by id


@response(Opcode.DESCRIBE_STREAMS, items="describe_responses")
class DescribeStreamsResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[StreamResult, ...] = ()  # the spec's describe_responses
    continuation: int = -1  # project: -1 = no more pages


# ------------------------------------------------------------------------------------ TRIM_STREAMS


@table()
class TrimItem(Table):
    stream_id: int = 0
    trim_offset: int = 0


@request(Opcode.TRIM_STREAMS, items="trimmed_streams")
class TrimStreamsRequest(Message):
    timeout_ms: int = 0
    items: tuple[TrimItem, ...] = ()  # the spec's trimmed_streams


@table(stream="trimmed_stream")
class TrimResult(Table):
    stream: Stream | None = None  # the spec's trimmed_stream
    status: Status = STATUS_OK
    range: Range | None = None  # the stream's smallest range after the trim


@response(Opcode.TRIM_STREAMS, items="streams")
class TrimStreamsResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    items: tuple[TrimResult, ...] = ()  # the spec's streams


# ---------------------------------------------------------------------------------- REPORT_METRICS


@request(Opcode.REPORT_METRICS)
class ReportMetricsRequest(Message):
    """A data node's load, with the spec's types (int16 fields must fit: the sender saturates).

    ``uring_*`` are the data node's I/O executor figures (task rate, in flight, pending, latency).
    """

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


@response(Opcode.REPORT_METRICS)
class ReportMetricsResponse(Message):
    data_node: DataNode | None = None
    status: Status = STATUS_OK


# ----------------------------------------------- INFO / STATS / CONNECTIONS / WHOAMI (project)
# The header carries what a caller checks at a glance; the figures are a UTF-8 JSON object in the
# payload (docs/protocol.md, "Introspection payloads").


@request(Opcode.INFO)
class InfoRequest(Message):
    """Project opcode: the server's totals and per-minute rates by opcode (JSON payload)."""


@response(Opcode.INFO)
class InfoResponse(Message):
    status: Status = STATUS_OK
    role: str = ""  # "pm" or "datanode"
    version: str = ""
    uptime_ms: int = 0
    node_id: int = -1  # the data node's id; -1 on the PM


@request(Opcode.STATS)
class StatsRequest(Message):
    """Project opcode: per-stream figures for ``stream_ids``, or the ``top`` streams by rate."""

    stream_ids: tuple[int, ...] = ()
    top: int = 0  # 0 = the server's default


@response(Opcode.STATS)
class StatsResponse(Message):
    status: Status = STATUS_OK
    stream_count: int = 0


@request(Opcode.CONNECTIONS)
class ConnectionsRequest(Message):
    """Project opcode: the server's open connections (at most ``limit``; 0 = the default)."""

    limit: int = 0


@response(Opcode.CONNECTIONS)
class ConnectionsResponse(Message):
    status: Status = STATUS_OK
    connection_count: int = 0  # open connections; the payload lists at most `limit`


@request(Opcode.WHOAMI)
class WhoamiRequest(Message):
    """Project opcode: the caller's own connection as the server sees it."""


@response(Opcode.WHOAMI)
class WhoamiResponse(Message):
    status: Status = STATUS_OK
    connection_id: int = 0
    peer: str = ""
    client_id: str = ""
    client_role: ClientRole = ClientRole.UNSPECIFIED


# ------------------------------------------------------------------------- quotas 0x1020-0x1023


@table()
class Quota(Table):
    """One quota (sbpstream.quota.model.QuotaSpec on the wire); -1 = rate not limited."""

    kind: int = 0  # 0 default, 1 client id, 2 stream, 3 user
    name: str = ""  # the client id, the decimal stream id, or "" (default, user)
    produce_bytes_per_s: int = -1
    fetch_bytes_per_s: int = -1
    requests_per_s: int = -1
    user: str = ""  # appended: the principal of a user or user+client-id quota


@table()
class QuotaResult(Table):
    quota: Quota | None = None
    status: Status = STATUS_OK


@request(Opcode.SET_QUOTAS)
class SetQuotasRequest(Message):
    timeout_ms: int = 0
    quotas: tuple[Quota, ...] = ()


@response(Opcode.SET_QUOTAS)
class SetQuotasResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    results: tuple[QuotaResult, ...] = ()


@request(Opcode.DELETE_QUOTAS)
class DeleteQuotasRequest(Message):
    timeout_ms: int = 0
    quotas: tuple[Quota, ...] = ()  # only kind and name are read


@response(Opcode.DELETE_QUOTAS)
class DeleteQuotasResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    results: tuple[QuotaResult, ...] = ()


@request(Opcode.DESCRIBE_QUOTAS)
class DescribeQuotasRequest(Message):
    timeout_ms: int = 0


@response(Opcode.DESCRIBE_QUOTAS)
class DescribeQuotasResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    quotas: tuple[Quota, ...] = ()


@table()
class QuotaCounter(Table):
    """One live counter as Throttr's QUERY answers it: quota left, TTL type, TTL left."""

    key: str = ""
    quota: int = 0
    ttl_type: int = 3  # Throttr's TTL type; 3 = milliseconds
    ttl: int = 0


@request(Opcode.QUOTA_COUNTERS)
class QuotaCountersRequest(Message):
    timeout_ms: int = 0


@response(Opcode.QUOTA_COUNTERS)
class QuotaCountersResponse(Message):
    throttle_time_ms: int = 0
    status: Status = STATUS_OK
    counters: tuple[QuotaCounter, ...] = ()
    max_counters: int = 0
    overflowed: int = 0
    quotas: tuple[Quota, ...] = ()  # the quotas the node enforces


# ------------------------------------------------------------------- AUTHENTICATE (project opcodes)


@request(Opcode.AUTHENTICATE)
class AuthenticateRequest(Message):
    mechanism: str = ""  # "SCRAM-SHA-256" or "TOKEN"
    data: bytes = b""  # the SCRAM client message, or the token


@response(Opcode.AUTHENTICATE)
class AuthenticateResponse(Message):
    status: Status = STATUS_OK
    data: bytes = b""  # the SCRAM server message
    token: str = ""  # after a successful SCRAM exchange
    expires_at_ms: int = 0
    principal: str = ""
    done: bool = False  # the connection is authenticated


@request(Opcode.MANAGE_USERS)
class ManageUsersRequest(Message):
    action: int = 0  # 1 add, 2 delete, 3 list
    user: str = ""
    password: str = ""


@table()
class UserEntry(Table):
    name: str = ""


@response(Opcode.MANAGE_USERS)
class ManageUsersResponse(Message):
    status: Status = STATUS_OK
    users: tuple[UserEntry, ...] = ()


@table()
class AclEntry(Table):
    principal: str = ""
    operations: str = ""  # comma-separated: create,delete,update,trim,describe,append,fetch,admin
    resource: str = ""  # "stream:ID", "prefix:TEXT" or "*"


@request(Opcode.MANAGE_ACLS)
class ManageAclsRequest(Message):
    action: int = 0  # 1 add, 2 delete, 3 list
    acl: AclEntry | None = None
    principal: str = ""  # list filter


@response(Opcode.MANAGE_ACLS)
class ManageAclsResponse(Message):
    status: Status = STATUS_OK
    acls: tuple[AclEntry, ...] = ()


# ------------------------------------------ consumer groups and committed offsets (project)
# docs/protocol.md, "Consumer groups": offsets are durable PM metadata; membership is the PM
# leader's memory, rebuilt by heartbeats after a failover.


@table()
class NameItem(Table):
    """One string of a list (the codec has no vector of strings)."""

    name: str = ""


@request(Opcode.JOIN_GROUP)
class JoinGroupRequest(Message):
    """Project opcode: join ``group`` sharing the streams named by ids, names and a pattern."""

    timeout_ms: int = 0
    group: str = ""
    member_id: str = ""  # "" = new member
    stream_ids: tuple[int, ...] = ()
    stream_names: tuple[NameItem, ...] = ()
    stream_pattern: str = ""  # a name prefix ending in '*'
    session_timeout_ms: int = 0  # 0 = the PM's default
    client_id: str = ""


@response(Opcode.JOIN_GROUP)
class JoinGroupResponse(Message):
    status: Status = STATUS_OK
    member_id: str = ""
    generation: int = 0
    stream_ids: tuple[int, ...] = ()  # the subscription, resolved
    session_timeout_ms: int = 0


@request(Opcode.GROUP_HEARTBEAT)
class GroupHeartbeatRequest(Message):
    """Project opcode: stay in the group; ``owned`` = the streams still consumed."""

    timeout_ms: int = 0
    group: str = ""
    member_id: str = ""
    generation: int = 0
    owned: tuple[int, ...] = ()


@response(Opcode.GROUP_HEARTBEAT)
class GroupHeartbeatResponse(Message):
    status: Status = STATUS_OK
    generation: int = 0
    assigned: tuple[int, ...] = ()
    pending: int = 0  # streams of the member's target still held by another member


@request(Opcode.LEAVE_GROUP)
class LeaveGroupRequest(Message):
    timeout_ms: int = 0
    group: str = ""
    member_id: str = ""


@response(Opcode.LEAVE_GROUP)
class LeaveGroupResponse(Message):
    status: Status = STATUS_OK


@table()
class OffsetCommitItem(Table):
    stream_id: int = 0
    offset: int = 0  # the next offset to read
    metadata: str = ""


@table()
class OffsetCommitResult(Table):
    stream_id: int = 0
    status: Status = STATUS_OK


@request(Opcode.OFFSET_COMMIT)
class OffsetCommitRequest(Message):
    """Project opcode: commit offsets; a member's commit is fenced by its generation."""

    timeout_ms: int = 0
    group: str = ""
    member_id: str = ""  # "" with generation -1: from outside the group
    generation: int = -1
    items: tuple[OffsetCommitItem, ...] = ()


@response(Opcode.OFFSET_COMMIT)
class OffsetCommitResponse(Message):
    status: Status = STATUS_OK
    items: tuple[OffsetCommitResult, ...] = ()


@request(Opcode.OFFSET_FETCH)
class OffsetFetchRequest(Message):
    """Project opcode: committed offsets of ``stream_ids`` (empty = every committed stream)."""

    timeout_ms: int = 0
    group: str = ""
    stream_ids: tuple[int, ...] = ()


@table()
class OffsetFetchResult(Table):
    stream_id: int = 0
    offset: int = -1  # -1 = nothing committed
    metadata: str = ""
    commit_ms: int = 0
    status: Status = STATUS_OK


@response(Opcode.OFFSET_FETCH)
class OffsetFetchResponse(Message):
    status: Status = STATUS_OK
    items: tuple[OffsetFetchResult, ...] = ()


@table()
class GroupMember(Table):
    member_id: str = ""
    client_id: str = ""
    host: str = ""
    stream_ids: tuple[int, ...] = ()  # subscribed
    assigned: tuple[int, ...] = ()


@table()
class GroupDescription(Table):
    group: str = ""
    status: Status = STATUS_OK
    state: str = ""  # "stable", "rebalancing" or "empty"
    generation: int = 0
    members: tuple[GroupMember, ...] = ()
    committed_streams: int = 0


@request(Opcode.DESCRIBE_GROUPS)
class DescribeGroupsRequest(Message):
    timeout_ms: int = 0
    groups: tuple[NameItem, ...] = ()


@response(Opcode.DESCRIBE_GROUPS)
class DescribeGroupsResponse(Message):
    status: Status = STATUS_OK
    items: tuple[GroupDescription, ...] = ()


@request(Opcode.LIST_GROUPS)
class ListGroupsRequest(Message):
    timeout_ms: int = 0


@response(Opcode.LIST_GROUPS)
class ListGroupsResponse(Message):
    status: Status = STATUS_OK
    groups: tuple[NameItem, ...] = ()


@table()
class GroupResult(Table):
    group: str = ""
    status: Status = STATUS_OK


@request(Opcode.DELETE_GROUP)
class DeleteGroupRequest(Message):
    timeout_ms: int = 0
    groups: tuple[NameItem, ...] = ()


@response(Opcode.DELETE_GROUP)
class DeleteGroupResponse(Message):
    status: Status = STATUS_OK
    items: tuple[GroupResult, ...] = ()


@request(Opcode.RESET_OFFSETS)
class ResetOffsetsRequest(Message):
    """Project opcode: set committed offsets of a group without members (offset -1 forgets)."""

    timeout_ms: int = 0
    group: str = ""
    items: tuple[OffsetCommitItem, ...] = ()


@response(Opcode.RESET_OFFSETS)
class ResetOffsetsResponse(Message):
    status: Status = STATUS_OK
    items: tuple[OffsetCommitResult, ...] = ()


# -------------------------------------------------------------------------------------- registries

MESSAGES: Final[tuple[type[Message], ...]] = tuple(_MESSAGES)
if set(REQUESTS) != set(Opcode) or set(RESPONSES) != set(Opcode):
    raise TypeError("every opcode needs a request and a response class")


def decode_request(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a request header; an opcode without a request class raises KeyError."""
    return REQUESTS[Opcode(opcode)].decode(buf)


def decode_response(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a response header; an opcode without a response class raises KeyError.

    A system error frame (flag 0x04) carries :class:`SystemErrorResponse` whatever the opcode:
    decode it with ``SystemErrorResponse.decode``.
    """
    return RESPONSES[Opcode(opcode)].decode(buf)
