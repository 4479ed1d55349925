"""Draining a data node: moving every range off it so it can be stopped and removed with no
under-replicated range (issue 33; docs/operations.md, "Draining a data node").

An operator marks a node draining (DRAIN_NODE, ``sbpstream node drain``). The mark is durable in
the metadata (:attr:`~sbpstream.pm.metadata.NodeMeta.draining`), so a restarted or newly elected
PM goes on with it. While it is set:

- placement never chooses the node (:class:`~sbpstream.pm.placement.Placer` skips it), for new
  ranges and for copies alike;
- every leader sweep starts a pass (:meth:`Drainer.tick`) that seals each writable range with a
  replica on the node and opens its successor on other nodes, through the PM's own
  seal-and-new (the path a node's death takes: producers meet RANGE_SEALED, ask SEAL_RANGES and
  go on in the successor, their idempotent sequences carried over, so nothing is lost or
  written twice);
- the same pass copies each sealed range with a replica on the node to another live node (the
  re-replication path, :meth:`~sbpstream.pm.repair.Repairer.move_replica`; the draining node
  itself may be the source) and only once the copy is complete replaces the node by the new one
  in the range's replica set.

The drain is complete when no range lists the node; once it is stopped (no longer live) it can
be removed from the metadata (:meth:`Drainer.remove`, ``sbpstream node remove``), which is
refused while it runs or while any range lists it. Cancelling clears the mark: what was moved
stays moved. A drain is refused when the live nodes left (not draining) would be fewer than some
stream's replica count.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

from sbpstream.net.server import Request, Responder
from sbpstream.pm.deadlines import within
from sbpstream.pm.metadata import RangeMeta
from sbpstream.pm.passes import BackgroundPass
from sbpstream.pm.placement import NodeState
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.messages import Status

if TYPE_CHECKING:
    from sbpstream.pm.repair import Repairer
    from sbpstream.pm.service import PmService

log = logging.getLogger("sbpstream.pm")

DRAIN_CONCURRENCY: Final = 4
"""Ranges sealed or copied at once by one pass: a drain is background work beside the traffic
the cluster is serving; each copy streams a whole range from a replica."""

IDLE_RETRY_S: Final = 5.0
"""A pass that moved nothing off a node that still holds ranges (no node to copy to, no live
source, a seal no replica answers) is not repeated for that node before this long, rather than
at every sweep: each try costs list and copy calls and a log line."""

STREAMS_PAGE: Final = 1000
"""Streams read per metadata call when checking replica counts before a drain starts."""


DrainState = m.DrainState
"""One data node as a drain sees it: the wire table itself (sbp.fbs), one copy of the concept
(the SDK's :class:`~sbpstream.client.types.DrainStatus` adds ``complete`` for applications)."""


class Drainer:
    def __init__(self, service: PmService, repairer: Repairer) -> None:
        self.service = service
        self.repairer = repairer
        self._pass = BackgroundPass("drain_pass", self.run_once)
        self._reported: dict[int, int] = {}
        """Ranges left per draining node at the last pass (logged when it changes)."""
        self._retry_at: dict[int, float] = {}
        """Draining nodes whose last pass moved nothing: not tried again before then."""

    # ------------------------------------------------------------------ requests
    def resolve(self, node_id: int, address: str) -> NodeState:
        """The node named by id, or by advertise address or registered host."""
        reg = self.service.registry
        if node_id > 0:
            st = reg.get(node_id)
            if st is None:
                raise DataNodeNotFoundError(f"data node {node_id} is unknown; `sbpstream nodes` "
                                            "lists the registered ones")
            return st
        if address:
            for st in reg.all():
                if address in (st.advertise_addr, st.host):
                    return st
            raise DataNodeNotFoundError(f"no data node has the address {address!r}; "
                                        "`sbpstream nodes` lists the registered ones")
        raise InvalidRequestError("name the data node to drain: its id or its address")

    async def start(self, node_id: int, address: str) -> DrainState:
        svc = self.service
        st = self.resolve(node_id, address)
        nid = st.node_id
        if nid in svc.draining:
            raise InvalidRequestError(f"data node {nid} is already draining; watch it with "
                                      f"`sbpstream node drain {nid} --wait`, or cancel it with "
                                      f"`sbpstream node drain {nid} --cancel`")
        await self._check_capacity(nid)
        await svc.meta.set_node_draining(nid, True)
        svc.draining.add(nid)
        self._retry_at.pop(nid, None)
        log.info("event=drain_started node_id=%d advertise_addr=%s", nid, st.advertise_addr)
        state = await self.state(st)  # before the first pass moves anything
        self.kick()
        return state

    async def cancel(self, node_id: int, address: str) -> DrainState:
        svc = self.service
        st = self.resolve(node_id, address)
        if st.node_id not in svc.draining:
            raise InvalidRequestError(f"data node {st.node_id} is not draining; start with "
                                      f"`sbpstream node drain {st.node_id}`")
        await svc.meta.set_node_draining(st.node_id, False)
        svc.draining.discard(st.node_id)
        self._reported.pop(st.node_id, None)
        self._retry_at.pop(st.node_id, None)
        log.info("event=drain_cancelled node_id=%d", st.node_id)
        return await self.state(st)

    async def remove(self, node_id: int, address: str) -> DrainState:
        """Forget a stopped node that no range lists (drained, or dead with every replica it
        held re-created elsewhere). Refused while it is live or still listed."""
        svc = self.service
        st = self.resolve(node_id, address)
        nid = st.node_id
        state = await self.state(st)
        if state.ranges_left:
            raise InvalidRequestError(
                f"data node {nid} still holds {state.ranges_left} range(s); drain it first "
                f"with `sbpstream node drain {nid} --wait`")
        if state.live:
            raise InvalidRequestError(f"data node {nid} is still running; stop it, then remove "
                                      "it once the PM has not heard from it for node_timeout")
        await svc.meta.remove_node(nid)
        svc.registry.remove(nid)
        svc.draining.discard(nid)
        self._reported.pop(nid, None)
        self._retry_at.pop(nid, None)
        log.info("event=node_removed node_id=%d advertise_addr=%s", nid, st.advertise_addr)
        return DrainState(nid, st.advertise_addr, False, False, 0, 0)

    async def status(self, node_id: int, address: str) -> list[DrainState]:
        """The named node, or every draining node when none is named."""
        if node_id > 0 or address:
            return [await self.state(self.resolve(node_id, address))]
        reg = self.service.registry
        return [await self.state(st) for st in reg.all() if st.node_id in self.service.draining]

    async def state(self, st: NodeState) -> DrainState:
        svc = self.service
        ranges = await svc.meta.list_node_ranges(st.node_id)
        return DrainState(st.node_id, st.advertise_addr, st.node_id in svc.draining,
                          svc.registry.is_live(st.node_id, svc.clock()), len(ranges),
                          sum(r.writable for r in ranges))

    async def _check_capacity(self, nid: int) -> None:
        """Refuse when the live nodes left would be fewer than some stream's replica count."""
        svc = self.service
        now = svc.clock()
        left = [st.node_id for st in svc.registry.live_nodes(now)
                if st.node_id != nid and st.node_id not in svc.draining]
        after = -1
        while True:
            page = await svc.meta.list_streams(after, STREAMS_PAGE)
            for s in page:
                if s.replica_nums > len(left):
                    raise InvalidRequestError(
                        f"draining data node {nid} would leave {len(left)} live data node(s), "
                        f"but stream {s.stream_id} has {s.replica_nums} replicas: start another "
                        "data node first, or lower the stream's replicas with `sbpstream stream "
                        f"update {s.stream_id} --replicas {max(1, len(left))}`")
            if len(page) < STREAMS_PAGE:
                return
            after = page[-1].stream_id

    # ------------------------------------------------------------------ the passes
    def tick(self) -> None:
        """Called once per liveness sweep of the leader: start a pass while some node is
        draining, unless the last one is still running."""
        if self.service.draining:
            self.kick()

    def kick(self) -> None:
        self._pass.kick()

    async def close(self) -> None:
        await self._pass.close()

    async def run_once(self) -> int:
        """One pass over every draining node; how many ranges left them."""
        moved = 0
        for nid in sorted(self.service.draining):
            if self._retry_at.get(nid, 0.0) > self.service.clock():
                continue
            moved += await self._drain_node(nid)
        return moved

    async def _drain_node(self, nid: int) -> int:
        svc = self.service
        sem = asyncio.Semaphore(DRAIN_CONCURRENCY)
        ranges = await svc.meta.list_node_ranges(nid)
        writable = [r for r in ranges if r.writable]

        async def seal(r: RangeMeta) -> bool:
            async with sem:
                try:
                    await svc.seal_and_new(r.stream_id, r.range_index, reason="drain")
                except (StreamDeletedError, StreamNotFoundError):
                    return False
                except SbpError as e:
                    log.warning("event=drain_seal_failed node_id=%d stream_id=%d "
                                "range_index=%d error=%r", nid, r.stream_id, r.range_index,
                                str(e))
                    return False
                return True

        sealed_now = sum(await asyncio.gather(*(seal(r) for r in writable)))
        if writable:
            ranges = await svc.meta.list_node_ranges(nid)

        async def move(r: RangeMeta) -> bool:
            async with sem:
                if nid not in svc.draining:
                    return False  # cancelled meanwhile
                return await self.repairer.move_replica(r, nid, set(), reason="drain") is not None

        moved = sum(await asyncio.gather(*(move(r) for r in ranges if not r.writable)))
        left = len(await svc.meta.list_node_ranges(nid))
        if left and not sealed_now and not moved:
            self._retry_at[nid] = svc.clock() + IDLE_RETRY_S
        else:
            self._retry_at.pop(nid, None)
        if self._reported.get(nid) != left:
            self._reported[nid] = left
            if left:
                log.info("event=drain_progress node_id=%d ranges_left=%d sealed=%d moved=%d",
                         nid, left, sealed_now, moved)
            else:
                log.info("event=drain_complete node_id=%d next=%r", nid,
                         f"it holds no range: stop it, then `sbpstream node remove {nid}`")
        return moved


ACTION_START: Final = 1
ACTION_CANCEL: Final = 2
ACTION_STATUS: Final = 3
ACTION_REMOVE: Final = 4
"""DRAIN_NODE's ``action`` values (sbp.fbs)."""



class DrainHandler:
    """DRAIN_NODE on the PM (admin only when auth is on: sbpstream.auth.gate.ADMIN_OPCODES)."""

    def __init__(self, drainer: Drainer) -> None:
        self.drainer = drainer

    async def __call__(self, req: Request, resp: Responder) -> None:
        r = m.DrainNodeRequest.decode(req.header)
        d = self.drainer
        try:
            async with within(r.timeout_ms, "DRAIN_NODE"):
                if r.action == ACTION_START:
                    states = [await d.start(r.node_id, r.address)]
                elif r.action == ACTION_CANCEL:
                    states = [await d.cancel(r.node_id, r.address)]
                elif r.action == ACTION_STATUS:
                    states = await d.status(r.node_id, r.address)
                elif r.action == ACTION_REMOVE:
                    states = [await d.remove(r.node_id, r.address)]
                else:
                    raise InvalidRequestError(f"DRAIN_NODE action {r.action}: expected 1 (start),"
                                              " 2 (cancel), 3 (status) or 4 (remove)")
        except SbpError as e:
            if e.redirect:
                raise
            await resp.send(m.DrainNodeResponse(Status.of(e)).encode())
            return
        await resp.send(m.DrainNodeResponse(
            nodes=tuple(states)).encode())
