"""SQLite backend of :class:`~sbpstream.pm.metadata.MetadataStore` (the embedded default).

- WAL journal with ``synchronous=FULL``: a write the PM acknowledged survives a crash or power
  loss (the WAL is fsynced at every commit).
- ``locking_mode=EXCLUSIVE``: one PM owns the file; a second PM on the same file fails at open
  instead of handing out duplicate ids.
- One thread owns the connection (a single-worker executor), so the event loop never blocks on
  disk and no two transactions interleave.
- Batches are one transaction: CREATE_STREAMS of 1,000 items costs one fsync. Items stay
  all-or-nothing through a savepoint (a fast path inserts the whole batch under one savepoint;
  if any row fails, the batch is retried item by item, each under its own savepoint).
- Soft state (heartbeat times, metrics) is kept in memory and written lazily: with the next
  durable transaction, or at most every ``SOFT_STATE_FLUSH_INTERVAL_S``, or at close.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from sbpstream.pm.metadata import (
    FIRST_NODE_ID,
    FIRST_STREAM_ID,
    MAX_NODE_ID,
    MAX_STREAM_ID,
    WRITABLE_END_OFFSET,
    CreatedStream,
    DeleteOutcome,
    NewStream,
    NodeMeta,
    NodeMetrics,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    SealOutcome,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
    replace_in,
)
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    MetadataError,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

log = logging.getLogger("sbpstream.pm.sqlite")

T = TypeVar("T")
U = TypeVar("U")

SCHEMA_VERSION: Final = 1
"""Bumped by every schema change; ``_MIGRATIONS[v]`` upgrades a file from version ``v``."""

SOFT_STATE_FLUSH_INTERVAL_S: Final = 5.0
"""Heartbeat times and metrics reach the file at most this late. They only inform placement and
operators; liveness after a restart restarts from a fresh grace period, so losing them is safe."""

SQL_IN_CHUNK: Final = 500
"""Ids per ``IN (...)`` clause: well under SQLite's default 999 bound-parameter limit of old
builds, large enough that a 1,000-item batch takes two queries."""

BUSY_TIMEOUT_MS: Final = 2000
"""How long open waits for another process's lock before reporting the file in use."""

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
        updated_ms INTEGER NOT NULL
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
)

