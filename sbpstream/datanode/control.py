"""The PM-facing handlers: SEAL_RANGES (SEAL), SYNC_RANGES, DESCRIBE_RANGES, TRIM_STREAMS,
DELETE_STREAMS. Every item gets its own status; one bad item never fails the batch."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from sbpstream.datanode.digest import DigestBudget, range_digest
from sbpstream.datanode.limits import (
    DEFAULT_DIGEST_TIMEOUT_MS,
    DEFAULT_SYNC_TIMEOUT_MS,
    MAX_DIGEST_TIMEOUT_MS,
    MAX_SYNC_TIMEOUT_MS,
)
from sbpstream.datanode.rereplicate import needs_copy
from sbpstream.net.server import Request, Responder
from sbpstream.protocol.errors import (
    FencedLeaderError,
    InternalError,
    LimitExceededError,
    RequestTimeoutError,
    SbpError,
)
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DescribeRangeResult,
    DescribeRangesRequest,
    DescribeRangesResponse,
    ProducerState,
    Range,
    SealRangesRequest,
    SealRangesResponse,
    SealResult,
    Status,
    Stream,
    StreamResult,
    SyncRangesRequest,
    SyncRangesResponse,
    SyncResult,
    TrimResult,
    TrimStreamsRequest,
    TrimStreamsResponse,
)
from sbpstream.quota.enforcer import FETCH

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

log = logging.getLogger("sbpstream.datanode")


def _status(exc: Exception) -> Status:
    if isinstance(exc, SbpError):
        return Status.of(exc)
    log.exception("event=item_failed")
    return Status.of(InternalError(f"{type(exc).__name__}: {exc}"))


def _check(n: int) -> None:
    if n > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(f"{n} items; at most {MAX_ITEMS_PER_REQUEST} are accepted")


class ControlHandlers:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    async def seal(self, req: Request, resp: Responder) -> None:
        """end_offset -1: stop writing, report the local end and producer states. end_offset
        >= 0: sealed there for good; anything stored past it is dropped."""
        ctx = self.ctx
        m = SealRangesRequest.decode(req.header)
        _check(len(m.items))
        out: list[SealResult] = []
        try:
            ctx.pm_fence.admit(m.pm_epoch)  # a deposed PM's seal changes nothing
        except FencedLeaderError as exc:
            log.warning("event=seal_fenced pm_epoch=%d highest=%d", m.pm_epoch,
                        ctx.pm_fence.highest)
            await resp.send(SealRangesResponse(items=tuple(
                SealResult(stream_id=it.stream_id, status=Status.of(exc)) for it in m.items)
            ).encode())
            return
        for it in m.items:
            try:
                final = it.end_offset >= 0
                ctx.replicators.drop(it.stream_id, it.range_index)
                end = ctx.store.seal_range(it.stream_id, it.range_index,
                                          it.end_offset if final else None)
                if not final:
                    end = self._replicated_end(it.stream_id, it.range_index, end)
                if final:
                    ctx.set_committed(it.stream_id, it.range_index, end)
                producers = tuple(
                    ProducerState(producer_id=p.producer_id, producer_epoch=p.epoch,
                                  last_sequence=p.last_sequence,
                                  last_base_offset=p.last_base_offset)
                    for p in ctx.store.producer_states(it.stream_id, it.range_index))
                rng = ctx.range_message(it.stream_id, it.range_index)
                if not final:  # the end is not final yet: report the local end as next_offset
                    rng = Range(rng.stream_id, rng.range_index, rng.start_offset, end, -1,
                                rng.replica_nodes)
                log.info("event=seal stream_id=%d range_index=%d end_offset=%d final=%s",
                         it.stream_id, it.range_index, end, final)
                out.append(SealResult(stream_id=it.stream_id, ranges=(rng,),
                                      producers=producers))
            except Exception as exc:  # per-item status
                out.append(SealResult(stream_id=it.stream_id, status=_status(exc)))
        await resp.send(SealRangesResponse(items=tuple(out)).encode())

    def _replicated_end(self, stream_id: int, range_index: int, local_end: int) -> int:
        """The end this node reports when asked to stop: on the primary of a replicated range,
        no more than what every secondary confirmed (``replicated_offset``).

        Why: the primary writes a batch before it replicates it, so after a failed round it
        holds batches no secondary has (none of them acknowledged). Reporting its local end let
        a seal that reached only the primary end the range there, leaving every secondary short
        of the sealed range for good (the ``range_missing_data`` of issue 15). Everything
        acknowledged is below ``replicated_offset``, so ending there loses nothing."""
        info = self.ctx.table.get(stream_id, range_index)
        if (info is None or not info.is_primary or info.replicated_offset < 0
                or not self.ctx.replicators.needs(info)):
            return local_end
        start = self.ctx.store.describe_range(stream_id, range_index).start_offset
        return max(start, min(local_end, info.replicated_offset))

    async def sync(self, req: Request, resp: Responder) -> None:
        """Create the listed ranges here (idempotent) and remember their placement. A sealed
        range with data this node lacks is copied from another replica first (may take a
        while); its item is OK only once the copy is durable and sealed. The wait for copies
        ends at the request's deadline (``timeout_ms``, see DEFAULT/MAX_SYNC_TIMEOUT_MS): the
        items not done by then answer TIMEOUT and their copies go on in the background."""
        ctx = self.ctx
        m = SyncRangesRequest.decode(req.header)
        _check(sum(len(sr.ranges) for sr in m.items))
        ms = m.timeout_ms if m.timeout_ms > 0 else DEFAULT_SYNC_TIMEOUT_MS
        deadline = time.monotonic() + min(ms, MAX_SYNC_TIMEOUT_MS) / 1000
        out: list[SyncResult] = []
        for sr in m.items:
            try:
                for r in sr.ranges:  # a sealed range this node lacks: copy it first
                    if needs_copy(ctx, r):
                        await self._copy_by(r, deadline, m.timeout_ms)
                got = tuple(ctx.adopt_range(r) for r in sr.ranges)
                out.append(SyncResult(stream_id=sr.stream_id, ranges=got))
            except Exception as exc:  # per-item status
                out.append(SyncResult(stream_id=sr.stream_id, status=_status(exc)))
        ctx.note_new_streams([sr.stream_id for sr in m.items])
        await resp.send(SyncRangesResponse(items=tuple(out)).encode())

    async def _copy_by(self, r: Range, deadline: float, timeout_ms: int) -> None:
        """Copy sealed range ``r`` here, waiting until ``deadline`` at most: then the copy is
        handed to the background convergence (retried until complete) and TIMEOUT raised."""
        copy = asyncio.ensure_future(self.ctx.rereplicator.copy(r))
        done, _ = await asyncio.wait({copy}, timeout=max(0.0, deadline - time.monotonic()))
        if not done:  # the copy goes on (it is shielded); adopt the range once it is done
            self.ctx.rereplicator.start(r)  # a failed copy is retried until complete
            self.ctx.spawn(self._adopt_when_copied(r, copy))
            raise RequestTimeoutError(
                f"range {r.stream_id}/{r.range_index} not copied within the request's timeout_ms "
                f"{timeout_ms}; the copy goes on in the background")
        copy.result()

    async def _adopt_when_copied(self, r: Range, copy: asyncio.Future[None]) -> None:
        try:
            await copy
        except Exception:  # the background convergence retries it
            return
        try:
            self.ctx.adopt_range(r)
        except SbpError as exc:
            log.warning("event=adopt_failed stream_id=%d range_index=%d error=%r",
                        r.stream_id, r.range_index, str(exc))

    async def describe(self, req: Request, resp: Responder) -> None:
        ctx = self.ctx
        m = DescribeRangesRequest.decode(req.header)
        _check(len(m.items))
        # digests (sbpstream check) read whole ranges: they stop at the request's deadline
        ms = m.timeout_ms if m.timeout_ms > 0 else DEFAULT_DIGEST_TIMEOUT_MS
        deadline = time.monotonic() + min(ms, MAX_DIGEST_TIMEOUT_MS) / 1000
        out: list[DescribeRangeResult] = []
        budget = DigestBudget()  # bounded per request, charged as fetch (digest.py)
        for it in m.items:
            try:
                res = DescribeRangeResult(
                    stream_id=it.stream_id,
                    range=ctx.committed_range_message(it.stream_id, it.range_index))
                if it.digest_end_offset >= 0:  # sbpstream check
                    try:
                        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                            d = await range_digest(ctx, it.stream_id, it.range_index,
                                                   it.digest_start_offset,
                                                   it.digest_end_offset, budget)
                    except TimeoutError:
                        raise RequestTimeoutError(
                            f"digest of range {it.stream_id}/{it.range_index} not done within "
                            f"the request's timeout_ms {m.timeout_ms}") from None
                    res = replace(res, digest=d.digest, digest_start_offset=d.start_offset,
                                  digest_end_offset=d.end_offset)
                out.append(res)
            except Exception as exc:  # per-item status
                out.append(DescribeRangeResult(stream_id=it.stream_id, status=_status(exc)))
        throttle = ctx.quotas.charge(req.conn, FETCH, budget.used, budget.by_stream) \
            if budget.used else 0
        await resp.send(DescribeRangesResponse(throttle, items=tuple(out)).encode())

    async def trim(self, req: Request, resp: Responder) -> None:
        ctx = self.ctx
        m = TrimStreamsRequest.decode(req.header)
        _check(len(m.items))
        out: list[TrimResult] = []
        for it in m.items:
            try:
                ctx.store.trim(it.stream_id, it.trim_offset)
                start = ctx.stream_start(it.stream_id)
                log.info("event=trim stream_id=%d trim_offset=%d start_offset=%d",
                         it.stream_id, it.trim_offset, start)
                out.append(TrimResult(stream=Stream(stream_id=it.stream_id, start_offset=start),
                                      range=ctx.first_range_message(it.stream_id)))
            except Exception as exc:  # per-item status
                out.append(TrimResult(stream=Stream(stream_id=it.stream_id),
                                      status=_status(exc)))
        await resp.send(TrimStreamsResponse(items=tuple(out)).encode())

    async def delete(self, req: Request, resp: Responder) -> None:
        """The stream rejects writes (and reads) from now on; its bytes become garbage that
        compaction reclaims."""
        ctx = self.ctx
        m = DeleteStreamsRequest.decode(req.header)
        _check(len(m.items))
        out: list[StreamResult] = []
        for it in m.items:
            try:
                ctx.delete_stream(it.stream_id)
                out.append(StreamResult(stream=Stream(stream_id=it.stream_id)))
            except Exception as exc:  # per-item status
                out.append(StreamResult(stream=Stream(stream_id=it.stream_id),
                                        status=_status(exc)))
        await resp.send(DeleteStreamsResponse(items=tuple(out)).encode())
