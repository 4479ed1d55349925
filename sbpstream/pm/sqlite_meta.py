"""SQLite backend of :class:`~sbpstream.pm.metadata.MetadataStore` (the embedded default).

- WAL journal with ``synchronous=FULL``: a write the PM acknowledged survives a crash or power
  loss (the WAL is fsynced at every commit).
- ``locking_mode=EXCLUSIVE``: one PM owns the file; a second PM on the same file fails at open
  instead of handing out duplicate ids.
- One thread owns the connection (a single-worker executor), so the event loop never blocks on
  disk and no two transactions interleave.
- Batches are one transaction: CREATE_STREAMS of 1,000 items costs one fsync. Each item runs
  its rule (:mod:`sbpstream.pm.rules`) against a staged view of the file inside the write
  transaction (:mod:`sbpstream.pm.staging`); an item whose rule fails leaves nothing staged, so
  items stay all-or-nothing. The staged rows are then written with a few ``executemany``.
- Soft state (heartbeat times, metrics) is kept in memory and written lazily: with the next
  durable transaction, or at most every ``SOFT_STATE_FLUSH_INTERVAL_S``, or at close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from sbpstream.pm import rules
from sbpstream.pm.metadata import (
    FIRST_NODE_ID,
    FIRST_STREAM_ID,
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
from sbpstream.pm.rules import COUNTER_NODE, COUNTER_STREAM, MetaTxn
from sbpstream.pm.staging import NAME_DROPPED, Layer, StagedTxn
from sbpstream.private_files import open_private, private_dir
from sbpstream.protocol.errors import MetadataError, SbpError
from sbpstream.protocol.fbtable import maker
from sbpstream.protocol.names import prefix_upper_bound
from sbpstream.quota.model import QuotaKind, QuotaSpec

log = logging.getLogger("sbpstream.pm.sqlite")

T = TypeVar("T")
ItemT = TypeVar("ItemT")

SCHEMA_VERSION: Final = 3
"""Bumped by every schema change; ``_MIGRATIONS[v]`` upgrades a file from version ``v``."""

SQL_IN_CHUNK: Final = 500
"""Ids per ``IN (...)`` clause: well under SQLite's default 999 bound-parameter limit of old
builds, large enough that a 1,000-item batch takes two queries."""

BUSY_TIMEOUT_MS: Final = 2000
"""How long open waits for another process's lock before reporting the file in use."""

_NAMES_TABLE: Final = """CREATE TABLE IF NOT EXISTS stream_names (
        name TEXT PRIMARY KEY,
        stream_id INTEGER NOT NULL
    ) WITHOUT ROWID"""
"""The name index is its own table: its primary key keeps live names unique; a deleted
stream's row here goes while the stream row keeps its name for history."""

_OFFSETS_TABLE: Final = """CREATE TABLE IF NOT EXISTS consumer_offsets (
        group_name TEXT NOT NULL,
        stream_id INTEGER NOT NULL,
        committed INTEGER NOT NULL,
        metadata TEXT NOT NULL DEFAULT '',
        commit_ms INTEGER NOT NULL,
        PRIMARY KEY (group_name, stream_id)
    ) WITHOUT ROWID"""
"""Committed offsets of consumer groups (issue 21): one row per (group, stream)."""