_MIGRATIONS: Final[dict[int, tuple[str, ...]]] = {}
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

    Hot for LIST_RANGES of a whole data node (hundreds of thousands of rows): one pass, and the
    replica sort only when a range has several."""
    out: list[RangeMeta] = []
    append = out.append
    cur_sid = cur_idx = -1
    head: tuple[int, ...] = ()
    replicas: list[ReplicaMeta] = []
    for row in rows:
        sid, idx = row[0], row[1]
        if sid != cur_sid or idx != cur_idx:
            if head:
                append(_range(head, replicas))
            cur_sid, cur_idx, head, replicas = sid, idx, row, []
        if row[5] is not None:
            replicas.append(ReplicaMeta(row[5], bool(row[6])))
    if head:
        append(_range(head, replicas))
    return out


def _range(head: tuple[int, ...], replicas: list[ReplicaMeta]) -> RangeMeta:
    # Primary first, then by node id: a stable order for clients and tests.
    if len(replicas) > 1:
        replicas.sort(key=lambda r: (not r.is_primary, r.node_id))
    return RangeMeta(head[0], head[1], head[2], head[3], head[4], tuple(replicas))


def _stream(row: tuple[int, ...]) -> StreamMeta:
    return StreamMeta(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6])


_STREAM_COLS: Final = (
    "stream_id, replica_nums, retention_period_ms, start_offset, deleted, created_ms, updated_ms"
)


class SqliteMetadataStore:
    """:class:`~sbpstream.pm.metadata.MetadataStore` on one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self._path = str(path)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        # Soft state, touched only on the executor thread.
        self._pending_heartbeats: dict[int, int] = {}
        self._pending_metrics: dict[int, tuple[NodeMetrics, int]] = {}
        self._last_flush = time.monotonic()

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
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One durable write transaction; carries pending soft state along for free."""
        c = self._c
        c.execute("BEGIN IMMEDIATE")
        try:
            self._write_soft_state(c)
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    def _counter(self, c: sqlite3.Connection, key: str) -> int:
        row = c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise MetadataError(f"metadata counter {key!r} missing")
        return int(row[0])

    def _set_counter(self, c: sqlite3.Connection, key: str, value: int) -> None:
        c.execute("UPDATE meta SET value = ? WHERE key = ?", (value, key))

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
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
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
        with self._tx():
            c.execute(_SCHEMA[0])
            row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                for stmt in _SCHEMA[1:]:
                    c.execute(stmt)
                c.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema_version", SCHEMA_VERSION),
                        ("next_stream_id", FIRST_STREAM_ID),
                        ("next_node_id", FIRST_NODE_ID),
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
                self._set_counter(c, "schema_version", version)
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
            if self._pending_heartbeats or self._pending_metrics:
                with self._tx():
                    pass
        finally:
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ soft state
    def _write_soft_state(self, c: sqlite3.Connection) -> None:
        if self._pending_heartbeats:
            c.executemany(
                "UPDATE data_nodes SET last_heartbeat_ms = ? WHERE node_id = ?",
                [(ms, nid) for nid, ms in self._pending_heartbeats.items()],
            )
        if self._pending_metrics:
            c.executemany(
                "UPDATE data_nodes SET metrics = ?, metrics_ms = ? WHERE node_id = ?",
                [
                    (json.dumps(m.to_dict(), separators=(",", ":")), ms, nid)
                    for nid, (m, ms) in self._pending_metrics.items()
                ],
            )
        self._pending_heartbeats.clear()
        self._pending_metrics.clear()
        self._last_flush = time.monotonic()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= SOFT_STATE_FLUSH_INTERVAL_S:
            with self._tx():
                pass

    async def record_heartbeat(self, node_id: int, now_ms: int) -> None:
        await self._run(self._record_heartbeat, node_id, now_ms)

    def _record_heartbeat(self, node_id: int, now_ms: int) -> None:
        self._pending_heartbeats[node_id] = now_ms
        self._maybe_flush()

    async def record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        await self._run(self._record_metrics, node_id, metrics, now_ms)

    def _record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        self._pending_metrics[node_id] = (metrics, now_ms)
        self._maybe_flush()

    # ------------------------------------------------------------------ data nodes
    async def allocate_node_id(self, host: str, now_ms: int) -> int:
        return await self._run(self._allocate_node_id, host, now_ms)

    def _allocate_node_id(self, host: str, now_ms: int) -> int:
        with self._tx() as c:
            node_id = self._counter(c, "next_node_id")
            if node_id > MAX_NODE_ID:
                raise LimitExceededError("node ids exhausted (int32)")
            self._set_counter(c, "next_node_id", node_id + 1)
            c.execute(
                "INSERT INTO data_nodes (node_id, host, advertise_addr, registered_ms) "
                "VALUES (?, ?, '', ?)",
                (node_id, host, now_ms),
            )
        return node_id

    def _node_from_row(self, row: Sequence[Any]) -> NodeMeta:
        node_id = int(row[0])
        hb = self._pending_heartbeats.get(node_id, int(row[4]))
        metrics: NodeMetrics | None = None
        metrics_ms = int(row[6])
        if node_id in self._pending_metrics:
            metrics, metrics_ms = self._pending_metrics[node_id]
        elif isinstance(row[5], str):
            metrics = NodeMetrics.from_dict(json.loads(row[5]))
        return NodeMeta(
            node_id=node_id,
            host=str(row[1]),
            advertise_addr=str(row[2]),
            registered_ms=int(row[3]),
            last_heartbeat_ms=hb,
            metrics=metrics,
            metrics_ms=metrics_ms,
        )

    _NODE_COLS: Final = (
        "node_id, host, advertise_addr, registered_ms, last_heartbeat_ms, metrics, metrics_ms"
    )

    async def get_node(self, node_id: int) -> NodeMeta | None:
        return await self._run(self._get_node, node_id)

    def _get_node(self, node_id: int) -> NodeMeta | None:
        row = self._c.execute(
            f"SELECT {self._NODE_COLS} FROM data_nodes WHERE node_id = ?", (node_id,)
        ).fetchone()
        return None if row is None else self._node_from_row(row)

    async def list_nodes(self) -> list[NodeMeta]:
        return await self._run(self._list_nodes)

    def _list_nodes(self) -> list[NodeMeta]:
        rows = self._c.execute(
            f"SELECT {self._NODE_COLS} FROM data_nodes ORDER BY node_id"
        ).fetchall()
        return [self._node_from_row(r) for r in rows]

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        return await self._run(self._update_node_address, node_id, advertise_addr)

    def _update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        with self._tx() as c:
            cur = c.execute(
                "UPDATE data_nodes SET advertise_addr = ? WHERE node_id = ?",
                (advertise_addr, node_id),
            )
            if cur.rowcount == 0:
                raise DataNodeNotFoundError(f"data node {node_id} was never allocated here")
        node = self._get_node(node_id)
        assert node is not None
        return node

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
        with self._tx() as c:
            first_id = self._counter(c, "next_stream_id")
            if first_id + len(items) - 1 > MAX_STREAM_ID:
                raise LimitExceededError("stream ids exhausted (int64)")
            self._set_counter(c, "next_stream_id", first_id + len(items))
            created = [self._created(first_id + i, item, now_ms) for i, item in enumerate(items)]
            c.execute("SAVEPOINT batch")
            try:
                self._insert_created(c, created)
                c.execute("RELEASE batch")
                return list(created)
            except sqlite3.IntegrityError:
                c.execute("ROLLBACK TO batch")
                c.execute("RELEASE batch")
            # Slow path: some row failed; give every item its own outcome.
            outcomes: list[CreatedStream | SbpError] = []
            for cs in created:
                c.execute("SAVEPOINT item")
                try:
                    self._insert_created(c, [cs])
                    c.execute("RELEASE item")
                    outcomes.append(cs)
                except sqlite3.IntegrityError as e:
                    c.execute("ROLLBACK TO item")
                    c.execute("RELEASE item")
                    log.error("event=create_stream_failed stream_id=%d error=%r",
                              cs.stream.stream_id, e)
                    outcomes.append(MetadataError(f"could not create stream: {e}"))
            return outcomes

    @staticmethod
    def _created(stream_id: int, item: NewStream, now_ms: int) -> CreatedStream:
        stream = StreamMeta(
            stream_id, item.replica_nums, item.retention_period_ms, 0, False, now_ms, now_ms
        )
        rng = RangeMeta(stream_id, 0, 0, WRITABLE_END_OFFSET, 0, item.replicas)
        return CreatedStream(stream, rng)

    @staticmethod
    def _insert_created(c: sqlite3.Connection, created: Sequence[CreatedStream]) -> None:
        c.executemany(
            f"INSERT INTO streams ({_STREAM_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (s.stream_id, s.replica_nums, s.retention_period_ms, s.start_offset,
                 int(s.deleted), s.created_ms, s.updated_ms)
                for s in (cs.stream for cs in created)
            ],
        )
        SqliteMetadataStore._insert_ranges(c, [cs.first_range for cs in created])

    @staticmethod
    def _insert_ranges(c: sqlite3.Connection, ranges: Sequence[RangeMeta]) -> None:
        c.executemany(
            "INSERT INTO ranges (stream_id, range_index, start_offset, end_offset, next_offset) "
            "VALUES (?, ?, ?, ?, ?)",
            [(r.stream_id, r.range_index, r.start_offset, r.end_offset, r.next_offset)
             for r in ranges],
        )
        c.executemany(
            "INSERT INTO range_replicas (stream_id, range_index, node_id, is_primary) "
            "VALUES (?, ?, ?, ?)",
            [(r.stream_id, r.range_index, rep.node_id, int(rep.is_primary))
             for r in ranges for rep in r.replicas],
        )

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

    def _live_stream(self, c: sqlite3.Connection, stream_id: int) -> StreamMeta:
        row = c.execute(
            f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id = ?", (stream_id,)
        ).fetchone()
        if row is None:
            raise StreamNotFoundError(f"stream {stream_id} does not exist")
        s = _stream(row)
        if s.deleted:
            raise StreamDeletedError(f"stream {stream_id} was deleted")
        return s

    def _per_item(
        self, c: sqlite3.Connection, items: Sequence[U], fn: Callable[[sqlite3.Connection, U], T]
    ) -> list[T | SbpError]:
        """Run ``fn`` per item under its own savepoint: an item that fails leaves no trace."""
        out: list[T | SbpError] = []
        for item in items:
            c.execute("SAVEPOINT item")
            try:
                out.append(fn(c, item))
            except (SbpError, sqlite3.IntegrityError) as e:
                c.execute("ROLLBACK TO item")
                c.execute("RELEASE item")
                out.append(e if isinstance(e, SbpError) else MetadataError(f"sqlite: {e}"))
                continue
            c.execute("RELEASE item")
        return out

    async def update_streams(
        self, items: Sequence[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        if not items:
            return []
        return await self._run(self._update_streams, list(items), now_ms)

    def _update_streams(
        self, items: list[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        def one(c: sqlite3.Connection, u: StreamUpdate) -> StreamMeta:
            self._live_stream(c, u.stream_id)
            c.execute(
                "UPDATE streams SET replica_nums = ?, retention_period_ms = ?, updated_ms = ? "
                "WHERE stream_id = ?",
                (u.replica_nums, u.retention_period_ms, now_ms, u.stream_id),
            )
            return self._live_stream(c, u.stream_id)

        with self._tx() as c:
            return self._per_item(c, items, one)

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        if not items:
            return []
        return await self._run(self._trim_streams, list(items), now_ms)

    def _trim_streams(
        self, items: list[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        with self._tx() as c:
            return self._per_item(c, items, lambda c, it: self._trim_one(c, it[0], it[1], now_ms))

    def _trim_one(
        self, c: sqlite3.Connection, stream_id: int, trim_offset: int, now_ms: int
    ) -> TrimOutcome:
        if trim_offset < 0:
            raise InvalidRequestError(f"trim offset {trim_offset} is negative")
        stream = self._live_stream(c, stream_id)
        ranges = self._stream_ranges(c, stream_id)
        if trim_offset <= stream.start_offset:
            return TrimOutcome(stream, ranges[0] if ranges else None, ())
        dropped = tuple(r for r in ranges if not r.writable and r.end_offset <= trim_offset)
        for r in dropped:
            self._delete_range(c, r.stream_id, r.range_index)
        remaining = ranges[len(dropped):]
        first: RangeMeta | None = None
        if remaining:
            r0 = remaining[0]
            start = max(r0.start_offset, trim_offset)
            nxt = max(r0.next_offset, start)
            c.execute(
                "UPDATE ranges SET start_offset = ?, next_offset = ? "
                "WHERE stream_id = ? AND range_index = ?",
                (start, nxt, stream_id, r0.range_index),
            )
            first = RangeMeta(r0.stream_id, r0.range_index, start, r0.end_offset, nxt,
                              r0.replicas)
        c.execute(
            "UPDATE streams SET start_offset = ?, updated_ms = ? WHERE stream_id = ?",
            (trim_offset, now_ms, stream_id),
        )
        return TrimOutcome(self._live_stream(c, stream_id), first, dropped)

    async def delete_streams(
        self, stream_ids: Sequence[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        if not stream_ids:
            return []
        return await self._run(self._delete_streams, list(stream_ids), now_ms)

    def _delete_streams(
        self, stream_ids: list[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        with self._tx() as c:
            return self._per_item(c, stream_ids, lambda c, sid: self._delete_one(c, sid, now_ms))

    def _delete_one(self, c: sqlite3.Connection, stream_id: int, now_ms: int) -> DeleteOutcome:
        self._live_stream(c, stream_id)
        ranges = self._stream_ranges(c, stream_id)
        c.execute("DELETE FROM range_replicas WHERE stream_id = ?", (stream_id,))
        c.execute("DELETE FROM ranges WHERE stream_id = ?", (stream_id,))
        c.execute("DELETE FROM seal_producers WHERE stream_id = ?", (stream_id,))
        c.execute(
            "UPDATE streams SET deleted = 1, updated_ms = ? WHERE stream_id = ?",
            (now_ms, stream_id),
        )
        row = c.execute(
            f"SELECT {_STREAM_COLS} FROM streams WHERE stream_id = ?", (stream_id,)
        ).fetchone()
        return DeleteOutcome(_stream(row), tuple(ranges))

    # ------------------------------------------------------------------ ranges
    @staticmethod
    def _delete_range(c: sqlite3.Connection, stream_id: int, range_index: int) -> None:
        for table in ("range_replicas", "ranges", "seal_producers"):
            c.execute(
                f"DELETE FROM {table} WHERE stream_id = ? AND range_index = ?",
                (stream_id, range_index),
            )

    @staticmethod
    def _stream_ranges(c: sqlite3.Connection, stream_id: int) -> list[RangeMeta]:
        rows = c.execute(
            f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            "WHERE r.stream_id = ? ORDER BY r.range_index",
            (stream_id,),
        ).fetchall()
        return _group_ranges(rows)

    @staticmethod
    def _one_range(c: sqlite3.Connection, stream_id: int, range_index: int) -> RangeMeta | None:
        rows = c.execute(
            f"SELECT {_RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            "WHERE r.stream_id = ? AND r.range_index = ?",
            (stream_id, range_index),
        ).fetchall()
        got = _group_ranges(rows)
        return got[0] if got else None

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
        return await self._run(self._one_range_read, stream_id, range_index)

    def _one_range_read(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return self._one_range(self._c, stream_id, range_index)

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
        if updates:
            await self._run(self._record_next_offsets, list(updates))

    def _record_next_offsets(self, updates: list[tuple[int, int, int]]) -> None:
        with self._tx() as c:
            c.executemany(
                "UPDATE ranges SET next_offset = MAX(next_offset, ?) "
                "WHERE stream_id = ? AND range_index = ? AND end_offset = -1",
                [(nxt, sid, idx) for sid, idx, nxt in updates],
            )

    async def seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: Sequence[ProducerStateMeta],
    ) -> SealOutcome:
        return await self._run(
            self._seal_and_new, stream_id, range_index, end_offset, new_replicas, list(producers)
        )

    def _seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: list[ProducerStateMeta],
    ) -> SealOutcome:
        with self._tx() as c:
            self._live_stream(c, stream_id)
            cur = self._one_range(c, stream_id, range_index)
            if cur is None:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if not cur.writable:
                nxt = self._one_range(c, stream_id, range_index + 1)
                if nxt is not None:  # any sealed range: its pair and its producer states
                    return SealOutcome(cur, nxt, self._producers(c, stream_id, range_index), False)
                # A sealed last range (never left by this store): open its successor.
                end_offset = cur.end_offset
            elif end_offset < cur.start_offset:
                raise InvalidRequestError(
                    f"seal end {end_offset} is below range start {cur.start_offset}"
                )
            if not new_replicas:
                raise InvalidRequestError("a new range needs at least one replica")
            c.execute(
                "UPDATE ranges SET end_offset = ?, next_offset = ? "
                "WHERE stream_id = ? AND range_index = ?",
                (end_offset, end_offset, stream_id, range_index),
            )
            new = RangeMeta(stream_id, range_index + 1, end_offset, WRITABLE_END_OFFSET,
                            end_offset, tuple(new_replicas))
            self._insert_ranges(c, [new])
            c.executemany(
                "INSERT OR REPLACE INTO seal_producers "
                "(stream_id, range_index, producer_id, producer_epoch, last_sequence, "
                "last_base_offset) VALUES (?, ?, ?, ?, ?, ?)",
                [(stream_id, range_index, p.producer_id, p.producer_epoch, p.last_sequence,
                  p.last_base_offset) for p in producers],
            )
            sealed = self._one_range(c, stream_id, range_index)
            fresh = self._one_range(c, stream_id, range_index + 1)
            assert sealed is not None and fresh is not None
            return SealOutcome(sealed, fresh, self._producers(c, stream_id, range_index), True)

    @staticmethod
    def _producers(
        c: sqlite3.Connection, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        rows = c.execute(
            "SELECT producer_id, producer_epoch, last_sequence, last_base_offset "
            "FROM seal_producers WHERE stream_id = ? AND range_index = ? ORDER BY producer_id",
            (stream_id, range_index),
        ).fetchall()
        return tuple(ProducerStateMeta(int(a), int(b), int(s), int(o)) for a, b, s, o in rows)

    async def get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        return await self._run(self._get_seal_producers, stream_id, range_index)

    def _get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        return self._producers(self._c, stream_id, range_index)

    async def replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        return await self._run(
            self._replace_replica, stream_id, range_index, old_node_id, new_node_id
        )

    def _replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        with self._tx() as c:
            self._live_stream(c, stream_id)
            cur = self._one_range(c, stream_id, range_index)
            new = replace_in(cur, stream_id, range_index, old_node_id, new_node_id)
            if new is None:
                assert cur is not None
                return cur
            c.execute(
                "UPDATE range_replicas SET node_id = ? "
                "WHERE stream_id = ? AND range_index = ? AND node_id = ?",
                (new_node_id, stream_id, range_index, old_node_id),
            )
            got = self._one_range(c, stream_id, range_index)
            assert got is not None
            return got
