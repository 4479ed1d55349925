"""The consumer: reads one stream from an offset, across its ranges and their replicas.

Each round is one FETCH (long-polled with ``max_wait_ms`` at the end of the stream) to a replica
of the range holding the position, the primary first, another replica after an error. When a
sealed range is read to its end the consumer moves to the next range index. A fetch that starts
inside a batch returns that whole batch; records before the position are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sbpstream.client.retry import REFRESH_CODES, Attempts
from sbpstream.client.routing import replica_addresses
from sbpstream.client.types import ColumnBatch, ConsumedRecord, Range, StartPosition
from sbpstream.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeNotFoundError,
    SbpError,
)
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse
from sbpstream.records import Columns, decode_columns, iter_all_records_bytes

if TYPE_CHECKING:
    from sbpstream.client.aclient import AsyncClient

log = logging.getLogger("sbpstream.client.consumer")

FETCH_TIMEOUT_MARGIN_MS = 5000  # client-side wait for a frame beyond max_wait_ms


class AsyncConsumer:
    """Async iterator of :class:`ConsumedRecord` of one stream, in offset order.

    Without ``end`` the iteration never stops: at the end of the stream it long-polls for new
    records. With ``end`` it stops before that offset. :meth:`poll` and :meth:`poll_columns` are
    the non-blocking-ish forms (one fetch round, bounded by ``timeout_ms``). ``auto_reset =
    "earliest"`` makes a position whose records were trimmed jump to the stream's start instead
    of raising :class:`OffsetTrimmedError`. Create with :meth:`AsyncClient.consumer`.
    """

    def __init__(
        self,
        client: AsyncClient,
        stream_id: int,
        start: StartPosition = "earliest",
        *,
        end: int | None = None,
        max_wait_ms: int = 500,
        batch_max_bytes: int = 1024 * 1024,
        auto_reset: str | None = None,
    ) -> None:
        if isinstance(start, int) and start < 0:
            raise InvalidRequestError(f"bad start offset {start}: offsets are >= 0")
        if not isinstance(start, int) and start not in ("earliest", "latest"):
            raise InvalidRequestError(
                f"bad start {start!r}: expected earliest, latest or an offset")
        if auto_reset not in (None, "earliest", "none"):
            raise InvalidRequestError(f"bad auto_reset {auto_reset!r}: expected earliest or none")
        self._client = client
        self._routing = client.routing
        self.stream_id = stream_id
        self._start = start
        self.end = end
        self.max_wait_ms = max_wait_ms
        self.batch_max_bytes = batch_max_bytes
        self.auto_reset = auto_reset
        self._position: int | None = None
        self.high_watermark = -1
        self._buffer: deque[ConsumedRecord] = deque()
        self._replica = 0
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
        while not self._buffer:
            if self.at_end or self._closed:
                raise StopAsyncIteration
            await self._fill(self.max_wait_ms)
        return self._buffer.popleft()

    async def poll(self, max_records: int = 10_000, timeout_ms: int | None = None) -> list[
            ConsumedRecord]:
        """Up to ``max_records`` records: buffered ones, else one fetch waiting ``timeout_ms``.

        Returns an empty list when nothing arrived in time or ``end`` was reached.
        """
        if not self._buffer and not self.at_end and not self._closed:
            await self._fill(self.max_wait_ms if timeout_ms is None else timeout_ms)
        n = min(max_records, len(self._buffer))
        return [self._buffer.popleft() for _ in range(n)]

    async def poll_columns(self, timeout_ms: int | None = None) -> ColumnBatch:
        """One fetch round decoded as columns (the bulk path); may hold no records."""
        wait = self.max_wait_ms if timeout_ms is None else timeout_ms
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
        return self._buffer.popleft() if self._buffer else None

    async def fetch_batches(self, timeout_ms: int = 0) -> list[memoryview]:
        """One FETCH round at the position, as the raw record batches that hold it (their
        headers carry producer ids and sequences); the position does not move: :meth:`seek`
        past them to go on. Errors are retried as for the records."""
        return await self._fetch(timeout_ms)

    async def seek(self, offset: int) -> None:
        """Continue from ``offset``."""
        if offset < 0:
            raise InvalidRequestError(f"bad offset {offset}: offsets are >= 0")
        self._buffer.clear()
        self._position = offset

    async def close(self) -> None:
        """Stop; iteration ends."""
        self._closed = True
        self._buffer.clear()

    # ---------------------------------------------------------------------------- internals

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

    async def _fill(self, wait_ms: int) -> None:
        bufs = await self._fetch(wait_ms)
        pos = self._position_or(0)  # _fetch may have moved it (auto_reset)
        sid, end = self.stream_id, self.end
        out = self._buffer
        for buf in bufs:
            # one bytes copy per batch; keys, values and headers are bytes slices of it
            for off, ts, key, value, hdrs in iter_all_records_bytes(buf, start_offset=pos):
                if end is not None and off >= end:
                    break
                out.append(ConsumedRecord(sid, off, ts, key, value, hdrs))
                pos = off + 1
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
        for refresh in (False, True):
            ranges = await self._routing.ranges(self.stream_id, refresh=refresh)
            if not ranges:
                continue
            if pos < ranges[0].start_offset:
                raise OffsetTrimmedError(f"offset {pos} is before the stream's start "
                                         f"{ranges[0].start_offset}")
            for r in ranges:
                if r.start_offset <= pos and (not r.sealed or pos < r.end_offset):
                    return r
        # every range is sealed and pos is at (or past) the last end: nothing to read yet
        end = ranges[-1].end_offset if ranges else 0
        if pos > end:
            raise OffsetOutOfRangeError(
                f"offset {pos} is beyond the end {end} of stream {self.stream_id}")
        return None

    async def _fetch_from(self, rng: Range, pos: int, wait_ms: int) -> list[memoryview]:
        addrs = replica_addresses(rng)
        if not addrs:
            raise OffsetOutOfRangeError(f"range {rng.range_index} of stream {self.stream_id} "
                                        "has no replicas")
        addr = addrs[self._replica % len(addrs)]
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
            raise OffsetTrimmedError(f"offset {pos} is before the stream's start {start}")
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
