"""The consumer: reads streams from an offset, across their ranges and their replicas.

By default it **subscribes** (``_Subscriber``): one FETCH with a window per data node holding
the streams' current ranges; the node pushes records as they are committed, and the consumer
acks (BUFFER_ACK, payload bytes) as the application takes them. At a sealed range's end, on a
node failure or a refused stream it plans that stream again (the next range, another replica);
a node that refuses subscriptions (UNSUPPORTED_OPERATION, LIMIT_EXCEEDED) is long-polled with
one multi-stream FETCH per round instead. A multi-stream consumer with ``subscribe=False``
long-polls every node that way.

Each subscription is a **fetch session in push mode**: streams planned for a node whose
subscription runs join it by an incremental FETCH (a stream's next range there,
:meth:`AsyncConsumer.set_streams`, a group rebalance), and dropped streams are forgotten there, so
one subscription per node serves the consumer's changing stream set. A refused change (a session
error, a limit) changes nothing on the node; the streams it would have added get a full
subscription of their own, from the consumer's positions.

Those long polls run in a **fetch session** per feed (docs/protocol.md, "Fetch sessions"): the
first FETCH is full and makes the session, each next one names only the streams whose position or
range changed plus the ones dropped (``forgotten``), and the node answers only the streams with
records or a changed state. A session error (FETCH_SESSION_ID_NOT_FOUND,
INVALID_FETCH_SESSION_EPOCH) or any failed round starts a full session again from the consumer's
own positions, so nothing is skipped or read twice.

Without a subscription (``subscribe=False``, :meth:`AsyncConsumer.poll_columns`,
:meth:`AsyncConsumer.fetch_batches`) each round is one FETCH (long-polled with ``max_wait_ms``
at the end of the stream) to a replica of the range holding the position, the primary first,
another replica after an error. When a sealed range is read to its end the consumer moves to the
next range index. A fetch that starts inside a batch returns that whole batch; records before
the position are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from sbpstream.client.options import ConsumerOptions
from sbpstream.client.retry import REFRESH_CODES, Attempts
from sbpstream.client.routing import replica_addresses
from sbpstream.client.types import (
    ColumnBatch,
    ConsumedRecord,
    Range,
    RebalanceEvent,
)
from sbpstream.protocol.errors import (
    ErrorCode,
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    InvalidRequestError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeNotFoundError,
    SbpError,
    ShuttingDownError,
)
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    BufferAckRequest,
    BufferAckResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Columns, decode_columns, stream_records

if TYPE_CHECKING:
    from sbpstream.client.core import ClientCore
    from sbpstream.net.client import Connection

log = logging.getLogger("sbpstream.client.consumer")

FETCH_TIMEOUT_MARGIN_MS = 5000  # client-side wait for a frame beyond max_wait_ms

SUBSCRIBE_FALLBACK_CODES: frozenset[int] = frozenset(
    {ErrorCode.UNSUPPORTED_OPERATION, ErrorCode.LIMIT_EXCEEDED})
"""A node answering a subscribing FETCH with these is served by long polls instead."""

ACK_DELAY_S = 0.005
"""Longest an idle consumer holds back acks of less than a quarter of its window (see
:meth:`_Feed.idle`): delays only a batch larger than three quarters of the window."""

YIELD_EVERY_RECORDS = 512
"""Records an iterating application takes from the buffer before the consumer yields to the
event loop once. Without it a frame's records (~9,000 of 100 B) are handed out without the loop
running, so the sockets are not read meanwhile: the node's next frame waits in its socket buffer
for the application to run dry, and then for the node to be scheduled to send the rest (a few ms
per frame on a loaded machine). Yielding keeps the node's frames flowing while the application
works; a yield costs ~10 us, 0.02 us a record."""

SEALED_RETRY_S = 0.05
"""Wait before looking again for the range after a sealed one (the PM creates it shortly)."""

FIRST_STARTS = 256
"""Streams whose starts (and ranges) are resolved before a many-stream consumer subscribes. The
others are resolved while the first ones stream, in chunks growing STARTS_GROWTH-fold, each
joining its node's subscription (an incremental FETCH of its session) as it is resolved: for
1,000 streams the records start flowing after the PM's answers for 256 streams (~10 ms) instead
of the ~50 ms of all 1,000, and the PM's work on the rest overlaps the consumer's."""

RESOLVE_WAIT_S = 0.05
"""Longest the resolution of the other streams' starts waits for the first subscription to be
sent (it starts at once when it is: encoding its requests first would delay that one)."""

STARTS_GROWTH = 8
"""Each next chunk of starts resolved while the consumer runs is this many times the last: few
chunks (two for 1,000 streams, four for 100,000), each one incremental FETCH per node."""


class AsyncConsumer:
    """Async iterator of :class:`ConsumedRecord` of one or more streams, each in offset order
    (``record.stream_id`` says which; streams interleave as their records arrive).

    Without ``end`` the iteration never stops: at the end of the stream it long-polls for new
    records. With ``end`` it stops before that offset. :meth:`poll` and :meth:`poll_columns` are
    the non-blocking-ish forms (one fetch round, bounded by ``timeout_ms``). ``auto_reset =
    "earliest"`` makes a position whose records were trimmed jump to the stream's start instead
    of raising :class:`OffsetTrimmedError`. ``subscribe`` (the default) has the nodes push
    records under a ``window_bytes`` window; with ``subscribe=False`` every round is a long
    poll. ``end``, :meth:`poll_columns`, :meth:`fetch_batches` and :attr:`position` are for a
    single stream. Create with :meth:`AsyncClient.consumer`.
    """

    def __init__(self, client: ClientCore, streams: int | Sequence[int],
                 options: ConsumerOptions | None = None) -> None:
        o = ConsumerOptions() if options is None else options
        self.options = o
        start, end, window_bytes, auto_reset = o.start, o.end, o.window_bytes, o.auto_reset
        ids = (streams,) if isinstance(streams, int) else tuple(streams)
        if not ids or len(set(ids)) != len(ids):
            raise InvalidRequestError(f"bad streams {streams!r}: one or more distinct ids")
        if end is not None and len(ids) > 1:
            raise InvalidRequestError("end is for a single-stream consumer")
        if window_bytes <= 0:
            raise InvalidRequestError(f"bad window_bytes {window_bytes}: must be positive")
        stream_id = ids[0]
        if isinstance(start, int) and start < 0:
            raise InvalidRequestError(f"bad start offset {start}: offsets are >= 0")
        if not isinstance(start, int) and start not in ("earliest", "latest"):
            raise InvalidRequestError(
                f"bad start {start!r}: expected earliest, latest or an offset")
        if auto_reset not in (None, "earliest", "none"):
            raise InvalidRequestError(f"bad auto_reset {auto_reset!r}: expected earliest or none")
        self._client = client
        self._routing = client.routing
        self.stream_ids = ids
        self.stream_id = stream_id
        self.subscribe = o.subscribe
        self.window_bytes = window_bytes
        self._sub: _Subscriber | None = None
        self._marks: deque[tuple[int, _Feed, int]] = deque()  # (last record seq, feed, bytes)
        self._pushed = 0
        self._taken = 0
        self._start = start
        self.end = end
        self.max_wait_ms = o.max_wait_ms
        self.batch_max_bytes = o.batch_max_bytes
        self.auto_reset = auto_reset
        self._position: int | None = None
        self.high_watermark = -1
        self._buffer: deque[ConsumedRecord] = deque()
        self._streak = 0  # records handed out by __anext__ since it last yielded
        self._replica = 0
        self._replica_range = -1  # the range index self._replica was chosen for
        self._attempts: Attempts | None = None
        self._closed = False

    # --------------------------------------------------------------------------------- API

    @property
    def throttle_time_ms(self) -> int:
        """Quotas: total throttle_time_ms the data nodes asked of this consumer's client (it
        waits each one out before its next FETCH from that node)."""
        return self._routing.throttle.throttle_time_ms_total

    @property
    def position(self) -> int | None:
        """The offset of the next record to return (None until the start is resolved)."""
        if self._position is None:
            return None
        return self._buffer[0].offset if self._buffer else self._position

    @property
    def at_end(self) -> bool:
        """True when ``end`` was given and every record before it was returned."""
        pos = self.position
        return self.end is not None and pos is not None and pos >= self.end and not self._buffer

    @property
    def caught_up(self) -> bool:
        """True when the last fetch found nothing past the position (the stream's end)."""
        pos = self.position
        return pos is not None and 0 <= self.high_watermark <= pos and not self._buffer

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (iteration has ended)."""
        return self._closed

    @property
    def buffered(self) -> int:
        """Records fetched but not yet returned."""
        return len(self._buffer)

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> ConsumedRecord:
        buf = self._buffer
        if buf and self._streak < YIELD_EVERY_RECORDS:  # _take inlined: once per record
            self._streak += 1
            rec = buf.popleft()
            self._taken = taken = self._taken + 1
            marks = self._marks
            if buf and (not marks or marks[0][0] > taken):
                return rec  # nothing to ack yet, more buffered
            self._taken_up_to(taken)
            return rec
        await self._next_ready()
        self._streak += 1
        return self._take()

    async def _next_ready(self) -> None:
        """Until a record is buffered (or the end: StopAsyncIteration); yields to the loop
        once per YIELD_EVERY_RECORDS records handed out while subscribed."""
        if self._streak >= YIELD_EVERY_RECORDS:
            self._streak = 0
            if self._sub is not None:
                await asyncio.sleep(0)  # let the loop read the sockets: see YIELD_EVERY_RECORDS
        while not self._buffer:
            if self.at_end or self._closed:
                await self._stop_subscriber()
                raise StopAsyncIteration
            await self._fill(self.max_wait_ms)

    async def poll(self, max_records: int = 10_000, timeout_ms: int | None = None) -> list[
            ConsumedRecord]:
        """Up to ``max_records`` records: buffered ones, else one fetch waiting ``timeout_ms``.

        Returns an empty list when nothing arrived in time or ``end`` was reached.
        """
        if not self._buffer and not self.at_end and not self._closed:
            await self._fill(self.max_wait_ms if timeout_ms is None else timeout_ms)
        return self._take_many(max_records)

    async def poll_columns(self, timeout_ms: int | None = None) -> ColumnBatch:
        """One fetch round decoded as columns (the bulk path); may hold no records."""
        wait = self.max_wait_ms if timeout_ms is None else timeout_ms
        await self._stop_subscriber()
        start = await self._resolve_position()
        if self._buffer:
            recs = list(self._buffer)
            self._buffer.clear()
            cols = Columns()
            for r in recs:
                cols.offsets.append(r.offset)
                cols.timestamps.append(r.timestamp_ms)
                cols.keys.append(r.key)
                cols.values.append(r.value)
                cols.headers.append(r.headers)
            return ColumnBatch(self.stream_id, recs[0].offset, self._position_or(start),
                               self.high_watermark, cols)
        cols = Columns()
        if not self.at_end and not self._closed:
            bufs = await self._fetch(wait)
            start = self._position_or(start)  # _fetch may have moved it (auto_reset)
            for buf in bufs:
                got = decode_columns(buf, start_offset=self._position_or(start))
                if self.end is not None:
                    _truncate(got, self.end)
                if len(got):
                    _extend(cols, got)
                    self._position = got.offsets[-1] + 1
        return ColumnBatch(self.stream_id, start, self._position_or(start), self.high_watermark,
                           cols)

    async def fill(self, timeout_ms: int | None = None) -> int:
        """Fetch one round into the buffer unless records are buffered (or ``end`` was reached,
        or the consumer is closed), waiting up to ``timeout_ms``; return the records buffered.

        With :meth:`next_buffered` this is iteration in two steps: the sync consumer fetches on
        its loop thread and hands records out on the caller's thread without crossing over.
        """
        if not self._buffer and not self.at_end and not self._closed:
            await self._fill(self.max_wait_ms if timeout_ms is None else timeout_ms)
        return len(self._buffer)

    def next_buffered(self) -> ConsumedRecord | None:
        """The next buffered record, without fetching (None when the buffer is empty)."""
        return self._take() if self._buffer else None

    async def fetch_batches(self, timeout_ms: int = 0) -> list[memoryview]:
        """One FETCH round at the position, as the raw record batches that hold it (their
        headers carry producer ids and sequences); the position does not move: :meth:`seek`
        past them to go on. Errors are retried as for the records."""
        await self._stop_subscriber()
        return await self._fetch(timeout_ms)

    async def seek(self, offset: int) -> None:
        """Continue from ``offset``."""
        if offset < 0:
            raise InvalidRequestError(f"bad offset {offset}: offsets are >= 0")
        self._single("seek")
        await self._stop_subscriber()
        self._buffer.clear()
        self._position = offset

    async def close(self) -> None:
        """Stop (cancels the subscriptions); iteration ends."""
        self._closed = True
        await self._stop_subscriber()
        self._buffer.clear()

    async def set_streams(self, streams: int | Sequence[int]) -> None:
        """Read ``streams`` from now on (one id or a sequence of distinct ids), without starting
        over: the streams kept go on from where they are, the new ones start at the consumer's
        ``start``, and the dropped ones' buffered records are discarded. A running subscription
        is changed in place (an incremental FETCH of its session adds and forgets streams); a
        long-poll feed names the new streams in its next round and forgets the dropped ones."""
        ids = (streams,) if isinstance(streams, int) else tuple(streams)
        if not ids or len(set(ids)) != len(ids):
            raise InvalidRequestError(f"bad streams {streams!r}: one or more distinct ids")
        if self.end is not None and len(ids) > 1:
            raise InvalidRequestError("end is for a single-stream consumer")
        dropped = set(self.stream_ids) - set(ids)
        added = [sid for sid in ids if sid not in self.stream_ids]
        sub = self._sub
        self._discard(dropped)
        if sub is not None:
            sub.drop(dropped)
        self.stream_ids, self.stream_id = ids, ids[0]
        if sub is None:  # not reading yet: the next read starts with these
            if dropped:
                self._position = None
            return
        if added:
            starts = await self._resolve_starts(added)
            if self._sub is sub:
                sub.add(dict(zip(added, starts, strict=True)))
        self._position = sub.positions.get(self.stream_id)

    def _discard(self, dropped: set[int]) -> None:
        """Forget the buffered records of ``dropped`` streams. What the feeds sent and the
        application did not take is acked now (the acks count records taken in order)."""
        if not dropped or not any(r.stream_id in dropped for r in self._buffer):
            return
        sub = self._sub
        if sub is not None:
            for _, feed, nbytes in self._marks:
                sub.call(feed.taken, nbytes)
        self._marks.clear()
        self._pushed = self._taken = 0
        self._buffer = deque(r for r in self._buffer if r.stream_id not in dropped)

    # ------------------------------------------- consumer groups (overridden in client/groups.py)

    @property
    def group(self) -> str | None:
        """The consumer group (``group=`` of :meth:`AsyncClient.consumer`); None without one."""
        return None

    @property
    def assignment(self) -> tuple[int, ...]:
        """The streams read now: all of them without a group, the assigned ones with one."""
        return self.stream_ids

    async def commit(self, offsets: Mapping[int, int] | None = None) -> None:
        """Commit the group's offsets: by default, past every record handed out so far; or
        ``offsets`` (stream id -> next offset to read). A group consumer only."""
        raise InvalidRequestError("commit() needs a consumer with a group")

    async def committed(self) -> dict[int, int]:
        """The group's committed offsets of the assigned streams (stream id -> next offset to
        read; streams without one are absent). A group consumer only."""
        raise InvalidRequestError("committed() needs a consumer with a group")

    def rebalance_events(self) -> list[RebalanceEvent]:
        """The rebalance events since the last call, oldest first (always empty without a
        group)."""
        return []

    # ---------------------------------------------------------------------------- internals

    async def _fill_subscribed(self, wait_ms: int) -> None:
        sub = await self._start_subscriber()
        if self._buffer:
            return
        if sub.error is not None:
            err, sub.error = sub.error, None
            await self._stop_subscriber()
            raise err
        sub.arrived.clear()
        if not sub.ready.is_set():  # the first frames (every stream's state) come first
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._routing.request_timeout_ms / 1000):
                    await sub.ready.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(wait_ms, 0) / 1000):
                await sub.arrived.wait()
        if not self._buffer and sub.error is not None:
            err, sub.error = sub.error, None
            await self._stop_subscriber()
            raise err

    async def _resolve_starts(self, sids: Sequence[int]) -> list[int]:
        """Every stream's start position, in a few PM round trips (not one per stream): one
        DESCRIBE_STREAMS and one coalesced LIST_RANGES for "earliest", concurrent lookups
        (coalesced likewise) for "latest"."""
        if not sids:
            return []
        if isinstance(self._start, int):  # nothing to look up (a coroutine each cost ~18 us)
            return [self._start] * len(sids)
        if self._start == "earliest" and len(sids) > 1:
            described = asyncio.gather(
                *(self._client.describe_streams(sids[i:i + MAX_ITEMS_PER_REQUEST])
                  for i in range(0, len(sids), MAX_ITEMS_PER_REQUEST)))
            try:  # while the streams are being described
                ranges = await self._routing.ranges_many(sids, refresh=True)
            except BaseException:
                described.cancel()
                with contextlib.suppress(BaseException):
                    await described
                raise
            streams = [st for chunk in await described for st in chunk]
            return [max(st.start_offset, rs[0].start_offset if rs else 0)
                    for st, rs in zip(streams, ranges, strict=True)]
        return list(await asyncio.gather(*(self._resolve_start(sid) for sid in sids)))

    async def _resolve_start(self, sid: int) -> int:
        if self._start == "earliest":
            return await self._client.start_offset(sid)
        if self._start == "latest":
            return await self._client.end_offset(sid)
        assert isinstance(self._start, int)
        return self._start

    def _position_or(self, default: int) -> int:
        return default if self._position is None else self._position

    async def _resolve_position(self) -> int:
        if self._position is None:
            if self._start == "earliest":
                self._position = await self._client.start_offset(self.stream_id)
            elif self._start == "latest":
                self._position = await self._client.end_offset(self.stream_id)
            else:
                assert isinstance(self._start, int)
                self._position = self._start
        return self._position

    def _single(self, what: str) -> None:
        if len(self.stream_ids) > 1:
            raise InvalidRequestError(f"{what} is for a single-stream consumer")

    def _take(self) -> ConsumedRecord:
        """The next buffered record; acks what the application has now taken."""
        rec = self._buffer.popleft()
        self._taken = taken = self._taken + 1
        self._taken_up_to(taken)
        return rec

    def _take_many(self, limit: int) -> list[ConsumedRecord]:
        """Up to ``limit`` buffered records at once (the acks count records, so taking n in one
        step acks exactly what n single takes would); no per-record call when the whole buffer
        goes, which is the usual case of :meth:`poll`."""
        buf = self._buffer
        n = min(limit, len(buf))
        if n <= 0:
            return []
        if n == len(buf):
            out = list(buf)
            buf.clear()
        else:
            popleft = buf.popleft
            out = [popleft() for _ in range(n)]
        self._taken = taken = self._taken + n
        self._taken_up_to(taken)
        return out

    def _taken_up_to(self, taken: int) -> None:
        """The application took ``taken`` records: ack the batches it finished; when the buffer
        is empty, give every feed the chance to send its acks now."""
        marks = self._marks
        if marks and marks[0][0] <= taken:
            sub = self._sub
            while marks and marks[0][0] <= taken:
                _, feed, nbytes = marks.popleft()
                if sub is not None:
                    sub.call(feed.taken, nbytes)
        if not self._buffer:
            sub = self._sub
            if sub is not None:
                sub.call(sub.idle)  # about to wait: every feed may need its window back

    def _push_batch(self, sid: int, buf: memoryview, feed: _Feed) -> None:
        """Decode one batch a feed received into the buffer (records before the stream's
        position, or at/after ``end``, are skipped); its bytes are acked once taken."""
        assert self._sub is not None
        positions = self._sub.positions
        pos = positions[sid]
        end = self.end
        recs = cast(list[ConsumedRecord],
                    stream_records(buf, sid, ConsumedRecord, start_offset=pos))
        if end is not None and recs and recs[-1].offset >= end:
            recs = [r for r in recs if r.offset < end]
            pos = end
        elif recs:
            pos = recs[-1].offset + 1
        self._buffer.extend(recs)
        positions[sid] = pos
        if sid == self.stream_id:
            self._position = pos
        added = len(recs)
        if added:
            self._pushed += added
            self._marks.append((self._pushed, feed, len(buf)))
        else:
            feed.taken(len(buf))

    async def _start_subscriber(self) -> _Subscriber:
        """The subscriber, started once the first FIRST_STARTS streams' starts are known; the
        other streams' starts are resolved while it runs (:meth:`_Subscriber.resolve_later`),
        and each chunk joins its node's subscription as it comes."""
        if self._sub is None:
            sub = _Subscriber(self, self.window_bytes, pull=not self.subscribe)
            known = {self.stream_id: self._position} if self._position is not None else {}
            todo = [sid for sid in self.stream_ids if sid not in known]
            first, rest = todo[:FIRST_STARTS], todo[FIRST_STARTS:]
            starts = dict(zip(first, await self._resolve_starts(first), strict=True))
            for sid in (*known, *first):
                sub.positions[sid] = known[sid] if sid in known else starts[sid]
            self._position = sub.positions[self.stream_id]  # stream_ids[0]: known or first
            self._sub = sub
            sub.start()
            if rest:
                if isinstance(self._start, int):  # the ranges of the rest, asked for now (after
                    # the first streams', by _plan): in pipelined LIST_RANGES, while those read
                    sub.prefetch(rest)
                sub.resolve_later(rest)
        return self._sub

    async def _stop_subscriber(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        await sub.stop()
        self._marks.clear()
        self._pushed = self._taken = 0
        if self._buffer:  # the buffer stays; the position is its head
            self._position = self._buffer[0].offset
        else:
            self._position = sub.positions.get(self.stream_id)

    async def _fill(self, wait_ms: int) -> None:
        if self.subscribe or len(self.stream_ids) > 1 or self._sub is not None:  # feeds
            await self._fill_subscribed(wait_ms)
            return
        bufs = await self._fetch(wait_ms)
        pos = self._position_or(0)  # _fetch may have moved it (auto_reset)
        sid, end = self.stream_id, self.end
        for buf in bufs:
            # one bytes copy per batch; keys, values and headers are bytes slices of it
            recs = cast(list[ConsumedRecord],
                        stream_records(buf, sid, ConsumedRecord, start_offset=pos))
            if end is not None and recs and recs[-1].offset >= end:
                recs = [r for r in recs if r.offset < end]
            if recs:
                self._buffer.extend(recs)
                pos = recs[-1].offset + 1
        self._position = pos

    async def _fetch(self, wait_ms: int) -> list[memoryview]:
        """One FETCH round at the position: the payload slices holding our batches.

        Moves to the next range at a sealed range's end; retries RETRIABLE errors (another
        replica, fresh metadata) under the client's retry deadline.
        """
        pos = await self._resolve_position()
        while True:
            try:
                rng = await self._range_for(pos)
                if rng is None:  # between a seal and its new range: look again shortly
                    await asyncio.sleep(min(wait_ms, 50) / 1000)
                    return []
                chunks = await self._fetch_from(rng, pos, wait_ms)
                self._position = pos
                return chunks
            except SbpError as exc:
                await self._on_error(exc, pos)
                pos = self._position_or(pos)

    async def _on_error(self, exc: SbpError, pos: int) -> None:
        if isinstance(exc, OffsetTrimmedError) or exc.code == ErrorCode.OFFSET_TRIMMED:
            if self.auto_reset == "earliest":
                self._position = await self._client.start_offset(self.stream_id)
                return
            raise OffsetTrimmedError(
                f"offset {pos} of stream {self.stream_id} was trimmed away "
                f"(use auto_reset='earliest' to jump to the start)"
            )
        if not exc.retriable:
            raise exc
        if self._attempts is None:
            self._attempts = Attempts(self._routing.retry)
        log.debug("event=fetch_retry stream=%d offset=%d error=%s", self.stream_id, pos, exc)
        if exc.code in REFRESH_CODES:
            self._routing.invalidate(self.stream_id)
        self._replica += 1
        await self._attempts.backoff(exc)

    async def _range_for(self, pos: int) -> Range | None:
        return await self._range_for_stream(self.stream_id, pos)

    async def _range_for_stream(self, sid: int, pos: int) -> Range | None:
        """The range of ``sid`` holding ``pos``; None between a seal and the next range."""
        for refresh in (False, True):
            ranges = await self._routing.ranges(sid, refresh=refresh)
            if not ranges:
                continue
            if pos < ranges[0].start_offset:
                if self.auto_reset == "earliest" and self._sub is not None:
                    self._sub.positions[sid] = pos = ranges[0].start_offset
                else:
                    raise OffsetTrimmedError(
                        f"offset {pos} is before the stream's start {ranges[0].start_offset} "
                        f"(use auto_reset='earliest' to jump to the start)")
            for r in ranges:
                if r.start_offset <= pos and (not r.sealed or pos < r.end_offset):
                    return r
        # every range is sealed and pos is at (or past) the last end: nothing to read yet
        end = ranges[-1].end_offset if ranges else 0
        if pos > end:
            raise OffsetOutOfRangeError(
                f"offset {pos} is beyond the end {end} of stream {sid}")
        return None

    async def _fetch_from(self, rng: Range, pos: int, wait_ms: int) -> list[memoryview]:
        addrs = replica_addresses(rng)
        if not addrs:
            raise OffsetOutOfRangeError(f"range {rng.range_index} of stream {self.stream_id} "
                                        "has no replicas")
        if rng.range_index != self._replica_range:
            # a new range starts at its first replica (the primary of a writable range): the
            # replica a failure moved us to in the last range may be a follower of this one,
            # whose readable end lags the primary's until the next append reaches it
            self._replica_range = rng.range_index
            self._replica = 0
        # A writable range is read from its primary unless it just failed: a secondary learns
        # the committed offset one replication round late (when writes stop, from the primary's
        # commit round a moment later), so the primary is the fresher replica to read. Sealed
        # ranges and retries go round the replicas.
        primary_first = not rng.sealed and self._attempts is None
        addr = addrs[0] if primary_first else addrs[self._replica % len(addrs)]
        req = FetchRequest(
            max_wait_ms=wait_ms,
            min_bytes=1,
            items=(FetchItem(stream_id=self.stream_id, request_index=0, fetch_offset=pos,
                             batch_max_bytes=self.batch_max_bytes,
                             range_index=rng.range_index),),
        )
        timeout_s = (wait_ms + self._routing.request_timeout_ms + FETCH_TIMEOUT_MARGIN_MS) / 1000
        rs = await self._routing.stream(addr, req, timeout_s=timeout_s)
        chunks: list[memoryview] = []
        range_end = -1
        async with rs:
            async for frame in rs:
                resp = FetchResponse.decode(frame.header)
                resp.status.raise_for_error()
                for item, chunk in resp.chunks(frame.payload):
                    if item.stream_id != self.stream_id:
                        continue
                    if not item.status.ok:
                        if item.status.code == ErrorCode.OFFSET_OUT_OF_RANGE:
                            await self._check_out_of_range(pos, item.status.error())
                        raise item.status.error()
                    if item.high_watermark >= 0:
                        self.high_watermark = item.high_watermark
                    if item.range_end_offset >= 0:
                        range_end = item.range_end_offset
                    if len(chunk):
                        chunks.append(chunk)
        self._attempts = None
        if not chunks and (range_end >= 0 or rng.sealed):
            end = range_end if range_end >= 0 else rng.end_offset
            if pos >= end:
                if not rng.sealed:
                    self._routing.invalidate(self.stream_id)  # the PM sealed it meanwhile
                ranges = await self._routing.ranges(self.stream_id, refresh=not rng.sealed)
                if ranges and ranges[-1].range_index == rng.range_index and ranges[-1].sealed:
                    self._routing.invalidate(self.stream_id)  # the next range is not known yet
        return chunks

    async def _check_out_of_range(self, pos: int, err: SbpError) -> None:
        """OFFSET_OUT_OF_RANGE: below the start is a trim, past the end is the caller's error."""
        start = await self._client.start_offset(self.stream_id)
        if pos < start:
            raise OffsetTrimmedError(f"offset {pos} is before the stream's start {start} "
                                     f"(use auto_reset='earliest' to jump to the start)")
        end = await self._client.end_offset(self.stream_id)
        if pos > end:
            raise OffsetOutOfRangeError(
                f"offset {pos} is beyond the end {end} of stream {self.stream_id}")
        # the position is inside the stream: our range metadata was stale; refresh and retry
        self._routing.invalidate(self.stream_id)
        raise err if err.retriable else RangeNotFoundError(err.message)


def _truncate(cols: Columns, end: int) -> None:
    n = len(cols)
    while n and cols.offsets[n - 1] >= end:
        n -= 1
    for lst in (cols.offsets, cols.timestamps, cols.keys, cols.values, cols.headers):
        del lst[n:]


def _extend(dst: Columns, src: Columns) -> None:
    dst.offsets.extend(src.offsets)
    dst.timestamps.extend(src.timestamps)
    dst.keys.extend(src.keys)
    dst.values.extend(src.values)
    dst.headers.extend(src.headers)


def iter_columns(batch: ColumnBatch) -> Iterator[ConsumedRecord]:
    """The records of a :class:`ColumnBatch`, one by one."""
    c = batch.columns
    for i in range(len(c)):
        yield ConsumedRecord(batch.stream_id, c.offsets[i], c.timestamps[i], c.keys[i],
                             c.values[i], c.headers[i])


# ------------------------------------------------------------------------------ subscriptions

class _Feed:
    """One subscription (or, against a node that refuses them, a long-poll loop) to one node
    for some of a consumer's streams. Counts payload bytes as the node does: batch_length."""

    def __init__(self, owner: _Subscriber, addr: str,
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
                    timeout_s=self.owner.consumer._routing.request_timeout_ms / 1000)
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


class _Subscriber:
    """The subscription side of an :class:`AsyncConsumer`: one feed per node holding the
    consumer's streams' current ranges, records pushed into the consumer's buffer as they
    arrive, acks sent as the application takes them, feeds re-planned on a seal, a trim, a
    node failure (another replica) or a refusal (long polls)."""

    def __init__(self, consumer: AsyncConsumer, window: int, *, pull: bool = False) -> None:
        self.consumer = consumer
        self.window = window
        self.pull = pull  # long polls (in fetch sessions) at every node, no subscriptions
        self.positions: dict[int, int] = {}
        self.replica: dict[int, int] = {}
        #: stream -> (range index, offset) of the last range a node reported sealed and read
        #: to its end, until a later range is planned
        self.ended: dict[int, tuple[int, int]] = {}
        self.feeds: set[_Feed] = set()
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

    def resolve_later(self, sids: Sequence[int]) -> None:
        """Resolve the starts of ``sids`` while the subscriber runs, in chunks growing from
        FIRST_STARTS, and read each chunk from there as it is resolved (the streams the
        consumer still reads then). A failure ends the subscriber, as one of its feeds' would."""
        self._resolver = asyncio.ensure_future(self._resolve(list(sids)))

    def prefetch(self, sids: Sequence[int]) -> None:
        """Look up the ranges of ``sids`` in the background (a failure is the stream's own, met
        again when it is planned); :meth:`stop` cancels it."""
        routing = self.consumer._routing

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
                starts = await c._resolve_starts(chunk)
                with contextlib.suppress(Exception):  # each stream's own error comes in _plan
                    # their ranges now, while the first streams are read: _plan then finds them
                    # cached instead of looking them up when a busy loop gets to it
                    await c._routing.ranges_many(chunk)
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
                    feed = _Feed(self, addr, ranges)
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

    def _join(self, feed: _Feed, ranges: dict[int, tuple[int, int]]) -> None:
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

    async def _change(self, feed: _Feed, added: Mapping[int, tuple[int, int]],
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
                    timeout_s=self.consumer._routing.request_timeout_ms / 1000)
                FetchResponse.decode(frame.header).status.raise_for_error()
            except (SbpError, OSError) as exc:
                log.debug("event=subscription_change_refused addr=%s error=%s", feed.addr, exc)
                feed.session_id = 0  # no more changes: the next streams get a feed of their own
                self._give_back(feed, mine)
                return
            feed.epoch = 1 if feed.epoch >= 2**31 - 1 else feed.epoch + 1

    def _give_back(self, feed: _Feed, ranges: Mapping[int, int]) -> None:
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
            await self.consumer._routing.ranges_many(
                [sid for sid in sids if sid in self.positions])
        for sid in sids:
            pos = self.positions.get(sid)
            if pos is None:  # dropped
                continue
            if self.consumer.end is not None and pos >= self.consumer.end:
                continue
            rng = await self.consumer._range_for_stream(sid, pos)
            ended = self.ended.get(sid)
            if rng is not None and ended is not None and (
                    rng.range_index == ended[0] and not rng.sealed and pos >= ended[1]):
                # a node reported this range sealed at our position, but the PM still lists
                # it as writable (its metadata is written after the data nodes are sealed):
                # look again shortly rather than subscribe to an ended range over and over
                self.consumer._routing.invalidate(sid)
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

    async def _feed(self, feed: _Feed) -> None:
        """Run one feed until it has no streams left; gives back what it could not serve."""
        c = self.consumer
        try:
            feed.conn = await c._client.routing.connection(feed.addr)
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
                        c._routing.invalidate(sid)
                if self._attempts is None:
                    self._attempts = Attempts(c._routing.retry)
                await self._attempts.backoff(exc)
            for sid in list(feed.ranges):
                feed.ranges.pop(sid)
                self.release(sid)
        finally:
            feed.closing = True
            self.sent.set()  # (failed before its first request: the resolver need not wait)

    def _items(self, feed: _Feed) -> tuple[FetchItem, ...]:
        return tuple(self._item(feed, sid, ri) for sid, ri in feed.ranges.items())

    def _item(self, feed: _Feed, sid: int, ri: int) -> FetchItem:
        return FetchItem(stream_id=sid, request_index=feed.index(sid),
                         fetch_offset=self.positions[sid],
                         batch_max_bytes=self.consumer.batch_max_bytes, range_index=ri)

    async def _subscription(self, feed: _Feed) -> None:
        assert feed.conn is not None
        # a session in push mode (epoch 0): streams can then be added and dropped as it runs
        req = FetchRequest(max_wait_ms=0, min_bytes=0, window_bytes=self.window,
                           items=self._items(feed), session_id=0, session_epoch=0)
        rs = await feed.conn.stream(req.OPCODE, req.encode(), timeout_s=None)
        self.sent.set()
        feed.request_id = rs.request_id
        feed.unacked = feed.to_ack = 0
        async with rs:
            async for frame in rs:
                self.consumer._routing.note_throttle(feed.addr, Opcode.FETCH, frame.header)
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
        if feed.ranges:  # ended (node closing): re-plan what is left, elsewhere if need be
            raise ShuttingDownError(f"subscription at {feed.addr} ended")

    def _session_request(self, feed: _Feed) -> tuple[FetchRequest, dict[int, tuple[int, int,
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

    async def _long_poll_round(self, feed: _Feed) -> None:
        assert feed.conn is not None
        c = self.consumer
        await feed.room.wait()
        req, state = self._session_request(feed)
        timeout_s = (c.max_wait_ms + c._routing.request_timeout_ms
                     + FETCH_TIMEOUT_MARGIN_MS) / 1000
        session_id = 0
        try:
            rs = await feed.conn.stream(req.OPCODE, req.encode(), timeout_s=timeout_s)
            self.sent.set()
            async with rs:
                async for frame in rs:
                    c._routing.note_throttle(feed.addr, Opcode.FETCH, frame.header)
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

    async def _take_frame(self, feed: _Feed, resp: FetchResponse,
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
                    self.positions[sid] = await c._client.start_offset(sid)
                    feed.ranges.pop(sid)
                    self.release(sid)
                    continue
                if isinstance(err, OffsetTrimmedError):
                    raise OffsetTrimmedError(
                        f"offset {self.positions.get(sid)} of stream {sid} was trimmed away "
                        f"(use auto_reset='earliest' to jump to the start)")
                if not err.retriable:
                    raise err
                c._routing.invalidate(sid)
                self.replica[sid] = self.replica.get(sid, 0) + 1
                feed.ranges.pop(sid)
                self.release(sid)
                continue
            if item.high_watermark >= 0 and sid == c.stream_id:
                c.high_watermark = item.high_watermark
            if item.batch_length:
                feed.unacked += item.batch_length
                c._push_batch(sid, chunk, feed)
            known_end = feed.ends.get(sid, -1)
            if item.range_end_offset >= 0 or 0 <= known_end <= self.positions[sid]:
                if known_end < 0:  # the cache may still hold the range as writable
                    c._routing.invalidate(sid)
                self.replica.pop(sid, None)  # the next range: its primary first
                self.positions[sid] = max(self.positions[sid], item.range_end_offset)
                self.ended[sid] = (feed.ranges[sid], self.positions[sid])
                feed.ranges.pop(sid)
                self.release(sid)
        self.arrived.set()
        self.ready.set()
