"""Convergence of sealed ranges: a replica that lacks part of a sealed range copies it.

Every replica of a sealed range must hold exactly ``[start, end)`` (design.md 5). A replica can
find itself short of a sealed range in two ways:

- the PM hands it a sealed range it does not hold (re-replication after a replica died for good,
  :mod:`sbpstream.pm.repair`): SYNC_RANGES copies it before it answers;
- the range was sealed while this node was away (killed, partitioned) at an end past what this
  node holds: this node learns the end when it reconciles on restart, from SYNC_RANGES or a
  lookup, or from :meth:`Rereplicator.sweep` (it asks the PM about ranges that look stopped or
  idle). It seals the range at the PM's end at once (the end is final), serves what it holds, and
  copies the rest in the background, retried with a backoff until complete.

A copy FETCHes ``[local next, end)`` from any other replica the Range lists, chunk by chunk
(``COPY_CHUNK_BYTES`` per FETCH bounds memory), appends each batch as a replication append
(offsets already assigned, so the bytes are the source's, byte for byte), makes it durable, seals
the range at ``end`` and commits it there. Concurrent requests for the same range join the copy
in flight. Until a range is complete it counts in ``missing`` (REPORT_METRICS'
``range_missing_replica_cnt``), and a FETCH past what it holds fails with REPLICA_UNAVAILABLE, so
readers move on to a complete replica instead of waiting here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Final

from sbpstream.datanode.limits import PM_CALL_TIMEOUT_S
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import (
    ErrorCode,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
    StreamDeletedError,
)
from sbpstream.protocol.messages import (
    FetchItem,
    FetchRequest,
    FetchResponse,
    ListRangesRequest,
    ListRangesResponse,
    Range,
    StreamOwner,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records.header import BatchError, split_batches

if TYPE_CHECKING:
    from sbpstream.datanode.host import ReplicaHost

log = logging.getLogger("sbpstream.datanode")

COPY_CHUNK_BYTES: Final = 4 * 1024 * 1024
"""batch_max_bytes of each FETCH of a copy: bounds the bytes held at once."""
COPY_FETCH_TIMEOUT_S: Final = 30.0
"""One FETCH round trip to the source replica."""
COPY_CONNECT_TIMEOUT_S: Final = 5.0
COPY_RETRY_MIN_S: Final = 0.2
COPY_RETRY_MAX_S: Final = 5.0
"""Backoff between attempts of a background copy (doubling from min to max)."""
SWEEP_INTERVAL_S: Final = 2.0
"""How often :meth:`Rereplicator.sweep` looks for ranges the PM may have sealed without us."""
STOPPED_IDLE_S: Final = 3.0
"""A range stopped by a seal (end -1) but not told its final end after this long is looked up."""
OPEN_IDLE_S: Final = 30.0
"""An open range without a write for this long is looked up (it may be sealed at the PM)."""
SWEEP_MAX_STREAMS: Final = 200
"""Streams looked up per sweep (one LIST_RANGES request)."""


def needs_copy(ctx: ReplicaHost, r: Range) -> bool:
    """A sealed range with data that this node lacks (absent, short, or an unfinished copy)."""
    if r.end_offset <= r.start_offset or (r.replica_nodes and not ctx.is_me(r.replica_nodes)):
        return False
    try:
        st = ctx.store.describe_range(r.stream_id, r.range_index)
    except RangeNotFoundError:
        return True
    return st.next_offset < r.end_offset


class Rereplicator:
    """Copies sealed ranges into this node, one task per range; remembers the short ones."""

    def __init__(self, ctx: ReplicaHost) -> None:
        self.ctx = ctx
        self._inflight: dict[tuple[int, int], asyncio.Task[None]] = {}
        # sealed ranges held short here, by key: the Range (end, replicas) to copy from
        self.missing: dict[tuple[int, int], Range] = {}
        self._background: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._looked_up: dict[int, float] = {}

    # ------------------------------------------------------------------ short ranges

    def missing_at(self, stream_id: int, offset: int) -> bool:
        """True when ``offset`` falls in the part of a sealed range this node still lacks."""
        for (sid, _), r in self.missing.items():
            if sid == stream_id and r.start_offset <= offset < r.end_offset:
                try:
                    st = self.ctx.store.describe_range(sid, r.range_index)
                except SbpError:
                    return False
                return offset >= st.next_offset
        return False

    def start(self, r: Range) -> None:
        """This node holds less of sealed range ``r`` than its end: copy the rest in the
        background, retried until complete (or the range/stream is gone, or the node closes)."""
        key = (r.stream_id, r.range_index)
        self.missing[key] = r  # the newest placement wins: the sources may have changed
        task = self._background.get(key)
        if task is None or task.done():
            self._background[key] = asyncio.ensure_future(self._converge(key))

    async def _converge(self, key: tuple[int, int]) -> None:
        ctx = self.ctx
        delay = COPY_RETRY_MIN_S
        try:
            while not ctx.closing:
                r = self.missing.get(key)
                if r is None:
                    return
                try:
                    if needs_copy(ctx, r):
                        await self.copy(r)
                    self.missing.pop(key, None)
                    return
                except (StreamDeletedError, RangeNotFoundError) as exc:
                    log.warning("event=range_copy_abandoned stream_id=%d range_index=%d "
                                "error=%r", key[0], key[1], str(exc))
                    self.missing.pop(key, None)
                    return
                except (SbpError, OSError, TimeoutError, BatchError) as exc:
                    log.warning("event=range_copy_retry stream_id=%d range_index=%d "
                                "retry_in_s=%.1f error=%r", key[0], key[1], delay, str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, COPY_RETRY_MAX_S)
                if delay >= COPY_RETRY_MAX_S:
                    # the replicas listed may be stale: learn the range again from the PM
                    with contextlib.suppress(SbpError, OSError, TimeoutError):
                        await self.lookup([key[0]])
        finally:
            if self._background.get(key) is asyncio.current_task():
                self._background.pop(key, None)

    async def lookup(self, stream_ids: list[int]) -> None:
        """Ask the PM for these streams' ranges and adopt the ones placed here: seals (and
        truncations, and copies of short ranges) decided while this node did not hear."""
        ctx = self.ctx
        r = await ctx.pm.call(ListRangesRequest(
            timeout_ms=int(PM_CALL_TIMEOUT_S * 1000),
            items=tuple(StreamOwner(sid) for sid in stream_ids)), ListRangesResponse)
        for res in r.items:
            if res.status.code in (ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED):
                if res.stream_id in ctx.table.streams:
                    ctx.delete_stream(res.stream_id)
                continue
            for rng in res.ranges:
                if not ctx.is_me(rng.replica_nodes):
                    continue
                try:
                    ctx.adopt_range(rng)
                except SbpError as exc:
                    log.warning("event=adopt_failed stream_id=%d range_index=%d error=%r",
                                rng.stream_id, rng.range_index, str(exc))

    async def sweep(self) -> None:
        """Look up, at the PM, streams with a range that is stopped (a seal began and its end
        never arrived) or open and idle (the PM may have sealed it while we did not hear)."""
        ctx = self.ctx
        now = time.monotonic()
        due: list[int] = []
        for st in ctx.store.ranges():
            if st.sealed and st.end_offset >= 0:
                continue
            info = ctx.table.get(st.stream_id, st.range_index)
            idle = now - info.last_active if info is not None else OPEN_IDLE_S
            limit = STOPPED_IDLE_S if st.sealed else OPEN_IDLE_S
            if idle < limit or now - self._looked_up.get(st.stream_id, 0.0) < limit:
                continue
            if st.stream_id not in due:
                due.append(st.stream_id)
            if len(due) >= SWEEP_MAX_STREAMS:
                break
        if not due:
            return
        for sid in due:
            self._looked_up[sid] = now
        if len(self._looked_up) > 4 * SWEEP_MAX_STREAMS:
            self._looked_up = {k: v for k, v in self._looked_up.items() if now - v < OPEN_IDLE_S}
        await self.lookup(due)

    def close(self) -> None:
        for task in list(self._background.values()):
            task.cancel()
        self._background.clear()

    # ------------------------------------------------------------------ copies

    async def copy(self, r: Range) -> None:
        key = (r.stream_id, r.range_index)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._copy(r))
            self._inflight[key] = task
            task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        await asyncio.shield(task)

    def _sources(self, r: Range) -> list[str]:
        return [rn.data_node.advertise_addr for rn in r.replica_nodes
                if rn.data_node.node_id != self.ctx.node_id and rn.data_node.advertise_addr]

    async def _copy(self, r: Range) -> None:
        ctx = self.ctx
        store = ctx.store
        try:
            st = store.describe_range(r.stream_id, r.range_index)
        except RangeNotFoundError:
            st = store.create_range(r.stream_id, r.range_index, r.start_offset)
        ctx.table.ensure(r.stream_id, r.range_index, st.next_offset)
        if not (st.sealed and st.end_offset >= 0):
            # the end is final: seal first (a stopped range refuses replication appends; one
            # sealed at its end takes them up to the end), so an interrupted copy resumes
            store.seal_range(r.stream_id, r.range_index, r.end_offset)
        self.missing.setdefault((r.stream_id, r.range_index), r)
        errors: list[str] = []
        t0 = time.monotonic()
        for addr in self._sources(r):
            try:
                copied = await self._copy_from(addr, r)
            except (SbpError, OSError, TimeoutError, BatchError) as exc:
                errors.append(f"{addr}: {type(exc).__name__}: {exc}")
                log.warning("event=rereplicate_source_failed stream_id=%d range_index=%d "
                            "source=%s error=%r", r.stream_id, r.range_index, addr, str(exc))
                continue
            await store.sync(store.log_position)
            end = store.seal_range(r.stream_id, r.range_index, r.end_offset)
            ctx.set_committed(r.stream_id, r.range_index, end)
            self.missing.pop((r.stream_id, r.range_index), None)
            log.info("event=range_copied stream_id=%d range_index=%d start_offset=%d "
                     "end_offset=%d source=%s bytes=%d elapsed_ms=%d", r.stream_id,
                     r.range_index, r.start_offset, end, addr, copied,
                     int((time.monotonic() - t0) * 1000))
            return
        raise ReplicaUnavailableError(
            f"range {r.stream_id}/{r.range_index}: no replica to copy from "
            f"({'; '.join(errors) or 'none listed'})")

    async def _copy_from(self, addr: str, r: Range) -> int:
        """Append [local next, end) fetched from ``addr``; returns the bytes copied."""
        store = self.ctx.store
        pool = self.ctx.pool  # its TLS and node credentials (auth on) serve this copy too
        conn = await Connection.open(addr, connect_timeout_s=COPY_CONNECT_TIMEOUT_S,
                                     ssl_context=pool.ssl_context,
                                     authenticator=pool.authenticator)
        copied = 0
        try:
            offset = store.describe_range(r.stream_id, r.range_index).next_offset
            while offset < r.end_offset:
                req = FetchRequest(max_wait_ms=0, min_bytes=1, items=(FetchItem(
                    stream_id=r.stream_id, request_index=0, fetch_offset=offset,
                    batch_max_bytes=COPY_CHUNK_BYTES, range_index=r.range_index),))
                frames = await conn.request(Opcode.FETCH, req.encode(),
                                            timeout_s=COPY_FETCH_TIMEOUT_S)
                progressed = False
                for f in frames:
                    for item in FetchResponse.decode(f.header).items:
                        if item.status.code:
                            raise item.status.error()
                    payload = memoryview(f.payload)
                    for pos, h in split_batches(payload):
                        if h.base_offset >= r.end_offset:
                            break
                        if h.base_offset + h.record_count <= offset:
                            continue  # already here (an overlapping answer)
                        batch = payload[pos : pos + h.total_size]
                        store.append(r.stream_id, r.range_index, batch, assign_offset=False)
                        offset = h.base_offset + h.record_count
                        copied += h.total_size
                        progressed = True
                if not progressed:
                    raise ReplicaUnavailableError(
                        f"replica {addr} returned nothing at {offset} < {r.end_offset}")
                # durable chunk by chunk: the page cache holds no unbounded backlog
                await store.sync(store.log_position)
        finally:
            await conn.aclose()
        if offset != r.end_offset:
            raise ReplicaUnavailableError(
                f"replica {addr}: copy ended at {offset}, the range ends at {r.end_offset}")
        return copied
