"""The one interface to all Placement Manager metadata.

Everything the PM knows lives behind :class:`MetadataStore`: streams, their ranges and replica
placement, data nodes, and id counters. The embedded backend is SQLite
(:mod:`sbpstream.pm.sqlite_meta`); the etcd backend (:mod:`sbpstream.pm.etcd`) implements the
same protocol for several PMs.

The records here are plain frozen dataclasses, independent of the wire messages, so a backend
never imports the codec and the server converts at the edge. Their names never reuse a message
class's name (``ProducerStateMeta`` beside ``messages.ProducerState``, ``SealOutcome`` beside
``messages.SealResult``), so a reader always knows which side of that edge a value is on.

Every rule that changes metadata is written once, in :mod:`sbpstream.pm.rules`; a backend only
makes a batch of staged writes durable. :func:`sbpstream.pm.backends.open_metadata` picks the
backend from a URL.

Atomicity contract (every backend):

- ``create_streams``: one call is one transaction; each item is all-or-nothing (the stream row
  and its first range appear together or not at all) and gets its own outcome.
- ``seal_and_new``: marking a range sealed at ``end_offset`` and inserting range ``index + 1``
  starting there is one transaction; repeating it for a range already sealed returns the same
  pair and never creates a third range.
- ``update_streams``, ``trim_streams`` and ``delete_streams``: one transaction per call; each
  item changes its stream and that stream's ranges all-or-nothing and gets its own outcome.
- A call that returns has made its writes durable (``synchronous=FULL`` in SQLite), except the
  *soft state* (heartbeat time, metrics), which a backend may persist lazily: losing a few
  seconds of it in a crash is harmless because a restarted PM gives every node a fresh grace
  period and nodes report again within one interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sbpstream.protocol.errors import SbpError
from sbpstream.protocol.limits import MAX_STREAM_ID as MAX_STREAM_ID  # stream ids are int64
from sbpstream.quota.model import QuotaSpec

WRITABLE_END_OFFSET = -1
"""``end_offset`` of a writable (open) range, as the wire says (design.md, "unclear spec")."""

FIRST_STREAM_ID = 1
"""Stream ids start at 1: 0 is the FlatBuffers default, so a missing field never names a stream."""

FIRST_NODE_ID = 1
"""Node ids start at 1 for the same reason: ``node_id = 0`` means "not set" on the wire."""

MAX_NODE_ID = 2**31 - 1
"""Node ids are int32 on the wire (design.md: ALLOCATE_ID ``id`` is int32)."""



@dataclass(frozen=True, slots=True)
class StreamMeta:
    stream_id: int
    replica_nums: int
    retention_period_ms: int
    start_offset: int
    """The trim point: records below it are gone."""
    deleted: bool = False
    created_ms: int = 0
    updated_ms: int = 0
    name: str = ""
    """The stream's unique name ("" = unnamed); a deleted stream releases it."""


@dataclass(frozen=True, slots=True)
class ReplicaMeta:
    node_id: int
    is_primary: bool


@dataclass(frozen=True, slots=True)
class RangeMeta:
    stream_id: int
    range_index: int
    start_offset: int
    end_offset: int
    """-1 while the range is writable; the sealed end afterwards."""
    next_offset: int
    """Best known next offset: the sealed end, or the last one a data node reported."""
    replicas: tuple[ReplicaMeta, ...]

    @property
    def writable(self) -> bool:
        return self.end_offset == WRITABLE_END_OFFSET

    @property
    def primary_node_id(self) -> int | None:
        for r in self.replicas:
            if r.is_primary:
                return r.node_id
        return None

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(r.node_id for r in self.replicas)


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    """The last REPORT_METRICS of a data node (the spec's fields; units as the spec says)."""

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

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> NodeMetrics:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: int(v) for k, v in d.items() if k in names and isinstance(v, int)}
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class NodeMeta:
    node_id: int
    host: str
    advertise_addr: str
    registered_ms: int
    last_heartbeat_ms: int = 0
    """Wall-clock ms of the last heartbeat (soft state; liveness itself uses a monotonic clock)."""
    metrics: NodeMetrics | None = None
    metrics_ms: int = 0
    draining: bool = False
    """An operator is moving every range off the node (:mod:`sbpstream.pm.drain`): no new range
    is placed on it. Durable, so a restarted or newly elected PM goes on draining it."""


