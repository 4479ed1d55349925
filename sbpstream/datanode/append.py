"""APPEND: validate, write, make durable, replicate, acknowledge: item by item, frame by frame.

One request carries many ``(stream, request_index, batch)`` items; the payload holds the batches
back to back. Items are answered **as they complete**, over several response frames:

1. Items that fail at once (corrupt batch, sealed or deleted stream, not primary) are answered in
   the first frame, without waiting for anything else.
2. Items whose range is known are written to the store in request order (the store assigns
   offsets synchronously, so a stream's batches keep their order), then one group commit
   (``store.sync``) covers all of them: they are acknowledged together in one frame.
3. Items of a stream this node has not heard of wait for one LIST_RANGES lookup at the PM (the
   PM may have created the range a moment ago and its SYNC_RANGES be in flight); each such stream
   is answered in its own frame when its lookup and write finish.

The last frame carries END. A record is acknowledged only after ``store.sync`` returned (per the
fsync policy) and ``replicate`` succeeded; only then does the range's committed offset move, which
is what readers are allowed to see. A batch that duplicates one already stored (an idempotent
producer's retry) is acknowledged on the same terms: once the original's replication round
succeeded, not merely because this node holds it.

**Deadline.** The request's ``timeout_ms`` (DEFAULT_APPEND_TIMEOUT_MS when <= 0, at most
MAX_APPEND_TIMEOUT_MS) bounds everything done on its behalf: the PM lookup of an unknown stream,
the durability wait, and the replication wait (whose rounds take their own bound from the same
deadline, see :mod:`sbpstream.datanode.replication`). Items not acknowledged by then are answered
TIMEOUT (retriable; the batch may still become committed, and its retry is then a duplicate).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sbpstream.datanode.hoptrace import hop_trace_from_env
from sbpstream.datanode.limits import (
    DEFAULT_APPEND_TIMEOUT_MS,
    MAX_APPEND_ITEMS,
    MAX_APPEND_TIMEOUT_MS,
)
from sbpstream.datanode.ranges import ReplicaRange
from sbpstream.net.server import Request, Responder
from sbpstream.protocol.errors import (
    InternalError,
    InvalidRequestError,
    LimitExceededError,
    NotPrimaryError,
    RangeNotFoundError,
    SbpError,
    TimeoutError_,
)
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    AppendResult,
    Status,
)
from sbpstream.quota.enforcer import PRODUCE
from sbpstream.store import AppendOutcome

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext


@dataclass(slots=True)
class Written:
    """One batch stored (not yet durable) and the result it will be acknowledged with."""

    item: AppendItem
    rng: ReplicaRange
    outcome: AppendOutcome
    append_time_ms: int
    # resolves once every secondary holds the batch (None: nothing to replicate)
    replicated: asyncio.Future[None] | None = None
    durable_at: float = 0.0  # when its group commit returned (monotonic; hop trace only)


def _error(item: AppendItem, exc: SbpError) -> AppendResult:
    return AppendResult(stream_id=item.stream_id, request_index=item.request_index,
                        status=Status.of(exc))


def split_payload(m: AppendRequest, payload: memoryview) -> list[memoryview]:
    """Slice the payload into the items' batches; the lengths must add up exactly."""
    if len(m.items) > MAX_APPEND_ITEMS:
        raise LimitExceededError(
            f"{len(m.items)} items in one APPEND; at most {MAX_APPEND_ITEMS} are accepted")
    out: list[memoryview] = []
    pos = 0
    for it in m.items:
        if it.batch_length == 0 and m.replication:
            out.append(payload[pos:pos])  # a commit item: no batch (see _commit_only)
            continue
        if it.batch_length <= 0:
            raise InvalidRequestError(
                f"item {it.request_index}: batch_length {it.batch_length} is not positive")
        out.append(payload[pos : pos + it.batch_length])
        pos += it.batch_length
    if pos != len(payload):
        raise InvalidRequestError(
            f"batch lengths add up to {pos} bytes but the payload has {len(payload)}")
    return out