_NAMES_BY_STREAM: Final = (
    "CREATE INDEX IF NOT EXISTS stream_names_by_stream ON stream_names (stream_id)")

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS streams (
        stream_id INTEGER PRIMARY KEY,
        replica_nums INTEGER NOT NULL,
        retention_period_ms INTEGER NOT NULL,
        start_offset INTEGER NOT NULL DEFAULT 0,
        deleted INTEGER NOT NULL DEFAULT 0,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL,
        name TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE IF NOT EXISTS ranges (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        start_offset INTEGER NOT NULL,
        end_offset INTEGER NOT NULL,
        next_offset INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS range_replicas (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        node_id INTEGER NOT NULL,
        is_primary INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index, node_id)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS range_replicas_by_node ON range_replicas (node_id)",
    """CREATE TABLE IF NOT EXISTS data_nodes (
        node_id INTEGER PRIMARY KEY,
        host TEXT NOT NULL,
        advertise_addr TEXT NOT NULL,
        registered_ms INTEGER NOT NULL,
        last_heartbeat_ms INTEGER NOT NULL DEFAULT 0,
        metrics TEXT,
        metrics_ms INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE IF NOT EXISTS seal_producers (
        stream_id INTEGER NOT NULL,
        range_index INTEGER NOT NULL,
        producer_id INTEGER NOT NULL,
        producer_epoch INTEGER NOT NULL,
        last_sequence INTEGER NOT NULL,
        last_base_offset INTEGER NOT NULL,
        PRIMARY KEY (stream_id, range_index, producer_id)
    ) WITHOUT ROWID""",
    _NAMES_TABLE,
    _NAMES_BY_STREAM,
    _OFFSETS_TABLE,
)

_QUOTAS_TABLE: Final = (
    """CREATE TABLE IF NOT EXISTS quotas (
        key TEXT PRIMARY KEY,
        kind INTEGER NOT NULL,
        name TEXT NOT NULL,
        produce_bytes_per_s INTEGER NOT NULL,
        fetch_bytes_per_s INTEGER NOT NULL,
        requests_per_s INTEGER NOT NULL,
        principal TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID"""
)
"""Quotas (issue 22). Created at every open when missing, without a schema version bump: an
older sbpstream opening the file ignores the table (it enforces no quotas). ``principal`` (user
and user+client-id quotas) came later: a table from before it gets the column at open (ADD
COLUMN with a default; an older sbpstream reads the table as before and ignores the column)."""

_AUTH_TABLE: Final = """CREATE TABLE IF NOT EXISTS auth_records (
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (kind, key)
    ) WITHOUT ROWID"""
"""Users and ACL rules (sbpstream.auth.records): opaque values by kind and key."""


_MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {
    1: ("ALTER TABLE streams ADD COLUMN name TEXT NOT NULL DEFAULT ''", _NAMES_TABLE,
        _NAMES_BY_STREAM),  # named streams (issue 20): old files have none
    2: (_OFFSETS_TABLE,),  # consumer groups' committed offsets (issue 21)
}
"""from-version -> statements bringing the file to from-version + 1."""

_RANGE_COLS: Final = (
    "r.stream_id, r.range_index, r.start_offset, r.end_offset, r.next_offset, "
    "rr.node_id, rr.is_primary"
)


def _chunks(ids: Sequence[int]) -> Iterator[Sequence[int]]:
    for i in range(0, len(ids), SQL_IN_CHUNK):
        yield ids[i : i + SQL_IN_CHUNK]


def _group_ranges(rows: Sequence[tuple[int, ...]]) -> list[RangeMeta]:
    """Rows of ``_RANGE_COLS`` ordered by (stream, index) -> one RangeMeta per range.

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


def _stream(row: Sequence[Any]) -> StreamMeta:
    return StreamMeta(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6], row[7])


_STREAM_COLS: Final = (
    "stream_id, replica_nums, retention_period_ms, start_offset, deleted, created_ms, updated_ms, "
    "name"
)
_S_COLS: Final = ", ".join(f"s.{c.strip()}" for c in _STREAM_COLS.split(","))
"""_STREAM_COLS of ``streams s`` in a join."""


_NODE_COLS: Final = (
    "node_id, host, advertise_addr, registered_ms, last_heartbeat_ms, metrics, metrics_ms"
)

_Replicas = frozenset[tuple[int, bool]]
_UNREAD: Final = frozenset({(-1, False)})
"""Marker of a range this transaction never read (its stored replicas are unknown)."""


def _replica_set(r: RangeMeta) -> _Replicas:
    return frozenset((x.node_id, x.is_primary) for x in r.replicas)


class _SqlReader:
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
            f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id BETWEEN ? AND ?", (first, last)
        ):
            self._streams[row[0]] = _stream(row)
        self._ranges.update((sid, []) for sid in range(first, last + 1))
        rows = self.c.execute(
            f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            "WHERE r.stream_id BETWEEN ? AND ? ORDER BY r.stream_id, r.range_index",
            (first, last),
        ).fetchall()
        for rng in self._remember(_group_ranges(rows)):
            self._ranges[rng.stream_id].append(rng)

    def _remember(self, ranges: list[RangeMeta]) -> list[RangeMeta]:
        for r in ranges:
            self.stored[(r.stream_id, r.range_index)] = _replica_set(r)
        return ranges

    def stream(self, sid: int) -> StreamMeta | None:
        if sid not in self._streams:
            row = self.c.execute(
                f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id = ?", (sid,)
            ).fetchone()
            self._streams[sid] = None if row is None else _stream(row)
        return self._streams[sid]

    def ranges(self, sid: int) -> list[RangeMeta]:
        if sid not in self._ranges:
            rows = self.c.execute(
                f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                "WHERE r.stream_id = ? ORDER BY r.range_index",
                (sid,),
            ).fetchall()
            self._ranges[sid] = self._remember(_group_ranges(rows))
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
                f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                "WHERE r.stream_id = ? AND r.range_index = ?",
                (sid, idx),
            ).fetchall()
            one = self._remember(_group_ranges(rows))
            got = one[0] if one else None
        if got is None:
            self.stored[(sid, idx)] = None
        return got

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        return _producers(self.c, sid, idx)

    def node(self, nid: int) -> NodeMeta | None:
        row = self.c.execute(
            f"SELECT {_NODE_COLS} FROM data_nodes WHERE node_id = ?", (nid,)
        ).fetchone()
        return None if row is None else _node(row, self.soft)

    def stream_named(self, name: str) -> int | None:
        row = self.c.execute("SELECT stream_id FROM stream_names WHERE name = ?",
                             (name,)).fetchone()
        return None if row is None else int(row[0])

    def quota(self, key: str) -> QuotaSpec | None:
        row = self.c.execute(f"SELECT {_QUOTA_COLS} FROM quotas WHERE key = ?",
                             (key,)).fetchone()
        return None if row is None else _quota(row)

    def quota_keys(self) -> set[str]:
        return {str(r[0]) for r in self.c.execute("SELECT key FROM quotas")}

    def offset(self, group: str, sid: int) -> OffsetMeta | None:
        row = self.c.execute(
            f"SELECT {_OFFSET_COLS} FROM consumer_offsets WHERE group_name = ? AND stream_id = ?",
            (group, sid)).fetchone()
        return None if row is None else _offset(row)

    def counter(self, name: str) -> int:
        row = self.c.execute("SELECT value FROM meta WHERE key = ?", (name,)).fetchone()
        if row is None:
            raise MetadataError(f"metadata counter {name!r} missing")
        return int(row[0])


def _producers(c: sqlite3.Connection, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
    rows = c.execute(
        "SELECT producer_id, producer_epoch, last_sequence, last_base_offset "
        "FROM seal_producers WHERE stream_id = ? AND range_index = ? ORDER BY producer_id",
        (sid, idx),
    ).fetchall()
    return tuple(ProducerStateMeta(int(a), int(b), int(s), int(o)) for a, b, s, o in rows)


def _node(row: Sequence[Any], soft: rules.SoftState) -> NodeMeta:
    metrics = NodeMetrics.from_dict(json.loads(row[5])) if isinstance(row[5], str) else None
    n = NodeMeta(int(row[0]), str(row[1]), str(row[2]), int(row[3]), int(row[4]), metrics,
                 int(row[6]))
    return soft.applied(n)


_QUOTA_COLS: Final = ("kind, name, produce_bytes_per_s, fetch_bytes_per_s, requests_per_s, "
                      "principal")


def _quota(row: Sequence[Any]) -> QuotaSpec:
    return QuotaSpec(QuotaKind(int(row[0])), str(row[1]), int(row[2]), int(row[3]), int(row[4]),
                     str(row[5]))


def _metrics_json(m: NodeMetrics | None) -> str | None:
    return None if m is None else json.dumps(m.to_dict(), separators=(",", ":"))


_OFFSET_COLS: Final = "group_name, stream_id, committed, metadata, commit_ms"


def _offset(row: Sequence[Any]) -> OffsetMeta:
    return OffsetMeta(str(row[0]), int(row[1]), int(row[2]), str(row[3]), int(row[4]))


def _apply(c: sqlite3.Connection, layer: Layer, base: _SqlReader) -> None:
    """Write a staged layer: drops first, then every put as a whole row."""
    if layer.offsets:
        c.executemany("DELETE FROM consumer_offsets WHERE group_name = ? AND stream_id = ?",
                      [k for k, o in layer.offsets.items() if o is None])
        c.executemany(
            f"INSERT OR REPLACE INTO consumer_offsets ({_OFFSET_COLS}) VALUES (?, ?, ?, ?, ?)",
            [(o.group, o.stream_id, o.offset, o.metadata, o.commit_ms)
             for o in layer.offsets.values() if o is not None])
    c.executemany("UPDATE meta SET value = ? WHERE key = ?",
                  [(v, name) for name, v in layer.counters.items()])
    for table in ("range_replicas", "ranges", "seal_producers"):
        c.executemany(f"DELETE FROM {table} WHERE stream_id = ? AND range_index < ?",
                      list(layer.dropped.items()))
    c.executemany(
        f"INSERT OR REPLACE INTO streams ({_STREAM_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
        f"INSERT OR REPLACE INTO quotas (key, {_QUOTA_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(q.key, int(q.kind), q.name, *q.rates(), q.user) for q in layer.quotas.values()
         if q is not None])
    c.executemany(
        f"INSERT OR REPLACE INTO data_nodes ({_NODE_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(n.node_id, n.host, n.advertise_addr, n.registered_ms, n.last_heartbeat_ms,
          _metrics_json(n.metrics), n.metrics_ms) for n in layer.nodes.values()],
    )


class SqliteMetadataStore:
    """:class:`~sbpstream.pm.metadata.MetadataStore` on one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self._path = str(path)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._soft = rules.SoftState()
        """Touched only on the executor thread."""

    @property
    def path(self) -> str:
        return self._path

    # ------------------------------------------------------------------ plumbing
    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            raise MetadataError("metadata store is not open")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._guard, fn, args)

    @staticmethod
    def _guard(fn: Callable[..., T], args: tuple[object, ...]) -> T:
        try:
            return fn(*args)
        except SbpError:
            raise
        except sqlite3.Error as e:
            log.error("event=sqlite_error error=%r", e)
            raise MetadataError(f"sqlite: {e}") from e

    @property
    def _c(self) -> sqlite3.Connection:
        if self._conn is None:
            raise MetadataError("metadata store is not open")
        return self._conn

    @contextlib.contextmanager
    def _raw_tx(self) -> Iterator[sqlite3.Connection]:
        c = self._c
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    def _transaction(self, body: Callable[[_SqlReader, Layer], T]) -> T:
        """One durable write transaction: ``body`` stages writes into the layer it is given,
        which is then applied. Pending soft state is carried along for free."""
        soft = self._soft
        with self._raw_tx() as c:
            base = _SqlReader(c, soft)
            chunk = Layer(journaled=True)
            flushed = soft.pending()
            for nid in flushed:
                rules.flush_soft_state(StagedTxn(base, Layer(), chunk), nid)
            chunk.keep()
            result = body(base, chunk)
            _apply(c, chunk, base)
        soft.forget(flushed)
        soft.last_flush = time.monotonic()
        return result

    @staticmethod
    def _stage(
        base: _SqlReader, chunk: Layer, items: Sequence[ItemT],
        plan: Callable[[MetaTxn, ItemT], T],
    ) -> list[T | SbpError]:
        """Each item's rule over the items before it; a failed item stages nothing."""
        out: list[T | SbpError] = []
        tx = StagedTxn(base, Layer(), chunk)
        for item in items:
            try:
                out.append(plan(tx, item))
            except SbpError as e:
                out.append(e)
                chunk.undo()
            else:
                chunk.keep()
        return out

    def _write(
        self, items: Sequence[ItemT], plan: Callable[[MetaTxn, ItemT], T]
    ) -> list[T | SbpError]:
        return self._transaction(lambda base, chunk: self._stage(base, chunk, items, plan))

    def _write_one(self, plan: Callable[[MetaTxn, None], T]) -> T:
        (out,) = self._write([None], plan)
        if isinstance(out, SbpError):
            raise out
        return out

    async def _write_async(
        self, items: Sequence[ItemT], plan: Callable[[MetaTxn, ItemT], T]
    ) -> list[T | SbpError]:
        if not items:
            return []
        return await self._run(self._write, list(items), plan)

    # ------------------------------------------------------------------ open / close
    async def open(self) -> None:
        if self._executor is not None:
            return
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pm-sqlite"
        )
        try:
            await self._run(self._open)
        except BaseException:
            self._executor.shutdown(wait=True)
            self._executor = None
            raise

    def _open(self) -> None:
        if self._path != ":memory:":
            # owner-only: the file holds SCRAM verifiers; SQLite gives its -wal and -shm files
            # the database file's mode (docs/security.md, Safe defaults)
            private_dir(Path(self._path).parent)
            os.close(open_private(self._path, os.O_RDWR))
        c = sqlite3.connect(
            self._path,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT_MS / 1000,
        )
        try:
            c.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            c.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if self._path != ":memory:" and str(mode).lower() != "wal":
                raise MetadataError(f"could not put {self._path} in WAL mode (got {mode})")
            c.execute("PRAGMA synchronous = FULL")
            self._conn = c
            self._init_schema(c)
            # auth records came after schema version 1: created on open, old files included
            c.execute(_AUTH_TABLE)
        except sqlite3.OperationalError as e:
            c.close()
            self._conn = None
            if "locked" in str(e):
                raise MetadataError(
                    f"metadata file {self._path} is in use by another process"
                ) from e
            raise
        except BaseException:
            c.close()
            self._conn = None
            raise

    def _init_schema(self, c: sqlite3.Connection) -> None:
        with self._raw_tx():
            c.execute(_SCHEMA[0])
            c.execute(_QUOTAS_TABLE)  # not versioned: see _QUOTAS_TABLE
            cols = {str(r[1]) for r in c.execute("PRAGMA table_info(quotas)")}
            if "principal" not in cols:
                c.execute("ALTER TABLE quotas ADD COLUMN principal TEXT NOT NULL DEFAULT ''")
            row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                for stmt in _SCHEMA[1:]:
                    c.execute(stmt)
                c.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema_version", SCHEMA_VERSION),
                        (COUNTER_STREAM, FIRST_STREAM_ID),
                        (COUNTER_NODE, FIRST_NODE_ID),
                    ],
                )
                log.info("event=metadata_created path=%s schema_version=%d", self._path,
                         SCHEMA_VERSION)
                return
            version = int(row[0])
            if version > SCHEMA_VERSION:
                raise MetadataError(
                    f"metadata file {self._path} has schema version {version}, newer than this "
                    f"sbpstream ({SCHEMA_VERSION}); upgrade sbpstream"
                )
            while version < SCHEMA_VERSION:
                for stmt in _MIGRATIONS[version]:
                    c.execute(stmt)
                version += 1
                c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
                log.info("event=metadata_migrated path=%s schema_version=%d", self._path, version)

    async def close(self) -> None:
        if self._executor is None:
            return
        try:
            await self._run(self._close)
        finally:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _close(self) -> None:
        if self._conn is None:
            return
        try:
            if self._soft.pending():
                self._transaction(lambda base, chunk: None)
        finally:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ soft state
    async def record_heartbeat(self, node_id: int, now_ms: int) -> None:
        await self._run(self._soft_changed, self._soft.heartbeat, node_id, now_ms)

    async def record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        await self._run(self._soft_changed, self._soft.report, node_id, metrics, now_ms)

    def _soft_changed(self, record: Callable[..., None], *args: object) -> None:
        record(*args)
        if self._soft.due():
            self._transaction(lambda base, chunk: None)

    # ------------------------------------------------------------------ data nodes
    async def allocate_node_id(self, host: str, now_ms: int) -> int:
        return await self._run(
            self._write_one, lambda tx, _: rules.allocate_node_id(tx, host, now_ms))

    async def get_node(self, node_id: int) -> NodeMeta | None:
        return await self._run(self._get_node, node_id)

    def _get_node(self, node_id: int) -> NodeMeta | None:
        row = self._c.execute(
            f"SELECT {_NODE_COLS} FROM data_nodes WHERE node_id = ?", (node_id,)
        ).fetchone()
        return None if row is None else _node(row, self._soft)

    async def list_nodes(self) -> list[NodeMeta]:
        return await self._run(self._list_nodes)

    def _list_nodes(self) -> list[NodeMeta]:
        rows = self._c.execute(f"SELECT {_NODE_COLS} FROM data_nodes ORDER BY node_id").fetchall()
        return [_node(r, self._soft) for r in rows]

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        return await self._run(
            self._write_one,
            lambda tx, _: rules.update_node_address(tx, node_id, advertise_addr))

    # ------------------------------------------------------------------ quotas (issue 22)
    async def set_quotas(self, items: Sequence[QuotaSpec]) -> list[QuotaSpec | SbpError]:
        return await self._write_async(items, rules.set_quota)

    async def delete_quotas(
        self, items: Sequence[tuple[int, str, str]]
    ) -> list[QuotaSpec | SbpError]:
        return await self._write_async(items, lambda tx, it: rules.delete_quota(tx, *it))

    async def list_quotas(self) -> list[QuotaSpec]:
        return await self._run(self._list_quotas)

    def _list_quotas(self) -> list[QuotaSpec]:
        rows = self._c.execute(f"SELECT {_QUOTA_COLS} FROM quotas ORDER BY key").fetchall()
        return [_quota(r) for r in rows]

    # ------------------------------------------------------------------ streams
    async def create_streams(
        self, items: Sequence[NewStream], now_ms: int
    ) -> list[CreatedStream | SbpError]:
        if not items:
            return []
        return await self._run(self._create_streams, list(items), now_ms)

    def _create_streams(
        self, items: list[NewStream], now_ms: int
    ) -> list[CreatedStream | SbpError]:
        def body(base: _SqlReader, chunk: Layer) -> list[CreatedStream | SbpError]:
            first = rules.reserve_stream_ids(StagedTxn(base, Layer(), chunk), len(items))
            chunk.keep()
            base.preload(first, first + len(items) - 1)
            return self._stage(
                base, chunk, list(enumerate(items, first)),
                lambda tx, it: rules.create_stream(tx, it[0], it[1], now_ms))

        return self._transaction(body)

    async def get_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | None]:
        if not stream_ids:
            return []
        return await self._run(self._get_streams, list(stream_ids))

    def _get_streams(self, stream_ids: list[int]) -> list[StreamMeta | None]:
        found: dict[int, StreamMeta] = {}
        unique = sorted(set(stream_ids))
        for chunk in _chunks(unique):
            marks = ",".join("?" * len(chunk))
            for row in self._c.execute(
                f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id IN ({marks})", tuple(chunk)
            ):
                found[row[0]] = _stream(row)
        return [found.get(sid) for sid in stream_ids]

    async def list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        return await self._run(self._list_streams, after_stream_id, limit)

    def _list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        rows = self._c.execute(
            f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id > ? AND deleted = 0 "
            "ORDER BY stream_id LIMIT ?",
            (after_stream_id, max(0, limit)),
        ).fetchall()
        return [_stream(r) for r in rows]

    async def get_stream_by_name(self, name: str) -> StreamMeta | None:
        return await self._run(self._get_stream_by_name, name)

    def _get_stream_by_name(self, name: str) -> StreamMeta | None:
        row = self._c.execute(
            f"SELECT {_S_COLS} FROM stream_names n JOIN streams s ON s.stream_id = n.stream_id "
            "WHERE n.name = ?", (name,)).fetchone()
        return None if row is None else _stream(row)

    async def list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        return await self._run(self._list_streams_by_prefix, prefix, after_stream_id, limit)

    def _list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        rows = self._c.execute(
            f"SELECT {_S_COLS} FROM stream_names n JOIN streams s ON s.stream_id = n.stream_id "
            "WHERE n.name >= ? AND n.name < ? AND n.stream_id > ? AND s.deleted = 0 "
            "ORDER BY n.stream_id LIMIT ?",
            (prefix, prefix_upper_bound(prefix), after_stream_id, max(0, limit)),
        ).fetchall()
        return [_stream(r) for r in rows]

    async def update_streams(
        self, items: Sequence[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        return await self._write_async(items, lambda tx, u: rules.update_stream(tx, u, now_ms))

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        return await self._write_async(
            items, lambda tx, it: rules.trim_stream(tx, it[0], it[1], now_ms))

    async def delete_streams(
        self, stream_ids: Sequence[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        return await self._write_async(
            stream_ids, lambda tx, sid: rules.delete_stream(tx, sid, now_ms))

    # ------------------------------------------------------------------ ranges
    async def list_ranges(self, stream_ids: Sequence[int]) -> list[list[RangeMeta]]:
        if not stream_ids:
            return []
        return await self._run(self._list_ranges, list(stream_ids))

    def _list_ranges(self, stream_ids: list[int]) -> list[list[RangeMeta]]:
        by_stream: dict[int, list[RangeMeta]] = {}
        for chunk in _chunks(sorted(set(stream_ids))):
            marks = ",".join("?" * len(chunk))
            rows = self._c.execute(
                f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                f"WHERE r.stream_id IN ({marks}) "
                "ORDER BY r.stream_id, r.range_index",
                tuple(chunk),
            ).fetchall()
            for rng in _group_ranges(rows):
                by_stream.setdefault(rng.stream_id, []).append(rng)
        return [list(by_stream.get(sid, [])) for sid in stream_ids]

    async def list_node_ranges(
        self, node_id: int, writable_only: bool = False
    ) -> list[RangeMeta]:
        return await self._run(self._list_node_ranges, node_id, writable_only)

    def _list_node_ranges(self, node_id: int, writable_only: bool) -> list[RangeMeta]:
        cond = "AND r.end_offset = -1" if writable_only else ""
        rows = self._c.execute(
            f"SELECT {_RANGE_COLS} FROM range_replicas mine "
            "JOIN ranges r ON r.stream_id = mine.stream_id AND r.range_index = mine.range_index "
            "JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            f"WHERE mine.node_id = ? {cond} "
            # The node index already yields (stream, index) order: no sort step.
            "ORDER BY mine.stream_id, mine.range_index",
            (node_id,),
        ).fetchall()
        return _group_ranges(rows)

    async def get_range(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return await self._run(self._get_range, stream_id, range_index)

    def _get_range(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return _SqlReader(self._c, self._soft).range(stream_id, range_index)

    async def writable_range_counts(self) -> dict[int, int]:
        return await self._run(self._writable_range_counts)

    def _writable_range_counts(self) -> dict[int, int]:
        rows = self._c.execute(
            "SELECT rr.node_id, COUNT(*) FROM range_replicas rr JOIN ranges r "
            "ON r.stream_id = rr.stream_id AND r.range_index = rr.range_index "
            "WHERE r.end_offset = -1 GROUP BY rr.node_id"
        ).fetchall()
        return {int(n): int(k) for n, k in rows}

    async def record_next_offsets(self, updates: Sequence[tuple[int, int, int]]) -> None:
        await self._write_async(
            updates, lambda tx, u: rules.record_next_offset(tx, u[0], u[1], u[2]))

    async def seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: Sequence[ProducerStateMeta],
    ) -> SealOutcome:
        return await self._run(self._write_one, lambda tx, _: rules.seal_and_new(
            tx, stream_id, range_index, end_offset, new_replicas, producers))

    async def get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        return await self._run(_producers, self._c, stream_id, range_index)

    async def replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        return await self._run(self._write_one, lambda tx, _: rules.replace_replica(
            tx, stream_id, range_index, old_node_id, new_node_id))

    # ------------------------------------------------------------------ auth records
    async def auth_get(self, kind: str, key: str) -> str | None:
        def get() -> str | None:
            row = self._c.execute("SELECT value FROM auth_records WHERE kind = ? AND key = ?",
                                  (kind, key)).fetchone()
            return None if row is None else str(row[0])
        return await self._run(get)

    async def auth_put(self, kind: str, key: str, value: str) -> None:
        def put() -> None:
            with self._raw_tx() as c:
                c.execute("INSERT OR REPLACE INTO auth_records (kind, key, value) "
                          "VALUES (?, ?, ?)", (kind, key, value))
        await self._run(put)

    async def auth_delete(self, kind: str, key: str) -> bool:
        def delete() -> bool:
            with self._raw_tx() as c:
                cur = c.execute("DELETE FROM auth_records WHERE kind = ? AND key = ?",
                                (kind, key))
                return cur.rowcount > 0
        return await self._run(delete)

    async def auth_list(self, kind: str) -> list[tuple[str, str]]:
        def rows() -> list[tuple[str, str]]:
            return [(str(k), str(v)) for k, v in self._c.execute(
                "SELECT key, value FROM auth_records WHERE kind = ? ORDER BY key", (kind,))]
        return await self._run(rows)

    # ------------------------------------------------------------------ committed offsets
    async def commit_offsets(
        self, items: Sequence[OffsetMeta], now_ms: int
    ) -> list[OffsetMeta | SbpError]:
        return await self._write_async(items, lambda tx, o: rules.commit_offset(tx, o, now_ms))

    async def fetch_offsets(self, group: str, stream_ids: Sequence[int]) -> list[OffsetMeta]:
        return await self._run(self._fetch_offsets, group, list(stream_ids))

    def _fetch_offsets(self, group: str, stream_ids: list[int]) -> list[OffsetMeta]:
        q = f"SELECT {_OFFSET_COLS} FROM consumer_offsets WHERE group_name = ?"
        if not stream_ids:
            rows = self._c.execute(q + " ORDER BY stream_id", (group,)).fetchall()
            return [_offset(r) for r in rows]
        out: list[OffsetMeta] = []
        for chunk in _chunks(sorted(set(stream_ids))):
            marks = ",".join("?" * len(chunk))
            rows = self._c.execute(q + f" AND stream_id IN ({marks}) ORDER BY stream_id",
                                   (group, *chunk)).fetchall()
            out += [_offset(r) for r in rows]
        return out

    async def offset_groups(self) -> dict[str, int]:
        return await self._run(self._offset_groups)

    def _offset_groups(self) -> dict[str, int]:
        rows = self._c.execute("SELECT group_name, COUNT(*) FROM consumer_offsets "
                               "GROUP BY group_name ORDER BY group_name").fetchall()
        return {str(g): int(n) for g, n in rows}

    async def delete_offsets(self, group: str) -> int:
        return await self._run(self._delete_offsets, group)

    def _delete_offsets(self, group: str) -> int:
        with self._raw_tx() as c:
            cur = c.execute("DELETE FROM consumer_offsets WHERE group_name = ?", (group,))
            return int(cur.rowcount)
