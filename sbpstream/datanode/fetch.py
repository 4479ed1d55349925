"""FETCH: many streams per request, streamed back in frames, long-polled (Kafka's fetch).

Each round reads every unfinished item from the store (memoryviews over the segment maps, no
copies; the views are the frame's payload parts), never past the stream's committed offset, and
packs the batches into frames of about ``fetch_frame_bytes`` (one FetchResult per batch in the
frame's header, in payload order). Frames go out as they fill. When the response holds fewer
than ``min_bytes`` and ``max_wait_ms`` has not passed, the handler parks on one asyncio.Event
registered with every stream it waits on; the append path sets it right after a commit, so new
records reach a waiting consumer at once, without polling. The final frame carries END, plus one
empty result (batch_length 0) for every item that returned nothing, so each item reports its
stream's start, high watermark and, at the end of a sealed range, that range's end.

A FETCH with ``window_bytes > 0`` is a subscription instead, served by subscribe.py: it streams
until cancelled, under BUFFER_ACK flow control.

A FETCH with a session (``session_id``/``session_epoch`` other than ``(0, -1)``, sessions.py)
serves its session's streams the same way, reading only those that may have changed (dirty:
added, changed, woken by a commit, or last read with batches or an error), and answers only the
streams with batches, an error or a state that changed since the session last reported it;
every frame carries the session's id.

**Revocation** (auth on; docs/security.md, "Revocation and live reads"). A session is served
under its connection's current token: a FETCH of the session under a token other than the one
its streams were last checked against (the connection renewed it, with maybe other rules)
re-checks ``fetch`` on every stream of the session first, not only the ones the FETCH adds, and
answers each stream no longer allowed with AUTHORIZATION_FAILED in its place, out of the
session from then on. Within one token the rules cannot change (they travel in the token), so
the check is not repeated for each incremental FETCH. A long poll ends no later than its
connection's token expires; the next request is refused with TOKEN_EXPIRED by the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sbpstream.auth.acl import Op
from sbpstream.auth.gate import claims_of, live_verdicts, token_expiry_s
from sbpstream.datanode.limits import (
    DEFAULT_FETCH_ITEM_BYTES,
    MAX_BATCHES_PER_FETCH_FRAME,
    MAX_FETCH_ITEM_BYTES,
    MAX_FETCH_ITEMS,
    MAX_FETCH_WAIT_MS,
)
from sbpstream.datanode.ranges import StreamInfo
from sbpstream.datanode.sessions import (
    FINAL_EPOCH,
    INITIAL_EPOCH,
    FetchSession,
    FetchSessionCache,
    SessionStream,
    is_sessionless,
)
from sbpstream.datanode.subscribe import Subscriptions
from sbpstream.net.server import Request, Responder, ServerConnection
from sbpstream.protocol.errors import (
    InternalError,
    InvalidFetchSessionEpochError,
    LimitExceededError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
)
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse, FetchResult, Status
from sbpstream.quota.enforcer import FETCH

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

FIRST_PUSH_FRAME_BYTES = 64 * 1024
"""A subscription's first frame closes at this payload size; the next ones grow four-fold up
to ``fetch_frame_bytes`` (see FramePacker): 64 KiB is ~600 records of 100 B, enough for the
consumer to start on while the node reads on."""


@dataclass(slots=True)
class _ItemState:
    item: FetchItem
    offset: int
    budget: int
    done: bool = False
    answered: bool = False  # at least one result (batch or status) was sent for it
    cached: SessionStream | None = None  # its session's state (None: no session)


class FramePacker:
    """Accumulates results and payload views; sends a frame when the next batch would not fit.

    With ``first_frame_bytes`` (subscriptions) the first frame closes at that size and each
    next one may be four times the last, up to ``frame_bytes``: the consumer starts decoding
    after a few streams were read instead of after a whole frame's worth (a 1 MiB frame of
    100 B records is ~100 streams read, encoded and checksummed before it can go), while the
    node goes on filling the next frames."""

    def __init__(self, resp: Responder, frame_bytes: int,
                 first_frame_bytes: int | None = None) -> None:
        self.resp = resp
        self.status = Status()  # the response's top-level status (sent in every frame)
        self.max_frame_bytes = frame_bytes
        self.frame_bytes = min(frame_bytes, first_frame_bytes or frame_bytes)
        self.results: list[FetchResult] = []
        self.parts: list[memoryview] = []
        self.frame_payload = 0
        self.total_bytes = 0
        self.frames = 0
        self.stream_bytes: dict[int, int] = {}  # quotas: bytes served per stream
        self.throttle_ms = 0  # quotas: set before the END frame, carried by it
        self.session_id = 0  # the fetch session served (in every frame's header)

    async def add(self, result: FetchResult, view: memoryview | None = None) -> None:
        size = 0 if view is None else len(view)
        if self.results and (self.frame_payload + size > self.frame_bytes
                             or len(self.results) >= MAX_BATCHES_PER_FETCH_FRAME):
            await self.flush(end=False)
        self.results.append(result)
        if view is not None:
            self.parts.append(view)
            self.frame_payload += size
            self.total_bytes += size
            sid = result.stream_id
            self.stream_bytes[sid] = self.stream_bytes.get(sid, 0) + size

    async def flush(self, *, end: bool) -> None:
        if not end and not self.results:
            return
        # throttle_ms: set before the END frame of a long poll, or after a subscription's round
        # went over its quota; carried once, by the next frame
        header = FetchResponse(self.throttle_ms, status=self.status, items=tuple(self.results),
                               session_id=self.session_id).encode()
        self.throttle_ms = 0
        parts, self.parts, self.results, self.frame_payload = self.parts, [], [], 0
        await self.resp.send(header, parts, end=end)
        self.frames += 1
        if self.frame_bytes < self.max_frame_bytes:
            self.frame_bytes = min(self.max_frame_bytes, self.frame_bytes * 4)


class FetchHandler:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        #: fetch sessions (sessions.py); a connection's die with it
        self.sessions = FetchSessionCache(alive=_alive)
        #: FETCHes with a window (subscriptions: sessions in push mode when they ask for one)
        #: and BUFFER_ACK (see subscribe.py)
        self.subscriptions = Subscriptions(ctx, self.sessions)
        self._reapers: set[asyncio.Task[None]] = set()

    async def __call__(self, req: Request, resp: Responder) -> None:
        ctx = self.ctx
        t0 = time.monotonic()
        m = FetchRequest.decode(req.header)
        if self.subscriptions.serves(m):  # changes a live subscription's streams
            await self.subscriptions.update(req, resp, m)
            return
        if m.window_bytes > 0:
            await self.subscriptions.serve(req, resp, m, FramePacker(
                resp, ctx.config.fetch_frame_bytes, FIRST_PUSH_FRAME_BYTES))
            return
        if len(m.items) > MAX_FETCH_ITEMS:
            raise LimitExceededError(
                f"{len(m.items)} items in one FETCH; at most {MAX_FETCH_ITEMS} are accepted")
        ctx.metrics.c.fetch_requests += 1
        ctx.metrics.c.fetch_items += len(m.items)
        session = None if is_sessionless(m) else self._session(req.conn, m)
        out = FramePacker(resp, ctx.config.fetch_frame_bytes)
        if session is None:
            await self._serve(m, [_ItemState(it, it.fetch_offset,
                                             self._budget(it.batch_max_bytes))
                                  for it in m.items], out, t0, req)
            return
        out.session_id = session.session_id
        session.busy = True
        try:
            await self._recheck(req.conn, session, out)
            await self._serve_session(m, session, out, t0, req.conn)
        finally:
            # free before the last frame goes: the client may send its next FETCH the moment
            # it has it, maybe before this task runs again
            self._done_with(session)
        out.throttle_ms = self._charge(req, out)
        await out.flush(end=True)

    async def _recheck(self, conn: ServerConnection, session: FetchSession,
                       out: FramePacker) -> None:
        """Under a token other than the one the session was last checked against: ``fetch`` on
        every stream of it; the streams no longer allowed are answered with their refusal and
        leave the session. A new session's streams were checked by the gate just now."""
        claims = claims_of(conn)
        if session.claims is claims:
            return
        first = session.claims is None
        session.claims = claims
        if first or claims is None:
            return
        sids = list(session.streams)
        verdict = await live_verdicts(conn, Op.FETCH, sids)
        gone: list[int] = []
        for sid, v in zip(sids, verdict, strict=True):
            c = session.streams.get(sid)
            if v is None or c is None:
                continue
            await out.add(FetchResult(stream_id=sid, request_index=c.item.request_index,
                                      batch_length=0, status=v))
            gone.append(sid)
        if gone:
            self.sessions.update(session, (), gone)

    @staticmethod
    def _done_with(session: FetchSession) -> None:
        session.busy = False
        session.wake = None
        session.last_used = time.monotonic()
        if session.closed:  # closed while it served (connection gone, replaced)
            session.release()

    def _session(self, conn: ServerConnection, m: FetchRequest) -> FetchSession | None:
        """The session a FETCH uses (created, or updated by its items and ``forgotten``), or
        None when it is served sessionless (closing a session; no room for a new one)."""
        cache = self.sessions
        sid, epoch = m.session_id, m.session_epoch
        if epoch == FINAL_EPOCH:
            cache.close_owned(conn, sid)
            return None
        if epoch == INITIAL_EPOCH:
            if sid:
                cache.close_owned(conn, sid)
            if not conn.attributes.get("fetch_sessions"):  # drop them when it closes
                conn.attributes["fetch_sessions"] = True
                task = asyncio.ensure_future(self._reap(conn))
                self._reapers.add(task)
                task.add_done_callback(self._reapers.discard)
            return cache.create(conn, m.items)
        if epoch < FINAL_EPOCH or sid == 0:
            cache.bad_epoch += 1
            raise InvalidFetchSessionEpochError(
                f"fetch session epoch {epoch} with session id {sid}: an incremental FETCH names "
                "a session and an epoch > 0")
        s = cache.get(conn, sid, epoch)
        cache.update(s, m.items, m.forgotten)
        return s

    async def _reap(self, conn: ServerConnection) -> None:
        await conn.closed_event.wait()
        self.sessions.close_owner(conn)

    async def _serve_session(self, m: FetchRequest, session: FetchSession, out: FramePacker,
                             t0: float, conn: ServerConnection) -> None:
        """Serve a session's FETCH but its last frame: read only its dirty streams (added,
        changed, woken by a commit, or not yet read to their committed end), long-polled as any
        FETCH."""
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _wait_s(m, conn)
        min_bytes = max(m.min_bytes, 0)
        wake = session.wake = asyncio.Event()
        states: dict[int, _ItemState] = {}
        streams = session.streams
        table = ctx.table.streams
        waited = 0.0
        failed = 0
        while True:
            wake.clear()
            todo, session.dirty = session.dirty, set()
            again: set[int] = set()
            for sid in todo:
                c = streams.get(sid)
                if c is None:
                    continue
                if not session.closed:  # before reading: a commit from now on wakes us
                    c.watch(table.get(sid))
                st = states.get(sid)
                if st is None:
                    st = states[sid] = _ItemState(c.item, c.item.fetch_offset,
                                                  self._budget(c.item.batch_max_bytes),
                                                  cached=c)
                if not st.done:
                    budget = st.budget
                    failed += await self._poll(st, out)
                    if st.budget == budget and not st.done and c.info is not None:
                        continue  # read to its committed end: clean until woken
                again.add(sid)  # batches, an end or an error: read it again next time
            woken = session.dirty  # by commits while we were reading
            session.dirty = woken | again
            remaining = deadline - loop.time()
            if out.total_bytes >= min_bytes or remaining <= 0 or ctx.closing:
                break
            if any(sid not in states or not states[sid].done for sid in woken):
                continue
            await out.flush(end=False)
            w0 = loop.time()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await wake.wait()
            waited += loop.time() - w0
        for st in states.values():
            if not st.answered:
                await self._emit(out, st, self._result(st, 0))
        ctx.metrics.c.fetch_failed += failed
        ctx.metrics.fetch_latency_ms.add((time.monotonic() - t0 - waited) * 1000.0)

    async def _serve(self, m: FetchRequest, states: list[_ItemState], out: FramePacker,
                     t0: float, req: Request) -> None:
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _wait_s(m, req.conn)
        min_bytes = max(m.min_bytes, 0)
        wake = asyncio.Event()
        registered: list[StreamInfo] = []
        waited = 0.0
        failed = 0
        try:
            while True:
                # Register before reading, so a commit landing between the read and the wait
                # still wakes us (no lost wake-up).
                wake.clear()
                for st in states:
                    s = ctx.table.streams.get(st.item.stream_id)
                    if not st.done and s is not None and wake not in s.waiters:
                        s.waiters.add(wake)
                        registered.append(s)
                for st in states:
                    if not st.done:
                        failed += await self._poll(st, out)
                remaining = deadline - loop.time()
                if (out.total_bytes >= min_bytes or remaining <= 0 or ctx.closing
                        or all(st.done for st in states)):
                    break
                await out.flush(end=False)  # what we have goes now; the rest as it arrives
                w0 = loop.time()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):  # no extra task, unlike wait_for
                        await wake.wait()
                waited += loop.time() - w0
            for st in states:
                if not st.answered:
                    await self._emit(out, st, self._result(st, 0))
            out.throttle_ms = self._charge(req, out)
            await out.flush(end=True)
        finally:
            for s in registered:
                s.waiters.discard(wake)
        ctx.metrics.c.fetch_failed += failed
        ctx.metrics.fetch_latency_ms.add((time.monotonic() - t0 - waited) * 1000.0)

    def _charge(self, req: Request, out: FramePacker) -> int:
        """Quotas (issue 22): the bytes served as fetch, by stream; the throttle time."""
        return self.ctx.quotas.charge(req.conn, FETCH, out.total_bytes, out.stream_bytes)

    @staticmethod
    def _budget(batch_max_bytes: int) -> int:
        if batch_max_bytes <= 0:
            return DEFAULT_FETCH_ITEM_BYTES
        return min(batch_max_bytes, MAX_FETCH_ITEM_BYTES)

    def _result(self, st: _ItemState, batch_length: int, *, status: Status | None = None,
                start: int = -1, range_end: int = -1) -> FetchResult:
        sid = st.item.stream_id
        st.answered = True
        return FetchResult(
            stream_id=sid, request_index=st.item.request_index, batch_length=batch_length,
            status=status if status is not None else Status(),
            start_offset=start, high_watermark=self.ctx.table.high_watermark(sid),
            range_end_offset=range_end)

    @staticmethod
    async def _emit(out: FramePacker, st: _ItemState, result: FetchResult,
                    view: memoryview | None = None) -> None:
        """Send one result; in a session, a result without batches or error is sent only when
        it changes what the session last reported for its stream."""
        c = st.cached
        if c is not None:
            code = result.status.code
            if (view is None and code == 0
                    and not c.changed(result.high_watermark, result.range_end_offset, code)):
                return
            c.reported(result.high_watermark, result.range_end_offset, code)
        await out.add(result, view)

    async def _poll(self, st: _ItemState, out: FramePacker) -> int:
        """Read what is committed for one item into ``out``; returns 1 when the item failed."""
        ctx = self.ctx
        it = st.item
        try:
            if st.offset < 0:
                raise OffsetOutOfRangeError(f"fetch offset {st.offset} is negative")
            if it.range_index >= 0 and ctx.table.get(it.stream_id, it.range_index) is None:
                raise RangeNotFoundError(
                    f"range {it.stream_id}/{it.range_index} is not on this node")
            hwm = ctx.table.high_watermark(it.stream_id)
            while st.budget > 0:
                res = ctx.store.read(it.stream_id, st.offset, min(st.budget, out.frame_bytes),
                                    max_offset=max(hwm, 0))
                range_end = res.next_offset if res.range_end else -1
                if res.batches:  # STATS counters: what the consumer advances by
                    sc = ctx.stream_stats.of(it.stream_id)
                    sc.records_fetched += res.next_offset - st.offset
                    sc.bytes_fetched += res.byte_count
                for i, view in enumerate(res.batches):
                    last = i == len(res.batches) - 1
                    await self._emit(out, st, self._result(
                        st, len(view), start=res.start_offset,
                        range_end=range_end if last else -1), view)
                st.offset = res.next_offset
                st.budget -= res.byte_count
                if res.range_end:
                    if not res.batches:
                        await self._emit(out, st, self._result(
                            st, 0, start=res.start_offset, range_end=range_end))
                    st.done = True
                    return 0
                if not res.batches:
                    if ctx.rereplicator.missing_at(it.stream_id, st.offset):
                        raise ReplicaUnavailableError(  # readers: try a complete replica
                            f"node {ctx.node_id} is still copying {it.stream_id} at {st.offset}")
                    return 0  # caught up with the committed offset: wait for more
            st.done = True
            return 0
        except SbpError as exc:
            start = ctx.stream_start(it.stream_id) if isinstance(
                exc, OffsetTrimmedError | OffsetOutOfRangeError) else -1
            await self._emit(out, st, self._result(st, 0, status=Status.of(exc), start=start))
        except Exception as exc:  # one item's failure never fails the request
            await self._emit(out, st, self._result(st, 0, status=Status.of(
                InternalError(f"{type(exc).__name__}: {exc}"))))
        st.done = True
        return 1


def _wait_s(m: FetchRequest, conn: ServerConnection) -> float:
    """How long a FETCH may long-poll: its max_wait_ms, at most MAX_FETCH_WAIT_MS, and no longer
    than its connection's token lives."""
    wait = min(max(m.max_wait_ms, 0), MAX_FETCH_WAIT_MS) / 1000.0
    left = token_expiry_s(conn)
    return wait if left is None else max(0.0, min(wait, left))


def _alive(owner: object) -> bool:
    return not getattr(owner, "closed", False)