def append_timeout_s(timeout_ms: int) -> float:
    """An APPEND's time budget from its ``timeout_ms`` (<= 0: the default; bounded)."""
    ms = timeout_ms if timeout_ms > 0 else DEFAULT_APPEND_TIMEOUT_MS
    return min(ms, MAX_APPEND_TIMEOUT_MS) / 1000.0


def _retrieve(f: asyncio.Future[None]) -> None:
    if not f.cancelled():
        f.exception()  # answered TIMEOUT already: the round's outcome is not reported


async def replicate(ctx: NodeContext, rng: ReplicaRange, written: list[Written],
                    deadline: float) -> None:
    """Return once every secondary of the range holds the written batches.

    The batches were queued for replication right after ``store.append`` (in offset order, see
    :mod:`sbpstream.datanode.replication`); this waits for their rounds. A failed round raises
    REPLICA_UNAVAILABLE: the writer then seals the range at the PM (design.md section 5). Past
    ``deadline`` (monotonic) it raises TIMEOUT; the rounds are not cancelled (they carry other
    requests' batches and end by their own bound).
    """
    futs = [w.replicated for w in written if w.replicated is not None]
    if not futs:
        return
    _, pending = await asyncio.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
    if pending:
        for f in pending:
            f.add_done_callback(_retrieve)
        raise TimeoutError_(f"not replicated to every secondary of range {rng.stream_id}/"
                            f"{rng.range_index} within the request's timeout_ms; retry "
                            "(duplicates of idempotent producers are detected)")
    for f in futs:
        f.result()  # the first failure: REPLICA_UNAVAILABLE


def _count(ctx: NodeContext, stream_id: int, ws: list[Written], replication: bool) -> None:
    """STATS counters of one stream's acknowledged batches (duplicates are not new records)."""
    records = nbytes = 0
    for w in ws:
        if not w.outcome.duplicate:
            records += w.outcome.next_offset - w.outcome.base_offset
            nbytes += w.item.batch_length
    c = ctx.stream_stats.of(stream_id)
    if replication:
        c.records_replicated += records
        c.bytes_replicated += nbytes
    else:
        c.records_appended += records
        c.bytes_appended += nbytes
    c.last_append_ms = ws[-1].append_time_ms


