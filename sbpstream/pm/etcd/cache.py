"""Everything under the prefix, decoded, with each key's mod_revision: what every PM reads."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sbpstream.pm.etcd.codec import (
    decode_leader,
    decode_node,
    decode_offset,
    decode_producers,
    decode_quota,
    decode_range,
    decode_stream,
)
from sbpstream.pm.etcd.keys import Keys
from sbpstream.pm.metadata import NodeMeta, OffsetMeta, ProducerStateMeta, RangeMeta, StreamMeta
from sbpstream.pm.rules import SoftState
from sbpstream.protocol.errors import MetadataError
from sbpstream.quota.model import QuotaSpec

log = logging.getLogger("sbpstream.pm.etcd")

@dataclass(slots=True)
class Cache:
    """Everything under the prefix, decoded, with each key's mod_revision."""

    keys: Keys
    streams: dict[int, tuple[StreamMeta, int]] = field(default_factory=dict)
    ranges: dict[int, dict[int, tuple[RangeMeta, int]]] = field(default_factory=dict)
    producers: dict[tuple[int, int], tuple[tuple[ProducerStateMeta, ...], int]] = field(
        default_factory=dict)
    nodes: dict[int, tuple[NodeMeta, int]] = field(default_factory=dict)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)
    quotas: dict[str, tuple[QuotaSpec, int]] = field(default_factory=dict)
    by_node: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    names: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The name index: name -> (stream id, mod_revision of its key)."""
    offsets: dict[str, dict[int, tuple[OffsetMeta, int]]] = field(default_factory=dict)
    """Committed offsets: group -> stream id -> (offset, mod_revision of its key)."""
    schema: int | None = None
    leader: tuple[str, int] | None = None
    """(address, create_revision) of the leader key."""
    applied: int = 0
    _live_sorted: list[int] | None = None

    def put(self, key: bytes, value: bytes, mod_rev: int, create_rev: int,
            known: object = None) -> None:
        """Apply a put. ``known`` is the decoded value when this PM wrote exactly these bytes
        itself (its own writes skip JSON decoding)."""
        name = self.keys.name_of(key)
        if name is not None:
            try:
                self.names[name] = (int(value), mod_rev)
            except ValueError as e:
                log.error("event=etcd_bad_value key=%r error=%r", key, e)
            return
        off = self.keys.offset_of(key)
        if off is not None:
            try:
                o = (known if isinstance(known, OffsetMeta)
                     else decode_offset(off[0], off[1], value))
                self.offsets.setdefault(off[0], {})[off[1]] = (o, mod_rev)
            except (ValueError, IndexError, TypeError) as e:
                log.error("event=etcd_bad_value key=%r error=%r", key, e)
            return
        parsed = self.keys.parse(key)
        if parsed is None:
            return
        kind, ids = parsed
        try:
            if kind == "stream":
                s = known if isinstance(known, StreamMeta) else decode_stream(ids[0], value)
                self._put_stream(s, mod_rev)
            elif kind == "range":
                self._drop_range(ids[0], ids[1])
                rng = (known if isinstance(known, RangeMeta)
                       else decode_range(ids[0], ids[1], value))
                self.ranges.setdefault(ids[0], {})[ids[1]] = (rng, mod_rev)
                for nid in rng.node_ids:
                    self.by_node.setdefault(nid, set()).add((ids[0], ids[1]))
            elif kind == "producers":
                ps = known if isinstance(known, tuple) else decode_producers(value)
                self.producers[(ids[0], ids[1])] = (ps, mod_rev)
            elif kind == "node":
                n = known if isinstance(known, NodeMeta) else decode_node(ids[0], value)
                self.nodes[ids[0]] = (n, mod_rev)
            elif kind == "leader":
                self.leader = (decode_leader(value), create_rev)
            elif kind == "schema":
                self.schema = int(value)
            elif kind.startswith("counter:"):
                self.counters[kind[len("counter:"):]] = (int(value), mod_rev)
            elif kind.startswith("quota:"):
                q = known if isinstance(known, QuotaSpec) else decode_quota(value)
                self.quotas[kind[len("quota:"):]] = (q, mod_rev)
        except (ValueError, KeyError, TypeError) as e:
            log.error("event=etcd_bad_value key=%r error=%r", key, e)

    def delete(self, key: bytes) -> None:
        name = self.keys.name_of(key)
        if name is not None:
            self.names.pop(name, None)
            return
        off = self.keys.offset_of(key)
        if off is not None:
            per = self.offsets.get(off[0])
            if per is not None:
                per.pop(off[1], None)
                if not per:
                    del self.offsets[off[0]]
            return
        parsed = self.keys.parse(key)
        if parsed is None:
            return
        kind, ids = parsed
        if kind == "stream":
            if self.streams.pop(ids[0], None) is not None:
                self._live_sorted = None
        elif kind == "range":
            self._drop_range(ids[0], ids[1])
        elif kind == "producers":
            self.producers.pop((ids[0], ids[1]), None)
        elif kind == "node":
            self.nodes.pop(ids[0], None)
        elif kind == "leader":
            self.leader = None
        elif kind == "schema":
            self.schema = None
        elif kind.startswith("counter:"):
            self.counters.pop(kind[len("counter:"):], None)
        elif kind.startswith("quota:"):
            self.quotas.pop(kind[len("quota:"):], None)

    def _put_stream(self, s: StreamMeta, mod_rev: int) -> None:
        old = self.streams.get(s.stream_id)
        self.streams[s.stream_id] = (s, mod_rev)
        live = self._live_sorted
        if live is None:
            return
        was_live = old is not None and not old[0].deleted
        if was_live == (not s.deleted):
            return
        if not s.deleted and (not live or live[-1] < s.stream_id):
            live.append(s.stream_id)  # the common case: ids only grow
        else:
            self._live_sorted = None

    def _drop_range(self, sid: int, idx: int) -> None:
        per = self.ranges.get(sid)
        if per is None:
            return
        old = per.pop(idx, None)
        if old is not None:
            for nid in old[0].node_ids:
                s = self.by_node.get(nid)
                if s is not None:
                    s.discard((sid, idx))
        if not per:
            del self.ranges[sid]

    def live_sorted(self) -> list[int]:
        if self._live_sorted is None:
            self._live_sorted = sorted(sid for sid, (s, _) in self.streams.items()
                                       if not s.deleted)
        return self._live_sorted

    def stream_rev(self, sid: int) -> int:
        got = self.streams.get(sid)
        return 0 if got is None else got[1]

    def range_rev(self, sid: int, idx: int) -> int:
        got = self.ranges.get(sid, {}).get(idx)
        return 0 if got is None else got[1]

    def producers_rev(self, sid: int, idx: int) -> int:
        got = self.producers.get((sid, idx))
        return 0 if got is None else got[1]

    def node_rev(self, nid: int) -> int:
        got = self.nodes.get(nid)
        return 0 if got is None else got[1]

    def name_rev(self, name: str) -> int:
        got = self.names.get(name)
        return 0 if got is None else got[1]

    def quota_rev(self, key: str) -> int:
        got = self.quotas.get(key)
        return 0 if got is None else got[1]

    def offset_rev(self, group: str, sid: int) -> int:
        got = self.offsets.get(group, {}).get(sid)
        return 0 if got is None else got[1]

    def counter_rev(self, name: str) -> int:
        got = self.counters.get(name)
        return 0 if got is None else got[1]


class CacheReader:
    """:class:`~sbpstream.pm.staging.BaseReader` over the cache, with pending soft state."""

    __slots__ = ("c", "soft")

    def __init__(self, cache: Cache, soft: SoftState) -> None:
        self.c = cache
        self.soft = soft

    def stream(self, sid: int) -> StreamMeta | None:
        got = self.c.streams.get(sid)
        return None if got is None else got[0]

    def ranges(self, sid: int) -> list[RangeMeta]:
        per = self.c.ranges.get(sid, {})
        return [per[i][0] for i in sorted(per)]

    def range(self, sid: int, idx: int) -> RangeMeta | None:
        got = self.c.ranges.get(sid, {}).get(idx)
        return None if got is None else got[0]

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        got = self.c.producers.get((sid, idx))
        return () if got is None else got[0]

    def node(self, nid: int) -> NodeMeta | None:
        got = self.c.nodes.get(nid)
        return None if got is None else self.soft.applied(got[0])

    def stream_named(self, name: str) -> int | None:
        got = self.c.names.get(name)
        return None if got is None else got[0]


    def quota(self, key: str) -> QuotaSpec | None:
        got = self.c.quotas.get(key)
        return None if got is None else got[0]

    def quota_keys(self) -> set[str]:
        return set(self.c.quotas)

    def offset(self, group: str, sid: int) -> OffsetMeta | None:
        got = self.c.offsets.get(group, {}).get(sid)
        return None if got is None else got[0]

    def counter(self, name: str) -> int:
        got = self.c.counters.get(name)
        if got is None:
            raise MetadataError(f"metadata counter {name!r} missing in etcd")
        return got[0]
