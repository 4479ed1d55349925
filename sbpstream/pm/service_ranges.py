"""The PM's range operations: listing and describing ranges, SEAL_AND_NEW (seal a writable
range at the end its replicas can tell, open the next on live nodes), and renewing the writable
ranges of dead data nodes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

from sbpstream.pm.deadlines import call_timeout
from sbpstream.pm.metadata import ProducerStateMeta, RangeMeta, ReplicaMeta, SealOutcome, StreamMeta
from sbpstream.pm.placement import NodeState
from sbpstream.pm.rules import sorted_replicas
from sbpstream.pm.service_base import (
    UNREACHABLE_BACKOFF_S,
    DnSealReply,
    ServiceBase,
    check_batch,
)
from sbpstream.protocol.errors import (
    NotEnoughDataNodesError,
    PmNotLeaderError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

log = logging.getLogger("sbpstream.pm")

LIST_RANGES_FRAME_MAX: Final = 5000
"""Ranges per LIST_RANGES response frame (~150 bytes each: under 1 MiB a frame), so listing every
range of a big data node streams in bounded frames instead of one oversize frame."""

RENEW_RETRY_S: Final = UNREACHABLE_BACKOFF_S
"""A dead node whose writable ranges could not all be sealed (no replica answered) is tried
again after this long, not at every sweep: listing and retrying a node's ranges costs the PM work
in proportion to how many it holds (a node may hold a million)."""

SWEEP_CONCURRENCY: Final = 32
"""Ranges of dead nodes renewed at once: bounds the burst of data node calls and transactions."""


class RangeOps(ServiceBase):
    # ------------------------------------------------------------------ ranges
    async def list_stream_ranges(
        self, stream_ids: Sequence[int]
    ) -> list[list[RangeMeta] | SbpError]:
        check_batch(len(stream_ids))
        streams = await self.meta.get_streams(stream_ids)
        ranges = await self.meta.list_ranges(stream_ids)
        out: list[list[RangeMeta] | SbpError] = []
        for sid, s, rs in zip(stream_ids, streams, ranges, strict=True):
            checked = self._live_or_error(sid, s)
            out.append(checked if isinstance(checked, SbpError) else rs)
        return out

    async def list_node_ranges(self, node_id: int) -> list[RangeMeta]:
        self._known_node(node_id)
        return await self.meta.list_node_ranges(node_id)

    async def describe_ranges(
        self, items: Sequence[tuple[int, int]]
    ) -> list[RangeMeta | SbpError]:
        """From metadata and last reports (the primary data node answers authoritatively)."""
        check_batch(len(items))
        out: list[RangeMeta | SbpError] = []
        for sid, idx in items:
            rng = await self.meta.get_range(sid, idx)
            if rng is None:
                out.append(await self._missing_range_error(sid, idx))
            else:
                out.append(rng)
        return out

    async def _missing_range_error(self, stream_id: int, range_index: int) -> SbpError:
        (s,) = await self.meta.get_streams([stream_id])
        checked = self._live_or_error(stream_id, s)
        if isinstance(checked, SbpError):
            return checked
        return RangeNotFoundError(f"stream {stream_id} has no range {range_index}")

    async def seal_ranges(self, items: Sequence[tuple[int, int]]) -> list[SealOutcome | SbpError]:
        """SEAL_AND_NEW for (stream_id, range_index) items, concurrently per stream."""
        check_batch(len(items))
        sem = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def one(sid: int, idx: int) -> SealOutcome | SbpError:
            async with sem:
                try:
                    return await self.seal_and_new(sid, idx, reason="writer")
                except SbpError as e:
                    if e.redirect:
                        raise  # not the leader (etcd backend): redirect the whole request
                    return e

        return list(await asyncio.gather(*(one(s, i) for s, i in items)))

    async def seal_and_new(self, stream_id: int, range_index: int, reason: str) -> SealOutcome:
        """Seal a writable range at the end its reachable replicas can tell, and open the next
        range. The seal never waits for placement: with too few live nodes for the next range
        the range is sealed alone (``new`` is None; readers get its end at once) and a later
        call opens the successor once enough nodes are live (NotEnoughDataNodesError until then).
        """
        async with self._locks.hold((stream_id,)):
            cur = await self.meta.get_range(stream_id, range_index)
            if cur is None:
                raise await self._missing_range_error(stream_id, range_index)
            (found,) = await self.meta.get_streams([stream_id])
            stream = self._live_or_error(stream_id, found)
            if isinstance(stream, SbpError):
                raise stream
            if not cur.writable:
                if await self.meta.get_range(stream_id, range_index + 1) is not None:
                    # Idempotent: the pair already made, never a third range.
                    return await self.meta.seal_and_new(stream_id, range_index, cur.end_offset,
                                                        (), ())
                result = await self._open_successor(stream, cur)
            else:
                result = await self._seal_writable(stream, cur)
        if result.created:
            log.info("event=range_sealed stream_id=%d range_index=%d end_offset=%d "
                     "new_nodes=%s reason=%s", stream_id, range_index, result.sealed.end_offset,
                     "-" if result.new is None else ",".join(map(str, result.new.node_ids)),
                     reason)
        if result.created and result.new is not None:
            await self._sync_ranges([result.new])
        return result

    async def _seal_writable(self, stream: StreamMeta, cur: RangeMeta) -> SealOutcome:
        # Stop the replicas first (end -1): a replica that cannot be reached is then known as
        # unreachable and the next range is not placed on it. Then seal at what the stopped
        # replicas hold, whether or not the next range can be placed.
        first = await self._stop_replicas(cur)
        try:
            new_replicas: tuple[ReplicaMeta, ...] = self.placer.place(
                stream.replica_nums, self.clock())
        except NotEnoughDataNodesError as e:
            new_replicas = ()
            log.warning("event=seal_without_successor stream_id=%d range_index=%d error=%r",
                        cur.stream_id, cur.range_index, str(e))
        new_ids = [r.node_id for r in new_replicas]
        try:
            end, producers = await self._finish_seal(cur, first)
            result = await self.meta.seal_and_new(
                cur.stream_id, cur.range_index, end, new_replicas, producers
            )
        except BaseException:
            self.placer.closed(new_ids)
            raise
        if result.created:
            self.placer.closed(cur.node_ids)
        if not result.created or result.new is None or result.new.node_ids != tuple(
                r.node_id for r in sorted_replicas(new_replicas)):
            self.placer.closed(new_ids)
        return result

    async def _open_successor(self, stream: StreamMeta, cur: RangeMeta) -> SealOutcome:
        """The successor of a range sealed while too few nodes were live for it."""
        new_replicas = await self._place(stream.replica_nums)
        new_ids = [r.node_id for r in new_replicas]
        try:
            result = await self.meta.seal_and_new(cur.stream_id, cur.range_index,
                                                  cur.end_offset, new_replicas, ())
        except BaseException:
            self.placer.closed(new_ids)
            raise
        if result.new is None or result.new.node_ids != tuple(
                r.node_id for r in sorted_replicas(new_replicas)):
            self.placer.closed(new_ids)
        return result

    async def _stop_replicas(self, rng: RangeMeta) -> list[tuple[NodeState, DnSealReply]]:
        """Ask every replica that may be called to stop (-1); the ones that answered."""
        nodes = [
            st for st in (self.registry.get(n) for n in rng.node_ids)
            if st is not None and self._may_call(st)
        ]
        return await self._seal_calls(nodes, rng, -1)

    async def _finish_seal(
        self, rng: RangeMeta, first: list[tuple[NodeState, DnSealReply]]
    ) -> tuple[int, tuple[ProducerStateMeta, ...]]:
        """Seal at the minimum end the stopped replicas reported and tell them."""
        if not first:
            # No replica answered. Sealing at the last *reported* next offset could cut off
            # records that were acknowledged after that report (a single-replica range on a
            # crashed node): durability first, the range stays writable-but-stopped and the
            # seal is retried (by the writer, or by the next liveness sweep) once a replica is
            # back. design.md section 5: every acknowledged record survives a seal.
            raise ReplicaUnavailableError(
                f"no replica of range {rng.stream_id}/{rng.range_index} answered; it cannot be "
                "sealed without risking acknowledged records: retry once a replica is back")
        end = max(rng.start_offset, min(reply.end_offset for _, reply in first))
        # The final seal drops what a replica holds past `end`, and it reaches the data nodes
        # before the (fenced) metadata write. A leader paused during the stop round may have
        # been replaced meanwhile, and the new one may have sealed this range at another end:
        # re-check leadership (lease deadline on the monotonic clock, docs/pm.md "Clocks,
        # pauses and stale authority") after the last await, just before sending.
        if not self.leading():
            raise PmNotLeaderError(
                f"not the leader any more: range {rng.stream_id}/{rng.range_index} left to the "
                "leader (retry there)")
        second = await self._seal_calls([st for st, _ in first], rng, end)
        replies = [r for _, r in second] or [r for _, r in first if r.end_offset == end]
        return end, _merge_producers(replies)

    async def _seal_calls(
        self, nodes: Sequence[NodeState], rng: RangeMeta, end_offset: int
    ) -> list[tuple[NodeState, DnSealReply]]:
        async def call(st: NodeState) -> tuple[NodeState, DnSealReply] | None:
            try:
                reply = await asyncio.wait_for(
                    self.dn.seal_range(st, rng, end_offset), call_timeout()
                )
            except RangeNotFoundError:
                # The node never heard of the range, so it holds nothing of it.
                return st, DnSealReply(rng.start_offset)
            except (SbpError, OSError, TimeoutError) as e:
                self._call_failed(st, e)
                log.warning("event=dn_seal_failed node_id=%d stream_id=%d range_index=%d "
                            "end_offset=%d error=%r", st.node_id, rng.stream_id,
                            rng.range_index, end_offset, str(e))
                return None
            return st, reply

        got = await asyncio.gather(*(call(st) for st in nodes))
        return [g for g in got if g is not None]

    # ------------------------------------------------------------------ liveness
    async def sweep_dead_nodes(self) -> int:
        """Seal and renew, on live nodes, the writable ranges of nodes past the timeout.
        Returns how many ranges were renewed. Failed ones are retried at the next sweep."""
        if self._sweep_lock.locked():
            return 0
        async with self._sweep_lock:
            renewed = 0
            now = self.clock()
            for st in self.registry.all():
                nid = st.node_id
                if nid in self._renewed_dead or not self.registry.is_dead(nid, now):
                    continue
                if self._renew_retry_at.get(nid, 0.0) > now:
                    continue
                renewed += await self._renew_node(nid)
            return renewed

    async def _renew_node(self, node_id: int) -> int:
        ranges = await self.meta.list_node_ranges(node_id, writable_only=True)
        if not ranges:
            self._renewed_dead.add(node_id)
            return 0
        log.warning("event=node_dead node_id=%d writable_ranges=%d", node_id, len(ranges))
        sem = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def one(r: RangeMeta) -> SbpError | None:
            async with sem:
                if r.node_ids and all(self._suspect(n) for n in r.node_ids):
                    # every replica just failed a call: a seal could not learn the end (and
                    # would be refused); skip the round trips, retry after RENEW_RETRY_S
                    return ReplicaUnavailableError(
                        f"no replica of range {r.stream_id}/{r.range_index} is reachable")
                try:
                    await self.seal_and_new(r.stream_id, r.range_index, reason="node_dead")
                except (StreamDeletedError, StreamNotFoundError):
                    return None  # deleted meanwhile: nothing to renew
                except SbpError as e:
                    return e
            return None

        errors = [e for e in await asyncio.gather(*(one(r) for r in ranges)) if e is not None]
        if errors:
            self._renew_retry_at[node_id] = self.clock() + RENEW_RETRY_S
            log.warning("event=node_renew_incomplete node_id=%d failed=%d first_error=%r "
                        "retry_in_s=%.0f", node_id, len(errors), str(errors[0]), RENEW_RETRY_S)
        else:
            self._renewed_dead.add(node_id)
        return len(ranges) - len(errors)


def _merge_producers(replies: Sequence[DnSealReply]) -> tuple[ProducerStateMeta, ...]:
    """Highest sequence per producer across the replicas' answers (they agree below the end)."""
    best: dict[int, ProducerStateMeta] = {}
    for reply in replies:
        for p in reply.producers:
            cur = best.get(p.producer_id)
            if cur is None or (p.producer_epoch, p.last_sequence) > (
                cur.producer_epoch, cur.last_sequence
            ):
                best[p.producer_id] = p
    return tuple(best[k] for k in sorted(best))