@dataclass(frozen=True, slots=True)
class ProducerStateMeta:
    """Highest sequence stored per idempotent producer in a sealed range (design.md section 5)."""

    producer_id: int
    producer_epoch: int
    last_sequence: int
    last_base_offset: int = -1
    """Offset of that producer's last stored batch (-1 unknown), so a resend can be answered."""


@dataclass(frozen=True, slots=True)
class NewStream:
    """One CREATE_STREAMS item after validation and placement."""

    replica_nums: int
    retention_period_ms: int
    replicas: tuple[ReplicaMeta, ...]
    name: str = ""
    """Validated by :func:`sbpstream.pm.rules.validate_stream_name`; "" = unnamed."""


@dataclass(frozen=True, slots=True)
class StreamUpdate:
    """One UPDATE_STREAMS item after validation."""

    stream_id: int
    replica_nums: int
    retention_period_ms: int


@dataclass(frozen=True, slots=True)
class CreatedStream:
    stream: StreamMeta
    first_range: RangeMeta


@dataclass(frozen=True, slots=True)
class SealOutcome:
    sealed: RangeMeta
    new: RangeMeta | None
    """The successor; None when the range was sealed alone (too few live nodes to place one)."""
    producers: tuple[ProducerStateMeta, ...]
    created: bool
    """True when this call sealed the range; False when it was already sealed (idempotent)."""


@dataclass(frozen=True, slots=True)
class TrimOutcome:
    stream: StreamMeta
    first_range: RangeMeta | None
    """The smallest range left after the trim (None only if the stream has no ranges)."""
    dropped: tuple[RangeMeta, ...]


@dataclass(frozen=True, slots=True)
class DeleteOutcome:
    stream: StreamMeta
    removed: tuple[RangeMeta, ...]


@dataclass(frozen=True, slots=True)
class OffsetMeta:
    """A consumer group's committed offset of one stream (docs/protocol.md, "Consumer
    groups"): the next offset the group reads there."""

    group: str
    stream_id: int
    offset: int
    metadata: str = ""
    commit_ms: int = 0


