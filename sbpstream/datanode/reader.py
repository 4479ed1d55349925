"""The one read path: how a data node reads one FETCH item and sends it, for every kind of read.

A pull FETCH (fetch.py, long-polled), a fetch session (sessions.py, served by fetch.py) and a
push subscription (subscribe.py, under BUFFER_ACK flow control) differ in when they read and how
much they may send; what they do with one item is the same, and is here, once:

- **Checks**: a negative offset is OFFSET_OUT_OF_RANGE; an item naming a range this node does
  not hold is RANGE_NOT_FOUND.
- **Store read** (:meth:`ItemReader.read`): whole batches as views over the segment maps (no
  copies), never past the stream's committed offset; with ``named_range_only`` (subscriptions)
  never past the end of the sealed range the item names either. The read reports the range's
  end (``range_end_offset``) when it stopped at the end of a sealed range whose successor is
  not held here, also when a later range is (a gap): the reader continues at the replicas the
  PM lists for the next range.
- **Replica-copy redirect**: a read that finds nothing at an offset this node is still copying
  (a sealed range being re-replicated, datanode/rereplicate.py) fails the item with
  REPLICA_UNAVAILABLE, so the reader tries a complete replica instead of waiting here.
- **Trimmed hints**: OFFSET_TRIMMED and OFFSET_OUT_OF_RANGE results carry the stream's start.
- **Per-stream STATS** (:meth:`ItemReader.send`): records and bytes fetched, per stream and per
  node, counted once per read sent (records: how far the reader advanced).
- **Frame packing**: results and views go through the request's
  :class:`~sbpstream.datanode.frames.FramePacker`, which adds up the bytes served per stream.
- **Quota charge** (:meth:`ItemReader.charge`): those bytes, as fetch, per stream.
- **ACL re-checks** (:meth:`ItemReader.refusals`): a session or subscription that outlives its
  request re-checks ``fetch`` on its streams under the connection's current token
  (auth/gate.py, ``live_verdicts``); a refused stream is answered like the gate answers a denied
  item, with no offsets.
- **Failures**: an item's failure is its result (an unexpected exception is INTERNAL_ERROR),
  never the request's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sbpstream.auth.acl import Op
from sbpstream.auth.gate import live_verdicts
from sbpstream.datanode.frames import FramePacker
from sbpstream.datanode.sessions import SessionStream
from sbpstream.net.server import ServerConnection
from sbpstream.protocol.errors import (
    InternalError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
)
from sbpstream.protocol.messages import FetchItem, FetchResult, Status
from sbpstream.quota.enforcer import FETCH

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext


@dataclass(slots=True, eq=False)
class Cursor:
    """One item being read: where it is, and whether it is finished and was answered."""

    item: FetchItem
    offset: int
    done: bool = False
    answered: bool = False  # at least one result (batch or status) was sent for it
    #: a pull session's stream: a result without batches or error goes out only when it
    #: changes what the session last reported for the stream
    session: SessionStream | None = None


@dataclass(slots=True)
class Read:
    """What :meth:`ItemReader.read` found for a cursor (nothing is sent yet)."""

    views: list[memoryview]
    nbytes: int  # payload bytes of ``views``
    start_offset: int  # the stream's lowest readable offset here
    next_offset: int  # where the cursor continues after these views
    range_end: int  # >= 0: the read stopped at this range end (the item is finished)
    more: bool  # more is committed here past ``next_offset``


class ItemReader:
    """The per-item read every FETCH uses (pull, session, push); one per data node."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ reading
    def check(self, cur: Cursor) -> None:
        """Raise why the item cannot be read here (a negative offset; a range not held)."""
        if cur.offset < 0:
            raise OffsetOutOfRangeError(f"fetch offset {cur.offset} is negative")
        it = cur.item
        if it.range_index >= 0 and self.ctx.table.get(it.stream_id, it.range_index) is None:
            raise RangeNotFoundError(f"range {it.stream_id}/{it.range_index} is not on this node")

    def read(self, cur: Cursor, max_bytes: int, *, named_range_only: bool = False) -> Read:
        """Read what is committed for ``cur`` from its offset: about ``max_bytes`` (at least one
        whole batch, when one is readable). Raises an SbpError when the item cannot be read
        here, REPLICA_UNAVAILABLE when the offset is still being copied to this node."""
        ctx = self.ctx
        self.check(cur)
        sid = cur.item.stream_id
        limit = max(ctx.table.high_watermark(sid), 0)
        end = -1
        if named_range_only and cur.item.range_index >= 0:
            # the named range only: at its end the reader goes to the next range's primary
            # (this node may hold that range as a secondary, committed later)
            rs = ctx.store.describe_range(sid, cur.item.range_index)
            if rs.sealed and rs.end_offset >= 0:
                end = rs.end_offset
                limit = min(limit, end) if limit > rs.start_offset else end
        res = ctx.store.read(sid, cur.offset, max_bytes, max_offset=limit)
        views = res.batches
        nxt = res.next_offset
        ended = (res.range_end or 0 <= end <= nxt
                 or (not views and self._gap_after_sealed(sid, cur.offset)))
        if not views and not ended and ctx.rereplicator.missing_at(sid, cur.offset):
            raise ReplicaUnavailableError(  # readers: try a complete replica
                f"node {ctx.node_id} is still copying {sid} at {cur.offset}")
        return Read(views, sum(len(v) for v in views) if views else 0, res.start_offset, nxt,
                    nxt if ended else -1, bool(views) and nxt < min(limit, res.end_offset))

    def _gap_after_sealed(self, sid: int, offset: int) -> bool:
        """True when ``offset`` is the end of a sealed range here and the next range is not
        here, though a later one is (the store reports range_end only after its last range)."""
        s = self.ctx.table.streams.get(sid)
        if s is None or len(s.ranges) < 2:
            return False
        ended = starts = False
        for idx in s.ranges:
            try:
                r = self.ctx.store.describe_range(sid, idx)
            except SbpError:
                continue
            ended |= r.sealed and r.end_offset == offset
            starts |= r.start_offset == offset and not (r.sealed and r.end_offset == offset)
        return ended and not starts

    # ------------------------------------------------------------------ sending
    async def send(self, out: FramePacker, cur: Cursor, rd: Read) -> None:
        """Send a read: one result per batch (the last carrying the range end), or the range
        end alone; count it in STATS (per stream and per node); advance the cursor."""
        views = rd.views
        if views:  # STATS counters: what the consumer advances by
            n = rd.next_offset - cur.offset
            stats = self.ctx.stream_stats
            sc = stats.of(cur.item.stream_id)
            sc.records_fetched += n
            sc.bytes_fetched += rd.nbytes
            stats.records_fetched += n
            stats.bytes_fetched += rd.nbytes
            last = len(views) - 1
            plain = cur.session is None  # (the hot path: no session filter to ask)
            for i, view in enumerate(views):
                result = self.result(cur, len(view), start=rd.start_offset,
                                     range_end=rd.range_end if i == last else -1)
                if plain:
                    await out.add(result, view)
                else:
                    await self.emit(out, cur, result, view)
        cur.offset = rd.next_offset
        if rd.range_end >= 0:
            if not views:
                await self.emit(out, cur, self.result(
                    cur, 0, start=rd.start_offset, range_end=rd.range_end))
            cur.done = True

    def result(self, cur: Cursor, batch_length: int, *, status: Status | None = None,
               start: int = -1, range_end: int = -1) -> FetchResult:
        """A result for ``cur`` with its stream's high watermark (marks it answered)."""
        sid = cur.item.stream_id
        cur.answered = True
        return FetchResult(
            stream_id=sid, request_index=cur.item.request_index, batch_length=batch_length,
            status=status if status is not None else Status(),
            start_offset=start, high_watermark=self.ctx.table.high_watermark(sid),
            range_end_offset=range_end)

    @staticmethod
    async def emit(out: FramePacker, cur: Cursor, result: FetchResult,
                   view: memoryview | None = None) -> None:
        """Send one result; in a pull session, a result without batches or error only when it
        changes what the session last reported for its stream."""
        c = cur.session
        if c is not None:
            code = result.status.code
            if (view is None and code == 0
                    and not c.changed(result.high_watermark, result.range_end_offset, code)):
                return
            c.reported(result.high_watermark, result.range_end_offset, code)
        await out.add(result, view)

    async def fail(self, out: FramePacker, cur: Cursor, exc: Exception) -> None:
        """The item failed: its error in its place (with the stream's start after a trim or an
        offset out of range); it is finished."""
        if not isinstance(exc, SbpError):  # one item's failure never fails the request
            exc = InternalError(f"{type(exc).__name__}: {exc}")
        start = self.ctx.stream_start(cur.item.stream_id) if isinstance(
            exc, OffsetTrimmedError | OffsetOutOfRangeError) else -1
        await self.emit(out, cur, self.result(cur, 0, status=Status.of(exc), start=start))
        cur.done = True
        self.ctx.metrics.c.fetch_failed += 1

    # ------------------------------------------------------------------ quotas, ACLs
    def charge(self, conn: ServerConnection, out: FramePacker) -> int:
        """Charge the fetch quota with the bytes ``out`` served since the last charge, per
        stream; returns the throttle time, which ``out``'s next frame carries."""
        per_stream = out.stream_bytes
        out.stream_bytes = {}
        ms = self.ctx.quotas.charge(conn, FETCH, sum(per_stream.values()), per_stream)
        out.throttle_ms = ms
        return ms

    @staticmethod
    async def refusals(conn: ServerConnection,
                       items: Sequence[FetchItem]) -> list[tuple[FetchItem, FetchResult]]:
        """Under the connection's current token, the items no longer allowed ``fetch``, each
        with the result that ends it (as the gate answers a denied item: no offsets)."""
        verdict = await live_verdicts(conn, Op.FETCH, [it.stream_id for it in items])
        return [(it, FetchResult(stream_id=it.stream_id, request_index=it.request_index,
                                 batch_length=0, status=v))
                for it, v in zip(items, verdict, strict=True) if v is not None]


__all__ = ["Cursor", "ItemReader", "Read"]
