"""FETCH: many streams per request, streamed back in frames, long-polled (Kafka's fetch).

Each round reads every unfinished item, up to its byte budget, through the one per-item reader
(reader.py: the store read never past the stream's committed offset, STATS, the replica-copy
redirect, the failure results; the same for sessions and subscriptions), which packs the batches
into frames of about ``fetch_frame_bytes`` (frames.py). Frames go out as they fill; the fetch
quota is charged once per FETCH, before its last frame. When the response holds fewer
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

from sbpstream.auth.gate import claims_of, token_expiry_s
from sbpstream.datanode.frames import FramePacker
from sbpstream.datanode.limits import (
    DEFAULT_FETCH_ITEM_BYTES,
    MAX_FETCH_ITEM_BYTES,
    MAX_FETCH_ITEMS,
    MAX_FETCH_WAIT_MS,
)
from sbpstream.datanode.ranges import StreamInfo
from sbpstream.datanode.reader import Cursor, ItemReader
from sbpstream.datanode.sessions import (
    FINAL_EPOCH,
    INITIAL_EPOCH,
    FetchSession,
    FetchSessionCache,
    is_sessionless,
)
from sbpstream.datanode.subscribe import Subscriptions
from sbpstream.net.server import Request, Responder, ServerConnection
from sbpstream.protocol.errors import InvalidFetchSessionEpochError, LimitExceededError
from sbpstream.protocol.messages import FetchRequest

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

@dataclass(slots=True, eq=False)
class _ItemState(Cursor):
    """A pull item: a cursor and the bytes it may still take in this FETCH."""

    budget: int = 0


class FetchHandler:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        #: the one per-item reader (reader.py), shared with the subscriptions
        self.reader = ItemReader(ctx)
        #: fetch sessions (sessions.py); a connection's die with it
        self.sessions = FetchSessionCache(alive=_alive)
        #: FETCHes with a window (subscriptions: sessions in push mode when they ask for one)
        #: and BUFFER_ACK (see subscribe.py)
        self.subscriptions = Subscriptions(ctx, self.sessions, self.reader)
        self._reapers: set[asyncio.Task[None]] = set()

    async def __call__(self, req: Request, resp: Responder) -> None:
        ctx = self.ctx
        t0 = time.monotonic()
        m = FetchRequest.decode(req.header)
        if self.subscriptions.serves(m):  # changes a live subscription's streams
            await self.subscriptions.update(req, resp, m)
            return
        if m.window_bytes > 0:
            await self.subscriptions.serve(req, resp, m)
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
                                             budget=self._budget(it.batch_max_bytes))
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
        self.reader.charge(req.conn, out)
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
        refused = await self.reader.refusals(conn, [c.item for c in session.streams.values()])
        for _, result in refused:
            await out.add(result)
        if refused:
            self.sessions.update(session, (), [it.stream_id for it, _ in refused])

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
                    st = states[sid] = _ItemState(c.item, c.item.fetch_offset, session=c,
                                                  budget=self._budget(c.item.batch_max_bytes))
                if not st.done:
                    budget = st.budget
                    await self._poll(st, out)
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
                await self.reader.emit(out, st, self.reader.result(st, 0))
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
                        await self._poll(st, out)
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
                    await self.reader.emit(out, st, self.reader.result(st, 0))
            self.reader.charge(req.conn, out)
            await out.flush(end=True)
        finally:
            for s in registered:
                s.waiters.discard(wake)
        ctx.metrics.fetch_latency_ms.add((time.monotonic() - t0 - waited) * 1000.0)

    @staticmethod
    def _budget(batch_max_bytes: int) -> int:
        if batch_max_bytes <= 0:
            return DEFAULT_FETCH_ITEM_BYTES
        return min(batch_max_bytes, MAX_FETCH_ITEM_BYTES)

    async def _poll(self, st: _ItemState, out: FramePacker) -> None:
        """Read what is committed for one item into ``out``, up to its budget (the reader's
        failures are the item's result)."""
        reader = self.reader
        try:
            while st.budget > 0:
                rd = reader.read(st, min(st.budget, out.frame_bytes))
                await reader.send(out, st, rd)
                st.budget -= rd.nbytes
                if st.done or not rd.views:
                    return  # its range's end; or caught up with the committed offset: wait
            st.done = True
        except Exception as exc:  # one item's failure never fails the request
            await reader.fail(out, st, exc)


def _wait_s(m: FetchRequest, conn: ServerConnection) -> float:
    """How long a FETCH may long-poll: its max_wait_ms, at most MAX_FETCH_WAIT_MS, and no longer
    than its connection's token lives."""
    wait = min(max(m.max_wait_ms, 0), MAX_FETCH_WAIT_MS) / 1000.0
    left = token_expiry_s(conn)
    return wait if left is None else max(0.0, min(wait, left))


def _alive(owner: object) -> bool:
    return not getattr(owner, "closed", False)
