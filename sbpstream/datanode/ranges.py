"""What the data node knows about each range beyond the store: placement and commit state.

The store holds the bytes and each range's start/next/end. This table adds, per range, who the
replicas are and whether this node is the primary (learned from SYNC_RANGES and LIST_RANGES), and
the **committed offset**: everything below it has been acknowledged to a writer. Reads never
return a batch at or after it, so no reader ever sees a record that a crash could still lose or a
seal could still cut off. Per stream it keeps the long-poll waiters: a FETCH parked at the end of
a stream registers an ``asyncio.Event`` here, and the append path sets it right after a commit.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sbpstream.protocol.messages import ReplicaNode


@dataclass(slots=True, eq=False)
class ReplicaRange:
    stream_id: int
    range_index: int
    committed_offset: int
    replicas: tuple[ReplicaNode, ...] = ()
    # Unknown placement (no replica list yet) counts as primary: a single-node range.
    is_primary: bool = True
    # On the primary of a replicated range: the offset below which every secondary confirmed
    # holding the batches (-1: unknown, e.g. nothing replicated since this node started). Every
    # acknowledged record is below it; a seal that cannot reach the secondaries uses it as this
    # node's end, so that no secondary is left short of a sealed range (see control.seal).
    replicated_offset: int = -1
    last_active: float = field(default_factory=time.monotonic)


@dataclass(slots=True, eq=False)
class StreamInfo:
    stream_id: int
    ranges: dict[int, ReplicaRange] = field(default_factory=dict)
    waiters: set[asyncio.Event] = field(default_factory=set)

    def last(self) -> ReplicaRange | None:
        return self.ranges[max(self.ranges)] if self.ranges else None


class RangeTable:
    def __init__(self) -> None:
        self.streams: dict[int, StreamInfo] = {}
        self.pending: set[int] = set()
        """Streams known from the local store only, until the PM confirms their ranges (a data
        node reconciling in the background after a restart, see node.py): no append reaches
        them before a lookup at the PM, and readers wait (the PM may have sealed them shorter
        while the node was away)."""

    def confirm(self, stream_ids: list[int] | set[int]) -> None:
        """The PM's view of these streams was applied: serve them, wake their readers."""
        for sid in stream_ids:
            if sid in self.pending:
                self.pending.discard(sid)
                self.wake(sid)

    def get(self, stream_id: int, range_index: int) -> ReplicaRange | None:
        s = self.streams.get(stream_id)
        return None if s is None else s.ranges.get(range_index)

    def ensure(self, stream_id: int, range_index: int, committed_offset: int) -> ReplicaRange:
        s = self.streams.get(stream_id)
        if s is None:
            s = self.streams[stream_id] = StreamInfo(stream_id)
        r = s.ranges.get(range_index)
        if r is None:
            r = s.ranges[range_index] = ReplicaRange(stream_id, range_index, committed_offset)
        return r

    def set_placement(self, r: ReplicaRange, replicas: tuple[ReplicaNode, ...],
                      node_id: int) -> None:
        if not replicas:
            return
        r.replicas = replicas
        r.is_primary = any(rn.is_primary and rn.data_node.node_id == node_id for rn in replicas)

    def commit(self, stream_id: int, range_index: int, next_offset: int) -> None:
        """Records below ``next_offset`` are acknowledged: publish them and wake the readers."""
        s = self.streams.get(stream_id)
        if s is None:
            return
        r = s.ranges.get(range_index)
        if r is None:
            return
        r.last_active = time.monotonic()
        if next_offset > r.committed_offset:
            r.committed_offset = next_offset
            self.wake(stream_id)

    def wake(self, stream_id: int) -> None:
        s = self.streams.get(stream_id)
        if s is not None:
            for ev in s.waiters:
                ev.set()

    def wake_all(self) -> None:
        for s in self.streams.values():
            for ev in s.waiters:
                ev.set()

    def high_watermark(self, stream_id: int) -> int:
        """The next offset a reader may read up to (exclusive) in this stream, or -1 (also
        while the stream awaits confirmation by the PM: its readers wait)."""
        if stream_id in self.pending:
            return -1
        s = self.streams.get(stream_id)
        last = None if s is None else s.last()
        return -1 if last is None else last.committed_offset

    def drop_stream(self, stream_id: int) -> None:
        s = self.streams.pop(stream_id, None)
        if s is not None:
            for ev in s.waiters:
                ev.set()

    def active_ranges(self, window_s: float, now: float) -> int:
        return sum(
            1 for s in self.streams.values() for r in s.ranges.values()
            if now - r.last_active <= window_s
        )
