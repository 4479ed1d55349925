"""The pull reader of a consumer: :class:`StreamReader` reads a set of streams (iteration,
poll, seek, the buffer, positions), pushed by a subscription per data node
(:mod:`sbpstream.client.push`) or, for one stream without one, long-polled FETCH by FETCH.
:class:`~sbpstream.client.consumer.AsyncConsumer` is the application's facade over it (or over a
group member, :mod:`sbpstream.client.groups`, which holds one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

from sbpstream.client.options import ConsumerOptions
from sbpstream.client.push import FETCH_TIMEOUT_MARGIN_MS, FIRST_STARTS, Feed, Subscriber
from sbpstream.client.retry import REFRESH_CODES, Attempts
from sbpstream.client.routing import replica_addresses
from sbpstream.client.types import (
    ColumnBatch,
    ConsumedRecord,
    Range,
)
from sbpstream.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeNotFoundError,
    SbpError,
)
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.records import Columns, decode_columns, stream_records

if TYPE_CHECKING:
    from sbpstream.client.core import ClientCore

log = logging.getLogger("sbpstream.client.pull")

YIELD_EVERY_RECORDS = 512
"""Records an iterating application takes from the buffer before the consumer yields to the
event loop once. Without it a frame's records (~9,000 of 100 B) are handed out without the loop
running, so the sockets are not read meanwhile: the node's next frame waits in its socket buffer
for the application to run dry, and then for the node to be scheduled to send the rest (a few ms
per frame on a loaded machine). Yielding keeps the node's frames flowing while the application
works; a yield costs ~10 us, 0.02 us a record."""


class StreamReader:
    """The plain reader of a fixed set of streams behind an :class:`AsyncConsumer` without a
    group (and of a group member's assigned streams, client/groups.py): the buffer, positions,
    fetch rounds and the subscription; it is the :class:`~sbpstream.client.push.SubscriberHost`.
    Its public methods are the consumer's, documented on :class:`AsyncConsumer`.
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
        #: The client (its stream metadata); the subscriber's host needs it too.
        self.client = client
        #: The client's range cache and data-node requests.
        self.routing = client.routing
        self.stream_ids = ids
        self.stream_id = stream_id
        self.subscribe = o.subscribe
        self.window_bytes = window_bytes
        self._sub: Subscriber | None = None
        self._marks: deque[tuple[int, Feed, int]] = deque()  # (last record seq, feed, bytes)
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
        return self.routing.throttle.throttle_time_ms_total

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

    def __aiter__(self) -> StreamReader:
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
            starts = await self.resolve_starts(added)
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
            # one request's bound, never past the retry deadline (issue 33)
            bound_ms = min(self.routing.request_timeout_ms, self.routing.retry.deadline_ms)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(bound_ms / 1000):
                    await sub.ready.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(wait_ms, 0) / 1000):
                await sub.arrived.wait()
        if not self._buffer and sub.error is not None:
            err, sub.error = sub.error, None
            await self._stop_subscriber()
            raise err

    async def resolve_starts(self, sids: Sequence[int]) -> list[int]:
        """Every stream's start position, in a few PM round trips (not one per stream): one
        DESCRIBE_STREAMS and one coalesced LIST_RANGES for "earliest", concurrent lookups
        (coalesced likewise) for "latest"."""
        if not sids:
            return []
        if isinstance(self._start, int):  # nothing to look up (a coroutine each cost ~18 us)
            return [self._start] * len(sids)
        if self._start == "earliest" and len(sids) > 1:
            described = asyncio.gather(
                *(self.client.describe_streams(sids[i:i + MAX_ITEMS_PER_REQUEST])
                  for i in range(0, len(sids), MAX_ITEMS_PER_REQUEST)))
            try:  # while the streams are being described
                ranges = await self.routing.ranges_many(sids, refresh=True)
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
            return await self.client.start_offset(sid)
        if self._start == "latest":
            return await self.client.end_offset(sid)
        assert isinstance(self._start, int)
        return self._start

    def _position_or(self, default: int) -> int:
        return default if self._position is None else self._position

    async def _resolve_position(self) -> int:
        if self._position is None:  # through the hook, so a group's reader starts at its offset
            (self._position,) = await self.resolve_starts([self.stream_id])
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

    def push_batch(self, sid: int, buf: memoryview, feed: Feed) -> None:
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

    async def _start_subscriber(self) -> Subscriber:
        """The subscriber, started once the first FIRST_STARTS streams' starts are known; the
        other streams' starts are resolved while it runs (:meth:`Subscriber.resolve_later`),
        and each chunk joins its node's subscription as it comes."""
        if self._sub is None:
            sub = Subscriber(self, self.window_bytes, pull=not self.subscribe)
            known = {self.stream_id: self._position} if self._position is not None else {}
            todo = [sid for sid in self.stream_ids if sid not in known]
            first, rest = todo[:FIRST_STARTS], todo[FIRST_STARTS:]
            starts = dict(zip(first, await self.resolve_starts(first), strict=True))
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
                self._position = await self.client.start_offset(self.stream_id)
                return
            raise OffsetTrimmedError(
                f"offset {pos} of stream {self.stream_id} was trimmed away "
                f"(use auto_reset='earliest' to jump to the start)"
            )
        if not exc.retriable:
            raise exc
        if self._attempts is None:
            self._attempts = Attempts(self.routing.retry)
        log.debug("event=fetch_retry stream=%d offset=%d error=%s", self.stream_id, pos, exc)
        if exc.code in REFRESH_CODES:
            self.routing.invalidate(self.stream_id)
        self._replica += 1
        await self._attempts.backoff(exc)

    async def _range_for(self, pos: int) -> Range | None:
        return await self.range_for_stream(self.stream_id, pos)

    async def range_for_stream(self, sid: int, pos: int) -> Range | None:
        """The range of ``sid`` holding ``pos``; None between a seal and the next range."""
        for refresh in (False, True):
            ranges = await self.routing.ranges(sid, refresh=refresh)
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
        timeout_s = (wait_ms + self.routing.request_timeout_ms + FETCH_TIMEOUT_MARGIN_MS) / 1000
        rs = await self.routing.stream(addr, req, timeout_s=timeout_s)
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
                    self.routing.invalidate(self.stream_id)  # the PM sealed it meanwhile
                ranges = await self.routing.ranges(self.stream_id, refresh=not rng.sealed)
                if ranges and ranges[-1].range_index == rng.range_index and ranges[-1].sealed:
                    self.routing.invalidate(self.stream_id)  # the next range is not known yet
        return chunks

    async def _check_out_of_range(self, pos: int, err: SbpError) -> None:
        """OFFSET_OUT_OF_RANGE: below the start is a trim, past the end is the caller's error."""
        start = await self.client.start_offset(self.stream_id)
        if pos < start:
            raise OffsetTrimmedError(f"offset {pos} is before the stream's start {start} "
                                     f"(use auto_reset='earliest' to jump to the start)")
        end = await self.client.end_offset(self.stream_id)
        if pos > end:
            raise OffsetOutOfRangeError(
                f"offset {pos} is beyond the end {end} of stream {self.stream_id}")
        # the position is inside the stream: our range metadata was stale; refresh and retry
        self.routing.invalidate(self.stream_id)
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

