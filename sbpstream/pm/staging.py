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

from typing import Any, Final, Protocol

from sbpstream.pm.metadata import NodeMeta, OffsetMeta, ProducerStateMeta, RangeMeta, StreamMeta
from sbpstream.protocol.errors import MetadataError
from sbpstream.quota.model import QuotaSpec

ALL_RANGES: Final = 1 << 62
"""A range-index bound above every real index: "drop every range of the stream"."""

_MISSING: Final = object()


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

    def quota(self, key: str) -> QuotaSpec | None: ...

    def quota_keys(self) -> set[str]:
        """The keys of every stored quota (at most MAX_QUOTAS)."""
    def stream_named(self, name: str) -> int | None:
        """The id of the live stream holding ``name``, or None."""

    def offset(self, group: str, sid: int) -> OffsetMeta | None: ...


NAME_DROPPED: Final = 0
"""A layer's value for a name it released (stream ids start at 1)."""


class Layer:
    """Writes staged over committed state: one item's, or several items' merged in order.

    A *journaled* layer records how to undo each write, so items can be staged straight into
    it and an item whose rule fails is taken back with :meth:`undo` (cheaper than a layer per
    item when the items need no separate accounting, as in SQLite)."""

    __slots__ = ("counters", "dropped", "journal", "names", "nodes", "offsets", "producers",
                 "quotas", "ranges", "streams")

    def __init__(self, journaled: bool = False) -> None:
        self.streams: dict[int, StreamMeta] = {}
        self.ranges: dict[int, dict[int, RangeMeta]] = {}
        """stream id -> range index -> range, as the rule put it."""
        self.dropped: dict[int, int] = {}
        """stream id -> ranges (and their producer states) with index < bound are deleted;
        the drops of a layer apply before its puts."""
        self.producers: dict[int, dict[int, tuple[ProducerStateMeta, ...]]] = {}
        self.nodes: dict[int, NodeMeta] = {}
        self.counters: dict[str, int] = {}
        self.names: dict[str, int] = {}
        """name -> the stream id now holding it, or NAME_DROPPED when released."""
        self.quotas: dict[str, QuotaSpec | None] = {}
        """quota key -> the quota put, or None: deleted."""
        self.offsets: dict[tuple[str, int], OffsetMeta | None] = {}
        """(group, stream id) -> committed offset, or None when forgotten."""
        self.journal: list[tuple[dict[Any, Any], Any, object]] | None = (
            [] if journaled else None)
        """(dict, key, previous value or _MISSING) per write since the last :meth:`keep`."""

    @property
    def empty(self) -> bool:
        return not (self.streams or self.ranges or self.dropped or self.producers
                    or self.nodes or self.counters or self.names or self.quotas
                    or self.offsets)

    def all_ranges(self) -> list[RangeMeta]:
        return [r for per in self.ranges.values() for r in per.values()]

    # --- writes (journaled when asked)
    def _set(self, d: dict[Any, Any], key: object, value: object) -> None:
        if self.journal is not None:
            self.journal.append((d, key, d.get(key, _MISSING)))
        d[key] = value

    def _per(self, staged: dict[int, dict[int, Any]], sid: int) -> dict[int, Any]:
        per = staged.get(sid)
        if per is None:
            per = {}
            self._set(staged, sid, per)
        return per

    def put_stream(self, s: StreamMeta) -> None:
        if self.journal is not None:
            self.journal.append((self.streams, s.stream_id,
                                 self.streams.get(s.stream_id, _MISSING)))
        self.streams[s.stream_id] = s

    def put_range(self, r: RangeMeta) -> None:
        # Inlined _per/_set: one call per created stream on the hot path.
        journal, sid, idx = self.journal, r.stream_id, r.range_index
        per = self.ranges.get(sid)
        if per is None:
            per = self.ranges[sid] = {}
            if journal is not None:
                journal.append((self.ranges, sid, _MISSING))
        if journal is not None:
            journal.append((per, idx, per.get(idx, _MISSING)))
        per[idx] = r

    def put_producers(self, sid: int, idx: int, ps: tuple[ProducerStateMeta, ...]) -> None:
        self._set(self._per(self.producers, sid), idx, ps)

    def drop(self, sid: int, bound: int) -> None:
        """Ranges of ``sid`` below ``bound`` go, including any this layer put before."""
        self._set(self.dropped, sid, max(bound, self.dropped.get(sid, 0)))
        for staged in (self.ranges, self.producers):
            per: dict[int, Any] | None = staged.get(sid)
            if per:
                for idx in [i for i in per if i < bound]:
                    if self.journal is not None:
                        self.journal.append((per, idx, per[idx]))
                    del per[idx]

    def keep(self) -> None:
        """The writes so far stay (an item succeeded)."""
        if self.journal is not None:
            self.journal.clear()

    def undo(self) -> None:
        """Take back every write since the last :meth:`keep` (an item failed)."""
        journal = self.journal
        if journal is None:
            raise MetadataError("undo on a layer without a journal")
        for d, key, old in reversed(journal):
            if old is _MISSING:
                d.pop(key, None)
            else:
                d[key] = old
        journal.clear()

    def merge(self, item: Layer) -> None:
        """Apply ``item`` (staged after this layer) on top of it; ``item`` is used up."""
        if item.dropped:
            for sid, bound in item.dropped.items():
                self.drop(sid, bound)
        if item.streams:
            self.streams.update(item.streams)
        if item.ranges:
            for sid, per in item.ranges.items():
                mine = self.ranges.get(sid)
                if mine is None:
                    self.ranges[sid] = per
                else:
                    mine.update(per)
        if item.producers:
            for sid, pper in item.producers.items():
                self.producers.setdefault(sid, {}).update(pper)
        if item.nodes:
            self.nodes.update(item.nodes)
        if item.counters:
            self.counters.update(item.counters)
        if item.names:
            self.names.update(item.names)
        if item.quotas:
            self.quotas.update(item.quotas)
        if item.offsets:
            self.offsets.update(item.offsets)


