"""The Placement Manager server: SBP frames in, :class:`PmService` calls, SBP frames out.

The net layer answers PING and GOAWAY, and UNSUPPORTED_OPERATION for the opcodes registered
nowhere here (APPEND, FETCH, SYNC_RANGES, BUFFER_ACK). Every handler decodes its header (a bad
one becomes a system error frame via the net layer), answers every item with its own status, and
never lets one item's failure touch another.

The PM is also a client: it tells data nodes of new ranges (SYNC_RANGES), seals ranges on them
(SEAL_RANGES), and forwards trims and deletes, through :class:`WireDataNodeApi`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Final, TypeVar

from sbpstream.auth.gate import PM_NODE_ONLY, PM_RULES
from sbpstream.auth.http import HttpAuth
from sbpstream.auth.names import StreamNames
from sbpstream.auth.pmauth import PmAuth
from sbpstream.auth.records import AuthRecords
from sbpstream.auth.setup import server_security
from sbpstream.introspect.figures import ATTR_CLIENT_ID, Introspector
from sbpstream.introspect.http import admin_gate
from sbpstream.introspect.http import routes as admin_routes
from sbpstream.net.admin import MetricsExporter, Sample, server_samples
from sbpstream.net.client import Authenticator, ConnectionPool
from sbpstream.net.server import Handler, Request, Responder, Server
from sbpstream.pm import metadata as md
from sbpstream.pm.backends import open_metadata
from sbpstream.pm.config import PmConfig
from sbpstream.pm.drain import Drainer, DrainHandler
from sbpstream.pm.groups import GroupHandlers
from sbpstream.pm.overview import ClusterOverview
from sbpstream.pm.placement import NodeState
from sbpstream.pm.repair import Repairer
from sbpstream.pm.service import (
    LIST_RANGES_FRAME_MAX,
    DnSealReply,
    PmService,
    call_timeout,
    within,
)
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    FencedLeaderError,
    InvalidRequestError,
    NotEnoughDataNodesError,
    PmNotLeaderError,
    SbpError,
)
from sbpstream.protocol.fbtable import maker
from sbpstream.protocol.messages import ClientRole, Status
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.model import QuotaSpec, validate_entity

if TYPE_CHECKING:
    from sbpstream.pm.leader import LeaderElection

log = logging.getLogger("sbpstream.pm")

DN_CONNECT_TIMEOUT_S: Final = 1.0
"""Connecting to a data node: it is on the same network; a node this slow is unreachable."""

SWEEP_STALL_INTERVALS: Final = 1.0
"""The liveness sweep waking this many heartbeat intervals late means the PM itself stalled;
the stall is then not counted against the data nodes (NodeRegistry.excuse_stall)."""

CONN_ROLE: Final = "role"
CONN_NODE_ID: Final = "node_id"
"""Keys in a connection's ``attributes``: set by its HEARTBEAT, read by TRIM_STREAMS to tell a
data node's retention report from a user's trim."""


RespT = TypeVar("RespT", bound=m.Message)


def _ok_or(err: SbpError | None) -> Status:
    return m.STATUS_OK if err is None else Status.of(err)


class WireDataNodeApi:
    """:class:`~sbpstream.pm.service.DataNodeApi` over SBP, one pooled connection per node."""

    def __init__(self, service_addr: Callable[[int], str],
                 ssl_context: ssl.SSLContext | None = None,
                 authenticator: Authenticator | None = None) -> None:
        self._addr_of = service_addr
        self.epoch: Callable[[], int] = lambda: 0
        """This PM's leadership epoch, sent with every SEAL_RANGES (sbpstream.datanode.pmfence):
        the election's fencing token, 0 without an election."""
        self.pool = ConnectionPool(connect_timeout_s=DN_CONNECT_TIMEOUT_S,
                                   ssl_context=ssl_context, authenticator=authenticator)

    def replica_nodes(self, replicas: tuple[md.ReplicaMeta, ...]) -> tuple[m.ReplicaNode, ...]:
        return tuple(
            m.ReplicaNode(m.DataNode(rep.node_id, self._addr_of(rep.node_id)), rep.is_primary)
            for rep in replicas
        )

    def to_range(self, r: md.RangeMeta,
                 replicas: dict[tuple[md.ReplicaMeta, ...], tuple[m.ReplicaNode, ...]] | None
                 = None) -> m.Range:
        """``replicas``: a cache for one response (a node's listing repeats a few replica
        sets hundreds of thousands of times; addresses are read once per set)."""
        reps = None if replicas is None else replicas.get(r.replicas)
        if reps is None:
            reps = self.replica_nodes(r.replicas)
            if replicas is not None:
                replicas[r.replicas] = reps
        return _new_range(r.stream_id, r.range_index, r.start_offset, r.next_offset,
                          r.end_offset, reps)

    async def _call(self, node: NodeState, req: m.Message, resp_cls: type[RespT]) -> RespT:
        conn = await self.pool.get(node.advertise_addr)
        frame = await conn.request_one(req.OPCODE, req.encode(), timeout_s=call_timeout())
        resp = resp_cls.decode(frame.header)
        status = getattr(resp, "status", m.STATUS_OK)
        status.raise_for_error()
        return resp

    async def sync_ranges(self, node: NodeState, ranges: Sequence[md.RangeMeta]) -> None:
        by_stream: dict[int, list[m.Range]] = {}
        for r in ranges:
            by_stream.setdefault(r.stream_id, []).append(self.to_range(r))
        req = m.SyncRangesRequest(
            timeout_ms=int(call_timeout() * 1000),
            items=tuple(m.StreamRanges(sid, tuple(rs)) for sid, rs in by_stream.items()),
        )
        resp = await self._call(node, req, m.SyncRangesResponse)
        bad = [it for it in resp.items if not it.status.ok]
        if bad:
            log.warning("event=sync_ranges_item_failed node_id=%d failed=%d first_stream_id=%d "
                        "first_error=%r", node.node_id, len(bad), bad[0].stream_id,
                        bad[0].status.message)

    async def seal_range(self, node: NodeState, rng: md.RangeMeta, end_offset: int) -> DnSealReply:
        req = m.SealRangesRequest(
            timeout_ms=int(call_timeout() * 1000),
            items=(m.SealItem(rng.stream_id, rng.range_index, end_offset),),
            pm_epoch=self.epoch(),
        )
        resp = await self._call(node, req, m.SealRangesResponse)
        if not resp.items:
            raise InvalidRequestError(f"data node {node.node_id} answered SEAL_RANGES with no item")
        item = resp.items[0]
        item.status.raise_for_error()
        if not item.ranges:
            raise InvalidRequestError(f"data node {node.node_id} sealed without a range")
        r = item.ranges[0]
        end = r.end_offset if r.end_offset >= 0 else r.next_offset
        producers = tuple(
            md.ProducerStateMeta(p.producer_id, p.producer_epoch, p.last_sequence,
                                 p.last_base_offset)
            for p in item.producers
        )
        return DnSealReply(end, producers)

    async def describe_range(self, node: NodeState, stream_id: int, range_index: int) -> int:
        req = m.DescribeRangesRequest(
            timeout_ms=int(call_timeout() * 1000),
            items=(m.DescribeRangeItem(stream_id, range_index),),
        )
        resp = await self._call(node, req, m.DescribeRangesResponse)
        if not resp.items:
            raise InvalidRequestError(f"data node {node.node_id} described no range")
        item = resp.items[0]
        item.status.raise_for_error()
        if item.range is None:
            raise InvalidRequestError(f"data node {node.node_id} described no range")
        return item.range.next_offset

    async def trim_streams(self, node: NodeState, items: Sequence[tuple[int, int]]) -> None:
        req = m.TrimStreamsRequest(
            timeout_ms=int(call_timeout() * 1000),
            items=tuple(m.TrimItem(sid, off) for sid, off in items),
        )
        resp = await self._call(node, req, m.TrimStreamsResponse)
        self._log_item_failures(node, "trim_streams", [it.status for it in resp.items])

    async def delete_streams(self, node: NodeState, stream_ids: Sequence[int]) -> None:
        req = m.DeleteStreamsRequest(
            timeout_ms=int(call_timeout() * 1000),
            items=tuple(m.Stream(stream_id=sid) for sid in stream_ids),
        )
        resp = await self._call(node, req, m.DeleteStreamsResponse)
        self._log_item_failures(node, "delete_streams", [it.status for it in resp.items])

    @staticmethod
    def _log_item_failures(node: NodeState, what: str, statuses: Sequence[Status]) -> None:
        bad = [s for s in statuses if not s.ok]
        if bad:
            log.info("event=%s_item_failed node_id=%d failed=%d first_error=%r", what,
                     node.node_id, len(bad), bad[0].message)

    async def close(self) -> None:
        await self.pool.close()


