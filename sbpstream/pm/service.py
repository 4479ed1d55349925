"""What the Placement Manager does, independent of the wire.

:class:`PmService` holds the PM's behaviour (registration, liveness, stream and range operations,
seal-and-new, trim/delete forwarding), one family per module: :mod:`.service_streams`,
:mod:`.service_ranges`, and here data nodes and SDK clients; :mod:`.service_base` holds what
they share. It speaks to the metadata store through
:class:`~sbpstream.pm.metadata.MetadataStore` and to data nodes through :class:`DataNodeApi`, so
it is tested without sockets; :mod:`sbpstream.pm.server` adapts it to SBP frames.

Every batched operation returns one outcome per item, in order: a result or an
:class:`~sbpstream.protocol.errors.SbpError`. One bad item never fails the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from sbpstream.pm.deadlines import DN_CALL_TIMEOUT_S, call_timeout, request_deadline, within
from sbpstream.pm.liveness import NodeLiveness, registry_liveness, stored_liveness
from sbpstream.pm.metadata import NodeMetrics
from sbpstream.pm.placement import NodeRegistry, NodeState, Placer
from sbpstream.pm.service_base import (
    MAX_REPLICA_NUMS,
    ClientInfo,
    DataNodeApi,
    DnSealReply,
    check_batch,
    validate_stream_config,
)
from sbpstream.pm.service_ranges import LIST_RANGES_FRAME_MAX, RangeOps
from sbpstream.pm.service_streams import DESCRIBE_STREAMS_PAGE_MAX, StreamOps
from sbpstream.protocol.messages import MAX_ITEMS_PER_REQUEST

log = logging.getLogger("sbpstream.pm")

CLIENTS_MAX: Final = 10_000
"""Live SDK clients remembered (by client_id, least recently seen dropped first): the table is
for introspection, and a flood of client ids must not grow the PM without bound."""

CLIENT_TIMEOUT_FACTOR: Final = 3
"""A client is live while its last HEARTBEAT is at most node_timeout * this old (SDK clients
heartbeat less often than data nodes: see client.HEARTBEAT_INTERVAL_S)."""


class PmService(StreamOps, RangeOps):
    """The PM's behaviour: streams and ranges (their families' modules), data nodes and
    clients (here)."""

    async def start(self) -> None:
        """Load nodes and placement counts from metadata (the store must be open). Liveness
        starts afresh: placement waits out PLACEMENT_WARMUP_S for the nodes' heartbeats."""
        self.registry = NodeRegistry(self.node_timeout_ms, self.clock())
        nodes = await self.meta.list_nodes()
        self.registry.load(nodes)
        self.draining.clear()  # the same set the placer holds
        self.draining.update(n.node_id for n in nodes if n.draining)
        self.placer = Placer(self.registry, suspect=self._suspect, draining=self.draining)
        self.placer.reset_counts(await self.meta.writable_range_counts())
        log.info("event=pm_state_loaded nodes=%d draining=%s", len(self.registry.all()),
                 ",".join(map(str, sorted(self.draining))) or "-")

    # ------------------------------------------------------------------ nodes
    async def allocate_node_id(self, host: str) -> int:
        """Idempotent per host: a host (a data node's advertise address) that already has an
        id gets that id again, so a node that lost the answer (or its id file before its first
        heartbeat) does not register twice."""
        async with self._alloc_lock:
            for st in self.registry.all():
                if host and st.host == host:
                    log.info("event=node_id_reallocated node_id=%d host=%s", st.node_id, host)
                    return st.node_id
            node_id = await self.meta.allocate_node_id(host, self.wall_ms())
            self.registry.add(node_id, host)
        log.info("event=node_id_allocated node_id=%d host=%s", node_id, host)
        return node_id

    # ------------------------------------------------------------------ SDK clients
    def client_seen(self, client_id: str, peer: str) -> None:
        """An SDK client's HEARTBEAT: remember it (bounded, see CLIENTS_MAX)."""
        self._clients.pop(client_id, None)
        self._clients[client_id] = ClientInfo(client_id, peer, self.clock())
        while len(self._clients) > CLIENTS_MAX:
            self._clients.popitem(last=False)

    def live_clients(self) -> list[ClientInfo]:
        """SDK clients heard from within node_timeout * CLIENT_TIMEOUT_FACTOR, by client id."""
        limit = self.registry.node_timeout_s * CLIENT_TIMEOUT_FACTOR
        now = self.clock()
        for cid in [c for c, info in self._clients.items() if now - info.last_seen > limit]:
            del self._clients[cid]
        return sorted(self._clients.values(), key=lambda c: c.client_id)

    async def node_seen(
        self, node_id: int, advertise_addr: str,
        committed: Sequence[tuple[int, int, int]] = (),
    ) -> NodeState:
        """A heartbeat (or metrics report) from a data node: it is alive at this address.
        ``committed``: (stream_id, range_index, committed next offset) of its writable ranges
        that moved; LIST_RANGES and DESCRIBE_RANGES answer with them (never lowered)."""
        st = self._known_node(node_id)
        if committed:
            await self.meta.record_next_offsets(committed)
        was_live = self.registry.is_live(node_id, self.clock())
        if self.registry.heartbeat(node_id, advertise_addr, self.clock()):
            await self.meta.update_node_address(node_id, advertise_addr)
            log.info("event=node_address node_id=%d advertise_addr=%s", node_id, advertise_addr)
        await self.meta.record_heartbeat(node_id, self.wall_ms())
        self._unreachable_until.pop(node_id, None)
        self._renew_retry_at.pop(node_id, None)
        if not was_live:
            self._renewed_dead.discard(node_id)
            log.info("event=node_live node_id=%d advertise_addr=%s", node_id, st.advertise_addr)
        return st

    async def report_metrics(self, node_id: int, advertise_addr: str, m: NodeMetrics) -> None:
        await self.node_seen(node_id, advertise_addr)
        self.registry.set_metrics(node_id, m)
        await self.meta.record_metrics(node_id, m, self.wall_ms())

    async def node_liveness(self) -> list[NodeLiveness]:
        """Every data node's liveness as this PM can tell (:mod:`sbpstream.pm.liveness`):
        first hand when it leads, else from the heartbeat times the leader persisted."""
        if self.leading():
            return registry_liveness(self.registry, self.clock())
        return stored_liveness(await self.meta.list_nodes(), self.wall_ms(),
                               self.node_timeout_ms, self.heartbeat_interval_ms)

    def node_address(self, node_id: int) -> str:
        st = self.registry.get(node_id)
        return st.advertise_addr if st is not None else ""


__all__ = [
    "DESCRIBE_STREAMS_PAGE_MAX",
    "DN_CALL_TIMEOUT_S",
    "LIST_RANGES_FRAME_MAX",
    "MAX_ITEMS_PER_REQUEST",
    "MAX_REPLICA_NUMS",
    "DataNodeApi",
    "DnSealReply",
    "PmService",
    "call_timeout",
    "check_batch",
    "request_deadline",
    "validate_stream_config",
    "within",
]