class StagedTxn:
    """Reads through staged layers (top first) to committed state; writes go to the top."""

    __slots__ = ("base", "below", "top")

    def __init__(self, base: BaseReader, below: Layer, top: Layer) -> None:
        self.base = base
        self.below = below
        self.top = top

    # --- reads
    def stream(self, sid: int) -> StreamMeta | None:
        s = self.top.streams.get(sid)
        if s is None:
            s = self.below.streams.get(sid)
        return self.base.stream(sid) if s is None else s

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
            per = layer.ranges.get(sid)
            if per is not None and idx in per:
                return per[idx]
            if layer.dropped and idx < layer.dropped.get(sid, -1):
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

    def stream_named(self, name: str) -> int | None:
        for layer in (self.top, self.below):
            sid = layer.names.get(name)
            if sid is not None:
                return None if sid == NAME_DROPPED else sid
        return self.base.stream_named(name)

    def quota(self, key: str) -> QuotaSpec | None:
        for layer in (self.top, self.below):
            if key in layer.quotas:
                return layer.quotas[key]
        return self.base.quota(key)

    def quota_count(self) -> int:
        keys = self.base.quota_keys()
        for layer in (self.below, self.top):
            for key, q in layer.quotas.items():
                if q is None:
                    keys.discard(key)
                else:
                    keys.add(key)
        return len(keys)

    def offset(self, group: str, sid: int) -> OffsetMeta | None:
        key = (group, sid)
        for layer in (self.top, self.below):
            if key in layer.offsets:
                return layer.offsets[key]
        return self.base.offset(group, sid)

    # --- writes
    def put_stream(self, s: StreamMeta) -> None:
        self.top.put_stream(s)

    def put_offset(self, o: OffsetMeta) -> None:
        self.top._set(self.top.offsets, (o.group, o.stream_id), o)

    def drop_offset(self, group: str, sid: int) -> None:
        self.top._set(self.top.offsets, (group, sid), None)

    def put_name(self, name: str, sid: int) -> None:
        self.top._set(self.top.names, name, sid)

    def drop_name(self, name: str) -> None:
        self.top._set(self.top.names, name, NAME_DROPPED)

    def put_range(self, r: RangeMeta) -> None:
        reps = r.replicas
        if len(reps) > 1 and len({x.node_id for x in reps}) != len(reps):
            raise MetadataError(
                f"range {r.range_index} of stream {r.stream_id} lists a node twice")
        self.top.put_range(r)

    def put_producers(self, sid: int, idx: int, ps: tuple[ProducerStateMeta, ...]) -> None:
        self.top.put_producers(sid, idx, ps)

    def put_node(self, n: NodeMeta) -> None:
        self.top._set(self.top.nodes, n.node_id, n)

    def drop_ranges_below(self, sid: int, bound: int) -> None:
        self.top.drop(sid, bound)

    def put_quota(self, q: QuotaSpec) -> None:
        self.top._set(self.top.quotas, q.key, q)

    def delete_quota(self, key: str) -> None:
        self.top._set(self.top.quotas, key, None)

    def next_id(self, name: str, n: int = 1) -> int:
        first = self.counter(name)
        self.top._set(self.top.counters, name, first + n)
        return first
