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

The tables and their migrations are in :mod:`sbpstream.pm.sqlite_schema`; how rows read and
write (and the reader the rules see inside a transaction) in :mod:`sbpstream.pm.sqlite_rows`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, TypeVar

from sbpstream.pm import rules
from sbpstream.pm.metadata import (
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
from sbpstream.pm.rules import MetaTxn
from sbpstream.pm.sqlite_rows import (
    NODE_COLS,
    OFFSET_COLS,
    QUOTA_COLS,
    RANGE_COLS,
    S_COLS,
    STREAM_COLS,
    SqlReader,
    apply_layer,
    chunks,
    group_ranges,
    node_of,
    offset_of,
    producers_of,
    quota_of,
    stream_of,
)
from sbpstream.pm.sqlite_schema import AUTH_TABLE, init_schema
from sbpstream.pm.staging import Layer, StagedTxn
from sbpstream.private_files import open_private, private_dir
from sbpstream.protocol.errors import MetadataError, SbpError
from sbpstream.protocol.names import prefix_upper_bound
from sbpstream.quota.model import QuotaSpec

log = logging.getLogger("sbpstream.pm.sqlite")

T = TypeVar("T")
ItemT = TypeVar("ItemT")

BUSY_TIMEOUT_MS: Final = 2000
"""How long open waits for another process's lock before reporting the file in use."""


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

    def _transaction(self, body: Callable[[SqlReader, Layer], T]) -> T:
        """One durable write transaction: ``body`` stages writes into the layer it is given,
        which is then applied. Pending soft state is carried along for free."""
        soft = self._soft
        with self._raw_tx() as c:
            base = SqlReader(c, soft)
            chunk = Layer(journaled=True)
            flushed = soft.pending()
            for nid in flushed:
                rules.flush_soft_state(StagedTxn(base, Layer(), chunk), nid)
            chunk.keep()
            result = body(base, chunk)
            apply_layer(c, chunk, base)
        soft.forget(flushed)
        soft.last_flush = time.monotonic()
        return result

    @staticmethod
    def _stage(
        base: SqlReader, chunk: Layer, items: Sequence[ItemT],
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
            with self._raw_tx():
                init_schema(c, self._path)
            # auth records came after schema version 1: created on open, old files included
            c.execute(AUTH_TABLE)
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
            f"SELECT {NODE_COLS} FROM data_nodes WHERE node_id = ?", (node_id,)
        ).fetchone()
        return None if row is None else node_of(row, self._soft)

    async def list_nodes(self) -> list[NodeMeta]:
        return await self._run(self._list_nodes)

    def _list_nodes(self) -> list[NodeMeta]:
        rows = self._c.execute(f"SELECT {NODE_COLS} FROM data_nodes ORDER BY node_id").fetchall()
        return [node_of(r, self._soft) for r in rows]

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        return await self._run(
            self._write_one,
            lambda tx, _: rules.update_node_address(tx, node_id, advertise_addr))

    async def remove_node(self, node_id: int) -> bool:
        def remove() -> bool:
            with self._raw_tx() as c:
                gone = c.execute("DELETE FROM data_nodes WHERE node_id = ?", (node_id,)).rowcount
            self._soft.forget([node_id])
            return gone > 0
        return await self._run(remove)

    async def set_node_draining(self, node_id: int, draining: bool) -> NodeMeta:
        return await self._run(
            self._write_one, lambda tx, _: rules.set_node_draining(tx, node_id, draining))

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
        rows = self._c.execute(f"SELECT {QUOTA_COLS} FROM quotas ORDER BY key").fetchall()
        return [quota_of(r) for r in rows]

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
        def body(base: SqlReader, chunk: Layer) -> list[CreatedStream | SbpError]:
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
        for chunk in chunks(unique):
            marks = ",".join("?" * len(chunk))
            for row in self._c.execute(
                f"SELECT {STREAM_COLS} FROM streams WHERE stream_id IN ({marks})", tuple(chunk)
            ):
                found[row[0]] = stream_of(row)
        return [found.get(sid) for sid in stream_ids]

    async def list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        return await self._run(self._list_streams, after_stream_id, limit)

    def _list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        rows = self._c.execute(
            f"SELECT {STREAM_COLS} FROM streams WHERE stream_id > ? AND deleted = 0 "
            "ORDER BY stream_id LIMIT ?",
            (after_stream_id, max(0, limit)),
        ).fetchall()
        return [stream_of(r) for r in rows]

    async def get_stream_by_name(self, name: str) -> StreamMeta | None:
        return await self._run(self._get_stream_by_name, name)

    def _get_stream_by_name(self, name: str) -> StreamMeta | None:
        row = self._c.execute(
            f"SELECT {S_COLS} FROM stream_names n JOIN streams s ON s.stream_id = n.stream_id "
            "WHERE n.name = ?", (name,)).fetchone()
        return None if row is None else stream_of(row)

    async def list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        return await self._run(self._list_streams_by_prefix, prefix, after_stream_id, limit)

    def _list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        rows = self._c.execute(
            f"SELECT {S_COLS} FROM stream_names n JOIN streams s ON s.stream_id = n.stream_id "
            "WHERE n.name >= ? AND n.name < ? AND n.stream_id > ? AND s.deleted = 0 "
            "ORDER BY n.stream_id LIMIT ?",
            (prefix, prefix_upper_bound(prefix), after_stream_id, max(0, limit)),
        ).fetchall()
        return [stream_of(r) for r in rows]

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
        for chunk in chunks(sorted(set(stream_ids))):
            marks = ",".join("?" * len(chunk))
            rows = self._c.execute(
                f"SELECT {RANGE_COLS} FROM ranges r LEFT JOIN range_replicas rr "
                "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
                f"WHERE r.stream_id IN ({marks}) "
                "ORDER BY r.stream_id, r.range_index",
                tuple(chunk),
            ).fetchall()
            for rng in group_ranges(rows):
                by_stream.setdefault(rng.stream_id, []).append(rng)
        return [list(by_stream.get(sid, [])) for sid in stream_ids]

    async def list_node_ranges(
        self, node_id: int, writable_only: bool = False
    ) -> list[RangeMeta]:
        return await self._run(self._list_node_ranges, node_id, writable_only)

    def _list_node_ranges(self, node_id: int, writable_only: bool) -> list[RangeMeta]:
        cond = "AND r.end_offset = -1" if writable_only else ""
        rows = self._c.execute(
            f"SELECT {RANGE_COLS} FROM range_replicas mine "
            "JOIN ranges r ON r.stream_id = mine.stream_id AND r.range_index = mine.range_index "
            "JOIN range_replicas rr "
            "ON rr.stream_id = r.stream_id AND rr.range_index = r.range_index "
            f"WHERE mine.node_id = ? {cond} "
            # The node index already yields (stream, index) order: no sort step.
            "ORDER BY mine.stream_id, mine.range_index",
            (node_id,),
        ).fetchall()
        return group_ranges(rows)

    async def get_range(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return await self._run(self._get_range, stream_id, range_index)

    def _get_range(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return SqlReader(self._c, self._soft).range(stream_id, range_index)

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
        return await self._run(producers_of, self._c, stream_id, range_index)

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
        q = f"SELECT {OFFSET_COLS} FROM consumer_offsets WHERE group_name = ?"
        if not stream_ids:
            rows = self._c.execute(q + " ORDER BY stream_id", (group,)).fetchall()
            return [offset_of(r) for r in rows]
        out: list[OffsetMeta] = []
        for chunk in chunks(sorted(set(stream_ids))):
            marks = ",".join("?" * len(chunk))
            rows = self._c.execute(q + f" AND stream_id IN ({marks}) ORDER BY stream_id",
                                   (group, *chunk)).fetchall()
            out += [offset_of(r) for r in rows]
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
