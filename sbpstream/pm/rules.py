"""Every PM metadata rule, written once against a small transaction interface.

A rule reads and writes through :class:`MetaTxn` and either returns its item's outcome or
raises :class:`~sbpstream.protocol.errors.SbpError`, in which case none of its writes happen.
Backends (:mod:`sbpstream.pm.sqlite_meta`, :mod:`sbpstream.pm.etcd`) only decide how a batch of
items becomes durable; what an item does is decided here, so both behave the same by
construction (tests/test_pm_etcd_conformance.py runs every rule on both).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Final, Protocol

from sbpstream.pm.metadata import (
    MAX_NODE_ID,
    MAX_STREAM_ID,
    WRITABLE_END_OFFSET,
    CreatedStream,
    DeleteOutcome,
    NewStream,
    NodeMeta,
    NodeMetrics,
    OffsetMeta,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    SealOutcome,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.staging import ALL_RANGES
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    InvalidStreamConfigError,
    LimitExceededError,
    MetadataError,
    RangeNotFoundError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import validate_group_name, validate_stream_name
from sbpstream.quota.model import MAX_QUOTAS, QuotaSpec, entity_key, validate, validate_entity

COUNTER_STREAM: Final = "next_stream_id"
COUNTER_NODE: Final = "next_node_id"
"""Id counters (SQLite's ``meta`` keys, etcd's ``P/meta/...`` keys): the next id to hand out."""

SOFT_STATE_FLUSH_INTERVAL_S: Final = 5.0
"""Heartbeat times and metrics reach the store at most this late. They only inform placement
and operators; liveness after a restart restarts from a fresh grace period, so losing them is
safe (metadata.py's atomicity contract)."""


class MetaTxn(Protocol):
    """What a rule may read and write. Reads see the rule's own earlier writes and those of
    earlier items of the same call."""

    def stream(self, sid: int) -> StreamMeta | None: ...

    def ranges(self, sid: int) -> list[RangeMeta]: ...

    def range(self, sid: int, idx: int) -> RangeMeta | None: ...

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]: ...

    def node(self, nid: int) -> NodeMeta | None: ...

    def put_stream(self, s: StreamMeta) -> None: ...

    def put_range(self, r: RangeMeta) -> None:
        """MetadataError when the range lists a node twice."""

    def put_producers(self, sid: int, idx: int, ps: tuple[ProducerStateMeta, ...]) -> None: ...

    def put_node(self, n: NodeMeta) -> None: ...

    def drop_ranges_below(self, sid: int, bound: int) -> None:
        """Delete the ranges of ``sid`` with index < ``bound`` and their producer states."""

    def next_id(self, name: str, n: int = 1) -> int:
        """Advance counter ``name`` by ``n``; its value before (the first id of the block)."""

    def stream_named(self, name: str) -> int | None:
        """The name index: the id of the live stream holding ``name``, or None."""

    def put_name(self, name: str, sid: int) -> None:
        """``name`` now names stream ``sid`` (SQLite: a ``stream_names`` row; etcd: the key
        ``P/names/<name>``, written in the same transaction as the stream, compared absent)."""

    def drop_name(self, name: str) -> None:
        """``name`` is free again."""

    def quota(self, key: str) -> QuotaSpec | None: ...

    def quota_count(self) -> int: ...

    def put_quota(self, q: QuotaSpec) -> None: ...

    def delete_quota(self, key: str) -> None: ...

    def offset(self, group: str, sid: int) -> OffsetMeta | None:
        """The committed offset of ``group`` in stream ``sid``, or None."""

    def put_offset(self, o: OffsetMeta) -> None: ...

    def drop_offset(self, group: str, sid: int) -> None: ...


# ---------------------------------------------------------------------------- helpers
def sorted_replicas(reps: Iterable[ReplicaMeta]) -> tuple[ReplicaMeta, ...]:
    """The replica order every read returns: primary first, then by node id."""
    return tuple(sorted(reps, key=lambda r: (not r.is_primary, r.node_id)))


def live_stream(tx: MetaTxn, sid: int) -> StreamMeta:
    s = tx.stream(sid)
    if s is None:
        raise StreamNotFoundError(f"stream {sid} does not exist")
    if s.deleted:
        raise StreamDeletedError(f"stream {sid} was deleted")
    return s


