"""Subscriptions: a FETCH with ``window_bytes > 0`` streams records until cancelled (DCP-style
flow control, answered BUFFER_ACKs).

A subscription is one FETCH request that never ends on its own while its streams are live. It
reads each stream through the one per-item reader (reader.py, as a long poll and a fetch session
do: STATS, quota charge, replica-copy redirect, ACL re-check); this module holds only the
window, the rounds and BUFFER_ACK. For
every named stream it sends what is committed, then parks on one ``asyncio.Event`` (set by
BUFFER_ACK, cancel and updates, and through each stream's waker by a commit, a seal or a delete
of that stream), and sends more as records are committed: frames without END, one FetchResult
per batch, as in a long poll. A round polls only the streams queued since the last (woken,
added, or left with more than the window took), not every stream. The first round answers
every stream (an empty result with its high watermark when nothing is readable yet), so a
subscriber learns at once where each stream stands; its first frame closes at 64 KiB and the
next ones grow to ``fetch_frame_bytes`` (fetch.py, FIRST_PUSH_FRAME_BYTES).

Flow control counts **payload bytes**: the sum of ``batch_length`` of the FetchResults sent (the
record batches exactly as stored; frame and FlatBuffers headers do not count). The node never
has more than ``window_bytes`` of them unacknowledged on a subscription; one batch larger than
the whole window goes alone when nothing is unacknowledged (otherwise it could never go). The
client acks with BUFFER_ACK ``{fetch_request_id, bytes_acked}`` what it has processed, counted the
same way. Every BUFFER_ACK is answered with a BufferAckResponse: OK, or why it was refused
(zero, negative, more than unacknowledged, no such subscription on this connection); a refused
ack changes nothing.

A subscription ends with an END frame when the client cancels (BUFFER_ACK with ``cancel``), when
every stream has ended, when the client stops sending on the connection (GOAWAY or a half-close:
no ack or cancel can come any more, and the connection's drain waits for its requests), or when
the node shuts down (top-level status SHUTTING_DOWN); it ends without one when the connection
closes. A stream ends on its own, its last FetchResult saying
why: ``range_end_offset >= 0`` when its sealed range was read to the end and the next range is
not held here (continue at that offset, at the replicas the PM lists for the next range), or an
error status (STREAM_DELETED, OFFSET_TRIMMED with ``start_offset``, RANGE_NOT_FOUND, ...).

A subscribing FETCH with ``(session_id, session_epoch) = (0, 0)`` is also a **fetch session in
push mode** (sessions.py): the node's session cache holds it under a new id, which every frame
carries, and an incremental FETCH ``(id, epoch)`` on the same connection changes the live
subscription (:meth:`Subscriptions.update`): ``forgotten`` streams stop, ``items`` are added or
replace a stream's item, under the session's epoch rules and this module's limits; it is answered
at once with one empty END frame. Results carry their item's ``request_index``, so a client tells
the results of a stream's earlier item (sent before the update) from the new one's. The session
lives as long as the subscription; closing it (epoch -1, ``(id, 0)``) ends the subscription.

**Revocation.** With auth on, a subscription acts under its connection's *current* token
(docs/security.md, "Revocation and live reads"). When that token expires and the connection did
not present a new one, the subscription ends at once with top-level status TOKEN_EXPIRED (a
timer wakes it at the expiry). When the connection presents a new token (AUTHENTICATE, the
SDK's renewal), the subscription re-checks ``fetch`` on every live stream against the new
token's rules before it sends anything more, and ends each stream no longer allowed with an
AUTHORIZATION_FAILED result in its place; the allowed ones go on.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from sbpstream.auth.gate import (
    claims_of,
    token_expired,
    token_expiry_s,
    unwatch_token,
    watch_token,
)
from sbpstream.datanode.frames import FramePacker
from sbpstream.datanode.limits import MAX_FETCH_ITEMS
from sbpstream.datanode.ranges import StreamInfo
from sbpstream.datanode.reader import Cursor, ItemReader
from sbpstream.datanode.sessions import (
    FINAL_EPOCH,
    INITIAL_EPOCH,
    SESSION_STREAM_BYTES,
    FetchSession,
    FetchSessionCache,
)
from sbpstream.introspect.counters import connection_counters
from sbpstream.net.server import Request, Responder, ServerConnection
from sbpstream.protocol.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    InvalidRequestError,
    LimitExceededError,
    SbpError,
    ShuttingDownError,
)
from sbpstream.protocol.limits import KiB, MiB
from sbpstream.protocol.messages import (
    BufferAckRequest,
    BufferAckResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
    Status,
)

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

FIRST_PUSH_FRAME_BYTES: Final = 64 * KiB
"""A subscription's first frame closes at this payload size; the next ones grow four-fold up
to ``fetch_frame_bytes`` (see FramePacker): 64 KiB is ~600 records of 100 B, enough for the
consumer to start on while the node reads on."""

MAX_WINDOW_BYTES: Final = 64 * MiB
"""Largest window a subscription may ask for: what a consumer that stops acking may still be
sent (the node keeps no copies, the batches are views over its segment maps, and what the socket
does not take waits in the write buffer, bounded by its 4 MiB high-water mark). 64 MiB keeps a
consumer streaming at full speed over a fast link while bounding what it must buffer."""

MAX_SUBSCRIPTION_STREAMS: Final = MAX_FETCH_ITEMS
"""Streams one subscription may name, as for any FETCH (10,000): each costs ~200 bytes of state
and a waiter registration, and a pass over all of them per wake-up."""

MAX_SUBSCRIPTIONS_PER_CONNECTION: Final = 256
"""Subscriptions open on one connection. Each holds an in-flight request slot for its lifetime;
256 stays far below the 1,024 slots a connection has, so BUFFER_ACKs, APPENDs and long polls on
the same connection always find one (a subscription whose acks cannot get in would stall)."""

MAX_SUBSCRIPTIONS_PER_NODE: Final = 4096
"""Subscriptions open on one node: a task, an event and a per-stream state each (~5.7 KB idle
with one stream, measured), so 4,096 idle subscriptions cost ~23 MiB."""

MAX_SUBSCRIBED_STREAMS_PER_NODE: Final = 200_000
"""Stream entries across all subscriptions of a node: bounds waiter registrations (a commit sets
every waiter of its stream) and per-stream state (~200 bytes: 40 MiB at the cap)."""

ROUND_BYTES_PER_STREAM: Final = 256 * 1024
"""Most one stream may take of the window per pass over the streams, so one stream with a large
backlog cannot starve the others of a shared window."""


@dataclass(slots=True, eq=False)
class _Item(Cursor):
    """A subscribed stream: a cursor, and whether (and where) it waits for a commit."""

    dirty: bool = True  # may have something to send: polled on the next pass
    queued: bool = True  # in its subscription's queue (made queued, and dirty)
    info: StreamInfo | None = None  # the stream's entry its waker is registered with
    waker: _Waker | None = None

    def retire(self) -> None:
        """Out of its subscription (forgotten, or replaced by an update): nothing more is sent
        for it (a batch already being sent still goes, under its old ``request_index``)."""
        self.done = True
        if self.info is not None and self.waker is not None:
            self.info.waiters.discard(self.waker)
        self.info = None


class _Waker(asyncio.Event):
    """Stands in a stream's waiters for one subscribed stream: a commit (a seal, a delete, the
    node closing) marks that stream for the next pass and wakes the subscription, so a pass
    polls the streams that may have something new, not all of them (a 1,000-stream catch-up
    would otherwise read every caught-up stream again at every BUFFER_ACK).

    Only ``set`` is ever called on a stream's waiters (RangeTable); the Event state is not
    built (a deque per subscribed stream), ``is_set`` is always False."""

    __slots__ = ("_st", "_sub")
    _value = False

    def __init__(self, sub: Subscription, st: _Item) -> None:  # no Event state: see above
        self._sub = sub
        self._st = st

    def set(self) -> None:
        st = self._st
        st.dirty = True
        if not st.queued and not st.done:
            st.queued = True
            self._sub.queue.append(st)
        self._sub.wake.set()


@dataclass(slots=True, eq=False)
class Subscription:
    """One open subscription: its window, what is unacknowledged, and its wake-up event."""

    conn: ServerConnection
    request_id: int
    window: int
    items: list[_Item]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    unacked: int = 0
    sent_bytes: int = 0
    acked_bytes: int = 0
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)
    round_left: int | None = None  # fetch quota: bytes this round may still push (None: no cap)
    #: the items that may have something to send (dirty), each once, in round-robin order: a
    #: pass polls these, not every stream (a round's cost follows what changed, not the
    #: subscription's size); filled by the wakers, by updates, and by a pass with the items
    #: it could not finish (at the back; the one the window held back at the front)
    queue: list[_Item] = field(default_factory=list)  # (a list: an idle one costs 56 bytes)
    #: items whose stream is not on this node (yet): checked each round, queued when it is
    unbound: list[_Item] = field(default_factory=list)
    blocked: bool = False  # this pass met a batch larger than the free window
    ended: bool = False  # an item ended (or was retired) since the last check of them all
    stream_ids: list[int] | None = None  # of its items, for the fetch quota (None: to make)
    #: its fetch session in push mode (0: none, its streams are fixed): the live streams by id,
    #: which an incremental FETCH changes
    session: FetchSession | None = None
    live: dict[int, _Item] = field(default_factory=dict)
    #: items not yet answered: each reports its state once, even with nothing to read yet
    fresh: list[_Item] = field(default_factory=list)
    #: auth: the token (claims) its streams were last checked against, and the timer waking it
    #: when that token expires
    claims: object = None
    expiry: asyncio.TimerHandle | None = None

    def apply(self, items: tuple[FetchItem, ...], forgotten: tuple[int, ...]) -> int:
        """An incremental FETCH of its session: drop ``forgotten``, then add ``items`` (a
        stream already here is replaced: it continues at the item's offset and range, under
        the item's request_index). Returns the change in its stream count."""
        before = len(self.live)
        for sid in forgotten:
            st = self.live.pop(sid, None)
            if st is not None:
                st.retire()
                self.ended = True
        for it in items:
            old = self.live.pop(it.stream_id, None)
            if old is not None:
                old.retire()
                self.ended = True
            st = self.live[it.stream_id] = _Item(it, it.fetch_offset)
            self.fresh.append(st)
            self.queue.append(st)
        self.items = list(self.live.values())  # a new list: a pass in progress keeps its own
        self.stream_ids = None
        self.wake.set()
        return len(self.live) - before

    def cancel(self) -> None:
        self.cancelled = True
        self.wake.set()

    @property
    def free(self) -> int:
        free = self.window - self.unacked
        return free if self.round_left is None else min(free, self.round_left)


@dataclass(frozen=True, slots=True)
class SubscriptionStats:
    subscriptions: int
    streams: int
    unacked_bytes: int  # payload sent and not yet acknowledged, all subscriptions
    max_unacked_bytes: int  # the largest single subscription's
    acks: int
    acks_refused: int
    state_bytes: int  # estimate of the subscriptions' own state (see Subscriptions.state_bytes)


# What a subscription's handler task costs beyond the objects _state_bytes counts: the task,
# its coroutine frames (serve, _run, the handler wrapper), the Responder and FramePacker, the
# request's decoded header, the connection's task-table entry. Fitted on CPython 3.11 to the RSS
# growth of 1,000 and 3,000 idle subscriptions (~5.2 KB each, docs/benchmarks.md) less what
# _state_bytes counts (~0.4 KB); a constant, as sys.getsizeof cannot see into frames.
_TASK_BYTES: Final = 4800


_WAKER_BYTES: Final = 72  # a _Waker (slots; sys.getsizeof on 3.11)


def _state_bytes(sub: Subscription) -> int:
    """The node's estimate of what one open subscription holds in memory: its own objects
    (sys.getsizeof: the subscription, its event, item list and per-stream entries with their
    FetchItem, one waiter-set slot per stream; its push session's entry and SESSION_STREAM_BYTES
    per stream) plus _TASK_BYTES. Payload is not counted: sent
    batches are views over the segment maps, unsent ones are not read yet."""
    n = (sys.getsizeof(sub) + sys.getsizeof(sub.wake) + sys.getsizeof(sub.items)
         + sys.getsizeof(sub.queue) + sys.getsizeof(sub.unbound) + _TASK_BYTES)
    if sub.session is not None:  # its push session: the cache's entry, a stream entry each
        n += (sys.getsizeof(sub.session) + sys.getsizeof(sub.live)
              + len(sub.live) * SESSION_STREAM_BYTES)
    if sub.items:
        st = sub.items[0]
        n += len(sub.items) * (sys.getsizeof(st) + sys.getsizeof(st.item) + 2 * 8
                               + _WAKER_BYTES)
    return n


class Subscriptions:
    """Every open subscription of a node; serves subscribing FETCHes and BUFFER_ACK."""

    def __init__(self, ctx: NodeContext, sessions: FetchSessionCache | None = None,
                 reader: ItemReader | None = None) -> None:
        self.ctx = ctx
        #: the one per-item reader (reader.py), shared with pull FETCHes and sessions
        self.reader = reader if reader is not None else ItemReader(ctx)
        #: the node's fetch sessions: a subscription asking for one (epoch 0) is a session
        #: in push mode there, changed by incremental FETCHes (see :meth:`update`)
        self.sessions = sessions if sessions is not None else FetchSessionCache()
        self.by_session: dict[int, Subscription] = {}
        self.updates = 0
        self.by_conn: dict[ServerConnection, dict[int, Subscription]] = {}
        self.count = 0
        self.streams = 0
        self.acks = 0
        self.acks_refused = 0

    def stats(self) -> SubscriptionStats:
        subs = [s for d in self.by_conn.values() for s in d.values()]
        return SubscriptionStats(
            subscriptions=len(subs), streams=self.streams,
            unacked_bytes=sum(s.unacked for s in subs),
            max_unacked_bytes=max((s.unacked for s in subs), default=0),
            acks=self.acks, acks_refused=self.acks_refused,
            state_bytes=sum(_state_bytes(s) for s in subs))

    def find(self, conn: ServerConnection, request_id: int) -> Subscription | None:
        d = self.by_conn.get(conn)
        return None if d is None else d.get(request_id)

    # ------------------------------------------------------------------ BUFFER_ACK

    async def buffer_ack(self, req: Request, resp: Responder) -> None:
        m = BufferAckRequest.decode(req.header)
        try:
            self._apply(req.conn, m)
            self.acks += 1
            status = Status()
        except SbpError as exc:
            self.acks_refused += 1
            status = Status.of(exc)
        await resp.send(BufferAckResponse(status=status).encode())

    def _apply(self, conn: ServerConnection, m: BufferAckRequest) -> None:
        sub = self.find(conn, m.fetch_request_id)
        if sub is None:
            raise InvalidRequestError(
                f"no subscription with fetch request id {m.fetch_request_id} on this connection")
        if m.cancel:
            sub.cancelled = True
            sub.wake.set()
            return
        if m.bytes_acked <= 0:
            raise InvalidRequestError(
                f"bytes_acked {m.bytes_acked}: an ack releases a positive number of bytes")
        if m.bytes_acked > sub.unacked:
            raise InvalidRequestError(
                f"bytes_acked {m.bytes_acked} is more than the {sub.unacked} payload bytes "
                f"unacknowledged on subscription {m.fetch_request_id}")
        sub.unacked -= m.bytes_acked
        sub.acked_bytes += m.bytes_acked
        sub.wake.set()

    # ------------------------------------------------------------------ push sessions

    def serves(self, m: FetchRequest) -> bool:
        """True when ``m`` is an incremental FETCH of a live subscription's session."""
        return m.session_epoch > 0 and m.session_id in self.by_session

    async def update(self, req: Request, resp: Responder, m: FetchRequest) -> None:
        """An incremental FETCH ``(id, epoch)`` of a subscription's session: drop its
        ``forgotten`` streams and add (or replace) its ``items`` on the live subscription, under
        the session's epoch rules; answered at once with one empty END frame (OK, the session
        id). The streams' records come on the subscription. A refused update changes nothing
        (the epoch included), but one the session cache cannot hold closes the session and so
        ends the subscription, as a pull session is closed."""
        sub = self.by_session[m.session_id]
        if len(m.items) > MAX_SUBSCRIPTION_STREAMS or len(m.forgotten) > MAX_SUBSCRIPTION_STREAMS:
            raise LimitExceededError(f"{len(m.items)} streams and {len(m.forgotten)} forgotten "
                                     f"in one FETCH; at most {MAX_SUBSCRIPTION_STREAMS} each")
        if sub.conn is req.conn:  # (another connection's gets FETCH_SESSION_ID_NOT_FOUND)
            after = (sub.live.keys() - set(m.forgotten)) | {it.stream_id for it in m.items}
            grown = len(after) - len(sub.live)
            if len(after) > MAX_SUBSCRIPTION_STREAMS:
                raise LimitExceededError(f"subscription {sub.request_id} would hold "
                                         f"{len(after)} streams; at most "
                                         f"{MAX_SUBSCRIPTION_STREAMS}")
            if grown > 0 and self.streams + grown > MAX_SUBSCRIBED_STREAMS_PER_NODE:
                raise LimitExceededError(
                    f"{self.streams} streams subscribed on this node; {grown} more would pass "
                    f"the {MAX_SUBSCRIBED_STREAMS_PER_NODE} limit")
        session = self.sessions.get(req.conn, m.session_id, m.session_epoch)  # epoch rules
        self.sessions.update(session, m.items, m.forgotten)  # closes it (and sub) if too big
        self.streams += sub.apply(m.items, m.forgotten)
        self.updates += 1
        self.ctx.metrics.c.fetch_requests += 1
        self.ctx.metrics.c.fetch_items += len(m.items)
        await resp.send(FetchResponse(session_id=m.session_id).encode())

    # ------------------------------------------------------------------ the subscription

    async def serve(self, req: Request, resp: Responder, m: FetchRequest) -> None:
        """Run the subscription ``m`` (window_bytes > 0) until it ends."""
        if m.window_bytes > MAX_WINDOW_BYTES:
            raise LimitExceededError(
                f"window_bytes {m.window_bytes}; at most {MAX_WINDOW_BYTES} are accepted")
        if len(m.items) > MAX_SUBSCRIPTION_STREAMS:
            raise LimitExceededError(f"{len(m.items)} streams in one subscription; at most "
                                     f"{MAX_SUBSCRIPTION_STREAMS} are accepted")
        mine = self.by_conn.get(req.conn, {})
        if len(mine) >= MAX_SUBSCRIPTIONS_PER_CONNECTION:
            raise LimitExceededError(f"{len(mine)} subscriptions open on this connection; at "
                                     f"most {MAX_SUBSCRIPTIONS_PER_CONNECTION}")
        if self.count >= MAX_SUBSCRIPTIONS_PER_NODE:
            raise LimitExceededError(f"{self.count} subscriptions open on this node; at most "
                                     f"{MAX_SUBSCRIPTIONS_PER_NODE}")
        if self.streams + len(m.items) > MAX_SUBSCRIBED_STREAMS_PER_NODE:
            raise LimitExceededError(
                f"{self.streams} streams subscribed on this node; {len(m.items)} more would "
                f"pass the {MAX_SUBSCRIBED_STREAMS_PER_NODE} limit")
        if m.session_epoch < FINAL_EPOCH or (m.session_epoch > 0 and not m.session_id):
            raise InvalidFetchSessionEpochError(
                f"fetch session epoch {m.session_epoch} with session id {m.session_id}: a "
                "subscription makes a session with epoch 0 and changes it with epoch > 0")
        if m.session_epoch > 0:  # incremental, but not of a live subscription's session
            if self.sessions.sessions.get(m.session_id) is not None:
                raise InvalidRequestError(
                    f"fetch session {m.session_id} is a long-poll session: a subscription "
                    "makes its own (epoch 0)")
            self.sessions.not_found += 1
            raise FetchSessionIdNotFoundError(
                f"fetch session {m.session_id} is not on this node (its subscription ended, "
                "or it was closed, evicted or never made)")
        if m.session_id:  # (id, 0) replaces session id, (id, -1) closes it
            self.sessions.close_owned(req.conn, m.session_id)
        out = FramePacker(resp, self.ctx.config.fetch_frame_bytes, FIRST_PUSH_FRAME_BYTES)
        items = [_Item(it, it.fetch_offset) for it in m.items]
        sub = Subscription(req.conn, req.request_id, m.window_bytes, items)
        if m.session_epoch == INITIAL_EPOCH:
            session = self.sessions.create(req.conn, m.items)
            if session is not None:  # else no room: a subscription whose streams are fixed
                session.push = session.busy = True
                session.on_close = sub.cancel
                sub.session = session
                sub.live = {st.item.stream_id: st for st in items}
                sub.items = list(sub.live.values())  # the last item of a stream wins
                self.by_session[session.session_id] = sub
                out.session_id = session.session_id
        sub.fresh = list(sub.items)
        sub.queue.extend(sub.items)
        sub.claims = claims_of(req.conn)  # the gate checked the items against this token
        watch_token(req.conn, sub.wake.set)  # a new token: re-check before sending more
        self._arm_expiry(sub)
        self.by_conn.setdefault(req.conn, {})[req.request_id] = sub
        self.count += 1
        counters = connection_counters(req.conn.attributes)
        counters.subscriptions += 1  # CONNECTIONS/WHOAMI: open subscriptions
        self.streams += len(sub.items)
        self.ctx.metrics.c.fetch_requests += 1
        self.ctx.metrics.c.fetch_items += len(m.items)
        req.conn.drain_events.add(sub.wake)
        try:
            status = await self._run(sub, out)
            for st in sub.items:
                if not st.answered and status.ok:
                    await out.add(self.reader.result(st, 0))
            out.status = status
            await out.flush(end=True)
        finally:
            unwatch_token(req.conn, sub.wake.set)
            if sub.expiry is not None:
                sub.expiry.cancel()
            req.conn.drain_events.discard(sub.wake)
            for st in sub.items:
                if st.info is not None and st.waker is not None:
                    st.info.waiters.discard(st.waker)
            self.count -= 1
            counters.subscriptions -= 1
            self.streams -= len(sub.items)
            if sub.session is not None:
                self.by_session.pop(sub.session.session_id, None)
                sub.session.on_close = None
                if self.sessions.sessions.get(sub.session.session_id) is sub.session:
                    self.sessions.close(sub.session.session_id)
            d = self.by_conn.get(req.conn)
            if d is not None:
                d.pop(req.request_id, None)
                if not d:
                    del self.by_conn[req.conn]

    async def _run(self, sub: Subscription, out: FramePacker) -> Status:
        ctx = self.ctx
        while True:
            sub.wake.clear()
            if sub.unbound:  # a stream not on this node when last polled: is it now?
                streams = ctx.table.streams
                for st in [st for st in sub.unbound if st.done or st.item.stream_id in streams]:
                    sub.unbound.remove(st)
                    if not st.done:
                        self._enqueue(sub, st)
            if ctx.closing:
                return Status.of(ShuttingDownError("the data node is shutting down"))
            expired = token_expired(sub.conn)
            if expired is not None:
                return Status.of(expired)
            if claims_of(sub.conn) is not sub.claims:  # a new token: its rules, every stream
                await self._recheck(sub, out)
            if sub.cancelled or sub.conn.draining or sub.conn.input_ended:
                return Status()  # cancelled, or the peer sends nothing more (no ack, no cancel)
            # a client with a fetch quota gets at most one quota window's bytes per round, then
            # the round is charged and the pushes wait out the throttle (as a long poll's next
            # request would): a push source cannot outrun the quota
            if sub.stream_ids is None:  # made again after a change of its streams only
                sub.stream_ids = [st.item.stream_id for st in sub.items]
            sub.round_left = self.ctx.quotas.fetch_round_bytes(sub.conn, sub.stream_ids)
            await self._pass(sub, out)
            cut = sub.round_left is not None and sub.round_left <= 0
            sub.round_left = None
            if sub.fresh:  # a new stream reports its state once, even with nothing to read
                fresh, sub.fresh = sub.fresh, []
                for st in fresh:
                    if not st.answered and not st.done:
                        await self._report(st, out)
                sub.ended = True  # a report may have ended a stream
            await out.flush(end=False)
            throttle_ms = self._charge(sub, out)
            if sub.ended:
                sub.ended = False
                if all(st.done for st in sub.items):
                    return Status()
            if throttle_ms:  # over its fetch quota: no push until it is back under (KIP-219)
                await asyncio.sleep(throttle_ms / 1000)
            if cut:
                continue  # more may be readable now: the next round reads it
            if not sub.wake.is_set():
                await sub.wake.wait()

    def _arm_expiry(self, sub: Subscription) -> None:
        """Wake the subscription when its connection's token expires (none: auth off, or a
        node token)."""
        if sub.expiry is not None:
            sub.expiry.cancel()
            sub.expiry = None
        left = token_expiry_s(sub.conn)
        if left is None:
            return

        def due() -> None:
            sub.expiry = None
            later = token_expiry_s(sub.conn)
            if later is not None and later > 0:  # renewed meanwhile, or the clocks differ
                sub.expiry = asyncio.get_running_loop().call_later(later, due)
            sub.wake.set()

        sub.expiry = asyncio.get_running_loop().call_later(max(left, 0.0), due)

    async def _recheck(self, sub: Subscription, out: FramePacker) -> None:
        """The connection presented a new token: ``fetch`` on every live stream under its
        rules; each stream no longer allowed ends with its refusal in its place."""
        sub.claims = claims_of(sub.conn)
        self._arm_expiry(sub)
        live = {st.item.stream_id: st for st in sub.items if not st.done}
        gone: list[int] = []
        for it, result in await self.reader.refusals(sub.conn, [st.item for st in live.values()]):
            st = live[it.stream_id]
            if st.done:  # (ended while the verdicts were looked up)
                continue
            st.answered = True
            await out.add(result)
            st.retire()
            gone.append(it.stream_id)
        if not gone:
            return
        sub.ended = True
        self.ctx.metrics.c.fetch_failed += len(gone)
        if sub.session is not None and not sub.session.closed:  # out of the session too
            self.sessions.update(sub.session, (), gone)
            self.streams += sub.apply((), tuple(gone))
        await out.flush(end=False)

    @staticmethod
    def _enqueue(sub: Subscription, st: _Item) -> None:
        st.dirty = True
        if not st.queued:
            st.queued = True
            sub.queue.append(st)

    def _bind(self, sub: Subscription, st: _Item) -> None:
        """Register the item's waker with its stream's entry before reading it, so a commit
        landing between the read and the wait still wakes the subscription. An entry is
        replaced only after the old one woke its waiters (deleted, then re-adopted), which
        queued the item: checking the items polled is enough."""
        s = self.ctx.table.streams.get(st.item.stream_id)
        if s is not st.info:
            if st.info is not None and st.waker is not None:
                st.info.waiters.discard(st.waker)
            st.info = s
            if s is not None:
                if st.waker is None:
                    st.waker = _Waker(sub, st)
                s.waiters.add(st.waker)

    async def _pass(self, sub: Subscription, out: FramePacker) -> None:
        """Poll the queued (dirty) streams in order until nothing more can be sent: the queue
        drained, or the window full. A stream with more than it could send goes to the back
        (round-robin); a pass stops at the first batch that does not fit (``sub.blocked``),
        leaving that stream at the front: reading the other streams then would only read
        batches that cannot go either (a 1,000-stream catch-up read each stream ~5 times per
        batch sent, once per ack); the next pass, woken by an ack, starts there. The queue is
        taken whole and what a pass leaves goes back in front of what was queued meanwhile."""
        sub.blocked = False
        while sub.queue and sub.free > 0:
            work, sub.queue = sub.queue, []
            i, n = 0, len(work)
            while i < n and sub.free > 0:
                st = work[i]
                i += 1
                st.queued = False
                if st.done or not st.dirty:
                    continue
                self._bind(sub, st)
                await self._poll(sub, st, out)
                if st.done:
                    sub.ended = True
                elif st.info is None and st not in sub.unbound:
                    sub.unbound.append(st)
                if st.dirty and not st.done and not st.queued:
                    st.queued = True
                    if sub.blocked:
                        i -= 1  # in front again, where it was
                        work[i] = st
                    else:
                        sub.queue.append(st)
                if sub.blocked:
                    break
            if i < n:  # blocked, or the window is full: the rest goes first next time
                sub.queue[:0] = work[i:]
                return

    def _charge(self, sub: Subscription, out: FramePacker) -> int:
        """Quotas: charge the fetch quota with what this round pushed (per stream, as a long
        poll is charged); returns the throttle time, which the next frame carries. A round
        that pushed nothing is not charged (it is not a request)."""
        if not out.stream_bytes:
            return 0
        return self.reader.charge(sub.conn, out)

    async def _report(self, st: _Item, out: FramePacker) -> None:
        """A new stream's first result when it had nothing to send: its state, or why its
        named range cannot be served here."""
        try:
            self.reader.check(st)
        except SbpError as exc:
            await self.reader.fail(out, st, exc)
            return
        await out.add(self.reader.result(st, 0))

    async def _poll(self, sub: Subscription, st: _Item, out: FramePacker) -> None:
        """Send what is committed for one stream, within the window and ROUND_BYTES_PER_STREAM
        (the one reader reads, counts and sends it; here only the window's share)."""
        free = sub.free
        if free <= 0:
            return  # still dirty: polled once acks make room
        st.dirty = False  # until a wake, or this poll finds more than it may send
        reader = self.reader
        try:
            rd = reader.read(st, min(free, ROUND_BYTES_PER_STREAM), named_range_only=True)
            views = rd.views
            if views and len(views[0]) > free and sub.unacked > 0:
                st.dirty = True
                sub.blocked = True
                return  # a batch larger than what is free: wait for acks
            # unacknowledged before it goes: an ack may come while a frame of it is sent
            n = rd.nbytes
            sub.unacked += n
            sub.sent_bytes += n
            if sub.round_left is not None:
                sub.round_left -= n
            await reader.send(out, st, rd)
            if rd.more and not st.done:
                st.dirty = True  # there is more (the window, ROUND_BYTES_PER_STREAM took it)
        except Exception as exc:  # one stream's failure never ends the subscription
            await reader.fail(out, st, exc)


__all__ = [
    "MAX_SUBSCRIBED_STREAMS_PER_NODE",
    "MAX_SUBSCRIPTIONS_PER_CONNECTION",
    "MAX_SUBSCRIPTIONS_PER_NODE",
    "MAX_SUBSCRIPTION_STREAMS",
    "MAX_WINDOW_BYTES",
    "SubscriptionStats",
    "Subscriptions",
]
