"""Writes staged over a backend's committed state: the one implementation of
:class:`~sbpstream.pm.rules.MetaTxn` that both backends use.

A backend plans a call item by item. Each item runs its rule against a :class:`StagedTxn` that
reads through the item's own :class:`Layer` (top), the layer of the items before it (below) and
finally the backend's committed state (a :class:`BaseReader`: SQLite queries inside the write
transaction, or etcd's in-memory cache). A rule that raises leaves its item layer unmerged, so
each item is all-or-nothing without savepoints; a merged layer is what the backend then writes
(SQL statements, or one fenced etcd transaction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Protocol

from sbpstream.pm.metadata import NodeMeta, ProducerStateMeta, RangeMeta, StreamMeta
from sbpstream.protocol.errors import MetadataError

ALL_RANGES: Final = 1 << 62
"""A range-index bound above every real index: "drop every range of the stream"."""


class BaseReader(Protocol):
    """Committed state as one backend reads it (nothing staged)."""

    def stream(self, sid: int) -> StreamMeta | None: ...

    def ranges(self, sid: int) -> list[RangeMeta]:
        """Every range of ``sid``, ascending index."""

    def range(self, sid: int, idx: int) -> RangeMeta | None: ...

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]: ...

    def node(self, nid: int) -> NodeMeta | None:
        """The node with its pending soft state applied."""

    def counter(self, name: str) -> int: ...


@dataclass(slots=True)
class Layer:
    """Writes staged over committed state: one item's, or several items' merged in order."""

    streams: dict[int, StreamMeta] = field(default_factory=dict)
    ranges: dict[int, dict[int, RangeMeta]] = field(default_factory=dict)
    """stream id -> range index -> range, as the rule put it."""
    dropped: dict[int, int] = field(default_factory=dict)
    """stream id -> ranges (and their producer states) with index < bound are deleted; the
    drops of a layer apply before its puts."""
    producers: dict[int, dict[int, tuple[ProducerStateMeta, ...]]] = field(default_factory=dict)
    nodes: dict[int, NodeMeta] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.streams or self.ranges or self.dropped or self.producers
                    or self.nodes or self.counters)

    def all_ranges(self) -> list[RangeMeta]:
        return [r for per in self.ranges.values() for r in per.values()]

    def drop(self, sid: int, bound: int) -> None:
        """Ranges of ``sid`` below ``bound`` go, including any this layer put before."""
        self.dropped[sid] = max(bound, self.dropped.get(sid, 0))
        for staged in (self.ranges, self.producers):
            per = staged.get(sid)
            if per:
                for idx in [i for i in per if i < bound]:
                    del per[idx]

    def merge(self, item: Layer) -> None:
        """Apply ``item`` (staged after this layer) on top of it."""
        for sid, bound in item.dropped.items():
            self.drop(sid, bound)
        self.streams.update(item.streams)
        for sid, per in item.ranges.items():
            self.ranges.setdefault(sid, {}).update(per)
        for sid, pper in item.producers.items():
            self.producers.setdefault(sid, {}).update(pper)
        self.nodes.update(item.nodes)
        self.counters.update(item.counters)


class StagedTxn:
    """Reads through staged layers (top first) to committed state; writes go to the top."""

    __slots__ = ("base", "below", "top")

    def __init__(self, base: BaseReader, below: Layer, top: Layer) -> None:
        self.base = base
        self.below = below
        self.top = top

    # --- reads
    def stream(self, sid: int) -> StreamMeta | None:
        for layer in (self.top, self.below):
            s = layer.streams.get(sid)
            if s is not None:
                return s
        return self.base.stream(sid)

    def ranges(self, sid: int) -> list[RangeMeta]:
        cur = {r.range_index: r for r in self.base.ranges(sid)}
        for layer in (self.below, self.top):
            bound = layer.dropped.get(sid)
            if bound is not None:
                cur = {i: r for i, r in cur.items() if i >= bound}
            cur.update(layer.ranges.get(sid, {}))
        return [cur[i] for i in sorted(cur)]

    def range(self, sid: int, idx: int) -> RangeMeta | None:
        for layer in (self.top, self.below):
            r = layer.ranges.get(sid, {}).get(idx)
            if r is not None:
                return r
            if idx < layer.dropped.get(sid, -1):
                return None
        return self.base.range(sid, idx)

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        for layer in (self.top, self.below):
            ps = layer.producers.get(sid, {}).get(idx)
            if ps is not None:
                return ps
            if idx < layer.dropped.get(sid, -1):
                return ()
        return self.base.producers(sid, idx)

    def node(self, nid: int) -> NodeMeta | None:
        for layer in (self.top, self.below):
            n = layer.nodes.get(nid)
            if n is not None:
                return n
        return self.base.node(nid)

    def counter(self, name: str) -> int:
        for layer in (self.top, self.below):
            if name in layer.counters:
                return layer.counters[name]
        return self.base.counter(name)

    # --- writes
    def put_stream(self, s: StreamMeta) -> None:
        self.top.streams[s.stream_id] = s

    def put_range(self, r: RangeMeta) -> None:
        if len(set(r.node_ids)) != len(r.node_ids):
            raise MetadataError(
                f"range {r.range_index} of stream {r.stream_id} lists a node twice")
        self.top.ranges.setdefault(r.stream_id, {})[r.range_index] = r

    def put_producers(self, sid: int, idx: int, ps: tuple[ProducerStateMeta, ...]) -> None:
        self.top.producers.setdefault(sid, {})[idx] = ps

    def put_node(self, n: NodeMeta) -> None:
        self.top.nodes[n.node_id] = n

    def drop_ranges_below(self, sid: int, bound: int) -> None:
        self.top.drop(sid, bound)

    def next_id(self, name: str, n: int = 1) -> int:
        first = self.counter(name)
        self.top.counters[name] = first + n
        return first