# ---------------------------------------------------------------------------- data nodes
def allocate_node_id(tx: MetaTxn, host: str, now_ms: int) -> int:
    nid = tx.next_id(COUNTER_NODE)
    if nid > MAX_NODE_ID:
        raise LimitExceededError("node ids exhausted (int32)")
    if tx.node(nid) is not None:
        raise MetadataError(f"node id {nid} is already registered")
    tx.put_node(NodeMeta(nid, host, "", now_ms))
    return nid


def update_node_address(tx: MetaTxn, nid: int, advertise_addr: str) -> NodeMeta:
    n = tx.node(nid)
    if n is None:
        raise DataNodeNotFoundError(f"data node {nid} was never allocated here")
    n = replace(n, advertise_addr=advertise_addr)
    tx.put_node(n)
    return n


def set_node_draining(tx: MetaTxn, nid: int, draining: bool) -> NodeMeta:
    """Mark node ``nid`` draining (or cancel it). DataNodeNotFoundError if unknown;
    InvalidRequestError if it already is (or is not) draining."""
    n = tx.node(nid)
    if n is None:
        raise DataNodeNotFoundError(f"data node {nid} is unknown; `sbpstream nodes` lists the "
                                    "registered ones")
    if n.draining == draining:
        if draining:
            raise InvalidRequestError(f"data node {nid} is already draining; watch it with "
                                      "`sbpstream node status`, or cancel with "
                                      f"`sbpstream node drain {nid} --cancel`")
        raise InvalidRequestError(f"data node {nid} is not draining; start with "
                                  f"`sbpstream node drain {nid}`")
    n = replace(n, draining=draining)
    tx.put_node(n)
    return n


def flush_soft_state(tx: MetaTxn, nid: int) -> None:
    """Persist a node's pending soft state (a read of the node already carries it)."""
    n = tx.node(nid)
    if n is not None:
        tx.put_node(n)


# ---------------------------------------------------------------------------- streams
def reserve_stream_ids(tx: MetaTxn, n: int) -> int:
    """A block of ``n`` fresh stream ids for one CREATE_STREAMS call; its first id. An item
    that fails later burns its id: ids are never reused."""
    first = tx.next_id(COUNTER_STREAM, n)
    if first + n - 1 > MAX_STREAM_ID:
        raise LimitExceededError("stream ids exhausted (int64)")
    return first


def create_stream(tx: MetaTxn, sid: int, item: NewStream, now_ms: int) -> CreatedStream:
    """Stream ``sid`` and its range 0 at offset 0, together; with its name, if it has one
    (InvalidStreamConfigError when a live stream holds the name already)."""
    if item.name:
        validate_stream_name(item.name)
        holder = tx.stream_named(item.name)
        if holder is not None:
            raise InvalidStreamConfigError(
                f"stream name {item.name!r} is taken by stream {holder}")
    if tx.stream(sid) is not None or tx.range(sid, 0) is not None:
        raise MetadataError(f"could not create stream: id {sid} is already in use")
    stream = StreamMeta(sid, item.replica_nums, item.retention_period_ms, 0, False, now_ms,
                        now_ms, item.name)
    rng = RangeMeta(sid, 0, 0, WRITABLE_END_OFFSET, 0, item.replicas)
    if item.name:
        tx.put_name(item.name, sid)
    tx.put_stream(stream)
    tx.put_range(rng)
    return CreatedStream(stream, rng)


def update_stream(tx: MetaTxn, u: StreamUpdate, now_ms: int) -> StreamMeta:
    s = replace(live_stream(tx, u.stream_id), replica_nums=u.replica_nums,
                retention_period_ms=u.retention_period_ms, updated_ms=now_ms)
    tx.put_stream(s)
    return s


