"""The batching, idempotent producer (design.md sections 4 and 5).

Records are encoded on :meth:`AsyncProducer.send` into one open batch per stream. A single sender
task dispatches batches: per stream, one batch is in flight at a time (so a retry can never
reorder a stream), while the batches of all streams whose writable range has the same primary
travel together as the items of one APPEND frame. The open batch of a stream keeps filling while
its previous batch is in flight, so batches grow with load (up to ``batch_max_bytes``) and the
pipeline spans streams.

Idempotence: every batch carries ``producer_id``, ``producer_epoch`` and ``base_sequence``
(sequences count records, per stream). A resend keeps the batch bytes, so the data node
acknowledges a duplicate with the original offset. When the primary fails (RANGE_SEALED,
NOT_PRIMARY, connection loss, timeout...) the producer asks the PM to seal the range; the seal
result says, per producer, the highest sequence the sealed range holds. The in-flight batch is
then either known stored (its offset is the producer's ``last_base_offset``) or resent to the new
range: failover neither loses nor duplicates.

One exception: when the primary of a *single-replica* range is unreachable, a seal could not
learn the range's end from any replica (the PM would fall back to its last report), so the
producer first retries that primary for ``primary_retry_ms`` (a resend is deduplicated), and
seals only if it stays away or the PM sealed the range meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sbpstream.client.retry import MOVE_CODES, Attempts, is_connection_error
from sbpstream.client.types import Compression, Headers, Range, Record, codec_of
from sbpstream.protocol.errors import (
    ConnectionClosedError,
    ErrorCode,
    InvalidRequestError,
    ProducerClosedError,
    SbpError,
    UnknownServerError,
)
from sbpstream.protocol.messages import AppendItem, AppendRequest, AppendResponse, AppendResult
from sbpstream.records import BatchBuilder

if TYPE_CHECKING:
    from sbpstream.client.aclient import AsyncClient

log = logging.getLogger("sbpstream.client.producer")

RECORD_OVERHEAD_BYTES = 16  # varints and bookkeeping counted per record against the buffer
MAX_ITEMS_PER_APPEND = 1000  # batches per APPEND frame
MAX_APPEND_PAYLOAD_BYTES = 8 * 1024 * 1024  # payload per APPEND frame (frames stop at 16 MiB)
APPEND_TIMEOUT_MARGIN_MS = 2000  # client-side wait beyond the server's timeout_ms
SEQUENCE_WRAP = 1 << 31  # sequences are int32 and wrap, as the data node expects (Kafka's rule)


@dataclass(slots=True, eq=False)
class _Batch:
    stream_id: int
    data: bytes
    base_sequence: int
    record_count: int
    futures: list[asyncio.Future[int]]
    nbytes: int  # counted against buffer_max_bytes
    attempts: Attempts | None = None


@dataclass(slots=True, eq=False)
class _Stream:
    stream_id: int
    next_sequence: int = 0
    builder: BatchBuilder | None = None
    started: float = 0.0  # monotonic time of the open batch's first record
    futures: list[asyncio.Future[int]] = field(default_factory=list)
    pending_bytes: int = 0
    ready: deque[_Batch] = field(default_factory=deque)
    in_flight: _Batch | None = None
    resolving: bool = False


class AsyncProducer:
    """Batches records per stream and appends them, idempotently, to each range's primary.

    :meth:`send` returns a future per record that resolves to the record's offset (or raises its
    error); it awaits while ``buffer_max_bytes`` of records are unacknowledged. :meth:`flush`
    waits for everything sent so far; :meth:`close` flushes and stops. Create with
    :meth:`AsyncClient.producer`.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        linger_ms: float = 5.0,
        batch_max_bytes: int = 512 * 1024,
        buffer_max_bytes: int = 64 * 1024 * 1024,
        compression: Compression | None = None,
        producer_id: int | None = None,
        producer_epoch: int = 0,
        max_in_flight_per_node: int = 16,
        primary_retry_ms: int = 15_000,
    ) -> None:
        self._client = client
        self.primary_retry_ms = primary_retry_ms
        self.linger_s = linger_ms / 1000
        self.batch_max_bytes = batch_max_bytes
        self.buffer_max_bytes = max(buffer_max_bytes, batch_max_bytes)
        self._codec = codec_of(compression)
        self.producer_id = random.getrandbits(63) if producer_id is None else producer_id
        self.producer_epoch = producer_epoch
        self._max_in_flight_per_node = max_in_flight_per_node
        self._streams: dict[int, _Stream] = {}
        self._active: set[_Stream] = set()
        self._buffered = 0
        self._unacked_batches = 0
        self._space = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()
        self._flushing = 0
        self._closed = False
        self._node_slots: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sender: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --------------------------------------------------------------------------------- API

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records sent but not yet acknowledged."""
        return self._buffered

    async def send(
        self,
        stream_id: int,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Headers = (),
        timestamp_ms: int | None = None,
    ) -> asyncio.Future[int]:
        """Queue one record; return a future of its offset. Awaits while the buffer is full."""
        size = RECORD_OVERHEAD_BYTES + len(value or b"") + len(key or b"")
        if headers:
            size += sum(len(k) + len(v) for k, v in headers)
        if self._buffered + size > self.buffer_max_bytes:
            await self._wait_for_space(size)
        return self._add(stream_id, value, key, headers, timestamp_ms, size)

    async def send_many(
        self, stream_id: int, records: Sequence[bytes | Record]
    ) -> list[asyncio.Future[int]]:
        """Queue many records of one stream (values, or :class:`Record` objects); their futures."""
        out: list[asyncio.Future[int]] = []
        for r in records:
            if isinstance(r, Record):
                out.append(
                    await self.send(
                        stream_id, r.value, key=r.key, headers=r.headers,
                        timestamp_ms=r.timestamp_ms or None,
                    )
                )
            else:
                out.append(await self.send(stream_id, r))
        return out

    async def flush(self) -> None:
        """Send every queued record now and wait until each is acknowledged or failed."""
        self._flushing += 1
        try:
            self._wake.set()
            while self._unacked_batches or any(s.builder is not None for s in self._active):
                self._idle.clear()
                self._wake.set()
                await self._idle.wait()
        finally:
            self._flushing -= 1

    async def close(self) -> None:
        """Flush, then stop the sender. Idempotent."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        for t in list(self._tasks):
            t.cancel()

    # ----------------------------------------------------------------------------- queueing

    def _add(
        self,
        stream_id: int,
        value: bytes | None,
        key: bytes | None,
        headers: Headers,
        timestamp_ms: int | None,
        size: int,
    ) -> asyncio.Future[int]:
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._sender = loop.create_task(self._run_sender())
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = _Stream(stream_id)
        b = st.builder
        if b is None:
            b = self._open_builder(st)
        if not b.add(value, key, headers, timestamp_ms):
            self._close_builder(st)
            b = self._open_builder(st)
            b.add(value, key, headers, timestamp_ms)  # RecordTooLargeError if it never fits
        fut: asyncio.Future[int] = loop.create_future()
        st.futures.append(fut)
        st.pending_bytes += size
        self._buffered += size
        return fut

    def _open_builder(self, st: _Stream) -> BatchBuilder:
        b = st.builder = BatchBuilder(
            codec=self._codec,
            batch_bytes_max=self.batch_max_bytes,
            producer_id=self.producer_id,
            producer_epoch=self.producer_epoch,
            base_sequence=st.next_sequence,
        )
        st.started = time.monotonic()
        if st not in self._active:
            self._active.add(st)
        self._wake.set()
        return b

    def _close_builder(self, st: _Stream) -> None:
        b = st.builder
        assert b is not None
        st.builder = None
        if not len(b):
            return
        batch = _Batch(st.stream_id, b.build(), st.next_sequence, len(b), st.futures,
                       st.pending_bytes)
        st.next_sequence = (st.next_sequence + len(b)) % SEQUENCE_WRAP
        st.futures = []
        st.pending_bytes = 0
        st.ready.append(batch)
        self._unacked_batches += 1
        self._wake.set()

    async def _wait_for_space(self, size: int) -> None:
        while self._buffered and self._buffered + size > self.buffer_max_bytes:
            self._space.clear()
            self._wake.set()
            await self._space.wait()

    # ------------------------------------------------------------------------------ sending

    async def _run_sender(self) -> None:
        while True:
            self._wake.clear()
            try:
                delay = self._dispatch()
            except Exception as exc:  # a bug: fail what is queued rather than hang flush()
                log.exception("event=producer_dispatch_failed")
                for st in list(self._active):
                    if st.in_flight is None:
                        self._fail_stream(st, as_sbp_error(exc))
                delay = 0.1
            if delay is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()

    def _dispatch(self) -> float | None:
        """Close due batches, group one ready batch per idle stream by primary, send them.

        Returns the seconds until the next open batch is due (None: nothing is waiting).
        """
        now = time.monotonic()
        next_due: float | None = None
        groups: dict[str, list[tuple[_Stream, _Batch, Range]]] = {}
        for st in list(self._active):
            if st.in_flight is not None or st.resolving:
                continue
            if not st.ready:
                if st.builder is None:
                    self._active.discard(st)
                    continue
                due = st.started + self.linger_s
                if self._flushing or now >= due or self._buffered >= self.buffer_max_bytes:
                    self._close_builder(st)
                else:
                    next_due = due if next_due is None else min(next_due, due)
                    continue
            rng = self._writable(st.stream_id)
            addr = _primary(rng) if rng is not None else None
            if rng is None or addr is None:
                st.resolving = True
                self._spawn(self._resolve(st))
                continue
            batch = st.ready.popleft()
            st.in_flight = batch
            groups.setdefault(addr, []).append((st, batch, rng))
        for addr, entries in groups.items():
            chunk: list[tuple[_Stream, _Batch, Range]] = []
            size = 0
            for e in entries:
                if chunk and (
                    len(chunk) >= MAX_ITEMS_PER_APPEND
                    or size + len(e[1].data) > MAX_APPEND_PAYLOAD_BYTES
                ):
                    self._spawn(self._send_group(addr, chunk))
                    chunk, size = [], 0
                chunk.append(e)
                size += len(e[1].data)
            self._spawn(self._send_group(addr, chunk))
        if next_due is None:
            return None
        return max(0.0, next_due - now)

    def _writable(self, stream_id: int) -> Range | None:
        ranges = self._client._ranges.get(stream_id)
        if ranges and not ranges[-1].sealed:
            return ranges[-1]
        return None

    def _spawn(self, coro: object) -> None:
        assert asyncio.iscoroutine(coro)
        t: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _resolve(self, st: _Stream) -> None:
        """Find the stream's writable range (from the PM; sealing a dead end if need be)."""
        st.resolving = True
        attempts = Attempts(self._client.retry)
        try:
            while True:
                try:
                    ranges = await self._client._ranges_of(st.stream_id, refresh=True)
                    if ranges and ranges[-1].sealed:
                        await self._client._seal_range(st.stream_id, ranges[-1].range_index)
                    elif not ranges:
                        raise InvalidRequestError(f"stream {st.stream_id} has no ranges")
                    if self._writable(st.stream_id) is not None:
                        return
                    await attempts.backoff(InvalidRequestError(
                        f"stream {st.stream_id} has no writable range"))
                except SbpError as exc:
                    if not exc.retriable:
                        raise
                    await attempts.backoff(exc)
        except Exception as exc:
            self._fail_stream(st, as_sbp_error(exc))
        finally:
            st.resolving = False
            self._wake.set()

    async def _send_group(self, addr: str, entries: list[tuple[_Stream, _Batch, Range]]) -> None:
        slots = self._node_slots.setdefault(addr, asyncio.Semaphore(self._max_in_flight_per_node))
        timeout_ms = self._client.request_timeout_ms
        req = AppendRequest(
            timeout_ms=timeout_ms,
            items=tuple(
                AppendItem(stream_id=b.stream_id, request_index=i, batch_length=len(b.data),
                           range_index=r.range_index)
                for i, (_, b, r) in enumerate(entries)
            ),
        )
        results: dict[int, AppendResult] = {}
        error: SbpError | None = None
        async with slots:
            try:
                # the data node answers items as they complete, over one or more frames
                frames = await self._client._dn_request_all(
                    addr, req, [b.data for _, b, _ in entries],
                    timeout_ms=timeout_ms + APPEND_TIMEOUT_MARGIN_MS,
                )
                for frame in frames:
                    resp = AppendResponse.decode(frame.header)
                    if not resp.status.ok:
                        error = resp.status.error()
                    results.update((r.request_index, r) for r in resp.items)
            except Exception as exc:
                error = as_sbp_error(exc)
        for i, (st, batch, rng) in enumerate(entries):
            res = results.get(i)
            if error is None and res is None:
                err: SbpError | None = ConnectionClosedError(f"{addr} did not answer item {i}")
            elif error is not None:
                err = error
            else:
                assert res is not None
                err = None if res.status.ok else res.status.error()
            if err is None:
                assert res is not None
                self._acked(st, batch, res.base_offset)
            else:
                self._spawn(self._recover(st, batch, rng, err))

    def _acked(self, st: _Stream, batch: _Batch, base_offset: int) -> None:
        for i, f in enumerate(batch.futures):
            if not f.done():
                f.set_result(base_offset + i)
        st.in_flight = None
        self._done(batch)

    def _done(self, batch: _Batch) -> None:
        self._buffered -= batch.nbytes
        self._unacked_batches -= 1
        self._space.set()
        if not self._unacked_batches:
            self._idle.set()
        self._wake.set()

    async def _recover(self, st: _Stream, batch: _Batch, rng: Range, err: SbpError) -> None:
        """After a failed append: seal and move on, refresh, or back off; then resend or fail."""
        if batch.attempts is None:
            batch.attempts = Attempts(self._client.retry)
        try:
            log.debug("event=append_retry stream=%d range=%d seq=%d error=%s",
                      st.stream_id, rng.range_index, batch.base_sequence, err)
            if err.code in MOVE_CODES and self._wait_for_primary(batch, rng, err):
                # The only replica is unreachable: a seal now could not learn the range's end
                # from any replica, so give the primary time to come back (a retry is deduped).
                await batch.attempts.backoff(err)
                if not await self._still_writable(st.stream_id, rng):
                    offset = await self._seal_and_check(st, batch, rng)
                    if offset is not None:
                        self._acked(st, batch, offset)
                        return
            elif err.code in MOVE_CODES:
                offset = await self._seal_and_check(st, batch, rng)
                if offset is not None:
                    self._acked(st, batch, offset)
                    return
            elif err.code == ErrorCode.RANGE_NOT_FOUND:
                await batch.attempts.backoff(err)
                await self._client._ranges_of(st.stream_id, refresh=True)
            elif err.retriable:
                await batch.attempts.backoff(err)
            else:
                raise err
            if batch.attempts.remaining_s <= 0:
                raise err
            st.ready.appendleft(batch)
            st.in_flight = None
            self._wake.set()
        except Exception as exc:
            st.in_flight = None
            self._fail_batch(st, batch, as_sbp_error(exc))

    def _wait_for_primary(self, batch: _Batch, rng: Range, err: SbpError) -> bool:
        assert batch.attempts is not None
        return (
            is_connection_error(err)
            and len(rng.replica_nodes) <= 1
            and batch.attempts.elapsed_s * 1000 < self.primary_retry_ms
        )

    async def _still_writable(self, stream_id: int, rng: Range) -> bool:
        """True when the PM still lists ``rng`` as the stream's writable range."""
        ranges = await self._client._ranges_of(stream_id, refresh=True)
        cur = next((r for r in ranges if r.range_index == rng.range_index), None)
        return cur is not None and not cur.sealed

    async def _seal_and_check(self, st: _Stream, batch: _Batch, rng: Range) -> int | None:
        """Seal the range written to; the batch's offset if the sealed range holds it."""
        assert batch.attempts is not None
        while True:
            try:
                res = await self._client._seal_range(st.stream_id, rng.range_index)
                break
            except SbpError as exc:
                if not exc.retriable:
                    raise
                await batch.attempts.backoff(exc)
        for p in res.producers:
            last = (batch.base_sequence + batch.record_count - 1) % SEQUENCE_WRAP
            if p.producer_id == self.producer_id and p.last_sequence == last:
                # One batch per stream is in flight, so the sealed range's last batch of this
                # producer is this one: it was stored at last_base_offset.
                return p.last_base_offset
        return None

    def _fail_batch(self, st: _Stream, batch: _Batch, exc: SbpError) -> None:
        """A batch failed for good: fail it and everything queued after it on its stream.

        The later batches carry sequences that would now leave a gap; they fail too, and the
        stream's sequence restarts at the failed batch's, so the next records can still go.
        """
        log.warning("event=append_failed stream=%d error=%s", st.stream_id, exc)
        self._fail_futures(batch, exc)
        self._done(batch)
        while st.ready:
            b = st.ready.popleft()
            self._fail_futures(b, exc)
            self._done(b)
        if st.builder is not None:
            for f in st.futures:
                if not f.done():
                    f.set_exception(exc)
            self._buffered -= st.pending_bytes
            st.futures, st.pending_bytes, st.builder = [], 0, None
            self._space.set()
        st.next_sequence = batch.base_sequence
        if not self._unacked_batches:
            self._idle.set()

    def _fail_stream(self, st: _Stream, exc: SbpError) -> None:
        if st.ready:
            first = st.ready.popleft()
            self._fail_batch(st, first, exc)
        elif st.builder is not None:
            self._close_builder(st)
            self._fail_stream(st, exc)

    @staticmethod
    def _fail_futures(batch: _Batch, exc: SbpError) -> None:
        for f in batch.futures:
            if not f.done():
                f.set_exception(exc)


def as_sbp_error(exc: BaseException) -> SbpError:
    """``exc`` itself when it is an SbpError, else a FATAL UnknownServerError wrapping it."""
    if isinstance(exc, SbpError):
        return exc
    return UnknownServerError(f"producer failure: {exc!r}")


def _primary(rng: Range) -> str | None:
    for rep in rng.replica_nodes:
        if rep.is_primary and rep.data_node.advertise_addr:
            return rep.data_node.advertise_addr
    return None
