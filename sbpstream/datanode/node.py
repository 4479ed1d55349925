"""The data node: its store, its registration with the PM, its handlers and background loops.

Start-up order matters: open the store (recovery), get the node id (ALLOCATE_ID on first start,
kept in ``DIR/node_id``), have a HEARTBEAT acknowledged, learn this node's ranges from the PM
(LIST_RANGES by data node) and reconcile them with the store, and only then listen: a node that
answers PING is registered and knows its ranges (LocalCluster relies on that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sbpstream.datanode.append import AppendHandler
from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.control import ControlHandlers
from sbpstream.datanode.fetch import FetchHandler
from sbpstream.datanode.limits import (
    DRAIN_TIMEOUT_S,
    METRICS_WINDOW_S,
    PM_CALL_TIMEOUT_S,
    PM_LOOKUP_TTL_S,
    PM_LOOKUP_WAIT_S,
    PM_RETRY_BACKOFF_MAX_S,
    PM_RETRY_BACKOFF_MIN_S,
)
from sbpstream.datanode.metrics import Metrics, rss_bytes
from sbpstream.datanode.pmclient import PmClient
from sbpstream.datanode.ranges import RangeInfo, RangeTable
from sbpstream.datanode.replication import Replicators
from sbpstream.net.admin import MetricsExporter, Sample, server_samples
from sbpstream.net.client import ConnectionPool
from sbpstream.net.ports import free_port
from sbpstream.net.server import Handler, Server
from sbpstream.protocol.errors import (
    ErrorCode,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
    StreamDeletedError,
)
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    AllocateIdRequest,
    AllocateIdResponse,
    ClientRole,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    ListRangesRequest,
    ListRangesResponse,
    Range,
    ReplicaNode,
    ReportMetricsRequest,
    ReportMetricsResponse,
    StreamOwner,
    TrimItem,
    TrimStreamsRequest,
    TrimStreamsResponse,
)
from sbpstream.protocol.messages import (
    DataNode as DataNodeMsg,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.store import FsyncPolicy, Store, StoreConfig

log = logging.getLogger("sbpstream.datanode")

NODE_ID_FILE = "node_id"
STORE_DIR = "store"


class DataNode:
    def __init__(self, config: DataNodeConfig) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self.table = RangeTable()
        self.exporter: MetricsExporter | None = None
        self.replicators = Replicators(self)
        self.metrics = Metrics(self.directory)
        self.pool = ConnectionPool()
        self.pm = PmClient(config.pm, self.pool)
        self.node_id = -1
        self.port = config.port
        self.advertise = config.advertise
        self.closing = False
        self.server: Server | None = None
        self._store: Store | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lookups: dict[int, tuple[float, asyncio.Task[None]]] = {}
        self._retention_ms: dict[int, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the data node is not started")
        return self._store

    @property
    def address(self) -> str:
        return self.advertise

    async def start(self) -> None:
        cfg = self.config
        self.directory.mkdir(parents=True, exist_ok=True)
        self._store = Store.open(self.directory / STORE_DIR, StoreConfig(
            fsync_policy=cfg.fsync, fsync_interval_ms=cfg.fsync_interval_ms))
        for st in self.store.ranges():
            committed = st.end_offset if st.sealed and st.end_offset >= 0 else st.next_offset
            self.table.ensure(st.stream_id, st.range_index, committed)
        if self.port == 0:  # the advertised address must be known before registering
            self.port = free_port(cfg.host)
        if not self.advertise:
            self.advertise = f"{cfg.host}:{self.port}"
        await self._register()
        await self._reconcile()
        handlers: dict[int, Handler] = {}
        control = ControlHandlers(self)
        handlers[Opcode.APPEND] = AppendHandler(self)
        handlers[Opcode.FETCH] = FetchHandler(self)
        handlers[Opcode.SEAL_RANGES] = control.seal
        handlers[Opcode.SYNC_RANGES] = control.sync
        handlers[Opcode.DESCRIBE_RANGES] = control.describe
        handlers[Opcode.TRIM_STREAMS] = control.trim
        handlers[Opcode.DELETE_STREAMS] = control.delete
        self.server = Server(handlers, name="datanode")
        await self.server.start(cfg.host, self.port)
        self.port = self.server.port
        self._spawn(self._every(cfg.heartbeat_interval_ms, self._heartbeat, "heartbeat"))
        self._spawn(self._every(cfg.metrics_interval_ms, self._report_metrics, "metrics"))
        self._spawn(self._every(cfg.retention_interval_ms, self._retention, "retention"))
        self._spawn(self._every(cfg.compaction_interval_ms, self._compact, "compaction"))
        if cfg.metrics_port >= 0:
            self.exporter = MetricsExporter(self.metric_samples, cfg.host, cfg.metrics_port)
            await self.exporter.start()
        log.info("event=datanode_started node_id=%d address=%s dir=%s fsync=%s ranges=%d",
                 self.node_id, self.advertise, self.directory, cfg.fsync.value,
                 sum(len(s.ranges) for s in self.table.streams.values()))

    def metric_samples(self) -> list[Sample]:
        """Figures for ``/metrics`` (runs on the loop thread: see sbpstream.net.admin)."""
        out = server_samples("sbpstream_datanode", self.server) if self.server else []
        c = self.metrics.c
        st = self.store.stats()
        p = "sbpstream_datanode"
        out += [
            Sample(f"{p}_append_items", "counter", "batches received in APPEND requests",
                   c.append_items),
            Sample(f"{p}_append_failed", "counter", "APPEND items answered with an error",
                   c.append_failed),
            Sample(f"{p}_fetch_items", "counter", "streams asked for in FETCH requests",
                   c.fetch_items),
            Sample(f"{p}_fetch_failed", "counter", "FETCH items answered with an error",
                   c.fetch_failed),
            Sample(f"{p}_append_latency_ms", "gauge", "APPEND latency, average of the last minute",
                   self.metrics.append_latency_ms.value()),
            Sample(f"{p}_fetch_latency_ms", "gauge", "FETCH handling time, last-minute average",
                   self.metrics.fetch_latency_ms.value()),
            Sample(f"{p}_sync_latency_ms", "gauge", "wait for durability, last-minute average",
                   self.metrics.sync_latency_ms.value()),
            Sample(f"{p}_store_bytes_written", "counter", "bytes appended to the log",
                   st.bytes_written),
            Sample(f"{p}_store_bytes_read", "counter", "bytes served from the log", st.bytes_read),
            Sample(f"{p}_store_fsyncs", "counter", "fsyncs of the log (group commits)", st.fsyncs),
            Sample(f"{p}_store_segments", "gauge", "segment files", st.segment_count),
            Sample(f"{p}_store_log_bytes", "gauge", "bytes in segment files", st.log_bytes),
            Sample(f"{p}_store_live_bytes", "gauge", "bytes still referenced", st.live_bytes),
            Sample(f"{p}_store_unindexed_bytes", "gauge",
                   "log bytes not yet covered by an index checkpoint", st.unindexed_bytes),
            Sample(f"{p}_streams", "gauge", "streams held", st.streams),
            Sample(f"{p}_ranges", "gauge", "ranges held", st.ranges),
            Sample(f"{p}_disk_free_bytes", "gauge", "free bytes on the data disk",
                   st.disk_free_bytes),
            Sample(f"{p}_memory_rss_bytes", "gauge", "resident memory", rss_bytes()),
            Sample(f"{p}_replication_ranges", "gauge",
                   "primary ranges forwarding to secondaries", len(self.replicators.by_range)),
        ]
        return out

    async def close(self) -> None:
        """Graceful: GOAWAY every connection, end long polls, drain (bounded), close the store."""
        if self._closed:
            return
        self._closed = True
        self.closing = True
        self.table.wake_all()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.exporter is not None:
            await self.exporter.close()
        if self.server is not None:
            await self.server.close(drain_timeout_s=DRAIN_TIMEOUT_S)
        for _, task in self._lookups.values():
            task.cancel()
        self.replicators.close()
        await self.pool.close()
        if self._store is not None:
            self._store.close()
        log.info("event=datanode_stopped node_id=%d", self.node_id)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _every(self, interval_ms: int, fn: Callable[[], Awaitable[None]],
                     what: str) -> None:
        while not self.closing:
            await asyncio.sleep(interval_ms / 1000.0)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a background failure is logged, retried
                log.warning("event=%s_failed error=%r", what, str(exc))

    # ------------------------------------------------------------------ registration

    def _me(self) -> DataNodeMsg:
        return DataNodeMsg(node_id=self.node_id, advertise_addr=self.advertise)

    def _load_node_id(self) -> int:
        try:
            data = json.loads((self.directory / NODE_ID_FILE).read_text())
            return int(data["node_id"])
        except FileNotFoundError:
            return -1

    def _save_node_id(self, node_id: int) -> None:
        path = self.directory / NODE_ID_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"node_id": node_id}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def _retrying(self, what: str, fn: Callable[[], Awaitable[bool]]) -> None:
        """Call ``fn`` until it returns True, backing off while the PM is unreachable."""
        delay = PM_RETRY_BACKOFF_MIN_S
        while not self.closing:
            try:
                if await fn():
                    return
            except SbpError as exc:
                log.warning("event=%s_retry pm=%s error=%r", what, self.pm.current, str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, PM_RETRY_BACKOFF_MAX_S)
        raise asyncio.CancelledError

    async def _register(self) -> None:
        self.node_id = self._load_node_id()
        if self.node_id < 0:
            async def allocate() -> bool:
                r = await self.pm.call(AllocateIdRequest(
                    timeout_ms=int(PM_CALL_TIMEOUT_S * 1000), host=self.advertise),
                    AllocateIdResponse)
                r.status.raise_for_error()
                if r.id <= 0:
                    return False
                self.node_id = r.id
                return True

            await self._retrying("allocate_id", allocate)
            self._save_node_id(self.node_id)
            log.info("event=node_id_allocated node_id=%d", self.node_id)

        async def first_heartbeat() -> bool:
            r = await self.pm.call(self._heartbeat_request(), HeartbeatResponse)
            if r.status.code == ErrorCode.DATA_NODE_NOT_FOUND:
                raise RuntimeError(
                    f"the PM does not know node id {self.node_id} (kept in "
                    f"{self.directory / NODE_ID_FILE}): was its metadata replaced?")
            r.status.raise_for_error()
            return True

        await self._retrying("register", first_heartbeat)
        log.info("event=registered node_id=%d advertise=%s pm=%s", self.node_id,
                 self.advertise, self.pm.current)

    def _heartbeat_request(self) -> HeartbeatRequest:
        return HeartbeatRequest(client_id=f"datanode-{self.node_id}",
                                client_role=ClientRole.DATA_NODE, data_node=self._me())

    async def _heartbeat(self) -> None:
        r = await self.pm.call(self._heartbeat_request(), HeartbeatResponse)
        if r.status.code:
            log.warning("event=heartbeat_rejected code=%d message=%r", r.status.code,
                        r.status.message)

    async def _reconcile(self) -> None:
        """Learn this node's ranges from the PM; align the store with what the PM decided
        while we were away (seals, new ranges)."""
        frames: list[ListRangesResponse] = []

        async def list_mine() -> bool:
            frames[:] = await self.pm.call_frames(
                ListRangesRequest(timeout_ms=int(PM_CALL_TIMEOUT_S * 1000), items=(self._me(),)),
                ListRangesResponse)
            frames[-1].status.raise_for_error()
            return True

        await self._retrying("list_ranges", list_mine)
        listed: set[tuple[int, int]] = set()
        for f in frames:
            for res in f.items:
                if res.status.code:
                    continue
                for r in res.ranges:
                    listed.add((r.stream_id, r.range_index))
                    try:
                        self.adopt_range(r)
                    except SbpError as exc:
                        log.error("event=reconcile_failed stream_id=%d range_index=%d error=%r",
                                  r.stream_id, r.range_index, str(exc))
        orphans = [(sid, idx) for sid, s in self.table.streams.items() for idx in s.ranges
                   if (sid, idx) not in listed]
        log.info("event=reconciled ranges_listed=%d orphans=%d", len(listed), len(orphans))
        self.note_new_streams(list(self.table.streams))

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
            if r.end_offset > r.start_offset:
                raise ReplicaUnavailableError(
                    f"range {r.stream_id}/{r.range_index} is sealed with data; copying a "
                    "sealed range from a replica is not implemented yet") from None
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
                log.error("event=range_missing_data stream_id=%d range_index=%d "
                          "sealed_end=%d local_next=%d", r.stream_id, r.range_index,
                          r.end_offset, st.next_offset)
                store.seal_range(r.stream_id, r.range_index, None)
        return self.range_message(r.stream_id, r.range_index)

    def resolve_range(self, stream_id: int, range_index: int) -> RangeInfo | None:
        """The range an APPEND targets (-1: the stream's last range here), None when unknown.
        Raises StreamDeletedError for a deleted stream."""
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

    def first_range_message(self, stream_id: int) -> Range | None:
        live = sorted(r.range_index for r in self.store.ranges() if r.stream_id == stream_id)
        return self.range_message(stream_id, live[0]) if live else None

    def stream_start(self, stream_id: int) -> int:
        """The stream's first readable offset here."""
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

    async def lookup_stream(self, stream_id: int) -> None:
        """Ask the PM (once per PM_LOOKUP_TTL_S per stream) for a stream's ranges and adopt
        the ones placed here: its SYNC_RANGES may not have arrived yet."""
        now = time.monotonic()
        ent = self._lookups.get(stream_id)
        if ent is None or now - ent[0] > PM_LOOKUP_TTL_S:
            if len(self._lookups) > MAX_ITEMS_PER_REQUEST:
                self._lookups = {k: v for k, v in self._lookups.items()
                                 if now - v[0] <= PM_LOOKUP_TTL_S}
            ent = (now, asyncio.ensure_future(self._lookup(stream_id)))
            self._lookups[stream_id] = ent
        with contextlib.suppress(SbpError, TimeoutError):
            async with asyncio.timeout(PM_LOOKUP_WAIT_S):
                await asyncio.shield(ent[1])

    async def _lookup(self, stream_id: int) -> None:
        r = await self.pm.call(ListRangesRequest(timeout_ms=int(PM_CALL_TIMEOUT_S * 1000),
                                                 items=(StreamOwner(stream_id),)),
                               ListRangesResponse)
        adopted = False
        for res in r.items:
            for rng in res.ranges:
                if self.is_me(rng.replica_nodes):
                    self.adopt_range(rng)
                    adopted = True
        if adopted:
            self.note_new_streams([stream_id])

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

    # ------------------------------------------------------------------ background work

    async def _report_metrics(self) -> None:
        req: ReportMetricsRequest = self.metrics.report(
            self._me(), self.store.stats(),
            self.table.active_ranges(METRICS_WINDOW_S, time.monotonic()))
        await self.pm.call(req, ReportMetricsResponse)

    def note_new_streams(self, stream_ids: list[int]) -> None:
        """Fetch retention periods of streams just learned of (in the background)."""
        new = [sid for sid in stream_ids
               if sid not in self._retention_ms and sid in self.table.streams]
        if new and not self.closing:
            self._spawn(self._refresh_streams(new))

    async def _refresh_streams(self, stream_ids: list[int]) -> None:
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

    async def _retention(self) -> None:
        await self._refresh_streams(list(self.table.streams))
        trimmed = self.store.apply_retention(time.time_ns() // 1_000_000)
        if not trimmed:
            return
        log.info("event=retention_trimmed streams=%d", len(trimmed))
        for i in range(0, len(trimmed), MAX_ITEMS_PER_REQUEST):
            chunk = trimmed[i : i + MAX_ITEMS_PER_REQUEST]
            await self.pm.call(TrimStreamsRequest(
                timeout_ms=int(PM_CALL_TIMEOUT_S * 1000),
                items=tuple(TrimItem(stream_id=s, trim_offset=o) for s, o in chunk)),
                TrimStreamsResponse)

    async def _compact(self) -> None:
        report = self.store.compact()
        if report.segments_deleted or report.segments_compacted:
            log.info("event=compacted deleted=%d compacted=%d bytes_copied=%d reclaimed=%d",
                     len(report.segments_deleted), len(report.segments_compacted),
                     report.bytes_copied, report.bytes_reclaimed)


async def run_datanode(config: DataNodeConfig) -> None:
    """Run a data node until SIGTERM/SIGINT, then shut it down gracefully."""
    node = DataNode(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(node.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start raises here
            await stopping
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
    finally:
        stopping.cancel()
        await node.close()