class AppendHandler:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.trace = hop_trace_from_env()  # off (None) unless SBPSTREAM_HOP_TRACE is set

    async def __call__(self, req: Request, resp: Responder) -> None:
        ctx = self.ctx
        t0 = time.monotonic()
        m = AppendRequest.decode(req.header)
        batches = split_payload(m, memoryview(req.payload))
        ctx.metrics.c.append_requests += 1
        ctx.metrics.c.append_items += len(batches)
        deadline = t0 + append_timeout_s(m.timeout_ms)
        throttle_ms = 0 if m.replication else self._charge(req, m)

        now_results: list[AppendResult] = []
        lookups: dict[int, list[tuple[AppendItem, memoryview]]] = {}
        written: list[Written] = []
        for pos, (item, batch) in enumerate(zip(m.items, batches, strict=True)):
            if m.replication and not batch:
                now_results.append(self._commit_only(item, m, pos))
                continue
            if item.stream_id in lookups:  # keep the stream's order behind its lookup
                lookups[item.stream_id].append((item, batch))
                continue
            res = self._write(item, batch, m, deadline, allow_lookup=True)
            if res is None:
                lookups[item.stream_id] = [(item, batch)]
            elif isinstance(res, Written):
                written.append(res)
            else:
                now_results.append(res)

        sent: list[AppendResult] = []
        if not lookups and not now_results:  # the common case: one group, one frame
            sent = await self._guard(self._complete(written, m, deadline),
                                     [w.item for w in written])
            await resp.send(AppendResponse(throttle_ms, items=tuple(sent)).encode())
            self._account(sent, t0)
            if self.trace is not None:
                self._trace(req, written, sent, t0)
            return
        tasks: list[asyncio.Task[list[AppendResult]]] = []
        loop = asyncio.get_running_loop()
        if written:
            tasks.append(loop.create_task(self._guard(self._complete(written, m, deadline),
                                                      [w.item for w in written])))
        for sid, pending in lookups.items():
            tasks.append(loop.create_task(self._guard(
                self._after_lookup(sid, pending, m, deadline), [it for it, _ in pending])))
        try:
            await self._respond(resp, now_results, tasks, sent, throttle_ms)
        finally:
            for t in tasks:
                t.cancel()
        self._account(sent, t0)

    def _trace(self, req: Request, written: list[Written], sent: list[AppendResult],
               t0: float) -> None:
        """The hop trace's rows of the items answered OK (see hoptrace.py)."""
        assert self.trace is not None
        acked = time.monotonic()
        ok = {r.request_index for r in sent if not r.status.code}
        for w in written:
            if w.item.request_index in ok and not w.outcome.duplicate:
                self.trace.note(w.item.stream_id, w.outcome.base_offset, w.outcome.next_offset,
                                req.received_at, t0, w.durable_at, acked)

    def _charge(self, req: Request, m: AppendRequest) -> int:
        """Quotas (issue 22): the payload's bytes as produce, by stream; the throttle time."""
        quotas = self.ctx.quotas
        if quotas.enforcer.empty:
            return 0
        items = m.items
        if not quotas.enforcer.has_stream_quotas:  # no byte count per stream is needed
            return quotas.charge(req.conn, PRODUCE, len(req.payload), {})
        if len(items) == 1:  # the common case
            return quotas.charge(req.conn, PRODUCE, len(req.payload),
                                 {items[0].stream_id: items[0].batch_length})
        per_stream: dict[int, int] = {}
        for it in items:
            per_stream[it.stream_id] = per_stream.get(it.stream_id, 0) + it.batch_length
        return quotas.charge(req.conn, PRODUCE, len(req.payload), per_stream)

    def _account(self, sent: list[AppendResult], t0: float) -> None:
        self.ctx.metrics.c.append_failed += sum(1 for r in sent if r.status.code)
        self.ctx.metrics.append_latency_ms.add((time.monotonic() - t0) * 1000.0)

    @staticmethod
    async def _respond(resp: Responder, first: list[AppendResult],
                       tasks: list[asyncio.Task[list[AppendResult]]],
                       sent: list[AppendResult], throttle_ms: int = 0) -> None:
        """One frame per group as it completes; the last one carries END. Each carries the
        request's throttle time."""
        pending: set[asyncio.Task[list[AppendResult]]] = set(tasks)
        ready = first
        if ready and pending:
            await resp.send(AppendResponse(throttle_ms, items=tuple(ready)).encode(), end=False)
            sent.extend(ready)
            ready = []
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                ready.extend(t.result())
            await resp.send(AppendResponse(throttle_ms, items=tuple(ready)).encode(),
                            end=not pending)
            sent.extend(ready)
            ready = []
        if not resp.finished:
            await resp.send(AppendResponse(throttle_ms, items=tuple(ready)).encode(), end=True)
            sent.extend(ready)

    @staticmethod
    async def _guard(work: Awaitable[list[AppendResult]],
                     items: list[AppendItem]) -> list[AppendResult]:
        """Whatever goes wrong inside, every item still gets an answer."""
        try:
            return await work
        except SbpError as exc:
            return [_error(it, exc) for it in items]
        except Exception as exc:  # bad input must never take the server down
            err = InternalError(f"{type(exc).__name__}: {exc}")
            return [_error(it, err) for it in items]

    def _commit_only(self, item: AppendItem, m: AppendRequest, pos: int) -> AppendResult:
        """A replication item without a batch (an idle primary's commit round, see
        replication.py): the range's committed offset moves, never past what is stored here."""
        ctx = self.ctx
        try:
            rng = ctx.resolve_range(item.stream_id, item.range_index)
            if rng is None:
                raise RangeNotFoundError(
                    f"stream {item.stream_id} range {item.range_index} is not on this node")
            committed = (m.committed_offsets[pos] if m.committed_offsets and
                         pos < len(m.committed_offsets) else m.committed_offset)
            stored = ctx.store.describe_range(item.stream_id, rng.range_index).next_offset
            top = min(committed, stored)
            ctx.table.commit(item.stream_id, rng.range_index, top)
        except SbpError as exc:
            return _error(item, exc)
        return AppendResult(stream_id=item.stream_id, request_index=item.request_index,
                            next_offset=max(top, 0))

    def _write(self, item: AppendItem, batch: memoryview, m: AppendRequest, deadline: float,
               *, allow_lookup: bool) -> Written | AppendResult | None:
        """Store one batch. None: the range is unknown here and the PM should be asked."""
        ctx = self.ctx
        try:
            rng = ctx.resolve_range(item.stream_id, item.range_index)
            if rng is None:
                if allow_lookup:
                    return None
                raise RangeNotFoundError(
                    f"stream {item.stream_id} range {item.range_index} is not on this node")
            if not m.replication and not rng.is_primary:
                raise NotPrimaryError(
                    f"node {ctx.node_id} is not the primary of {rng.stream_id}/{rng.range_index}")
            outcome = ctx.store.append(item.stream_id, rng.range_index, batch,
                                      assign_offset=not m.replication)
        except SbpError as exc:
            return _error(item, exc)
        replicated = None
        if not m.replication and ctx.replicators.needs(rng):
            if outcome.duplicate:  # acknowledged once the original is replicated
                replicated = ctx.replicators.wait_replicated(rng, outcome.next_offset)
            else:
                replicated = ctx.replicators.get(rng).submit(batch, outcome.base_offset,
                                                             deadline)
        return Written(item, rng, outcome, time.time_ns() // 1_000_000, replicated)

    async def _after_lookup(self, stream_id: int, pending: list[tuple[AppendItem, memoryview]],
                            m: AppendRequest, deadline: float) -> list[AppendResult]:
        await self.ctx.lookup_stream(stream_id, deadline - time.monotonic())
        out: list[AppendResult] = []
        written: list[Written] = []
        for item, batch in pending:
            res = self._write(item, batch, m, deadline, allow_lookup=False)
            if isinstance(res, Written):
                written.append(res)
            elif res is not None:
                out.append(res)
        if written:
            out.extend(await self._complete(written, m, deadline))
        return out

    async def _complete(self, written: list[Written], m: AppendRequest,
                        deadline: float) -> list[AppendResult]:
        """Group commit, replicate, then publish the committed offsets and answer; by the
        request's ``deadline`` (monotonic), else TIMEOUT."""
        ctx = self.ctx
        position = max(w.outcome.log_position for w in written)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await ctx.durable(position)  # no extra task, unlike wait_for
        except TimeoutError:
            err = TimeoutError_(f"not durable within the request's timeout_ms {m.timeout_ms}; "
                                "retry (duplicates of idempotent producers are detected)")
            return [_error(w.item, err) for w in written]
        if self.trace is not None:
            now = time.monotonic()
            for w in written:
                w.durable_at = now
        by_range: dict[tuple[int, int], list[Written]] = {}
        for w in written:
            by_range.setdefault((w.rng.stream_id, w.rng.range_index), []).append(w)
        # replication of several ranges in one request: each item carries its range's
        # committed offset (a missing one is 0: the commit does not move)
        per_item = (dict(zip(map(id, m.items), m.committed_offsets, strict=False))
                    if m.replication and m.committed_offsets else {})
        out: list[AppendResult] = []
        for (sid, idx), ws in by_range.items():
            try:
                if not m.replication:
                    await replicate(ctx, ws[0].rng, ws, deadline)
            except SbpError as exc:
                out.extend(_error(w.item, exc) for w in ws)
                continue
            top = max(w.outcome.next_offset for w in ws)
            _count(ctx, sid, ws, m.replication)
            if m.replication and m.committed_offsets:
                top = min(top, max(per_item.get(id(w.item), 0) for w in ws))
            elif m.replication and m.committed_offset >= 0:
                top = min(top, m.committed_offset)
            ctx.table.commit(sid, idx, top)
            out.extend(
                AppendResult(stream_id=w.item.stream_id, request_index=w.item.request_index,
                             base_offset=w.outcome.base_offset,
                             stream_append_time_ms=w.append_time_ms,
                             next_offset=w.outcome.next_offset)
                for w in ws
            )
        return out
