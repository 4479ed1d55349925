"""How the SQLite metadata file's rows read and write: row <-> record conversion, the reader a
write transaction's rules see (:class:`SqlReader`), and the writing of a staged layer
(:func:`apply_layer`). The tables are in :mod:`sbpstream.pm.sqlite_schema`."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any, Final

from sbpstream.pm import rules
from sbpstream.pm.metadata import (
    NodeMeta,
    NodeMetrics,
    OffsetMeta,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    StreamMeta,
)
from sbpstream.pm.staging import NAME_DROPPED, Layer
from sbpstream.protocol.errors import MetadataError
from sbpstream.protocol.fbtable import maker
from sbpstream.quota.model import QuotaKind, QuotaSpec

SQL_IN_CHUNK: Final = 500
"""Ids per ``IN (...)`` clause: well under SQLite's default 999 bound-parameter limit of old
builds, large enough that a 1,000-item batch takes two queries."""

RANGE_COLS: Final = (
    "r.stream_id, r.range_index, r.start_offset, r.end_offset, r.next_offset, "
    "rr.node_id, rr.is_primary"
)


def chunks(ids: Sequence[int]) -> Iterator[Sequence[int]]:
    for i in range(0, len(ids), SQL_IN_CHUNK):
        yield ids[i : i + SQL_IN_CHUNK]


def group_ranges(rows: Sequence[tuple[int, ...]]) -> list[RangeMeta]:
    """Rows of ``RANGE_COLS`` ordered by (stream, index) -> one RangeMeta per range.

    Hot for LIST_RANGES of a whole data node (hundreds of thousands of rows): one pass; a node's
    ranges repeat a few replica sets, so each set's sorted ReplicaMeta tuple is made once per call
    (equal sets are the same tuple), and RangeMeta is made without its frozen ``__init__``."""
    out: list[RangeMeta] = []
    append = out.append
    sets: dict[tuple[tuple[int, int], ...], tuple[ReplicaMeta, ...]] = {}
    cur_sid = cur_idx = -1
    head: tuple[int, ...] = ()
    replicas: list[tuple[int, int]] = []
    for row in rows:
        sid, idx = row[0], row[1]
        if sid != cur_sid or idx != cur_idx:
            if head:
                append(_range(head, replicas, sets))
            cur_sid, cur_idx, head, replicas = sid, idx, row, []
        if row[5] is not None:
            replicas.append((row[5], row[6]))
    if head:
        append(_range(head, replicas, sets))
    return out


def _range(head: tuple[int, ...], replicas: list[tuple[int, int]],
           sets: dict[tuple[tuple[int, int], ...], tuple[ReplicaMeta, ...]]) -> RangeMeta:
    key = tuple(replicas)
    reps = sets.get(key)
    if reps is None:
        # Primary first, then by node id: a stable order for clients and tests.
        reps = sets[key] = tuple(sorted((ReplicaMeta(n, bool(p)) for n, p in replicas),
                                        key=lambda r: (not r.is_primary, r.node_id)))
    return _new_range_meta(head[0], head[1], head[2], head[3], head[4], reps)


_new_range_meta: Final = maker(RangeMeta)


def stream_of(row: Sequence[Any]) -> StreamMeta:
    return StreamMeta(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7])


STREAM_COLS: Final = (
    "stream_id, replica_nums, retention_period_ms, start_offset, deleted, created_ms, updated_ms, "
    "name"
)
S_COLS: Final = ", ".join(f"s.{c.strip()}" for c in STREAM_COLS.split(","))
"""STREAM_COLS of ``streams s`` in a join."""


NODE_COLS: Final = (
    "node_id, host, advertise_addr, registered_ms, last_heartbeat_ms, metrics, metrics_ms, "
    "draining"
)

_Replicas = frozenset[tuple[int, bool]]
_UNREAD: Final = frozenset({(-1, False)})
"""Marker of a range this transaction never read (its stored replicas are unknown)."""


def _replica_set(r: RangeMeta) -> _Replicas:
    return frozenset((x.node_id, x.is_primary) for x in r.replicas)


class SqlReader:
    """:class:`~sbpstream.pm.staging.BaseReader` inside one write transaction. Nothing is written
    before the staged layer is applied at the end, so every read may be remembered."""

    def __init__(self, c: sqlite3.Connection, soft: rules.SoftState) -> None:
        self.c = c
        self.soft = soft
        self._streams: dict[int, StreamMeta | None] = {}
        self._ranges: dict[int, list[RangeMeta]] = {}
        self.stored: dict[tuple[int, int], _Replicas | None] = {}
        """(stream, index) -> the replicas the file holds for a range read (None: no range)."""

    def preload(self, first: int, last: int) -> None:
        """Read streams ``first..last`` and their ranges with two range scans (a batch's new
        ids: normally nothing is there, and each item's existence check is then a dict hit)."""
        self._streams.update(dict.fromkeys(range(first, last + 1)))
        for row in self.c.execute(
            f"SELECT {STREAM_COLS} FROM streams WHERE stream_id BETWEEN ? AND ?", (first, last)
        ):
            self._streams[row[0]] = stream_of(row)
        self._ranges.update((sid, []) for sid in range(first, last + 1))
        rows = self.c.execute(
            f"SELECT {RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            "WHERE r.stream_id BETWEEN ? AND ? ORDER BY r.stream_id, r.range_index",
            (first, last),
        ).fetchall()
        for rng in self._remember(group_ranges(rows)):
            self._ranges[rng.stream_id].append(rng)

    def _remember(self, ranges: list[RangeMeta]) -> list[RangeMeta]:
        for r in ranges:
            self.stored[(r.stream_id, r.range_index)] = _replica_set(r)
        return ranges

    def stream(self, sid: int) -> StreamMeta | None:
        if sid not in self._streams:
            row = self.c.execute(
                f"SELECT {STREAM_COLS} FROM streams WHERE stream_id = ?", (sid,)
            ).fetchone()
            self._streams[sid] = None if row is None else stream_of(row)
        return self._streams[sid]

    def ranges(self, sid: int) -> list[RangeMeta]:
        if sid not in self._ranges:
            rows = self.c.execute(
                f"SELECT {RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                "WHERE r.stream_id = ? ORDER BY r.range_index",
                (sid,),
            ).fetchall()
            self._ranges[sid] = self._remember(group_ranges(rows))
        return list(self._ranges[sid])

    def range(self, sid: int, idx: int) -> RangeMeta | None:
        known = self._ranges.get(sid)
        got: RangeMeta | None = None
        if known is not None:
            for r in known:
                if r.range_index == idx:
                    got = r
        else:
            rows = self.c.execute(
                f"SELECT {RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                "WHERE r.stream_id = ? AND r.range_index = ?",
                (sid, idx),
            ).fetchall()
            one = self._remember(group_ranges(rows))
            got = one[0] if one else None
        if got is None:
            self.stored[(sid, idx)] = None
        return got

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        return producers_of(self.c, sid, idx)

    def node(self, nid: int) -> NodeMeta | None:
        row = self.c.execute(
            f"SELECT {NODE_COLS} FROM data_nodes WHERE node_id = ?", (nid,)
        ).fetchone()
        return None if row is None else node_of(row, self.soft)

    def stream_named(self, name: str) -> int | None:
        row = self.c.execute("SELECT stream_id FROM stream_names WHERE name = ?",
                             (name,)).fetchone()
        return None if row is None else int(row[0])

    def quota(self, key: str) -> QuotaSpec | None:
        row = self.c.execute(f"SELECT {QUOTA_COLS} FROM quotas WHERE key = ?",
                             (key,)).fetchone()
        return None if row is None else quota_of(row)

    def quota_keys(self) -> set[str]:
        return {str(r[0]) for r in self.c.execute("SELECT key FROM quotas")}

    def offset(self, group: str, sid: int) -> OffsetMeta | None:
        row = self.c.execute(
            f"SELECT {OFFSET_COLS} FROM consumer_offsets WHERE group_name = ? AND stream_id = ?",
            (group, sid)).fetchone()
        return None if row is None else offset_of(row)

    def counter(self, name: str) -> int:
        row = self.c.execute("SELECT value FROM meta WHERE key = ?", (name,)).fetchone()
        if row is None:
            raise MetadataError(f"metadata counter {name!r} missing")
        return int(row[0])


def producers_of(c: sqlite3.Connection, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
    rows = c.execute(
        "SELECT producer_id, producer_epoch, last_sequence, last_base_offset "
        "FROM seal_producers WHERE stream_id = ? AND range_index = ? ORDER BY producer_id",
        (sid, idx),
    ).fetchall()
    return tuple(ProducerStateMeta(int(a), int(b), int(s), int(o)) for a, b, s, o in rows)


def node_of(row: Sequence[Any], soft: rules.SoftState) -> NodeMeta:
    metrics = NodeMetrics.from_dict(json.loads(row[5])) if isinstance(row[5], str) else None
    n = NodeMeta(int(row[0]), str(row[1]), str(row[2]), int(row[3]), int(row[4]), metrics,
                 int(row[6]), bool(row[7]))
    return soft.applied(n)


QUOTA_COLS: Final = ("kind, name, produce_bytes_per_s, fetch_bytes_per_s, requests_per_s, "
                      "principal")


def quota_of(row: Sequence[Any]) -> QuotaSpec:
    return QuotaSpec(QuotaKind(int(row[0])), str(row[1]), int(row[2]), int(row[3]), int(row[4]),
                     str(row[5]))


def _metrics_json(m: NodeMetrics | None) -> str | None:
    return None if m is None else json.dumps(m.to_dict(), separators=(",", ":"))


OFFSET_COLS: Final = "group_name, stream_id, committed, metadata, commit_ms"


def offset_of(row: Sequence[Any]) -> OffsetMeta:
    return OffsetMeta(str(row[0]), int(row[1]), int(row[2]), str(row[3]), int(row[4]))


def apply_layer(c: sqlite3.Connection, layer: Layer, base: SqlReader) -> None:
    """Write a staged layer: drops first, then every put as a whole row."""
    if layer.offsets:
        c.executemany("DELETE FROM consumer_offsets WHERE group_name = ? AND stream_id = ?",
                      [k for k, o in layer.offsets.items() if o is None])
        c.executemany(
            f"INSERT OR REPLACE INTO consumer_offsets ({OFFSET_COLS}) VALUES (?, ?, ?, ?, ?)",
            [(o.group, o.stream_id, o.offset, o.metadata, o.commit_ms)
             for o in layer.offsets.values() if o is not None])
    c.executemany("UPDATE meta SET value = ? WHERE key = ?",
                  [(v, name) for name, v in layer.counters.items()])
    for table in ("range_replicas", "ranges", "seal_producers"):
        c.executemany(f"DELETE FROM {table} WHERE stream_id = ? AND range_index < ?",
                      list(layer.dropped.items()))
    c.executemany(
        f"INSERT OR REPLACE INTO streams ({STREAM_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(s.stream_id, s.replica_nums, s.retention_period_ms, s.start_offset, int(s.deleted),
          s.created_ms, s.updated_ms, s.name) for s in layer.streams.values()],
    )
    if layer.names:
        c.executemany("DELETE FROM stream_names WHERE name = ?",
                      [(n,) for n, sid in layer.names.items() if sid == NAME_DROPPED])
        c.executemany("INSERT INTO stream_names (name, stream_id) VALUES (?, ?)",
                      [(n, sid) for n, sid in layer.names.items() if sid != NAME_DROPPED])
    ranges = layer.all_ranges()
    c.executemany(
        "INSERT OR REPLACE INTO ranges (stream_id, range_index, start_offset, end_offset, "
        "next_offset) VALUES (?, ?, ?, ?, ?)",
        [(r.stream_id, r.range_index, r.start_offset, r.end_offset, r.next_offset)
         for r in ranges],
    )
    # Replica rows only where they change (a next_offset report or a trim keeps them).
    stored = base.stored
    moved: list[RangeMeta] = []
    stale: list[tuple[int, int]] = []
    for r in ranges:
        key = (r.stream_id, r.range_index)
        was = stored.get(key, _UNREAD)
        if was is None and r.stream_id not in layer.dropped:
            moved.append(r)  # a new range: nothing to delete
        elif r.stream_id in layer.dropped or was != _replica_set(r):
            moved.append(r)
            stale.append(key)
    c.executemany("DELETE FROM range_replicas WHERE stream_id = ? AND range_index = ?", stale)
    c.executemany(
        "INSERT INTO range_replicas (stream_id, range_index, node_id, is_primary) "
        "VALUES (?, ?, ?, ?)",
        [(r.stream_id, r.range_index, x.node_id, int(x.is_primary)) for r in moved
         for x in r.replicas],
    )
    staged = [(sid, idx, ps) for sid, per in layer.producers.items() for idx, ps in per.items()]
    c.executemany("DELETE FROM seal_producers WHERE stream_id = ? AND range_index = ?",
                  [(sid, idx) for sid, idx, _ in staged])
    c.executemany(
        "INSERT INTO seal_producers (stream_id, range_index, producer_id, producer_epoch, "
        "last_sequence, last_base_offset) VALUES (?, ?, ?, ?, ?, ?)",
        [(sid, idx, p.producer_id, p.producer_epoch, p.last_sequence, p.last_base_offset)
         for sid, idx, ps in staged for p in ps],
    )
    c.executemany("DELETE FROM quotas WHERE key = ?",
                  [(k,) for k, q in layer.quotas.items() if q is None])
    c.executemany(
        f"INSERT OR REPLACE INTO quotas (key, {QUOTA_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(q.key, int(q.kind), q.name, *q.rates(), q.user) for q in layer.quotas.values()
         if q is not None])
    c.executemany(
        f"INSERT OR REPLACE INTO data_nodes ({NODE_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(n.node_id, n.host, n.advertise_addr, n.registered_ms, n.last_heartbeat_ms,
          _metrics_json(n.metrics), n.metrics_ms, int(n.draining))
         for n in layer.nodes.values()],
    )