def trim_stream(tx: MetaTxn, sid: int, trim_offset: int, now_ms: int) -> TrimOutcome:
    """Drop sealed ranges wholly below the offset, raise the start of the first remaining one,
    set the stream's start. Never lowers the start; a negative offset is invalid."""
    if trim_offset < 0:
        raise InvalidRequestError(f"trim offset {trim_offset} is negative")
    stream = live_stream(tx, sid)
    ranges = tx.ranges(sid)
    if trim_offset <= stream.start_offset:
        return TrimOutcome(stream, ranges[0] if ranges else None, ())
    dropped = tuple(r for r in ranges if not r.writable and r.end_offset <= trim_offset)
    remaining = ranges[len(dropped):]
    if dropped:
        tx.drop_ranges_below(sid, remaining[0].range_index if remaining else ALL_RANGES)
    first: RangeMeta | None = None
    if remaining:
        r0 = remaining[0]
        start = max(r0.start_offset, trim_offset)
        first = replace(r0, start_offset=start, next_offset=max(r0.next_offset, start))
        if first != r0:
            tx.put_range(first)
    s = replace(stream, start_offset=trim_offset, updated_ms=now_ms)
    tx.put_stream(s)
    return TrimOutcome(s, first, dropped)


def delete_stream(tx: MetaTxn, sid: int, now_ms: int) -> DeleteOutcome:
    """Mark the stream deleted (the id stays taken), release its name, remove its ranges."""
    stream = live_stream(tx, sid)
    ranges = tx.ranges(sid)
    if stream.name and tx.stream_named(stream.name) == sid:
        tx.drop_name(stream.name)
    tx.drop_ranges_below(sid, ALL_RANGES)
    s = replace(stream, deleted=True, updated_ms=now_ms)
    tx.put_stream(s)
    return DeleteOutcome(s, tuple(ranges))


# ---------------------------------------------------------------------------- ranges
def record_next_offset(tx: MetaTxn, sid: int, idx: int, next_offset: int) -> None:
    """Soft progress of a writable range: never lowers, never touches a sealed range."""
    r = tx.range(sid, idx)
    if r is not None and r.writable and next_offset > r.next_offset:
        tx.put_range(replace(r, next_offset=next_offset))


def seal_and_new(
    tx: MetaTxn,
    sid: int,
    idx: int,
    end_offset: int,
    new_replicas: tuple[ReplicaMeta, ...],
    producers: Sequence[ProducerStateMeta],
) -> SealOutcome:
    """Seal writable range ``idx`` at ``end_offset`` and open ``idx + 1`` there on
    ``new_replicas``; with no ``new_replicas``, seal it alone (too few live nodes for a new
    range: reads must not wait for one). A sealed range with a successor answers with that pair
    and its stored producer states (idempotent); a sealed last range gets its successor when
    replicas are given."""
    live_stream(tx, sid)
    cur = tx.range(sid, idx)
    if cur is None:
        raise RangeNotFoundError(f"stream {sid} has no range {idx}")
    end = end_offset
    if not cur.writable:
        nxt = tx.range(sid, idx + 1)
        if nxt is not None:  # any sealed range: its pair and its producer states
            return SealOutcome(cur, nxt, tx.producers(sid, idx), False)
        if not new_replicas:
            return SealOutcome(cur, None, tx.producers(sid, idx), False)
        end = cur.end_offset  # sealed alone earlier: open its successor now
        sealed = cur
    else:
        if end < cur.start_offset:
            raise InvalidRequestError(f"seal end {end} is below range start {cur.start_offset}")
        sealed = replace(cur, end_offset=end, next_offset=end)
        tx.put_range(sealed)
        if producers:
            merged = {p.producer_id: p for p in tx.producers(sid, idx)}
            merged.update((p.producer_id, p) for p in producers)
            tx.put_producers(sid, idx, tuple(merged[k] for k in sorted(merged)))
    new: RangeMeta | None = None
    if new_replicas:
        new = RangeMeta(sid, idx + 1, end, WRITABLE_END_OFFSET, end,
                        sorted_replicas(new_replicas))
        tx.put_range(new)
    return SealOutcome(sealed, new, tx.producers(sid, idx), True)


def replace_replica(tx: MetaTxn, sid: int, idx: int, old_node_id: int,
                    new_node_id: int) -> RangeMeta:
    """Sealed range ``idx``: its replica on ``old_node_id`` moves to ``new_node_id`` (keeping
    its is_primary flag). Idempotent once done. RangeNotFoundError without the range,
    InvalidRequestError for a writable range or a replica set that has neither node."""
    live_stream(tx, sid)
    cur = tx.range(sid, idx)
    if cur is None:
        raise RangeNotFoundError(f"stream {sid} has no range {idx}")
    if cur.writable:
        raise InvalidRequestError(f"range {sid}/{idx} is writable: only sealed ranges are "
                                  "re-replicated")
    ids = cur.node_ids
    if old_node_id not in ids:
        if new_node_id in ids:
            return cur
        raise InvalidRequestError(f"range {sid}/{idx} has no replica on node {old_node_id}")
    if new_node_id in ids:
        raise InvalidRequestError(f"range {sid}/{idx} already has a replica on node "
                                  f"{new_node_id}")
    reps = (ReplicaMeta(new_node_id, r.is_primary) if r.node_id == old_node_id else r
            for r in cur.replicas)
    new = replace(cur, replicas=sorted_replicas(reps))
    tx.put_range(new)
    return new