def _quota_spec(q: m.Quota) -> QuotaSpec:
    """The wire quota as a spec (an unknown kind: InvalidRequestError naming it)."""
    kind, name, user = validate_entity(q.kind, q.name, q.user)
    return QuotaSpec(kind, name, q.produce_bytes_per_s, q.fetch_bytes_per_s, q.requests_per_s,
                     user)


def _quota_msg(q: QuotaSpec) -> m.Quota:
    return m.Quota(int(q.kind), q.name, *q.rates(), q.user)


def _quota_results(asked: Sequence[m.Quota], outs: Sequence[QuotaSpec | SbpError]
                   ) -> tuple[m.QuotaResult, ...]:
    return tuple(m.QuotaResult(q, Status.of(o)) if isinstance(o, SbpError)
                 else m.QuotaResult(_quota_msg(o)) for q, o in zip(asked, outs, strict=True))


def _stream(s: md.StreamMeta) -> m.Stream:
    return m.Stream(s.stream_id, s.replica_nums, s.retention_period_ms, s.start_offset, s.name)


class PmServer:
    """A running PM: metadata store, service, SBP server and the liveness loop."""

    def __init__(self, config: PmConfig) -> None:
        config.validate()
        self.config = config
        self.meta: md.MetadataStore = open_metadata(config.metadata)
        self.election: LeaderElection | None = None
        if config.metadata.startswith("etcd://"):
            # Several PMs share etcd; one leads (docs/etcd.md). aetcd is an optional dependency.
            from sbpstream.pm.etcd import EtcdMetadataStore
            from sbpstream.pm.leader import LeaderElection

            assert isinstance(self.meta, EtcdMetadataStore)
            self.election = LeaderElection(self.meta, config.advertise,
                                           on_elected=self._on_elected)
        self.security = server_security(config.security, config.host, PM_NODE_ONLY, PM_RULES,
                                        "pm")
        self.dn = WireDataNodeApi(lambda nid: self.service.node_address(nid),
                                  self.security.client_ssl, self.security.credentials)
        self.service = PmService(self.meta, self.dn, node_timeout_ms=config.node_timeout_ms,
                                 heartbeat_interval_ms=config.heartbeat_interval_ms)
        if self.election is not None:
            election = self.election
            self.service.leading = lambda: election.is_leader
            self.dn.epoch = lambda: election.token or 0
        handlers: dict[int, Handler] = {
            Opcode.HEARTBEAT: self._heartbeat,
            Opcode.ALLOCATE_ID: self._allocate_id,
            Opcode.LIST_RANGES: self._list_ranges,
            Opcode.SEAL_RANGES: self._seal_ranges,
            Opcode.DESCRIBE_RANGES: self._describe_ranges,
            Opcode.CREATE_STREAMS: self._create_streams,
            Opcode.DELETE_STREAMS: self._delete_streams,
            Opcode.UPDATE_STREAMS: self._update_streams,
            Opcode.DESCRIBE_STREAMS: self._describe_streams,
            Opcode.TRIM_STREAMS: self._trim_streams,
            Opcode.REPORT_METRICS: self._report_metrics,
            Opcode.SET_QUOTAS: self._set_quotas,
            Opcode.DELETE_QUOTAS: self._delete_quotas,
            Opcode.DESCRIBE_QUOTAS: self._describe_quotas,
        }
        self.repairer = Repairer(self.service)
        self.drainer = Drainer(self.service, self.repairer)  # DRAIN_NODE (pm/drain.py)
        handlers[Opcode.DRAIN_NODE] = DrainHandler(self.drainer)
        self.groups = GroupHandlers(self.service)  # consumer groups (pm/groups.py)
        handlers.update(self.groups.handlers())
        gate = self.security.gate
        self.auth: PmAuth | None = None
        if gate is not None:
            self.auth = PmAuth(gate, AuthRecords(self.meta), config.security.token_ttl_s)
            gate.names = StreamNames(self._stream_names)  # prefix: ACLs match names
            gate.ids = self._stream_ids
            handlers = gate.wrap({**handlers, **self.auth.handlers()})
        if self.election is not None:
            handlers = {op: self._leader_only(h) for op, h in handlers.items()}
        self.server = Server(handlers, name="pm", ssl_context=self.security.ssl_context,
                             gate=gate, protected=self.security.protected)
        # INFO, STATS, CONNECTIONS, WHOAMI; served by followers too (their own figures)
        self.cluster = ClusterOverview(self.service, self.dn.pool, self.server)
        self.introspector = Introspector(self.server, "pm", streams=self.cluster,
                                         extra_info=self.cluster.overview)
        intro = self.introspector.handlers()
        if gate is not None:  # behind the gate too; the PM's own AUTHENTICATE (SCRAM) stays
            intro = {op: h for op, h in gate.wrap(intro).items() if op in intro}
        self.server.handlers.update(intro)
        self._sweeper: asyncio.Task[None] | None = None
        self._started = False
        self.exporter: MetricsExporter | None = None

    async def _stream_names(self, stream_ids: Sequence[int]) -> dict[int, str]:
        """Stream names by id for ``prefix:`` ACLs (sbpstream.auth.names)."""
        got = await self.meta.get_streams(stream_ids)
        return {s.stream_id: s.name for s in got if s is not None}

    async def _stream_ids(self, names: Sequence[str]) -> dict[str, int]:
        """Live streams' ids by name: a group naming a stream is checked on its id too."""
        out: dict[str, int] = {}
        for n in dict.fromkeys(names):
            s = await self.meta.get_stream_by_name(n)
            if s is not None:
                out[n] = s.stream_id
        return out

    def metric_samples(self) -> list[Sample]:
        """Figures for ``/metrics`` (runs on the loop thread: see sbpstream.net.admin)."""
        out = server_samples("sbpstream_pm", self.server)
        reg = self.service.registry
        now = self.service.clock()
        nodes = reg.all()
        live = len(reg.live_nodes(now))
        out += [
            Sample("sbpstream_pm_data_nodes", "gauge", "registered data nodes, by liveness",
                   live, {"state": "live"}),
            Sample("sbpstream_pm_data_nodes", "gauge", "registered data nodes, by liveness",
                   len(nodes) - live, {"state": "dead"}),
            Sample("sbpstream_pm_leader", "gauge", "1 while this PM is the leader",
                   1 if self.election is None or self.election.is_leader else 0),
        ]
        return out

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.config.advertise or f"{self.server.host}:{self.server.port}"

    async def start(self) -> None:
        await self.meta.open()
        try:
            await self.service.start()
            await self.server.start(self.config.host, self.config.port)
        except BaseException:
            await self.meta.close()
            raise
        self._started = True
        if self.election is not None:
            self.election.address = self.address
            self.election.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        self.introspector.start()
        if self.config.metrics_port >= 0:
            http = None  # auth on: who asks on the admin port (sbpstream.auth.http)
            if self.security.gate is not None and self.auth is not None:
                http = HttpAuth(self.security.gate, records=self.auth.records,
                                token_ttl_s=self.config.security.token_ttl_s)
            self.exporter = MetricsExporter(
                self.metric_samples, self.config.host, self.config.metrics_port,
                routes=admin_routes(self.introspector, self.cluster, http),
                tls=self.config.security.tls, protected=self.security.protected,
                gate=None if http is None else admin_gate(
                    http, public_metrics=self.config.public_metrics))
            await self.exporter.start()
        log.info("event=pm_started address=%s metadata=%s heartbeat_interval_ms=%d "
                 "node_timeout_ms=%d", self.address, self.config.metadata,
                 self.config.heartbeat_interval_ms, self.config.node_timeout_ms)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.drainer.close()
        await self.repairer.close()
        await self.introspector.close()
        if self.exporter is not None:
            await self.exporter.close()
            self.exporter = None
        if self._started:
            await self.server.close(drain_timeout_s=2.0)
        if self.election is not None:
            await self.election.stop()  # resign: a follower takes over without waiting
        await self.dn.close()
        await self.meta.close()
        if self._started:
            log.info("event=pm_stopped address=%s", self.address)
        self._started = False

    async def _sweep_loop(self) -> None:
        interval = self.config.heartbeat_interval_ms / 1000
        clock = self.service.clock
        due = clock() + interval
        while True:
            await asyncio.sleep(max(0.0, due - clock()))
            now = clock()
            late = now - due
            due = now + interval
            if late > interval * SWEEP_STALL_INTERVALS:
                # this process did not run (paused, or its loop blocked): the heartbeats sent
                # meanwhile are still unread, so the silence is ours, not the nodes'
                self.service.registry.excuse_stall(late, now)
                log.warning("event=pm_stall_excused stalled_s=%.3f", late)
            if self.election is not None and not self.election.is_leader:
                continue  # only the leader seals the ranges of dead nodes
            try:
                n = await self.service.sweep_dead_nodes()
                self.repairer.tick()  # re-replicate sealed ranges of nodes dead for good
                self.drainer.tick()  # move the ranges of draining nodes (pm/drain.py)
                if n:
                    log.info("event=dead_node_ranges_renewed ranges=%d", n)
            except SbpError as e:
                log.warning("event=sweep_failed error=%r", str(e))
            except Exception:
                log.exception("event=sweep_crashed")

    # ------------------------------------------------------------------ leadership (etcd)
    async def _on_elected(self, token: int) -> None:
        """Won the election: start from the warm metadata cache with fresh liveness (every
        node gets a grace period, as after a restart). Group membership restarts empty: members
        rejoin on their next heartbeat (pm/groups.py); committed offsets are in the metadata."""
        self.groups.coordinator.reset()
        await self.service.start()

    def _leader_only(self, handler: Handler) -> Handler:
        """A follower answers every request with PM_NOT_LEADER and the leader's address in
        ``detail``; a leader deposed mid-request (its write was fenced) does the same."""

        async def gated(req: Request, resp: Responder) -> None:
            assert self.election is not None
            self.election.check_leader()
            try:
                await handler(req, resp)
            except FencedLeaderError as e:
                raise PmNotLeaderError(e.message, e.detail) from e

        return gated

    # ------------------------------------------------------------------ handlers
    async def _heartbeat(self, req: Request, resp: Responder) -> None:
        hb = m.HeartbeatRequest.decode(req.header)
        req.conn.attributes[ATTR_CLIENT_ID] = hb.client_id  # CONNECTIONS / WHOAMI show it
        err: SbpError | None = None
        node = hb.data_node
        if hb.client_role == ClientRole.DATA_NODE:
            if node is None or node.node_id <= 0:
                err = InvalidRequestError("a data node heartbeat needs data_node.node_id")
            else:
                try:
                    st = await self.service.node_seen(
                        node.node_id, node.advertise_addr,
                        [(r.stream_id, r.range_index, r.next_offset) for r in hb.committed_ranges])
                    node = m.DataNode(st.node_id, st.advertise_addr)
                    req.conn.attributes[CONN_ROLE] = ClientRole.DATA_NODE
                    req.conn.attributes[CONN_NODE_ID] = st.node_id
                except SbpError as e:
                    err = e
        elif hb.client_role == ClientRole.CLIENT:
            req.conn.attributes.setdefault(CONN_ROLE, ClientRole.CLIENT)
            if hb.client_id:
                self.service.client_seen(hb.client_id, str(req.conn.peer))
            else:
                err = InvalidRequestError("a client heartbeat needs client_id")
        await resp.send(m.HeartbeatResponse(hb.client_id, hb.client_role, node,
                                            _ok_or(err)).encode())

    # ---- quotas (issue 22): stored in the metadata; data nodes pull DESCRIBE_QUOTAS
    async def _set_quotas(self, req: Request, resp: Responder) -> None:
        r = m.SetQuotasRequest.decode(req.header)
        specs: list[QuotaSpec | SbpError] = []
        for q in r.quotas:
            try:
                specs.append(_quota_spec(q))
            except SbpError as e:
                specs.append(e)
        async with within(r.timeout_ms, "SET_QUOTAS"):
            stored = iter(await self.meta.set_quotas(
                [s for s in specs if isinstance(s, QuotaSpec)]))
        outs = [s if isinstance(s, SbpError) else next(stored) for s in specs]
        await resp.send(m.SetQuotasResponse(results=_quota_results(r.quotas, outs)).encode())

    async def _delete_quotas(self, req: Request, resp: Responder) -> None:
        r = m.DeleteQuotasRequest.decode(req.header)
        async with within(r.timeout_ms, "DELETE_QUOTAS"):
            outs = await self.meta.delete_quotas([(q.kind, q.name, q.user) for q in r.quotas])
        await resp.send(m.DeleteQuotasResponse(results=_quota_results(r.quotas, outs)).encode())

    async def _describe_quotas(self, req: Request, resp: Responder) -> None:
        d = m.DescribeQuotasRequest.decode(req.header)
        async with within(d.timeout_ms, "DESCRIBE_QUOTAS"):
            quotas = await self.meta.list_quotas()
        await resp.send(m.DescribeQuotasResponse(
            quotas=tuple(_quota_msg(q) for q in quotas)).encode())

    async def _allocate_id(self, req: Request, resp: Responder) -> None:
        a = m.AllocateIdRequest.decode(req.header)
        try:
            async with within(a.timeout_ms, "ALLOCATE_ID"):
                node_id = await self.service.allocate_node_id(a.host or str(req.conn.peer))
            out = m.AllocateIdResponse(id=node_id)
        except SbpError as e:
            out = m.AllocateIdResponse(status=Status.of(e))
        await resp.send(out.encode())

    async def _report_metrics(self, req: Request, resp: Responder) -> None:
        r = m.ReportMetricsRequest.decode(req.header)
        err: SbpError | None = None
        if r.data_node is None or r.data_node.node_id <= 0:
            err = InvalidRequestError("REPORT_METRICS needs data_node.node_id")
        else:
            metrics = md.NodeMetrics(**{
                f: getattr(r, f) for f in md.NodeMetrics.__dataclass_fields__
            })
            try:
                await self.service.report_metrics(
                    r.data_node.node_id, r.data_node.advertise_addr, metrics
                )
            except SbpError as e:
                err = e
        await resp.send(m.ReportMetricsResponse(r.data_node, _ok_or(err)).encode())

    async def _create_streams(self, req: Request, resp: Responder) -> None:
        r = m.CreateStreamsRequest.decode(req.header)
        async with within(r.timeout_ms, "CREATE_STREAMS"):
            outs = await self.service.create_streams(
                [(it.replica_nums, it.retention_period_ms) for it in r.items],
                names=[it.name for it in r.items],
            )
        items: list[m.CreateStreamResult] = []
        for it, o in zip(r.items, outs, strict=True):
            if isinstance(o, SbpError):
                items.append(m.CreateStreamResult(None, it.replica_nums, it.retention_period_ms,
                                                  Status.of(o)))
            else:
                s = o.stream
                items.append(m.CreateStreamResult(_stream(s), s.replica_nums,
                                                  s.retention_period_ms))
        await resp.send(m.CreateStreamsResponse(items=tuple(items)).encode())

    def _stream_results(
        self, ids: Sequence[int], outs: Sequence[md.StreamMeta | SbpError]
    ) -> tuple[m.StreamResult, ...]:
        return tuple(
            m.StreamResult(m.Stream(stream_id=sid), Status.of(o)) if isinstance(o, SbpError)
            else m.StreamResult(_stream(o))
            for sid, o in zip(ids, outs, strict=True)
        )

    async def _delete_streams(self, req: Request, resp: Responder) -> None:
        r = m.DeleteStreamsRequest.decode(req.header)
        ids = [s.stream_id for s in r.items]
        async with within(r.timeout_ms, "DELETE_STREAMS"):
            outs = await self.service.delete_streams(ids)
        await resp.send(m.DeleteStreamsResponse(items=self._stream_results(ids, outs)).encode())

    async def _update_streams(self, req: Request, resp: Responder) -> None:
        r = m.UpdateStreamsRequest.decode(req.header)
        ids = [s.stream_id for s in r.items]
        async with within(r.timeout_ms, "UPDATE_STREAMS"):
            outs = await self.service.update_streams(
                [(s.stream_id, s.replica_nums, s.retention_period_ms) for s in r.items]
            )
        await resp.send(m.UpdateStreamsResponse(items=self._stream_results(ids, outs)).encode())

    async def _describe_streams(self, req: Request, resp: Responder) -> None:
        r = m.DescribeStreamsRequest.decode(req.header)
        async with within(r.timeout_ms, "DESCRIBE_STREAMS"):
            if r.stream_ids or r.name:
                outs = await self.service.describe_streams(r.stream_ids)
                items = self._stream_results(r.stream_ids, outs)
                if r.name:  # after the ids: the stream of that name
                    o = await self.service.describe_stream_named(r.name)
                    items += (m.StreamResult(m.Stream(name=r.name), Status.of(o))
                              if isinstance(o, SbpError) else m.StreamResult(_stream(o)),)
                out = m.DescribeStreamsResponse(items=items)
            elif r.name_prefix:
                try:
                    page, cont = await self.service.list_streams_by_prefix(
                        r.name_prefix, r.continuation, r.limit)
                except SbpError as e:
                    out = m.DescribeStreamsResponse(status=Status.of(e))
                else:
                    out = m.DescribeStreamsResponse(
                        items=tuple(m.StreamResult(_stream(s)) for s in page), continuation=cont)
            else:
                page, cont = await self.service.list_streams(r.continuation, r.limit)
                out = m.DescribeStreamsResponse(
                    items=tuple(m.StreamResult(_stream(s)) for s in page), continuation=cont
                )
        await resp.send(out.encode())

    async def _trim_streams(self, req: Request, resp: Responder) -> None:
        r = m.TrimStreamsRequest.decode(req.header)
        from_dn = req.conn.attributes.get(CONN_ROLE) == ClientRole.DATA_NODE
        async with within(r.timeout_ms, "TRIM_STREAMS"):
            outs = await self.service.trim_streams(
                [(it.stream_id, it.trim_offset) for it in r.items], from_data_node=from_dn
            )
        items: list[m.TrimResult] = []
        for it, o in zip(r.items, outs, strict=True):
            if isinstance(o, SbpError):
                items.append(m.TrimResult(m.Stream(stream_id=it.stream_id), Status.of(o)))
            else:
                rng = None if o.first_range is None else self.dn.to_range(o.first_range)
                items.append(m.TrimResult(_stream(o.stream), m.STATUS_OK, rng))
        await resp.send(m.TrimStreamsResponse(items=tuple(items)).encode())

    async def _seal_ranges(self, req: Request, resp: Responder) -> None:
        r = m.SealRangesRequest.decode(req.header)
        async with within(r.timeout_ms, "SEAL_RANGES"):
            outs = await self.service.seal_ranges(
                [(it.stream_id, it.range_index) for it in r.items])
        items: list[m.SealResult] = []
        for it, o in zip(r.items, outs, strict=True):
            if isinstance(o, SbpError):
                items.append(m.SealResult(it.stream_id, Status.of(o)))
                continue
            if o.new is None:
                # sealed (readers see its end) but no successor yet: the writer retries
                items.append(m.SealResult(it.stream_id, Status.of(NotEnoughDataNodesError(
                    f"range {it.stream_id}/{it.range_index} is sealed at "
                    f"{o.sealed.end_offset}, but too few data nodes are live to open the next "
                    f"range on {len(o.sealed.replicas)} replicas; new writes wait for them")),
                    (self.dn.to_range(o.sealed),)))
                continue
            items.append(m.SealResult(
                it.stream_id,
                m.STATUS_OK,
                (self.dn.to_range(o.sealed), self.dn.to_range(o.new)),
                tuple(m.ProducerState(p.producer_id, p.producer_epoch, p.last_sequence,
                                      p.last_base_offset) for p in o.producers),
            ))
        await resp.send(m.SealRangesResponse(items=tuple(items)).encode())

    async def _describe_ranges(self, req: Request, resp: Responder) -> None:
        r = m.DescribeRangesRequest.decode(req.header)
        async with within(r.timeout_ms, "DESCRIBE_RANGES"):
            outs = await self.service.describe_ranges(
                [(it.stream_id, it.range_index) for it in r.items]
            )
        items = tuple(
            m.DescribeRangeResult(it.stream_id, Status.of(o)) if isinstance(o, SbpError)
            else m.DescribeRangeResult(it.stream_id, m.STATUS_OK, self.dn.to_range(o))
            for it, o in zip(r.items, outs, strict=True)
        )
        await resp.send(m.DescribeRangesResponse(items=items).encode())

    async def _list_ranges(self, req: Request, resp: Responder) -> None:
        """By stream: one result per stream. By data node: one result per stream with ranges on
        the node. Results stream out in frames of at most LIST_RANGES_FRAME_MAX ranges."""
        r = m.ListRangesRequest.decode(req.header)
        sender = _FramedResults(resp)
        stream_owners = [o.stream_id for o in r.items if isinstance(o, m.StreamOwner)]
        async with within(r.timeout_ms, "LIST_RANGES"):
            by_stream = dict(zip(
                stream_owners, await self.service.list_stream_ranges(stream_owners), strict=True
            )) if stream_owners else {}
        sets: dict[tuple[md.ReplicaMeta, ...], tuple[m.ReplicaNode, ...]] = {}  # addresses
        for owner in r.items:  # read once per replica set, not once per range
            if isinstance(owner, m.StreamOwner):
                got = by_stream[owner.stream_id]
                if isinstance(got, SbpError):
                    await sender.add(m.ListRangesResult(owner.stream_id, Status.of(got)), 0)
                else:
                    await sender.add_ranges(owner.stream_id,
                                            [self.dn.to_range(x, sets) for x in got])
                continue
            with _gc_paused():  # hundreds of thousands of short-lived, acyclic objects
                try:
                    ranges = await self.service.list_node_ranges(owner.node_id)
                except DataNodeNotFoundError as e:
                    await sender.add(m.ListRangesResult(0, Status.of(e)), 0)
                    continue
                await sender.add_by_stream(ranges, self.dn.replica_nodes)
                del ranges
        await sender.finish()