class MetadataStore(Protocol):
    """Everything the PM persists. All methods are coroutines; failures of the store itself raise
    :class:`~sbpstream.protocol.errors.MetadataError`; per-item problems are returned as
    :class:`~sbpstream.protocol.errors.SbpError` instances in the item's slot."""

    async def open(self) -> None:
        """Open (creating or migrating the schema if needed)."""

    async def close(self) -> None:
        """Persist soft state and release the store. Idempotent."""

    # --- ids and data nodes
    async def allocate_node_id(self, host: str, now_ms: int) -> int:
        """A fresh int32 node id, registered with ``host`` and no address yet."""

    async def get_node(self, node_id: int) -> NodeMeta | None: ...

    async def list_nodes(self) -> list[NodeMeta]: ...

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        """Durably record a node's advertise address; DataNodeNotFoundError if unknown."""

    async def set_node_draining(self, node_id: int, draining: bool) -> NodeMeta:
        """Durably mark a node draining or not (rules.set_node_draining): DataNodeNotFoundError
        if unknown, InvalidRequestError if it already is in that state."""

    async def remove_node(self, node_id: int) -> bool:
        """Forget a data node (its id is never handed out again). The caller has checked that
        no range lists it (pm/drain.py). True if it was registered."""

    async def record_heartbeat(self, node_id: int, now_ms: int) -> None:
        """Soft state: the wall-clock time of the node's last heartbeat."""

    async def record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        """Soft state: the node's latest REPORT_METRICS."""

    # --- streams
    async def set_quotas(self, items: Sequence[QuotaSpec]) -> list[QuotaSpec | SbpError]:
        """Create or replace quotas (rules.set_quota), each item all-or-nothing."""

    async def delete_quotas(
        self, items: Sequence[tuple[int, str, str]]
    ) -> list[QuotaSpec | SbpError]:
        """Delete quotas by (kind, name, user) (rules.delete_quota); each the quota deleted."""

    async def list_quotas(self) -> list[QuotaSpec]:
        """Every stored quota, by key."""

    async def create_streams(
        self, items: Sequence[NewStream], now_ms: int
    ) -> list[CreatedStream | SbpError]:
        """One transaction; each item all-or-nothing (the stream and range 0 at offset 0)."""

    async def get_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | None]:
        """The streams (deleted ones included, flagged), None where unknown; order kept."""

    async def list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        """Live (not deleted) streams with id > ``after_stream_id``, ascending, <= ``limit``."""

    async def get_stream_by_name(self, name: str) -> StreamMeta | None:
        """The live stream holding ``name`` (names are unique among live streams), or None."""

    async def list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        """Live streams whose name starts with ``prefix`` ("" = every named stream) and whose
        id is > ``after_stream_id``, ascending id, <= ``limit``."""

    async def update_streams(
        self, items: Sequence[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        """One transaction; per item the updated stream, or StreamNotFoundError /
        StreamDeletedError."""

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        """(stream_id, trim_offset) items, one transaction. Per item: drop sealed ranges wholly
        below the offset, raise the start of the first remaining one, set the stream's start.
        Never lowers the start (a smaller offset is a no-op); a negative one is invalid."""

    async def delete_streams(
        self, stream_ids: Sequence[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        """One transaction; per item mark the stream deleted and remove its ranges
        (StreamDeletedError if already deleted)."""

    # --- ranges
    async def list_ranges(self, stream_ids: Sequence[int]) -> list[list[RangeMeta]]:
        """Ranges per stream (ascending index), in the order of ``stream_ids``."""

    async def list_node_ranges(
        self, node_id: int, writable_only: bool = False
    ) -> list[RangeMeta]:
        """Every range with a replica on ``node_id`` (all replicas listed), by stream and index."""

    async def get_range(self, stream_id: int, range_index: int) -> RangeMeta | None: ...

    async def writable_range_counts(self) -> dict[int, int]:
        """node id -> number of writable ranges it hosts (placement's load term)."""

    async def record_next_offsets(self, updates: Sequence[tuple[int, int, int]]) -> None:
        """Soft: (stream_id, range_index, next_offset) reported by data nodes; never lowers."""

    async def seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: Sequence[ProducerStateMeta],
    ) -> SealOutcome:
        """Seal writable range ``range_index`` at ``end_offset`` and open ``range_index + 1`` there
        on ``new_replicas``, atomically (no ``new_replicas``: seal it alone, ``new`` None; a
        later call with replicas opens the successor of such a sealed last range). Already
        sealed (any sealed range with a successor): that range, its successor and the producer
        states stored at its seal, ``created=False`` (a replaying writer learns what an older
        range holds of it). RangeNotFoundError if there is no such range, StreamDeletedError if
        deleted."""

    async def get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]: ...

    async def replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        """Sealed range ``range_index``: its replica on ``old_node_id`` is now on
        ``new_node_id`` (re-replication). Idempotent once done."""

    # ---- auth records (users, ACL rules): opaque to the store, their rules live in
    # sbpstream.auth.records; durable like every other write, fenced on etcd
    async def auth_get(self, kind: str, key: str) -> str | None: ...

    async def auth_put(self, kind: str, key: str, value: str) -> None: ...

    async def auth_delete(self, kind: str, key: str) -> bool:
        """True if the record existed."""

    async def auth_list(self, kind: str) -> list[tuple[str, str]]:
        """Every (key, value) of ``kind``, by key."""

    async def commit_offsets(
        self, items: Sequence[OffsetMeta], now_ms: int
    ) -> list[OffsetMeta | SbpError]:
        """Store committed offsets (one transaction per call, each item its own outcome; an
        ``offset`` of -1 forgets the stream's committed offset)."""

    async def fetch_offsets(self, group: str, stream_ids: Sequence[int]) -> list[OffsetMeta]:
        """The committed offsets of ``group`` for ``stream_ids`` (empty: every stream it has
        one for), ascending stream id; streams without one are absent."""

    async def offset_groups(self) -> dict[str, int]:
        """Every group with committed offsets -> how many streams it has one for."""

    async def delete_offsets(self, group: str) -> int:
        """Forget every committed offset of ``group``; how many there were."""