# ---------------------------------------------------------------------------- committed offsets
MAX_OFFSET_METADATA: Final = 4096
"""UTF-8 bytes of a commit's metadata string."""


def commit_offset(tx: MetaTxn, o: OffsetMeta, now_ms: int) -> OffsetMeta:
    """Store a committed offset of a live stream; ``offset`` -1 forgets it (also for a stream
    deleted since). Offsets only need to be >= 0: the group may commit ahead of the PM's soft
    view of the stream's end, and a reset may move them back."""
    validate_group_name(o.group)
    if len(o.metadata.encode()) > MAX_OFFSET_METADATA:
        raise LimitExceededError(f"commit metadata over {MAX_OFFSET_METADATA} bytes")
    if o.offset == -1:
        if tx.offset(o.group, o.stream_id) is not None:
            tx.drop_offset(o.group, o.stream_id)
        return replace(o, commit_ms=now_ms)
    if o.offset < 0:
        raise InvalidRequestError(f"bad committed offset {o.offset}: offsets are >= 0")
    live_stream(tx, o.stream_id)
    out = replace(o, commit_ms=now_ms)
    tx.put_offset(out)
    return out


# ---------------------------------------------------------------------------- soft state
# ---------------------------------------------------------------------------- quotas (issue 22)
def set_quota(tx: MetaTxn, spec: QuotaSpec) -> QuotaSpec:
    """Create or replace the quota of an entity; hostile values are refused (quota.model)."""
    q = validate(spec)
    if tx.quota(q.key) is None and tx.quota_count() >= MAX_QUOTAS:
        raise LimitExceededError(f"{MAX_QUOTAS} quotas are stored already; delete some first")
    tx.put_quota(q)
    return q


def delete_quota(tx: MetaTxn, kind: int, name: str, user: str = "") -> QuotaSpec:
    """Delete an entity's quota; the quota deleted."""
    k, n, u = validate_entity(kind, name, user)
    key = entity_key(k, n, u)
    old = tx.quota(key)
    if old is None:
        raise InvalidRequestError(f"there is no quota for {key}")
    tx.delete_quota(key)
    return old


class SoftState:
    """Heartbeat times and metrics not yet persisted. Reads of a node see them at once; a
    backend persists them with its next durable write, when :meth:`due`, or at close."""

    def __init__(self) -> None:
        self.heartbeats: dict[int, int] = {}
        self.metrics: dict[int, tuple[NodeMetrics, int]] = {}
        self.last_flush = time.monotonic()

    def heartbeat(self, nid: int, now_ms: int) -> None:
        self.heartbeats[nid] = now_ms

    def report(self, nid: int, metrics: NodeMetrics, now_ms: int) -> None:
        self.metrics[nid] = (metrics, now_ms)

    def due(self) -> bool:
        return time.monotonic() - self.last_flush >= SOFT_STATE_FLUSH_INTERVAL_S

    def pending(self) -> list[int]:
        """Node ids with pending soft state, ascending."""
        return sorted(self.heartbeats.keys() | self.metrics.keys())

    def applied(self, n: NodeMeta) -> NodeMeta:
        """``n`` as it reads with the pending soft state."""
        hb = self.heartbeats.get(n.node_id)
        if hb is not None:
            n = replace(n, last_heartbeat_ms=hb)
        m = self.metrics.get(n.node_id)
        if m is not None:
            n = replace(n, metrics=m[0], metrics_ms=m[1])
        return n

    def forget(self, ids: Iterable[int]) -> None:
        """These nodes' soft state is persisted (or dropped)."""
        for nid in ids:
            self.heartbeats.pop(nid, None)
            self.metrics.pop(nid, None)
