"""What the request handlers see of a data node: its store, ranges, peers and PM.

``NodeContext`` is the narrow interface the handler modules (append, fetch, control,
replication, rereplicate) depend on instead of the whole ``DataNodeServer``: the store, the
range table (committed offsets, placement, long-poll waiters), the connection pool and PM
client, metrics, the replicators of primary ranges, and the range operations handlers share
(adopt a range the PM placed here, resolve an APPEND's target, publish a committed offset,
describe a range, delete a stream, look a stream up at the PM, wait for durability).
``DataNodeServer`` (node.py) owns the lifecycle around it: opening the store, registering,
reconciling, the server and the background loops, which it runs through ``spawn`` so that
closing cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Final

from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.limits import PM_CALL_TIMEOUT_S, PM_LOOKUP_TTL_S, PM_LOOKUP_WAIT_S
from sbpstream.datanode.metrics import Metrics
from sbpstream.datanode.pmclient import PmClient
from sbpstream.datanode.pmfence import PmEpochFence
from sbpstream.datanode.quota import NodeQuotas
from sbpstream.datanode.ranges import RangeTable, ReplicaRange
from sbpstream.datanode.replication import Replicators
from sbpstream.datanode.rereplicate import Rereplicator
from sbpstream.introspect.counters import StreamCounterTable
from sbpstream.net.client import ConnectionPool
from sbpstream.protocol.errors import (
    ErrorCode,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
)
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    ListRangesRequest,
    ListRangesResponse,
    Range,
    ReplicaNode,
    StreamOwner,
)
from sbpstream.store import FsyncPolicy, Store

log = logging.getLogger("sbpstream.datanode")

HEARTBEAT_RANGES_MAX: Final = 5000
"""Most committed offsets one HEARTBEAT reports (about 40 bytes each: 200 KiB); the others
go with the next heartbeat, so a node holding a million writable ranges still sends bounded
frames."""


class NodeContext:
    def __init__(self, config: DataNodeConfig, metrics: Metrics, pool: ConnectionPool,
                 pm: PmClient) -> None:
        self.config = config
        self.metrics = metrics
        self.pool = pool
        self.pm = pm
        self.table = RangeTable()
        self.stream_stats = StreamCounterTable()  # STATS: traffic per stream (append, fetch)
        self.replicators = Replicators(self)
        self.rereplicator = Rereplicator(self)
        self.quotas = NodeQuotas()  # issue 22: quotas enforced here (sbpstream.datanode.quota)
        self.node_id = -1
        self.closing = False
        self._store: Store | None = None
        self._pm_fence: PmEpochFence | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lookups: dict[int, tuple[float, asyncio.Task[None]]] = {}
        self._retention_ms: dict[int, int] = {}
        self._reported: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ store, tasks

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the data node is not started")
        return self._store

    @property
    def pm_fence(self) -> PmEpochFence:
        """The highest PM epoch seen (sbpstream.datanode.pmfence), loaded by :meth:`attach`."""
        if self._pm_fence is None:
            raise RuntimeError("the data node is not started")
        return self._pm_fence

    def attach(self, store: Store) -> None:
        """The store was opened (and recovered): learn the ranges it holds."""
        self._store = store
        self._pm_fence = PmEpochFence(Path(self.config.directory))
        for st in store.ranges():
            # a sealed range is committed up to its end, unless held short (a copy then
            # completes it: see adopt_range); an open one up to what is stored
            self.table.ensure(st.stream_id, st.range_index, st.next_offset)

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` in the background until it ends or ``close`` cancels it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop: wake long polls, cancel background work and lookups, stop replicating. The
        store stays open (the owner closes it after the server drained)."""
        self.closing = True
        self.table.wake_all()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def stop_outgoing(self) -> None:
        """After the server drained: cancel PM lookups in flight, stop replicating."""
        for _, task in self._lookups.values():
            task.cancel()
        self.replicators.close()
        self.rereplicator.close()

    # ------------------------------------------------------------------ ranges

    def is_me(self, replicas: tuple[ReplicaNode, ...]) -> bool:
        return any(rn.data_node.node_id == self.node_id for rn in replicas)

    def adopt_range(self, r: Range) -> Range:
        """Create (idempotently) a range the PM placed here; seal it if the PM sealed it."""
        if r.replica_nodes and not self.is_me(r.replica_nodes):
            raise RangeNotFoundError(
                f"range {r.stream_id}/{r.range_index} is not placed on node {self.node_id}")
        store = self.store
        try:
            st = store.describe_range(r.stream_id, r.range_index)
        except RangeNotFoundError:
            st = store.create_range(r.stream_id, r.range_index, r.start_offset)
        info = self.table.ensure(r.stream_id, r.range_index, st.next_offset)
        self.table.set_placement(info, r.replica_nodes, self.node_id)
        if r.end_offset >= 0 and not (st.sealed and st.end_offset >= 0):
            if r.end_offset <= st.next_offset:
                if r.end_offset < st.next_offset:
                    # The PM sealed without us (we were away): what we hold past its end was
                    # never acknowledged to everyone; the PM's end is the truth (design.md 5).
                    log.warning("event=truncate_to_pm_end stream_id=%d range_index=%d "
                                "sealed_end=%d local_next=%d", r.stream_id, r.range_index,
                                r.end_offset, st.next_offset)
                end = store.seal_range(r.stream_id, r.range_index, r.end_offset)
                self.set_committed(r.stream_id, r.range_index, end)
            else:
                # Sealed while we were away at an end past what we hold: the end is final, so
                # seal there now, serve what we hold and copy the rest from a replica that has
                # it (in the background, until complete; see rereplicate.py).
                log.warning("event=range_missing_data stream_id=%d range_index=%d "
                            "sealed_end=%d local_next=%d action=copy", r.stream_id,
                            r.range_index, r.end_offset, st.next_offset)
                store.seal_range(r.stream_id, r.range_index, r.end_offset)
                self.set_committed(r.stream_id, r.range_index, st.next_offset)
                self.rereplicator.start(r)
        elif st.end_offset == r.end_offset > st.next_offset:  # sealed here, short: copy the rest
            self.rereplicator.start(r)
        return self.range_message(r.stream_id, r.range_index)

    def resolve_range(self, stream_id: int, range_index: int) -> ReplicaRange | None:
        """The range an APPEND targets (-1: the stream's last range here), None when unknown.
        Raises StreamDeletedError for a deleted stream. A stream still awaiting the PM's
        confirmation after a restart is unknown until a lookup confirms it."""
        if stream_id in self.table.pending:
            return None
        s = self.table.streams.get(stream_id)
        r = None
        if s is not None and s.ranges:
            r = s.last() if range_index < 0 else s.ranges.get(range_index)
        if r is None:
            self._raise_if_deleted(stream_id)
        return r

    def _raise_if_deleted(self, stream_id: int) -> None:
        try:
            self.store.describe_range(stream_id, 0)
        except StreamDeletedError:
            raise
        except SbpError:
            pass

    def set_committed(self, stream_id: int, range_index: int, offset: int) -> None:
        r = self.table.get(stream_id, range_index)
        if r is None:
            r = self.table.ensure(stream_id, range_index, offset)
        r.committed_offset = offset
        self.table.wake(stream_id)

    def range_message(self, stream_id: int, range_index: int) -> Range:
        st = self.store.describe_range(stream_id, range_index)
        info = self.table.get(stream_id, range_index)
        return Range(stream_id=stream_id, range_index=range_index, start_offset=st.start_offset,
                     next_offset=st.next_offset, end_offset=st.end_offset if st.sealed else -1,
                     replica_nodes=info.replicas if info is not None else ())

    def committed_range_message(self, stream_id: int, range_index: int) -> Range:
        """DESCRIBE_RANGES' view: a writable range's next_offset is its committed offset
        (what readers may read), never the store's next offset, which includes records not yet
        acknowledged to their writer."""
        rng = self.range_message(stream_id, range_index)
        info = self.table.get(stream_id, range_index)
        if rng.end_offset >= 0 or info is None:
            return rng
        committed = max(rng.start_offset, min(rng.next_offset, info.committed_offset))
        return Range(rng.stream_id, rng.range_index, rng.start_offset, committed, -1,
                     rng.replica_nodes)

    def committed_progress(self, limit: int = HEARTBEAT_RANGES_MAX) -> list[Range]:
        """Writable ranges whose committed offset moved since it was last reported (at most
        ``limit``; the rest go with the next heartbeat). :meth:`progress_reported` marks them."""
        out: list[Range] = []
        alive: set[tuple[int, int]] = set()
        for s in self.table.streams.values():
            for r in s.ranges.values():
                key = (r.stream_id, r.range_index)
                alive.add(key)
                if len(out) >= limit or self._reported.get(key) == r.committed_offset:
                    continue
                try:
                    st = self.store.describe_range(r.stream_id, r.range_index)
                except SbpError:
                    continue
                if st.sealed:
                    self._reported[key] = r.committed_offset  # the PM knows a sealed end
                    continue
                out.append(Range(stream_id=r.stream_id, range_index=r.range_index,
                                 start_offset=st.start_offset,
                                 next_offset=max(st.start_offset, r.committed_offset)))
        for key in [k for k in self._reported if k not in alive]:
            del self._reported[key]
        return out

    def progress_reported(self, ranges: list[Range]) -> None:
        for r in ranges:
            self._reported[(r.stream_id, r.range_index)] = r.next_offset

    def first_range_message(self, stream_id: int) -> Range | None:
        live = sorted(r.range_index for r in self.store.ranges() if r.stream_id == stream_id)
        return self.range_message(stream_id, live[0]) if live else None

    def stream_start(self, stream_id: int) -> int:
        """The stream's first readable offset here (after a trim), or -1."""
        end = self.table.high_watermark(stream_id)
        try:
            return self.store.read(stream_id, max(end, 0), 1, max_offset=0).start_offset
        except SbpError:
            return -1

    def delete_stream(self, stream_id: int) -> None:
        self.replicators.drop(stream_id)
        self.store.delete_stream(stream_id)
        self.table.drop_stream(stream_id)
        self._retention_ms.pop(stream_id, None)
        log.info("event=stream_deleted stream_id=%d", stream_id)

    async def durable(self, position: int) -> None:
        """``store.sync`` with the I/O executor figures REPORT_METRICS carries."""
        if self.config.fsync is not FsyncPolicy.ALWAYS:
            await self.store.sync(position)
            return
        c = self.metrics.c
        c.syncs_waiting += 1
        c.syncs_in_flight = 1
        t0 = time.monotonic()
        try:
            await self.store.sync(position)
        finally:
            c.syncs_waiting -= 1
            c.syncs_in_flight = 1 if c.syncs_waiting else 0
            c.syncs_done += 1
            self.metrics.sync_latency_ms.add((time.monotonic() - t0) * 1000.0)

    # ------------------------------------------------------------------ streams at the PM

    async def lookup_stream(self, stream_id: int, wait_s: float = PM_LOOKUP_WAIT_S) -> None:
        """Ask the PM (once per PM_LOOKUP_TTL_S per stream) for a stream's ranges and adopt
        the ones placed here: its SYNC_RANGES may not have arrived yet. Waits at most
        ``wait_s`` (the caller's time left; never more than PM_LOOKUP_WAIT_S): the lookup goes
        on for the next caller, this one stops waiting."""
        now = time.monotonic()
        ent = self._lookups.get(stream_id)
        if ent is None or now - ent[0] > PM_LOOKUP_TTL_S:
            if len(self._lookups) > MAX_ITEMS_PER_REQUEST:
                self._lookups = {k: v for k, v in self._lookups.items()
                                 if now - v[0] <= PM_LOOKUP_TTL_S}
            ent = (now, asyncio.ensure_future(self._lookup(stream_id)))
            self._lookups[stream_id] = ent
        with contextlib.suppress(SbpError, TimeoutError):
            async with asyncio.timeout(max(0.0, min(wait_s, PM_LOOKUP_WAIT_S))):
                await asyncio.shield(ent[1])

    async def _lookup(self, stream_id: int) -> None:
        r = await self.pm.call(ListRangesRequest(timeout_ms=int(PM_CALL_TIMEOUT_S * 1000),
                                                 items=(StreamOwner(stream_id),)),
                               ListRangesResponse)
        r.status.raise_for_error()
        adopted = False
        for res in r.items:
            if res.status.code in (ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED):
                if stream_id in self.table.streams:
                    log.warning("event=stream_gone_at_pm stream_id=%d code=%d", stream_id,
                                res.status.code)
                    self.delete_stream(stream_id)
                continue
            res.status.raise_for_error()
            for rng in res.ranges:
                if self.is_me(rng.replica_nodes):
                    self.adopt_range(rng)
                    adopted = True
        self.table.confirm([stream_id])  # the PM's view is applied (after a restart)
        if adopted:
            self.note_new_streams([stream_id])

    def note_new_streams(self, stream_ids: list[int]) -> None:
        """Fetch retention periods of streams just learned of (in the background)."""
        new = [sid for sid in stream_ids
               if sid not in self._retention_ms and sid in self.table.streams]
        if new and not self.closing:
            self.spawn(self.refresh_streams(new))

    async def refresh_streams(self, stream_ids: list[int]) -> None:
        """DESCRIBE_STREAMS at the PM: apply retention periods; delete streams the PM deleted
        while this node was away."""
        for i in range(0, len(stream_ids), MAX_ITEMS_PER_REQUEST):
            chunk = tuple(stream_ids[i : i + MAX_ITEMS_PER_REQUEST])
            try:
                r = await self.pm.call(DescribeStreamsRequest(
                    timeout_ms=int(PM_CALL_TIMEOUT_S * 1000), stream_ids=chunk),
                    DescribeStreamsResponse)
            except SbpError as exc:
                log.warning("event=describe_streams_failed error=%r", str(exc))
                return
            for sid, res in zip(chunk, r.items, strict=False):
                try:
                    if res.status.code in (ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED):
                        if sid in self.table.streams:
                            log.warning("event=stream_gone_at_pm stream_id=%d code=%d", sid,
                                        res.status.code)
                            self.delete_stream(sid)
                    elif res.stream is not None and not res.status.code:
                        self.store.set_retention(sid, max(res.stream.retention_period_ms, 0))
                        self._retention_ms[sid] = res.stream.retention_period_ms
                except SbpError as exc:
                    log.warning("event=set_retention_failed stream_id=%d error=%r", sid, str(exc))
