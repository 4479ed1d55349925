"""The data node: its store, its registration with the PM, its handlers and background loops.

Start-up order matters: open the store (recovery), get the node id (ALLOCATE_ID on first start,
kept in ``DIR/node_id``), have a HEARTBEAT acknowledged, learn this node's ranges from the PM
(LIST_RANGES by data node) and reconcile them with the store, and only then listen: a node that
answers PING is registered and knows its ranges (LocalCluster relies on that).

A node whose store holds more than ``RECONCILE_IN_BACKGROUND_RANGES`` ranges listens right after
registering and reconciles in the background (a whole-node listing of 333,000 ranges takes
seconds). Until the listing is applied, every stream the store holds is *pending*
(``RangeTable.pending``): an APPEND to it first looks the stream up at the PM (LIST_RANGES by
stream, as for a range the node never heard of) and applies the PM's view, so a range the PM
sealed or a stream it deleted while the node was away never takes an append; a FETCH of it sees
no committed data yet and long-polls until the stream is confirmed. Streams the listing does not
mention (orphans) are confirmed at its end, as the synchronous path leaves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from sbpstream.auth.client import Credentials
from sbpstream.auth.gate import DATANODE_PM_ONLY, DATANODE_RULES
from sbpstream.auth.http import HttpAuth
from sbpstream.auth.names import StreamNames
from sbpstream.auth.setup import server_security
from sbpstream.datanode.append import AppendHandler
from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.context import NodeContext
from sbpstream.datanode.control import ControlHandlers
from sbpstream.datanode.fetch import FetchHandler
from sbpstream.datanode.limits import (
    DRAIN_TIMEOUT_S,
    METRICS_WINDOW_S,
    PM_CALL_TIMEOUT_S,
    PM_RETRY_BACKOFF_MAX_S,
    PM_RETRY_BACKOFF_MIN_S,
)
from sbpstream.datanode.metrics import Metrics, rss_bytes
from sbpstream.datanode.pmclient import PmClient
from sbpstream.datanode.rereplicate import SWEEP_INTERVAL_S
from sbpstream.datanode.streams_view import DataNodeStreams
from sbpstream.introspect.figures import Introspector
from sbpstream.introspect.http import admin_gate
from sbpstream.introspect.http import routes as admin_routes
from sbpstream.net.admin import MetricsExporter, Sample, server_samples
from sbpstream.net.client import ConnectionPool
from sbpstream.net.ports import free_port
from sbpstream.net.server import Handler, Request, Responder, Server
from sbpstream.net.tls import TlsConfig
from sbpstream.private_files import private_dir
from sbpstream.protocol.errors import (
    ErrorCode,
    SbpError,
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
    ReportMetricsRequest,
    ReportMetricsResponse,
    Status,
    TrimItem,
    TrimStreamsRequest,
    TrimStreamsResponse,
)
from sbpstream.protocol.messages import (
    DataNode as DataNodeMsg,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.enforcer import FETCH as FETCH_RATE
from sbpstream.quota.enforcer import PRODUCE as PRODUCE_RATE
from sbpstream.quota.model import validate_client_id
from sbpstream.store import Store, StoreConfig

log = logging.getLogger("sbpstream.datanode")

CLIENTS_MAX = 10_000
"""SDK clients a data node remembers from their HEARTBEATs (least recently seen dropped first)."""

NODE_ID_FILE = "node_id"
STORE_DIR = "store"
RECONCILE_IN_BACKGROUND_RANGES = 10_000
"""Above this many ranges in the store, listen before the whole-node reconcile (see above)."""
RECONCILE_YIELD_EVERY = 2_000
"""Ranges adopted between two yields to the event loop while reconciling in the background."""


class DataNodeServer:
    def __init__(self, config: DataNodeConfig) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self.exporter: MetricsExporter | None = None
        self.metrics = Metrics(self.directory)
        self.security = server_security(config.security, config.host, frozenset(),
                                        DATANODE_RULES, "datanode", pm=config.pm, node_id=-1,
                                        cluster_only=DATANODE_PM_ONLY)
        self.pool = ConnectionPool(ssl_context=self.security.client_ssl,
                                   authenticator=self.security.credentials)
        self.pm = PmClient(config.pm, self.pool)
        if self.security.gate is not None:  # prefix: ACLs match names the PM holds
            self.security.gate.names = StreamNames(self._stream_names)
        self.ctx = NodeContext(config, self.metrics, self.pool, self.pm)
        self.port = config.port
        self.advertise = config.advertise
        self.server: Server | None = None
        self.introspector: Introspector | None = None
        self._store: Store | None = None
        self._append: AppendHandler | None = None  # (its hop trace is written at close)
        self._closed = False
        self.fetch: FetchHandler | None = None
        #: SDK clients that sent HEARTBEAT here: client_id -> (peer, monotonic last seen).
        self.clients: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.reconciled = asyncio.Event()
        """Set once this node's ranges were reconciled with the PM's listing."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def node_id(self) -> int:
        return self.ctx.node_id

    @property
    def address(self) -> str:
        return self.advertise

    async def start(self) -> None:
        cfg = self.config
        private_dir(self.directory)  # 0700: segments are data (docs/security.md)
        self._store = Store.open(self.directory / STORE_DIR, StoreConfig(
            fsync_policy=cfg.fsync, fsync_interval_ms=cfg.fsync_interval_ms))
        self.ctx.attach(self._store)
        if self.port == 0:  # the advertised address must be known before registering
            self.port = free_port(cfg.host)
        if not self.advertise:
            self.advertise = f"{cfg.host}:{self.port}"
        await self._register()
        table = self.ctx.table
        held = sum(len(s.ranges) for s in table.streams.values())
        background = held > RECONCILE_IN_BACKGROUND_RANGES
        if background:
            table.pending = set(table.streams)
        else:
            await self._reconcile()
        await self._pull_quotas_at_start()
        handlers: dict[int, Handler] = {}
        control = ControlHandlers(self.ctx)
        handlers[Opcode.APPEND] = self._append = AppendHandler(self.ctx)
        fetch = self.fetch = FetchHandler(self.ctx)
        handlers[Opcode.FETCH] = fetch
        handlers[Opcode.BUFFER_ACK] = fetch.subscriptions.buffer_ack
        handlers[Opcode.SEAL_RANGES] = control.seal
        handlers[Opcode.SYNC_RANGES] = control.sync
        handlers[Opcode.DESCRIBE_RANGES] = control.describe
        handlers[Opcode.TRIM_STREAMS] = control.trim
        handlers[Opcode.DELETE_STREAMS] = control.delete
        handlers[Opcode.HEARTBEAT] = self._client_heartbeat
        handlers[Opcode.QUOTA_COUNTERS] = self.ctx.quotas.counters
        sec = self.security
        self.server = Server(handlers, name="datanode", ssl_context=sec.ssl_context,
                             gate=sec.gate, protected=sec.protected)
        self.introspector = Introspector(self.server, "datanode", node_id=lambda: self.node_id,
                                         streams=DataNodeStreams(self.ctx))
        self.server.handlers.update(self.introspector.handlers())  # INFO, STATS, CONNECTIONS...
        if sec.gate is not None:  # every handler behind the gate, introspection included
            self.server.handlers = sec.gate.wrap(self.server.handlers)
        await self.server.start(cfg.host, self.port)
        self.port = self.server.port
        self.introspector.start()
        spawn = self.ctx.spawn
        if background:
            spawn(self._reconcile(yield_every=RECONCILE_YIELD_EVERY))
        spawn(self._every(cfg.heartbeat_interval_ms, self._heartbeat, "heartbeat"))
        spawn(self._every(cfg.metrics_interval_ms, self._report_metrics, "metrics"))
        spawn(self._every(int(SWEEP_INTERVAL_S * 1000), self.ctx.rereplicator.sweep, "converge"))
        spawn(self._every(cfg.heartbeat_interval_ms, self._pull_quotas, "quotas"))
        spawn(self._every(cfg.retention_interval_ms, self._retention, "retention"))
        spawn(self._every(cfg.compaction_interval_ms, self._compact, "compaction"))
        if cfg.metrics_port >= 0:
            http = None  # auth on: who asks on the admin port (sbpstream.auth.http)
            if sec.gate is not None:
                http = HttpAuth(sec.gate, pm_login=self._pm_login)
            self.exporter = MetricsExporter(
                self.metric_samples, cfg.host, cfg.metrics_port,
                routes=admin_routes(self.introspector, auth=http), tls=cfg.security.tls,
                protected=sec.protected, gate=None if http is None else admin_gate(
                    http, public_metrics=cfg.public_metrics))
            await self.exporter.start()
        log.info("event=datanode_started node_id=%d address=%s dir=%s fsync=%s ranges=%d "
                 "reconcile=%s", self.node_id, self.advertise, self.directory, cfg.fsync.value,
                 held, "background" if background else "done")

    async def _pm_login(self, user: str, password: str) -> str:
        """HTTP Basic on the admin port: a data node keeps no passwords, the PM checks them (a
        SCRAM login on the caller's behalf, answering the caller's token)."""
        tls = self.config.security.tls
        creds = Credentials(user=user, password=password, pm=self.config.pm,
                            tls=TlsConfig(tls.cert, tls.key, tls.ca) if tls.ca else None)
        return await creds.token()

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
                   "primary ranges forwarding to secondaries", len(self.ctx.replicators.by_range)),
            Sample(f"{p}_quota_throttled", "counter",
                   "requests answered with a throttle time (over a quota)",
                   self.ctx.quotas.enforcer.throttled),
            Sample(f"{p}_quota_throttle_ms", "counter", "throttle times handed out, added up",
                   self.ctx.quotas.enforcer.throttle_ms_total),
            Sample(f"{p}_quota_charged", "counter", "requests charged against quotas, by rate",
                   self.ctx.quotas.enforcer.charged[PRODUCE_RATE], {"rate": "produce"}),
            Sample(f"{p}_quota_charged", "counter", "requests charged against quotas, by rate",
                   self.ctx.quotas.enforcer.charged[FETCH_RATE], {"rate": "fetch"}),
            Sample(f"{p}_quota_counters", "gauge", "live quota counters",
                   len(self.ctx.quotas.enforcer.counters)),
            Sample(f"{p}_quota_overflowed", "counter",
                   "charges made to the shared overflow counter (counter table full)",
                   self.ctx.quotas.enforcer.counters.overflowed),
        ]
        if self.fetch is not None:
            sub = self.fetch.subscriptions.stats()
            out += [
                Sample(f"{p}_subscriptions", "gauge", "open subscriptions (FETCH with a window)",
                       sub.subscriptions),
                Sample(f"{p}_subscription_unacked_bytes", "gauge",
                       "payload sent to subscribers and not yet acknowledged", sub.unacked_bytes),
                Sample(f"{p}_subscription_state_bytes", "gauge",
                       "estimated memory of the open subscriptions' state", sub.state_bytes),
            ]
        return out

    async def close(self) -> None:
        """Graceful: GOAWAY every connection, end long polls, drain (bounded), close the store."""
        if self._closed:
            return
        self._closed = True
        await self.ctx.close()
        if self.introspector is not None:
            await self.introspector.close()
        if self.exporter is not None:
            await self.exporter.close()
        if self.server is not None:
            await self.server.close(drain_timeout_s=DRAIN_TIMEOUT_S)
        self.ctx.stop_outgoing()
        await self.pool.close()
        if self._store is not None:
            self._store.close()
        if self._append is not None and self._append.trace is not None:
            self._append.trace.dump()
        log.info("event=datanode_stopped node_id=%d", self.node_id)

    async def _every(self, interval_ms: int, fn: Callable[[], Awaitable[None]],
                     what: str) -> None:
        while not self.ctx.closing:
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
        while not self.ctx.closing:
            try:
                if await fn():
                    return
            except SbpError as exc:
                log.warning("event=%s_retry pm=%s error=%r", what, self.pm.current, str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, PM_RETRY_BACKOFF_MAX_S)
        raise asyncio.CancelledError

    async def _stream_names(self, stream_ids: Sequence[int]) -> dict[int, str]:
        """Names of streams by id, from the PM (DESCRIBE_STREAMS): for ``prefix:`` ACLs."""
        out: dict[int, str] = {}
        for i in range(0, len(stream_ids), MAX_ITEMS_PER_REQUEST):
            r = await self.pm.call(DescribeStreamsRequest(
                timeout_ms=int(PM_CALL_TIMEOUT_S * 1000),
                stream_ids=tuple(stream_ids[i:i + MAX_ITEMS_PER_REQUEST])),
                DescribeStreamsResponse)
            r.status.raise_for_error()
            out.update((res.stream.stream_id, res.stream.name) for res in r.items
                       if res.stream is not None and not res.status.code)
        return out

    def _identify(self) -> None:
        """Our node token names our node id from now on (auth on)."""
        if self.security.credentials is not None:
            self.security.credentials.set_node_id(self.node_id)

    async def _register(self) -> None:
        ctx = self.ctx
        ctx.node_id = self._load_node_id()
        self._identify()
        if ctx.node_id < 0:
            async def allocate() -> bool:
                r = await self.pm.call(AllocateIdRequest(
                    timeout_ms=int(PM_CALL_TIMEOUT_S * 1000), host=self.advertise),
                    AllocateIdResponse)
                r.status.raise_for_error()
                if r.id <= 0:
                    return False
                ctx.node_id = r.id
                return True

            await self._retrying("allocate_id", allocate)
            self._save_node_id(self.node_id)
            self._identify()
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

    def _heartbeat_request(self, progress: tuple[Range, ...] = ()) -> HeartbeatRequest:
        return HeartbeatRequest(client_id=f"datanode-{self.node_id}",
                                client_role=ClientRole.DATA_NODE, data_node=self._me(),
                                committed_ranges=progress)

    async def _client_heartbeat(self, req: Request, resp: Responder) -> None:
        """An SDK client's HEARTBEAT: the connection declares its client id (quotas apply per
        client id, sbpstream.datanode.quota); remembered (bounded by CLIENTS_MAX) and echoed."""
        hb = HeartbeatRequest.decode(req.header)
        try:
            req.conn.client_id = validate_client_id(hb.client_id)
        except SbpError as exc:
            await resp.send(HeartbeatResponse(hb.client_id, hb.client_role, self._me(),
                                              Status.of(exc)).encode())
            return
        if hb.client_id:
            self.clients.pop(hb.client_id, None)
            self.clients[hb.client_id] = (str(req.conn.peer), time.monotonic())
            while len(self.clients) > CLIENTS_MAX:
                self.clients.popitem(last=False)
        await resp.send(HeartbeatResponse(hb.client_id, hb.client_role, self._me()).encode())

    async def _heartbeat(self) -> None:
        """Liveness, plus the committed offsets of writable ranges that moved (the PM answers
        LIST_RANGES and DESCRIBE_RANGES with them, so a stream's end never goes backwards when
        its primary cannot be reached)."""
        progress = self.ctx.committed_progress()
        r = await self.pm.call(self._heartbeat_request(tuple(progress)), HeartbeatResponse)
        if r.status.code:
            log.warning("event=heartbeat_rejected code=%d message=%r", r.status.code,
                        r.status.message)
        else:
            self.ctx.progress_reported(progress)

    async def _pull_quotas(self) -> None:
        await self.ctx.quotas.pull(self.pm)

    async def _pull_quotas_at_start(self) -> None:
        """Quotas are known before the first request; a PM without them is not fatal."""
        try:
            await self._pull_quotas()
        except SbpError as exc:
            log.warning("event=quotas_pull_failed error=%r", str(exc))

    async def _reconcile(self, yield_every: int = 0) -> None:
        """Learn this node's ranges from the PM; align the store with what the PM decided
        while we were away (seals, new ranges). With ``yield_every``, the node is serving
        already: yield to the loop every that many ranges, confirm each stream as it is applied
        and the rest (orphans) at the end."""
        t0 = time.monotonic()
        frames: list[ListRangesResponse] = []

        async def list_mine() -> bool:
            frames[:] = await self.pm.call_frames(
                ListRangesRequest(timeout_ms=int(PM_CALL_TIMEOUT_S * 1000), items=(self._me(),)),
                ListRangesResponse)
            frames[-1].status.raise_for_error()
            return True

        await self._retrying("list_ranges", list_mine)
        t_listed = time.monotonic()
        listed: set[tuple[int, int]] = set()
        table = self.ctx.table
        mine: set[int] = set()  # streams this listing is applying
        for f in frames:
            for res in f.items:
                if res.status.code:
                    continue
                for r in res.ranges:
                    listed.add((r.stream_id, r.range_index))
                    if yield_every and r.stream_id not in table.pending and r.stream_id not in mine:
                        continue  # an append's lookup confirmed it since: that view is newer
                    mine.add(r.stream_id)
                    try:
                        self.ctx.adopt_range(r)
                    except SbpError as exc:
                        log.error("event=reconcile_failed stream_id=%d range_index=%d error=%r",
                                  r.stream_id, r.range_index, str(exc))
                    if yield_every and len(listed) % yield_every == 0:
                        await asyncio.sleep(0)
            if yield_every:
                table.confirm([res.stream_id for res in f.items])
        streams = table.streams
        orphans = [(sid, idx) for sid, s in streams.items() for idx in s.ranges
                   if (sid, idx) not in listed]
        table.confirm(set(table.pending))
        log.info("event=reconciled ranges_listed=%d orphans=%d list_s=%.3f apply_s=%.3f",
                 len(listed), len(orphans), t_listed - t0, time.monotonic() - t_listed)
        self.reconciled.set()
        self.ctx.note_new_streams(list(streams))

    # ------------------------------------------------------------------ background work

    async def _report_metrics(self) -> None:
        req: ReportMetricsRequest = self.metrics.report(
            self._me(), self.store.stats(),
            self.ctx.table.active_ranges(METRICS_WINDOW_S, time.monotonic()),
            missing_replicas=len(self.ctx.rereplicator.missing))
        await self.pm.call(req, ReportMetricsResponse)

    async def _retention(self) -> None:
        await self.ctx.refresh_streams(list(self.ctx.table.streams))
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
    node = DataNodeServer(config)
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
