"""Re-replication of sealed ranges that lost a replica for good (design.md 5).

Every ``REPAIR_EVERY_SWEEPS`` liveness sweeps the leader PM looks at the data nodes silent for
longer than ``node_timeout * DEAD_FOR_GOOD_FACTOR``. For each sealed range with data that still
lists such a node, it picks a live node that does not hold the range (lowest load first), sends
it SYNC_RANGES with the range (replicas: the live ones plus the new node, none primary), and
when the new node reports the range complete, replaces the dead node by the new one in the
metadata. The data node copies the range from a surviving replica before it answers
(:mod:`sbpstream.datanode.rereplicate`). Failures are logged and retried at the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Final

from sbpstream.pm.metadata import RangeMeta, ReplicaMeta
from sbpstream.pm.passes import BackgroundPass
from sbpstream.pm.placement import choose_nodes
from sbpstream.protocol.errors import (
    NotEnoughDataNodesError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

if TYPE_CHECKING:
    from sbpstream.pm.service import PmService

log = logging.getLogger("sbpstream.pm")

DEAD_FOR_GOOD_FACTOR: Final = 2
"""A node silent for longer than node_timeout * this has lost its replicas for good."""
REPAIR_EVERY_SWEEPS: Final = 5
"""Liveness sweeps (one per heartbeat interval) between repair passes."""
REPAIR_CONCURRENCY: Final = 4
"""Ranges copied at once in one pass."""
REPAIR_CALL_TIMEOUT_S: Final = 30.0
"""Bound on one SYNC_RANGES or DESCRIBE_RANGES call of a repair (the wire API has its own,
shorter one; a copy outliving it goes on at the data node and the next pass joins it)."""


class Repairer:
    def __init__(self, service: PmService) -> None:
        self.service = service
        self._sweeps = 0
        self._pass = BackgroundPass("repair", self.run_once)

    def tick(self) -> None:
        """Called once per liveness sweep: start a pass every REPAIR_EVERY_SWEEPS sweeps,
        unless the last one is still running."""
        self._sweeps += 1
        if self._sweeps % REPAIR_EVERY_SWEEPS:
            return
        self._pass.kick()

    async def close(self) -> None:
        await self._pass.close()

    def dead_for_good(self) -> set[int]:
        svc = self.service
        reg = svc.registry
        now = svc.clock()
        limit = reg.node_timeout_s * DEAD_FOR_GOOD_FACTOR
        out: set[int] = set()
        for st in reg.all():
            seen = st.last_seen if st.last_seen is not None else reg.started_at
            if now - seen > limit:
                out.add(st.node_id)
        return out

    async def run_once(self) -> int:
        """One pass; returns how many replicas were re-created."""
        dead = self.dead_for_good()
        if not dead:
            return 0
        todo: dict[tuple[int, int], RangeMeta] = {}
        for nid in sorted(dead):
            for r in await self.service.meta.list_node_ranges(nid):
                if r.end_offset >= 0 and r.end_offset > r.start_offset:
                    todo[(r.stream_id, r.range_index)] = r
        if not todo:
            return 0
        missing = sum(len([n for n in r.node_ids if n in dead]) for r in todo.values())
        log.warning("event=replicas_missing ranges=%d replicas=%d dead_nodes=%s",
                    len(todo), missing, ",".join(map(str, sorted(dead))))
        sem = asyncio.Semaphore(REPAIR_CONCURRENCY)

        async def one(r: RangeMeta) -> int:
            async with sem:
                return await self._repair_range(r, dead, missing)

        got = await asyncio.gather(*(one(r) for r in todo.values()))
        return sum(got)

    async def _repair_range(self, r: RangeMeta, dead: set[int], missing: int) -> int:
        done = 0
        for old in [n for n in r.node_ids if n in dead]:
            moved = await self.move_replica(r, old, dead, reason="dead", missing=missing)
            if moved is None:
                return done
            r = moved
            done += 1
        return done

    async def move_replica(self, r: RangeMeta, old: int, unusable: set[int], reason: str,
                           missing: int = 0) -> RangeMeta | None:
        """Copy sealed range ``r`` to a live node that does not hold it (lowest load first;
        placement skips draining nodes), from its live replicas not in ``unusable``, then
        replace ``old`` by that node in the metadata. The range after, or None when it could
        not be done now (logged; the next pass retries)."""
        svc = self.service
        now = svc.clock()
        holders = set(r.node_ids)
        candidates = [c for c in svc.placer.loads(now) if c.node_id not in holders]
        try:
            (new_id,) = choose_nodes(candidates, 1)
        except NotEnoughDataNodesError:
            log.warning("event=rereplicate_no_node stream_id=%d range_index=%d "
                        "old_node_id=%d reason=%s", r.stream_id, r.range_index, old, reason)
            return None
        live = [rep for rep in r.replicas
                if rep.node_id not in unusable and svc.registry.is_live(rep.node_id, now)]
        if not live:
            log.error("event=rereplicate_no_source stream_id=%d range_index=%d reason=%s",
                      r.stream_id, r.range_index, reason)
            return None
        target = replace(r, replicas=tuple(ReplicaMeta(rep.node_id, False)
                                           for rep in [*live, ReplicaMeta(new_id, False)]))
        st = svc.registry.get(new_id)
        assert st is not None
        try:
            await asyncio.wait_for(svc.dn.sync_ranges(st, [target]), REPAIR_CALL_TIMEOUT_S)
            have = await asyncio.wait_for(
                svc.dn.describe_range(st, r.stream_id, r.range_index), REPAIR_CALL_TIMEOUT_S)
        except (SbpError, OSError, TimeoutError) as e:
            log.warning("event=rereplicate_failed stream_id=%d range_index=%d "
                        "new_node_id=%d reason=%s error=%r", r.stream_id, r.range_index,
                        new_id, reason, str(e))
            return None
        if have != r.end_offset:
            log.warning("event=rereplicate_incomplete stream_id=%d range_index=%d "
                        "new_node_id=%d next_offset=%d end_offset=%d", r.stream_id,
                        r.range_index, new_id, have, r.end_offset)
            return None
        try:
            r = await svc.meta.replace_replica(r.stream_id, r.range_index, old, new_id)
        except (StreamDeletedError, StreamNotFoundError):
            return None
        log.info("event=rereplicated stream_id=%d range_index=%d old_node_id=%d "
                 "new_node_id=%d end_offset=%d replicas=%s missing=%d reason=%s", r.stream_id,
                 r.range_index, old, new_id, r.end_offset,
                 ",".join(map(str, r.node_ids)), missing, reason)
        return r