class _GcPause:
    """Automatic garbage collection off while at least one whole-node listing runs.

    A listing of 333,000 ranges makes about a million objects that live until their frame is
    sent and form no reference cycles (rows, RangeMeta, m.Range, results); the collector's
    passes over them, and its full passes over everything as they pile up, were half the PM's
    CPU for it. Bounded: the pause lasts as long as the listings (seconds), counted so that
    overlapping listings re-enable the collector only when the last ends, and leaves it alone
    when it was already off. Cycles made elsewhere meanwhile are collected afterwards."""

    def __init__(self) -> None:
        self.depth = 0
        self.was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.depth == 0:
            self.was_enabled = gc.isenabled()
            gc.disable()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and self.was_enabled:
                gc.enable()


_gc_paused: Final = _GcPause()


_new_range: Final = maker(m.Range)
_new_result: Final = maker(m.ListRangesResult)
"""m.Range(...) and m.ListRangesResult(...) without the frozen __init__: a node's listing makes
hundreds of thousands."""


class _FramedResults:
    """Packs LIST_RANGES results into response frames of bounded size."""

    def __init__(self, resp: Responder) -> None:
        self._resp = resp
        self._items: list[m.ListRangesResult] = []
        self._ranges = 0

    async def add(self, item: m.ListRangesResult, nranges: int) -> None:
        self._items.append(item)
        self._ranges += max(1, nranges)
        if self._ranges >= LIST_RANGES_FRAME_MAX or len(self._items) >= LIST_RANGES_FRAME_MAX:
            await self._flush(end=False)

    async def add_ranges(self, stream_id: int, ranges: Sequence[m.Range]) -> None:
        for i in range(0, max(1, len(ranges)), LIST_RANGES_FRAME_MAX):
            part = tuple(ranges[i : i + LIST_RANGES_FRAME_MAX])
            await self.add(_new_result(stream_id, m.STATUS_OK, part), len(part))

    async def add_by_stream(
        self, ranges: Sequence[md.RangeMeta],
        replica_nodes: Callable[[tuple[md.ReplicaMeta, ...]], tuple[m.ReplicaNode, ...]],
    ) -> None:
        """``ranges`` ordered by stream: one OK result per stream, exactly as :meth:`add_ranges`
        of each stream's ranges would add them (same results, same frames), in one loop: the
        whole-node listing's hot path. ``replica_nodes`` is called once per replica set."""
        new_range, new_result, ok, cap = _new_range, _new_result, m.STATUS_OK, LIST_RANGES_FRAME_MAX
        cache: dict[tuple[md.ReplicaMeta, ...], tuple[m.ReplicaNode, ...]] = {}
        last_set: tuple[md.ReplicaMeta, ...] | None = None
        last_reps: tuple[m.ReplicaNode, ...] = ()
        items, count = self._items, self._ranges
        n, i = len(ranges), 0
        while i < n:
            sid = ranges[i].stream_id
            j = i + 1
            while j < n and ranges[j].stream_id == sid:
                j += 1
            for k in range(i, j, cap):
                part: list[m.Range] = []
                for r in ranges[k : min(j, k + cap)]:
                    if r.replicas is not last_set:  # a node's ranges share a few replica sets
                        last_set = r.replicas
                        got = cache.get(last_set)
                        if got is None:
                            got = cache[last_set] = replica_nodes(last_set)
                        last_reps = got
                    part.append(new_range(r.stream_id, r.range_index, r.start_offset,
                                          r.next_offset, r.end_offset, last_reps))
                items.append(new_result(sid, ok, tuple(part)))
                count += len(part)
                if count >= cap or len(items) >= cap:
                    self._ranges = count
                    await self._flush(end=False)
                    items, count = self._items, self._ranges
            i = j
        self._ranges = count

    async def _flush(self, end: bool) -> None:
        await self._resp.send(m.ListRangesResponse(items=tuple(self._items)).encode(), end=end)
        self._items = []
        self._ranges = 0
        if not end:  # a node's whole listing is seconds of encoding: let heartbeats and
            await asyncio.sleep(0)  # lookups (a restarting node's appends) in between frames

    async def finish(self) -> None:
        await self._flush(end=True)


async def run_pm(config: PmConfig, stop: asyncio.Event | None = None) -> None:
    """Run a PM until ``stop`` is set (or the task is cancelled), then shut down cleanly."""
    server = PmServer(config)
    await server.start()
    try:
        if stop is None:
            await asyncio.Event().wait()
        else:
            await stop.wait()
    finally:
        await server.close()


__all__ = ["PmServer", "WireDataNodeApi", "run_pm"]
