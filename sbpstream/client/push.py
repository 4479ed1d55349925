"""A consumer's subscriptions: records pushed by the data nodes (issue 32 split this out of
:mod:`sbpstream.client.consumer`).

By default it **subscribes** (``Subscriber``): one FETCH with a window per data node holding
the streams' current ranges; the node pushes records as they are committed, and the consumer
acks (BUFFER_ACK, payload bytes) as the application takes them. At a sealed range's end, on a
node failure or a refused stream it plans that stream again (the next range, another replica);
a node that refuses subscriptions (UNSUPPORTED_OPERATION, LIMIT_EXCEEDED) is long-polled with
one multi-stream FETCH per round instead. A multi-stream consumer with ``subscribe=False``
long-polls every node that way.

Each subscription is a **fetch session in push mode**: streams planned for a node whose
subscription runs join it by an incremental FETCH (a stream's next range there,
:meth:`~sbpstream.client.consumer.AsyncConsumer.set_streams`, a group rebalance), and dropped
streams are forgotten there, so one subscription per node serves the consumer's changing stream
set. A refused change (a session error, a limit) changes nothing on the node; the streams it would
have added get a full subscription of their own, from the consumer's positions.

:class:`Subscriber` works for a :class:`SubscriberHost` (the consumer's plain reader,
:class:`~sbpstream.client.pull.StreamReader`): the host holds the buffer
and the application's positions; the subscriber calls only the host's public members below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from sbpstream.client.retry import REFRESH_CODES, Attempts, deadline_scope
from sbpstream.client.routing import RangeRouter, replica_addresses
from sbpstream.client.types import Range
from sbpstream.protocol.errors import (
    ClientTimeoutError,
    ErrorCode,
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    SbpError,
    ShuttingDownError,
)
from sbpstream.protocol.messages import (
    BufferAckRequest,
    BufferAckResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.protocol.opcodes import Opcode

if TYPE_CHECKING:
    from sbpstream.client.core import ClientCore
    from sbpstream.net.client import Connection

log = logging.getLogger("sbpstream.client.consumer")

FETCH_TIMEOUT_MARGIN_MS: Final = 5000
"""Client-side wait for a FETCH frame beyond max_wait_ms and the request timeout: the node
answers a long poll at max_wait_ms, so only a lost node or connection takes longer."""

SUBSCRIBE_FALLBACK_CODES: Final[frozenset[int]] = frozenset(
    {ErrorCode.UNSUPPORTED_OPERATION, ErrorCode.LIMIT_EXCEEDED})
"""A node answering a subscribing FETCH with these is served by long polls instead."""

ACK_DELAY_S: Final = 0.005
"""Longest an idle consumer holds back acks of less than a quarter of its window (see
:meth:`Feed.idle`): delays only a batch larger than three quarters of the window."""

SEALED_RETRY_S: Final = 0.05
"""Wait before looking again for the range after a sealed one (the PM creates it shortly)."""

RESOLVE_WAIT_S: Final = 0.05
"""Longest the resolution of the other streams' starts waits for the first subscription to be
sent (it starts at once when it is: encoding its requests first would delay that one)."""

STARTS_GROWTH: Final = 8
"""Each next chunk of starts resolved while the consumer runs is this many times the last: few
chunks (two for 1,000 streams, four for 100,000), each one incremental FETCH per node."""

FIRST_STARTS: Final = 256
"""Streams whose starts (and ranges) are resolved before a many-stream consumer subscribes. The
others are resolved while the first ones stream, in chunks growing STARTS_GROWTH-fold, each
joining its node's subscription (an incremental FETCH of its session) as it is resolved: for
1,000 streams the records start flowing after the PM's answers for 256 streams (~10 ms) instead
of the ~50 ms of all 1,000, and the PM's work on the rest overlaps the consumer's."""


IDLE_RANGE_RECHECK_S: Final = 5.0
"""A stream whose position has not moved for this long on a range planned writable is looked
up at the PM again. The replica it reads may have been cut from the PM while the PM sealed the
range on the others and opened its successor elsewhere: that replica never reports the end, so
only the PM can tell the reader to move on (issue 33, tests/test_fault_reads.py). Close to the
PM's default node timeout (6 s, the time the PM itself takes to seal a silent node's range);
one batched LIST_RANGES per consumer per period, and only while some stream is idle."""


class SubscriberHost(Protocol):
    """What a :class:`Subscriber` needs of its consumer."""

    client: ClientCore
    routing: RangeRouter
    stream_ids: tuple[int, ...]
    stream_id: int
    end: int | None
    max_wait_ms: int
    batch_max_bytes: int
    auto_reset: str | None
    high_watermark: int

    @property
    def buffered(self) -> int:
        """Records in the consumer's buffer, not yet taken by the application."""

    def push_batch(self, sid: int, buf: memoryview, feed: Feed) -> None:
        """Buffer the records of one batch of ``sid`` that ``feed`` received."""

    async def resolve_starts(self, sids: Sequence[int]) -> list[int]:
        """The offsets the consumer starts ``sids`` at."""

    async def range_for_stream(self, sid: int, pos: int) -> Range | None:
        """The range of ``sid`` holding ``pos`` (None: not created yet)."""


class Feed:
    """One subscription (or, against a node that refuses them, a long-poll loop) to one node
    for some of a consumer's streams. Counts payload bytes as the node does: batch_length."""

    def __init__(self, owner: Subscriber, addr: str,
                 ranges: dict[int, tuple[int, int]]) -> None:
        self.owner = owner
        self.addr = addr
        self.ranges = {sid: idx for sid, (idx, _) in ranges.items()}  # stream -> range index
        # the PM's end of the ranges already sealed when planned: a node that does not know it
        # yet never reports it, so the position reaching it ends the stream here as well
        self.ends = {sid: end for sid, (_, end) in ranges.items() if end >= 0}
        self.unacked = 0  # received, not yet acked (in the buffer or being acked)
        self.to_ack = 0  # taken by the application, not yet sent in a BUFFER_ACK
        self.conn: Connection | None = None
        self.request_id = -1
        self.long_poll = False
        # its fetch session (long polls): id (0 = none), the epoch of the next FETCH (0 = a
        # full one, making a session) and what the node's session holds per stream
        self.session_id = 0
        self.epoch = 0
        self.sent: dict[int, tuple[int, int, int]] = {}  # (offset, range index, batch bytes)
        # request_index of each stream's item: a subscription's session may be changed while it
        # streams (streams added, dropped, named again), and a result answers the item whose
        # request_index it carries, so results of a stream's earlier item are told apart
        self.indexes: dict[int, int] = {}
        self._next_index = 0
        self.closing = False  # takes no more streams (ending, or ended)
        self.opened = False  # a subscription's first frame came (its session is known then)
        self.update_lock = asyncio.Lock()  # a push session's changes go one at a time (epochs)
        self.room = asyncio.Event()
        self.room.set()
        self._acking: asyncio.Task[None] | None = None
        self._ack_timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def index(self, sid: int) -> int:
        """The request_index of ``sid``'s current item (a new one by :meth:`renumber`)."""
        i = self.indexes.get(sid)
        return self.renumber(sid) if i is None else i

    def renumber(self, sid: int) -> int:
        i = self.indexes[sid] = self._next_index
        self._next_index = (self._next_index + 1) & 0x7FFF_FFFF
        return i

    @property
    def opening(self) -> bool:
        """A subscription not answered yet: whether its node made it a session (so streams
        can join it) is not known yet."""
        return not self.long_poll and not self.closing and not self.opened

    @property
    def joinable(self) -> bool:
        """Streams can be added to it as it runs: a long-poll feed (its next round names them)
        or a subscription whose session the node made (an incremental FETCH adds them)."""
        return (not self.closing and self.conn is not None and not self.conn.closed
                and (self.long_poll or self.session_id != 0))

    def taken(self, nbytes: int) -> None:
        """The application took the records of ``nbytes`` payload bytes: ack (batched)."""
        self.to_ack += nbytes
        if self.long_poll:
            self.unacked -= self.to_ack
            self.to_ack = 0
            if self.unacked < self.owner.window // 2:
                self.room.set()
            return
        if self.to_ack >= self.owner.window // 2:
            self.flush_acks()
        elif not self.owner.consumer.buffered:
            self.idle()

    def idle(self) -> None:
        """The application took everything buffered: what it took goes back to the node at
        once when a quarter of the window or more is unacknowledged (the node may be waiting
        for room), else within ACK_DELAY_S (one BUFFER_ACK per delay, not one per record: at
        a few thousand records a second acks would otherwise double the messages)."""
        if self.to_ack <= 0:
            return
        if self.unacked >= self.owner.window // 4:
            self.flush_acks()
        elif self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_DELAY_S, self.flush_acks)

    def flush_acks(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        if self.to_ack > 0 and self._acking is None and self.conn is not None:
            self._acking = asyncio.ensure_future(self._send_acks())

    async def _send_acks(self) -> None:
        try:
            while self.to_ack > 0 and self.conn is not None and not self.conn.closed:
                n, self.to_ack = self.to_ack, 0
                self.unacked -= n
                f = await self.conn.request_one(
                    Opcode.BUFFER_ACK, BufferAckRequest(bytes_acked=n,
                                                        fetch_request_id=self.request_id).encode(),
                    timeout_s=self.owner.consumer.routing.request_timeout_ms / 1000)
                st = BufferAckResponse.decode(f.header).status
                if not st.ok:  # the subscription ended meanwhile: nothing to release
                    log.debug("event=ack_refused addr=%s error=%s", self.addr, st.message)
        except SbpError as exc:
            log.debug("event=ack_failed addr=%s error=%s", self.addr, exc)
        finally:
            self._acking = None

    def reset_session(self) -> None:
        """The next FETCH is a full one (it replaces the session, if the node still has it)."""
        self.epoch = 0
        self.sent = {}

    async def close_session(self) -> None:
        """Tell the node to drop the session (epoch -1); best effort (it also expires)."""
        conn, sid = self.conn, self.session_id
        self.session_id = 0
        self.reset_session()
        if conn is not None and not conn.closed and sid:
            req = FetchRequest(session_id=sid, session_epoch=-1)
            with contextlib.suppress(SbpError):
                await conn.request(req.OPCODE, req.encode(), timeout_s=5.0)

    async def cancel(self) -> None:
        if self.long_poll:
            await self.close_session()
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        conn, rid = self.conn, self.request_id
        if conn is not None and not conn.closed and rid >= 0 and not self.long_poll:
            with contextlib.suppress(SbpError):
                await conn.request_one(Opcode.BUFFER_ACK, BufferAckRequest(
                    fetch_request_id=rid, cancel=True).encode(), timeout_s=5.0)


class Subscriber:
    """The subscription side of a consumer (its :class:`SubscriberHost`): one feed per node
    holding the consumer's streams' current ranges, records pushed into the consumer's buffer as
    they arrive, acks sent as the application takes them, feeds re-planned on a seal, a trim, a
    node failure (another replica) or a refusal (long polls)."""

    def __init__(self, consumer: SubscriberHost, window: int, *, pull: bool = False) -> None:
        self.consumer = consumer
        self.window = window
        self.pull = pull  # long polls (in fetch sessions) at every node, no subscriptions
        self.positions: dict[int, int] = {}
        self.replica: dict[int, int] = {}
        #: stream -> (range index, offset) of the last range a node reported sealed and read
        #: to its end, until a later range is planned
        self.ended: dict[int, tuple[int, int]] = {}
        self.feeds: set[Feed] = set()
        self.waiting: list[int] = []
        self.replan = asyncio.Event()
        self.long_poll_addrs: set[str] = set()
        self.error: BaseException | None = None
        self.arrived = asyncio.Event()
        self.ready = asyncio.Event()  # a first frame (or an error) arrived
        self._task: asyncio.Task[None] | None = None
        self._changes: set[asyncio.Task[None]] = set()  # incremental FETCHes under way
        self._resolver: asyncio.Task[None] | None = None  # starts still being resolved
        #: a feed sent its first request (or failed): the resolver starts then, so encoding
        #: its PM requests does not hold back the first subscription
        self.sent = asyncio.Event()
        self._attempts: Attempts | None = None
        self.loop = asyncio.get_running_loop()  # created on it (by _start_subscriber)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
            self._spawn(self._recheck_idle())

    def resolve_later(self, sids: Sequence[int]) -> None:
        """Resolve the starts of ``sids`` while the subscriber runs, in chunks growing from
        FIRST_STARTS, and read each chunk from there as it is resolved (the streams the
        consumer still reads then). A failure ends the subscriber, as one of its feeds' would."""
        self._resolver = asyncio.ensure_future(self._resolve(list(sids)))

    def prefetch(self, sids: Sequence[int]) -> None:
        """Look up the ranges of ``sids`` in the background (a failure is the stream's own, met
        again when it is planned); :meth:`stop` cancels it."""
        routing = self.consumer.routing

        async def run() -> None:
            with contextlib.suppress(Exception):
                await routing.ranges_many(sids)

        self._spawn(run())

    async def _resolve(self, sids: list[int]) -> None:
        c = self.consumer
        size = FIRST_STARTS
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESOLVE_WAIT_S):
                    await self.sent.wait()
            i = 0
            while i < len(sids):
                size *= STARTS_GROWTH
                chunk = sids[i:i + size]
                i += len(chunk)
                starts = await c.resolve_starts(chunk)
                with contextlib.suppress(Exception):  # each stream's own error comes in _plan
                    # their ranges now, while the first streams are read: _plan then finds them
                    # cached instead of looking them up when a busy loop gets to it
                    await c.routing.ranges_many(chunk)
                wanted = set(c.stream_ids)
                self.add({sid: pos for sid, pos in zip(chunk, starts, strict=True)
                          if sid in wanted})
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """End the subscriber with ``exc``: the consumer delivers it to the application."""
        self.error = exc
        self.arrived.set()
        self.ready.set()

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the subscriber's loop (the sync consumer takes records on its caller's
        thread; acks are sent from the loop)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self.loop:
            fn(*args)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def idle(self) -> None:
        for f in self.feeds:
            f.idle()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if self._resolver is not None:
            self._resolver.cancel()
            self._resolver = None
        for t in list(self._changes):
            t.cancel()
        feeds = list(self.feeds)
        for f in feeds:
            await f.cancel()
        for f in feeds:
            if f.task is not None:
                f.task.cancel()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.feeds.clear()

    async def _recheck_idle(self) -> None:
        """Every IDLE_RANGE_RECHECK_S, ask the PM about the ranges of streams that did not
        move on a range planned writable; one the PM has sealed at (or below) the position is
        over: the stream leaves its feed and is planned on its next range."""
        routing = self.consumer.routing
        seen: dict[int, int] = {}
        while True:
            await asyncio.sleep(IDLE_RANGE_RECHECK_S)
            idle = [(feed, sid) for feed in list(self.feeds) if not feed.closing
                    for sid in list(feed.ranges)
                    if sid not in feed.ends and seen.get(sid) == self.positions.get(sid)]
            seen = {sid: pos for sid, pos in self.positions.items()}
            if not idle:
                continue
            try:
                found = await routing.ranges_many([sid for _, sid in idle], refresh=True)
            except (SbpError, OSError, TimeoutError) as exc:
                log.debug("event=idle_recheck_failed error=%s", exc)
                continue
            for (feed, sid), ranges in zip(idle, found, strict=True):
                idx, pos = feed.ranges.get(sid), self.positions.get(sid)
                rng = next((r for r in ranges if r.range_index == idx), None)
                if rng is None or pos is None or not rng.sealed:
                    continue
                if rng.end_offset > pos:  # it ends ahead: the position reaching it ends it here
                    feed.ends[sid] = rng.end_offset
                    continue
                log.info("event=range_ended_behind_replica stream_id=%d range_index=%d "
                         "offset=%d addr=%s", sid, rng.range_index, pos, feed.addr)
                self.replica.pop(sid, None)
                self.ended[sid] = (rng.range_index, pos)
                feed.ranges.pop(sid)
                if not feed.long_poll:
                    if not feed.ranges:
                        feed.closing = True
                        self._spawn(feed.cancel())  # the node ends the subscription
                    elif feed.session_id:
                        self._spawn(self._change(feed, {}, (sid,)))
                self.release(sid)

    def release(self, sid: int) -> None:
        """A feed gave ``sid`` back (range end, error, feed ended): plan it again."""
        self.waiting.append(sid)
        self.replan.set()

    async def _run(self) -> None:
        self.waiting = list(self.positions)
        try:
            while True:
                self.replan.clear()
                sids, self.waiting = self.waiting, []
                groups, later = await self._plan(sids)
                self.waiting += later
                for addr, ranges in groups.items():
                    ranges = {sid: r for sid, r in ranges.items() if sid in self.positions}
                    if not ranges:  # dropped meanwhile
                        continue
                    joined = next((f for f in self.feeds if f.addr == addr and f.joinable), None)
                    if joined is not None:  # one feed per node: its session takes them
                        self._join(joined, ranges)
                        continue
                    if any(f.addr == addr and f.opening for f in self.feeds):
                        self.waiting += ranges  # planned again once it answers (joinable)
                        continue
                    feed = Feed(self, addr, ranges)
                    feed.long_poll = self.pull or addr in self.long_poll_addrs
                    feed.task = asyncio.ensure_future(self._feed(feed))
                    self.feeds.add(feed)
                waits: list[asyncio.Future[Any]] = [
                    f.task for f in self.feeds if f.task is not None]
                replan: asyncio.Future[Any] = asyncio.ensure_future(self.replan.wait())
                try:
                    await asyncio.wait(
                        [*waits, replan], timeout=SEALED_RETRY_S if self.waiting else None,
                        return_when=asyncio.FIRST_COMPLETED)
                finally:
                    replan.cancel()
                for f in list(self.feeds):
                    if f.task is not None and f.task.done():
                        self.feeds.discard(f)
                        f.task.result()  # a fatal error ends the subscriber
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)
            log.debug("event=subscriber_failed streams=%s error=%r",
                      self.consumer.stream_ids, exc)

    def add(self, positions: Mapping[int, int]) -> None:
        """Read these streams too, from these positions (the consumer's stream set grew)."""
        for sid, pos in positions.items():
            if sid not in self.positions:
                self.positions[sid] = pos
                self.release(sid)

    def drop(self, sids: Iterable[int]) -> None:
        """Stop reading these streams: a feed holding one forgets it (an incremental FETCH of
        its session, or its next long poll's ``forgotten``); a feed left without streams ends."""
        gone = {sid for sid in sids if self.positions.pop(sid, None) is not None}
        if not gone:
            return
        self.waiting = [sid for sid in self.waiting if sid not in gone]
        for sid in gone:
            self.replica.pop(sid, None)
            self.ended.pop(sid, None)
        for feed in list(self.feeds):
            mine = [sid for sid in gone if sid in feed.ranges]
            if not mine:
                continue
            for sid in mine:
                feed.ranges.pop(sid)
                feed.ends.pop(sid, None)
            if feed.long_poll:
                continue  # the next round's request forgets them
            if not feed.ranges:
                feed.closing = True
                self._spawn(feed.cancel())
            elif feed.session_id:
                self._spawn(self._change(feed, {}, tuple(mine)))

    def _join(self, feed: Feed, ranges: dict[int, tuple[int, int]]) -> None:
        """Add streams to a running feed: named from the next round on (long polls), or at once
        by an incremental FETCH of the subscription's session."""
        for sid, (idx, end) in ranges.items():
            feed.ranges[sid] = idx
            if end >= 0:
                feed.ends[sid] = end
            feed.renumber(sid)  # results of an earlier item of the stream are not its
        if not feed.long_poll:
            self._spawn(self._change(feed, ranges, ()))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)

    async def _change(self, feed: Feed, added: Mapping[int, tuple[int, int]],
                      forgotten: tuple[int, ...]) -> None:
        """One incremental FETCH of a subscription's session. Refused (the session is gone or
        out of step: FETCH_SESSION_ID_NOT_FOUND, INVALID_FETCH_SESSION_EPOCH; a limit; a lost
        connection), it changed nothing: the added streams are planned again from the consumer's
        own positions, in a new full subscription, and the feed takes no more changes. So
        nothing is skipped or read twice: a result the node sends for a stream the feed does not
        hold under that request_index is dropped (and acked)."""
        async with feed.update_lock:
            mine = {sid: feed.ranges[sid] for sid in added if sid in feed.ranges}
            if feed.closing or feed.conn is None or not feed.session_id:
                self._give_back(feed, mine)
                return
            req = FetchRequest(
                session_id=feed.session_id, session_epoch=feed.epoch, forgotten=forgotten,
                items=tuple(self._item(feed, sid, idx) for sid, idx in mine.items()))
            try:
                frame = await feed.conn.request_one(
                    req.OPCODE, req.encode(),
                    timeout_s=self.consumer.routing.request_timeout_ms / 1000)
                FetchResponse.decode(frame.header).status.raise_for_error()
            except (SbpError, OSError) as exc:
                log.debug("event=subscription_change_refused addr=%s error=%s", feed.addr, exc)
                feed.session_id = 0  # no more changes: the next streams get a feed of their own
                self._give_back(feed, mine)
                return
            feed.epoch = 1 if feed.epoch >= 2**31 - 1 else feed.epoch + 1

    def _give_back(self, feed: Feed, ranges: Mapping[int, int]) -> None:
        for sid, idx in ranges.items():
            if feed.ranges.get(sid) == idx:
                feed.ranges.pop(sid)
                self.release(sid)

    async def _plan(self, sids: list[int],
                    ) -> tuple[dict[str, dict[int, tuple[int, int]]], list[int]]:
        groups: dict[str, dict[int, tuple[int, int]]] = {}
        later: list[int] = []
        # the streams not in the routing cache are looked up together first (one LIST_RANGES per
        # MAX_RANGE_LOOKUPS_PER_REQUEST), not one PM round trip per stream as the loop below
        # reaches them: 1,000 streams from an offset (no "earliest" lookup to fill the cache)
        # took 150 ms to their first record, 20 ms now
        with contextlib.suppress(Exception):  # each stream's own error is raised in the loop
            await self.consumer.routing.ranges_many(
                [sid for sid in sids if sid in self.positions])
        for sid in sids:
            pos = self.positions.get(sid)
            if pos is None:  # dropped
                continue
            if self.consumer.end is not None and pos >= self.consumer.end:
                continue
            rng = await self.consumer.range_for_stream(sid, pos)
            ended = self.ended.get(sid)
            if rng is not None and ended is not None and (
                    rng.range_index == ended[0] and not rng.sealed and pos >= ended[1]):
                # a node reported this range sealed at our position, but the PM still lists
                # it as writable (its metadata is written after the data nodes are sealed):
                # look again shortly rather than subscribe to an ended range over and over
                self.consumer.routing.invalidate(sid)
                rng = None
            if rng is None:
                later.append(sid)
                continue
            self.ended.pop(sid, None)
            addrs = replica_addresses(rng)
            if not addrs:
                raise OffsetOutOfRangeError(f"range {rng.range_index} of stream {sid} has no "
                                            "replicas")
            addr = addrs[self.replica.get(sid, 0) % len(addrs)]
            groups.setdefault(addr, {})[sid] = (rng.range_index, rng.end_offset)
        return groups, later

    def _answer_bound_s(self) -> float:
        """How long a node may stay silent before the feed tries another replica: one
        request's bound, never past the retry deadline (issue 33)."""
        routing = self.consumer.routing
        return min(routing.request_timeout_ms, routing.retry.deadline_ms) / 1000

    async def _feed(self, feed: Feed) -> None:
        """Run one feed until it has no streams left; gives back what it could not serve."""
        c = self.consumer
        try:
            # a silent node is left for another replica after _answer_bound_s
            with deadline_scope(time.monotonic() + self._answer_bound_s()):
                feed.conn = await c.routing.connection(feed.addr)
            while feed.ranges:
                if feed.long_poll:
                    await self._long_poll_round(feed)
                else:
                    await self._subscription(feed)
            feed.closing = True
            self._attempts = None
            if feed.session_id and feed.long_poll:
                await feed.close_session()
        except SbpError as exc:
            feed.closing = True
            if exc.code in SUBSCRIBE_FALLBACK_CODES and not feed.long_poll:
                log.info("event=subscribe_refused addr=%s code=%d: long polls instead",
                         feed.addr, exc.code)
                self.long_poll_addrs.add(feed.addr)
            else:
                if not exc.retriable:
                    raise
                log.debug("event=feed_retry addr=%s error=%s", feed.addr, exc)
                for sid in feed.ranges:
                    self.replica[sid] = self.replica.get(sid, 0) + 1
                    if exc.code in REFRESH_CODES:
                        c.routing.invalidate(sid)
                if self._attempts is None:
                    self._attempts = Attempts(c.routing.retry)
                await self._attempts.backoff(exc)
            for sid in list(feed.ranges):
                feed.ranges.pop(sid)
                self.release(sid)
        finally:
            feed.closing = True
            self.sent.set()  # (failed before its first request: the resolver need not wait)

    def _items(self, feed: Feed) -> tuple[FetchItem, ...]:
        return tuple(self._item(feed, sid, ri) for sid, ri in feed.ranges.items())

    def _item(self, feed: Feed, sid: int, ri: int) -> FetchItem:
        return FetchItem(stream_id=sid, request_index=feed.index(sid),
                         fetch_offset=self.positions[sid],
                         batch_max_bytes=self.consumer.batch_max_bytes, range_index=ri)

    async def _subscription(self, feed: Feed) -> None:
        assert feed.conn is not None
        # a session in push mode (epoch 0): streams can then be added and dropped as it runs
        req = FetchRequest(max_wait_ms=0, min_bytes=0, window_bytes=self.window,
                           items=self._items(feed), session_id=0, session_epoch=0)
        rs = await feed.conn.stream(req.OPCODE, req.encode(), timeout_s=None)
        self.sent.set()
        feed.request_id = rs.request_id
        feed.unacked = feed.to_ack = 0
        # the first frame (every stream's state) comes at once from a live node: a silent one
        # is left for another replica after _answer_bound_s (later frames may take any time)
        first = asyncio.timeout(self._answer_bound_s())
        try:
            async with rs, first:
                async for frame in rs:
                    first.reschedule(None)
                    self.consumer.routing.note_throttle(feed.addr, Opcode.FETCH, frame.header)
                    resp = FetchResponse.decode(frame.header)
                    resp.status.raise_for_error()
                    if feed.epoch == 0 and resp.session_id:  # its first frame names the session
                        feed.session_id, feed.epoch = resp.session_id, 1
                    if not feed.opened:
                        feed.opened = True
                        if self.waiting:  # streams held back for it can join it now
                            self.replan.set()
                    await self._take_frame(feed, resp, frame.payload, count=True)
                    if not feed.ranges:
                        feed.closing = True
                        await feed.cancel()
                        return
        except TimeoutError:
            if not first.expired():
                raise
            raise ClientTimeoutError(
                f"no answer to the subscription at {feed.addr} within "
                f"{self._answer_bound_s():.1f}s") from None
        if feed.ranges:  # ended (node closing): re-plan what is left, elsewhere if need be
            raise ShuttingDownError(f"subscription at {feed.addr} ended")

    def _session_request(self, feed: Feed) -> tuple[FetchRequest, dict[int, tuple[int, int,
                                                                                  int]]]:
        """The next long poll of ``feed``'s session: full (epoch 0, every stream) or
        incremental (the streams whose position, range or budget changed, and ``forgotten``);
        with what the node's session holds once it is answered."""
        c = self.consumer
        items = self._items(feed)
        state = {it.stream_id: (it.fetch_offset, it.range_index, it.batch_max_bytes)
                 for it in items}
        if feed.epoch == 0:
            return FetchRequest(max_wait_ms=c.max_wait_ms, min_bytes=1, items=items,
                                session_id=feed.session_id, session_epoch=0), state
        sent = feed.sent
        return FetchRequest(
            max_wait_ms=c.max_wait_ms, min_bytes=1, session_id=feed.session_id,
            session_epoch=feed.epoch,
            items=tuple(it for it in items if sent.get(it.stream_id) != state[it.stream_id]),
            forgotten=tuple(sid for sid in sent if sid not in state)), state

    async def _long_poll_round(self, feed: Feed) -> None:
        assert feed.conn is not None
        c = self.consumer
        await feed.room.wait()
        req, state = self._session_request(feed)
        timeout_s = (c.max_wait_ms + c.routing.request_timeout_ms
                     + FETCH_TIMEOUT_MARGIN_MS) / 1000
        session_id = 0
        try:
            rs = await feed.conn.stream(req.OPCODE, req.encode(), timeout_s=timeout_s)
            self.sent.set()
            async with rs:
                async for frame in rs:
                    c.routing.note_throttle(feed.addr, Opcode.FETCH, frame.header)
                    resp = FetchResponse.decode(frame.header)
                    resp.status.raise_for_error()
                    session_id = resp.session_id
                    await self._take_frame(feed, resp, frame.payload, count=True)
        except (FetchSessionIdNotFoundError, InvalidFetchSessionEpochError) as exc:
            log.debug("event=fetch_session_reset addr=%s error=%s", feed.addr, exc)
            feed.reset_session()  # the next round is full, from our positions
            return
        except BaseException:
            feed.reset_session()
            raise
        if feed.session_id != req.session_id or feed.epoch != req.session_epoch:
            return  # closed or reset meanwhile (close_session): the next FETCH is full
        if req.session_epoch == 0:
            feed.session_id = session_id
            feed.epoch = 1 if session_id else 0  # 0: no room on the node, full FETCHes
        else:
            feed.epoch = 1 if feed.epoch >= 2**31 - 1 else feed.epoch + 1
        feed.sent = state if feed.epoch else {}
        if feed.unacked >= self.window // 2:
            feed.room.clear()

    async def _take_frame(self, feed: Feed, resp: FetchResponse,
                          payload: bytes | bytearray | memoryview, *, count: bool) -> None:
        c = self.consumer
        push = not feed.long_poll
        for item, chunk in resp.chunks(payload):
            sid = item.stream_id
            if sid not in feed.ranges or (push and item.request_index != feed.indexes.get(sid)):
                # not ours any more, or an earlier item of the stream (sent before an update)
                if count and item.batch_length:
                    feed.unacked += item.batch_length
                    feed.taken(item.batch_length)  # not ours any more: release at once
                continue
            if not item.status.ok:
                err = item.status.error()
                if isinstance(err, OffsetTrimmedError) and c.auto_reset == "earliest":
                    self.positions[sid] = await c.client.start_offset(sid)
                    feed.ranges.pop(sid)
                    self.release(sid)
                    continue
                if isinstance(err, OffsetTrimmedError):
                    raise OffsetTrimmedError(
                        f"offset {self.positions.get(sid)} of stream {sid} was trimmed away "
                        f"(use auto_reset='earliest' to jump to the start)")
                if not err.retriable:
                    raise err
                c.routing.invalidate(sid)
                self.replica[sid] = self.replica.get(sid, 0) + 1
                feed.ranges.pop(sid)
                self.release(sid)
                continue
            if item.high_watermark >= 0 and sid == c.stream_id:
                c.high_watermark = item.high_watermark
            if item.batch_length:
                feed.unacked += item.batch_length
                c.push_batch(sid, chunk, feed)
            known_end = feed.ends.get(sid, -1)
            if item.range_end_offset >= 0 or 0 <= known_end <= self.positions[sid]:
                if known_end < 0:  # the cache may still hold the range as writable
                    c.routing.invalidate(sid)
                self.replica.pop(sid, None)  # the next range: its primary first
                self.positions[sid] = max(self.positions[sid], item.range_end_offset)
                self.ended[sid] = (feed.ranges[sid], self.positions[sid])
                feed.ranges.pop(sid)
                self.release(sid)
        self.arrived.set()
        self.ready.set()
