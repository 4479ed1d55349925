"""The batching, idempotent producer (design.md sections 4 and 5).

Records are encoded on :meth:`AsyncProducer.send` into one open batch per stream. A single sender
task dispatches batches: per stream, up to ``max_in_flight_per_stream`` batches (default 4, at
most 5: the data node's deduplication window) are in flight at once, so the group-commit fsync of
one overlaps the transfer of the next; the batches of all streams whose writable range has the
same primary travel together as the items of one APPEND frame. The APPENDs to a data node are
written to its connection in the order they were dispatched (each waits for the one before it to
be written, whatever either waited for first: a slot, a throttle, the connection, a paused
socket); a connection delivers requests in order and the data node applies them in order, and the
sequence check (OUT_OF_ORDER_SEQUENCE) refuses a gap, so a stream is never reordered. A range takes
the first batch of a producer whatever its sequence (after a seal a range starts mid-sequence), so
until a range has acknowledged a batch of the stream, its batches go to it one at a time.

Idempotence: every batch carries ``producer_id``, ``producer_epoch`` and ``base_sequence``
(sequences count records, per stream). A resend keeps the batch bytes, so the data node
acknowledges a duplicate with the original offset. When a send fails, nothing more goes on that
stream until every batch in flight has settled; then the failed ones are recovered in sequence
order. When the primary fails (RANGE_SEALED, NOT_PRIMARY, REPLICA_UNAVAILABLE, connection loss,
timeout...) the producer asks the PM to seal the range; the seal result says, per producer, the
highest sequence the sealed range holds. Failed batches at or below it are stored: their offsets
come from the seal result (the last one) or from reading the sealed range back (the others),
from a replica that holds it through its end (tried in turn, until the deadline); the rest,
and a batch a full read-back does not find (the seal cut it), are resent to the new range. A
send fails only for a FATAL error or when the deadline is exhausted (its sequences are then
never reused). Failover neither loses nor duplicates. One exception: when the primary of a
*single-replica* range is unreachable, no replica can report the range's end (the PM refuses to
seal it then), so the producer retries that primary for ``primary_retry_ms`` (a resend is
deduplicated) before asking for a seal again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from sbpstream.client.batches import (
    Batch,
    Offsets,
    Piece,
    StreamState,
    Waiter,
    as_sbp_error,
    fail_waiters,
    locate,
    seq_le,
    whole_sizes,
)
from sbpstream.client.flow import Flow, FlowEvent, ProducerFlowError
from sbpstream.client.options import ProducerOptions
from sbpstream.client.retry import (
    MOVE_CODES,
    Attempts,
    clip_timeout,
    deadline_after,
    deadline_scope,
    is_connection_error,
    remaining_s,
)
from sbpstream.client.routing import primary_address
from sbpstream.client.types import Headers, Range, Record, codec_of
from sbpstream.protocol.errors import (
    ClientTimeoutError,
    ConnectionClosedError,
    ErrorCode,
    InvalidRequestError,
    NoPmReachableError,
    ProducerClosedError,
    SbpError,
)
from sbpstream.protocol.limits import SEQUENCE_WRAP
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    AppendResult,
    ProducerState,
)
from sbpstream.records import (
    MAX_BATCH_BYTES,
    BatchBuilder,
    EncodedRecords,
    RecordTooLargeError,
)

if TYPE_CHECKING:
    from sbpstream.client.core import ClientCore

__all__ = ["AsyncProducer", "Offsets", "as_sbp_error"]

log = logging.getLogger("sbpstream.client.producer")

RECORD_OVERHEAD_BYTES = 16  # varints and bookkeeping counted per record against the buffer
MAX_ITEMS_PER_APPEND = 1000  # batches per APPEND frame
MAX_APPEND_PAYLOAD_BYTES = 8 * 1024 * 1024  # payload per APPEND frame (frames stop at 16 MiB)
APPEND_TIMEOUT_MARGIN_MS: Final = 2000
"""Client-side wait for an APPEND's answer beyond the ``timeout_ms`` it carries: the data node
answers TIMEOUT at that bound, and this leaves room for the answer to travel (a loaded machine).
Never past the batches' deadline (see MAX_APPEND_MARGIN_SHARE)."""
MAX_APPEND_MARGIN_SHARE: Final = 0.2
"""Near the batches' deadline the margin above is at most this share of what is left of it: the
APPEND carries ``timeout_ms`` = what is left minus the margin, so the data node answers (TIMEOUT
at worst) before the producer stops waiting, and the batch ends with the node's answer rather
than with silence."""
# The flow states the dispatcher tests per stream per round, looked up once (reading an enum
# member off its class costs ~4x a module global on Python 3.11).
SENDING, DRAINING, BROKEN = Flow.SENDING, Flow.DRAINING, Flow.BROKEN


class AsyncProducer:
    """Batches records per stream and appends them, idempotently, to each range's primary.

    :meth:`send` returns a future per record that resolves to the record's offset (or raises its
    error); it awaits while ``buffer_max_bytes`` of records are unacknowledged. :meth:`flush`
    waits for everything sent so far; :meth:`close` flushes and stops. Create with
    :meth:`AsyncClient.producer`."""

    def __init__(self, client: ClientCore, options: ProducerOptions | None = None) -> None:
        o = ProducerOptions() if options is None else options
        self.options = o
        self._max_in_flight_per_stream = o.max_in_flight_per_stream
        self._client = client
        self._routing = client.routing
        self.primary_retry_ms = o.primary_retry_ms
        self.linger_s = o.linger_ms / 1000
        self.batch_max_bytes = o.batch_max_bytes
        self.buffer_max_bytes = max(o.buffer_max_bytes, o.batch_max_bytes)
        self._codec = codec_of(o.compression)
        self.producer_id = random.getrandbits(63) if o.producer_id is None else o.producer_id
        self.producer_epoch = o.producer_epoch
        self._max_in_flight_per_node = o.max_in_flight_per_node
        self._streams: dict[int, StreamState] = {}
        self._active: set[StreamState] = set()
        self._buffered = 0
        self._unacked_batches = 0
        self._space = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()
        self._flushing = 0
        self._closed = False
        self._node_slots: dict[str, asyncio.Semaphore] = {}
        # per data node, the turn of the APPEND dispatched last: each request is written to the
        # node's connection only after the one dispatched before it (see _send_group)
        self._node_turns: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sender: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --------------------------------------------------------------------------------- API

    @property
    def throttle_time_ms(self) -> int:
        """Quotas: total throttle_time_ms the data nodes asked of this producer's client (it
        waits each one out before its next request to that node)."""
        return self._routing.throttle.throttle_time_ms_total

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
        # the per-record hot path of the async SDK: kept in one function (no helper calls
        # unless a batch opens or closes)
        size = RECORD_OVERHEAD_BYTES + (len(value) if value is not None else 0)
        if key is not None:
            size += len(key)
        if headers:
            size += sum(len(k) + len(v) for k, v in headers)
        if self._buffered + size > self.buffer_max_bytes:
            await self._wait_for_space(size)
        loop = self._loop
        if loop is None or self._closed:
            loop = self._loop_or_start()
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = StreamState(stream_id)
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

    async def send_batch(
        self, stream_id: int, records: Sequence[bytes | Record], *, key: bytes | None = None
    ) -> asyncio.Future[Offsets]:
        """Queue many records of one stream; return one future of their :class:`Offsets`.

        The bulk path: one future for the call, not one per record (each record's offset is
        derived from its batch's). Values share ``key`` (a :class:`Record` keeps its own key,
        headers and timestamp) and the call's timestamp. The future resolves once every record
        is acknowledged or failed: check :attr:`Offsets.error`. Awaits while the buffer is full
        (checked per batch filled, so the buffer may exceed its bound by one batch).
        """
        loop = self._loop_or_start()
        fut: asyncio.Future[Offsets] = loop.create_future()
        await self._send_into(stream_id, records, key, Offsets(len(records), fut))
        return fut

    async def _send_into(self, stream_id: int, records: Sequence[bytes | Record],
                         key: bytes | None, offsets: Offsets, plain: bool | None = None,
                         start: int = 0) -> None:
        """send_batch's work: queue ``records[start:]`` for ``offsets`` (``plain``: no Record
        among them, when the caller knows; ``start`` > 0 only for plain values)."""
        n = len(records)
        if start >= n:
            return
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = StreamState(stream_id)
        if plain is None:
            plain = not any(isinstance(r, Record) for r in records)
        if not plain:
            await self._send_records(st, records, key, offsets)
            return
        values: Sequence[bytes] = records  # type: ignore[assignment]  # checked just above
        ts = time.time_ns() // 1_000_000
        i = self._queue_values(st, values, start, key, ts, offsets)
        while i < n:  # the buffer is full
            await self._wait_for_space(RECORD_OVERHEAD_BYTES)
            if self._closed:
                offsets.record_failed(i, n - i, ProducerClosedError("the producer is closed"))
                return
            i = self._queue_values(st, values, i, key, ts, offsets)

    def _queue_values(self, st: StreamState, values: Sequence[bytes], i: int, key: bytes | None,
                      ts: int, offsets: Offsets) -> int:
        """Encode ``values[i:]`` into the stream's batches while the buffer has room (one piece
        of ``offsets`` per batch); return the index reached."""
        n = len(values)
        piece = i
        while i < n:
            if self._buffered + RECORD_OVERHEAD_BYTES > self.buffer_max_bytes:
                break
            b = st.builder
            if b is None:
                b = self._open_builder(st)
            before = b.size_bytes
            try:
                j = b.add_values(values, i, key, ts)
            except BaseException:
                if i > piece:
                    st.futures.append(Piece(offsets, piece, i - piece))
                raise
            if j == i:  # the open batch is full
                if i > piece:
                    st.futures.append(Piece(offsets, piece, i - piece))
                    piece = i
                self._close_builder(st)
                continue
            added = b.size_bytes - before + RECORD_OVERHEAD_BYTES * (j - i)
            st.pending_bytes += added
            self._buffered += added
            i = j
        if i > piece:
            st.futures.append(Piece(offsets, piece, i - piece))
        return i

    async def send_whole(self, stream_id: int, records: Sequence[Record] | EncodedRecords
                         ) -> asyncio.Future[Offsets]:
        """Queue ``records`` so that they travel in ONE batch: their offsets are consecutive
        even when other producers write to the stream (the Kafka gateway's Produce). Returns one
        future of their :class:`Offsets`. RecordTooLargeError when they exceed a batch.
        :class:`EncodedRecords` (a section made by the caller: the gateway's, from a Kafka
        batch) travel in a batch of their own, sent at once (the caller batched already)."""
        loop = self._loop_or_start()
        fut: asyncio.Future[Offsets] = loop.create_future()
        n, size, bound = whole_sizes(records, RECORD_OVERHEAD_BYTES)
        offsets = Offsets(n, fut)
        if not n:
            return fut
        enc = isinstance(records, EncodedRecords)
        if self._buffered + size > self.buffer_max_bytes:
            await self._wait_for_space(size)
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = StreamState(stream_id)
        b = st.builder
        if b is not None and (b.size_bytes + bound > self.batch_max_bytes or (enc and len(b))):
            self._close_builder(st)
        if st.builder is None:
            self._open_builder(st, max(self.batch_max_bytes, min(bound, MAX_BATCH_BYTES)))
        b = st.builder
        assert b is not None
        if isinstance(records, EncodedRecords):
            b.add_encoded(records)  # complete: it goes now, without lingering
        elif not all(b.add(r.value, r.key, r.headers, r.timestamp_ms) for r in records):
            raise RecordTooLargeError(f"{n} records exceed one batch ({MAX_BATCH_BYTES} B)")
        st.futures.append(Piece(offsets, 0, n))
        st.pending_bytes += size
        self._buffered += size
        if enc:
            self._close_builder(st)
        return fut

    async def _send_records(self, st: StreamState, records: Sequence[bytes | Record],
                            key: bytes | None, offsets: Offsets) -> None:
        """send_batch of records that are not all plain values: one record at a time."""
        for i, r in enumerate(records):
            if isinstance(r, Record):
                value, rkey, headers, ts = r.value, r.key, r.headers, r.timestamp_ms or None
            else:
                value, rkey, headers, ts = r, key, (), None
            size = RECORD_OVERHEAD_BYTES + len(value or b"") + len(rkey or b"")
            if headers:
                size += sum(len(k) + len(v) for k, v in headers)
            if self._buffered + size > self.buffer_max_bytes:
                await self._wait_for_space(size)
            if self._closed:
                offsets.record_failed(i, len(records) - i,
                                      ProducerClosedError("the producer is closed"))
                return
            self._queue(st, value, rkey, headers, ts, size, Piece(offsets, i, 1))

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

    def _loop_or_start(self) -> asyncio.AbstractEventLoop:
        """The producer's loop (raises once closed); the first call starts the sender."""
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            with deadline_scope(None, replace=True):  # lives on, whatever call started it
                self._sender = loop.create_task(self._run_sender())
        return loop

    def _queue(self, st: StreamState, value: bytes | None, key: bytes | None, headers: Headers,
               timestamp_ms: int | None, size: int, waiter: Waiter) -> None:
        """Encode one record into the stream's open batch (opening one if need be)."""
        b = st.builder
        if b is None:
            b = self._open_builder(st)
        if not b.add(value, key, headers, timestamp_ms):
            self._close_builder(st)
            b = self._open_builder(st)
            b.add(value, key, headers, timestamp_ms)  # RecordTooLargeError if it never fits
        st.futures.append(waiter)
        st.pending_bytes += size
        self._buffered += size

    def _open_builder(self, st: StreamState, batch_bytes_max: int = 0) -> BatchBuilder:
        b = st.builder = BatchBuilder(
            codec=self._codec,
            batch_bytes_max=batch_bytes_max or self.batch_max_bytes,
            producer_id=self.producer_id,
            producer_epoch=self.producer_epoch,
            base_sequence=st.next_sequence,
        )
        st.started = time.monotonic()
        if st not in self._active:
            self._active.add(st)
        self._wake.set()
        return b

    def _close_builder(self, st: StreamState) -> None:
        b = st.builder
        assert b is not None
        st.builder = None
        if not len(b):
            return
        batch = Batch(st.stream_id, b.build(), st.next_sequence, len(b), st.futures,
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
                    if not st.in_flight:
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
        groups: dict[str, list[tuple[StreamState, Batch, Range]]] = {}
        for st in list(self._active):
            if st.flow.state is not SENDING:
                if st.flow.state is BROKEN:
                    self._fail_broken(st)
                continue
            if len(st.in_flight) >= self._max_in_flight_per_stream:
                continue
            if not st.ready:
                if st.builder is None:
                    if not st.in_flight:
                        self._active.discard(st)
                    continue
                due = st.started + self.linger_s
                if self._flushing or now >= due or self._buffered >= self.buffer_max_bytes:
                    self._close_builder(st)
                else:
                    next_due = due if next_due is None else min(next_due, due)
                    continue
            rng = self._routing.writable(st.stream_id)
            addr = primary_address(rng) if rng is not None else None
            if rng is None or addr is None:
                # look the range up once what is in flight has settled
                if not st.in_flight and self._flow(st, FlowEvent.LOOKUP):
                    self._spawn(self._resolve(st))
                continue
            last = st.in_flight[-1].rng if st.in_flight else None
            if last is not None and last.range_index != rng.range_index:
                continue  # a new range: let the old one's batches settle first
            # A range takes the first batch of a producer whatever its sequence (a range after a
            # seal starts mid-sequence), so a batch overtaking that one would be taken as the
            # producer's first and the overtaken one refused for good: one at a time until then.
            limit = (self._max_in_flight_per_stream if st.acked_range >= rng.range_index
                     else 1)
            while st.ready and len(st.in_flight) < limit:
                batch = st.ready.popleft()
                batch.rng, batch.error = rng, None
                if batch.attempts is None:  # its deadline runs from its first send (issue 33)
                    batch.attempts = Attempts(self._routing.retry)
                st.in_flight.append(batch)
                groups.setdefault(addr, []).append((st, batch, rng))
        for addr, entries in groups.items():
            chunk: list[tuple[StreamState, Batch, Range]] = []
            size = 0
            for e in entries:
                if chunk and (
                    len(chunk) >= MAX_ITEMS_PER_APPEND
                    or size + len(e[1].data) > MAX_APPEND_PAYLOAD_BYTES
                ):
                    self._spawn_send(addr, chunk)
                    chunk, size = [], 0
                chunk.append(e)
                size += len(e[1].data)
            self._spawn_send(addr, chunk)
        if next_due is None:
            return None
        return max(0.0, next_due - now)

    def _flow(self, st: StreamState, event: FlowEvent) -> bool:
        """Apply ``event`` to the stream's flow; False when it broke the flow (a bug: logged,
        and the dispatcher fails the stream's records rather than leave them waiting)."""
        try:
            st.flow.process(event)
        except ProducerFlowError:
            log.exception("event=producer_flow_broken stream=%d", st.stream_id)
            self._wake.set()
            return False
        return True

    def _fail_broken(self, st: StreamState) -> None:
        """Fail what a BROKEN stream holds: failed batches in flight, queued ones, open ones."""
        assert st.flow.error is not None
        err = as_sbp_error(st.flow.error)
        for b in [b for b in st.in_flight if b.error is not None]:
            st.in_flight.remove(b)
            self._fail_futures(b, err)
            self._done(b)
        self._fail_stream(st, err)
        if not st.ready and st.builder is None and not st.in_flight:
            self._active.discard(st)

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        assert asyncio.iscoroutine(coro)
        t: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _resolve(self, st: StreamState) -> None:
        """Find the stream's writable range (from the PM; sealing a dead end if need be), by
        the deadline of its oldest queued batch."""
        oldest = st.ready[0].attempts if st.ready else None
        deadline = oldest.deadline if oldest is not None else deadline_after(self._routing.retry)
        with deadline_scope(deadline, replace=True):
            await self._resolve_by_deadline(st)

    async def _resolve_by_deadline(self, st: StreamState) -> None:
        attempts = Attempts(self._routing.retry)
        try:
            while True:
                try:
                    ranges = await self._routing.ranges(st.stream_id, refresh=True)
                    if ranges and ranges[-1].sealed:
                        await self._routing.seal(st.stream_id, ranges[-1].range_index)
                    elif not ranges:
                        raise InvalidRequestError(f"stream {st.stream_id} has no ranges")
                    if self._routing.writable(st.stream_id) is not None:
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
            self._flow(st, FlowEvent.LOOKUP_DONE)
            self._wake.set()

    def _spawn_send(self, addr: str, entries: list[tuple[StreamState, Batch, Range]]) -> None:
        """Send one APPEND; it takes its turn at the node now, in dispatch order."""
        prev = self._node_turns.get(addr)
        turn = self._node_turns[addr] = asyncio.get_running_loop().create_future()
        t = self._spawn(self._send_group(addr, entries, prev, turn))
        # a task cancelled before it ran (close) still passes the turn on
        t.add_done_callback(lambda _: None if turn.done() else turn.set_result(None))

    async def _send_group(self, addr: str, entries: list[tuple[StreamState, Batch, Range]],
                          prev: asyncio.Future[None] | None, turn: asyncio.Future[None]) -> None:
        """Send one APPEND and settle its batches. It is written to the node's connection after
        the APPEND dispatched before it (``prev`` is that one's turn; ``turn`` is this one's,
        done once written): whatever each waits for first (a slot, the throttle, the connection,
        a paused socket), a stream's batches reach the node in sequence order."""
        deadline = min(b.attempts.deadline if b.attempts is not None
                       else deadline_after(self._routing.retry) for _, b, _ in entries)
        # every wait of this APPEND (its turn, a slot, the connection, the answer) ends by the
        # earliest deadline of its batches (issue 33)
        with deadline_scope(deadline, replace=True):
            await self._send_group_by_deadline(addr, entries, prev, turn)

    async def _send_group_by_deadline(
            self, addr: str, entries: list[tuple[StreamState, Batch, Range]],
            prev: asyncio.Future[None] | None, turn: asyncio.Future[None]) -> None:
        slots = self._node_slots.setdefault(addr, asyncio.Semaphore(self._max_in_flight_per_node))
        results: dict[int, AppendResult] = {}
        error: SbpError | None = None
        acquired = False
        try:
            try:
                try:
                    waits = (prev is not None and not prev.done()) or slots.locked()
                    async with asyncio.timeout(clip_timeout(None) if waits else None):  # issue 34
                        if prev is not None and not prev.done():
                            await asyncio.shield(prev)  # the APPEND dispatched before is written
                        await slots.acquire()
                        acquired = True
                except TimeoutError:
                    raise ClientTimeoutError(
                        f"the APPEND to {addr} waited for its turn past its deadline") from None
                # its timeout_ms from what is left now: the node answers (TIMEOUT at worst)
                # before the producer stops waiting
                timeout_ms = self._routing.request_timeout_ms
                left = remaining_s()
                if left is not None:
                    left_ms = left * 1000
                    margin_ms = min(APPEND_TIMEOUT_MARGIN_MS, left_ms * MAX_APPEND_MARGIN_SHARE)
                    timeout_ms = max(1, min(timeout_ms, int(left_ms - margin_ms)))
                req = AppendRequest(
                    timeout_ms=timeout_ms,
                    items=tuple(
                        AppendItem(stream_id=b.stream_id, request_index=i,
                                   batch_length=len(b.data), range_index=r.range_index)
                        for i, (_, b, r) in enumerate(entries)
                    ),
                )
                collect = await self._routing.start_all(
                    addr, req, [b.data for _, b, _ in entries],
                    timeout_ms=timeout_ms + APPEND_TIMEOUT_MARGIN_MS,
                )
            finally:  # written, or failed: the next APPEND's turn
                turn.set_result(None)
                if self._node_turns.get(addr) is turn:
                    del self._node_turns[addr]
            # the data node answers items as they complete, over one or more frames
            for frame in await collect:
                resp = AppendResponse.decode(frame.header)
                if not resp.status.ok:
                    error = resp.status.error()
                results.update((r.request_index, r) for r in resp.items)
        except Exception as exc:
            error = as_sbp_error(exc)
        finally:
            if acquired:
                slots.release()
        for i, (st, batch, _rng) in enumerate(entries):
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
                self._failed(st, batch, err)

    def _acked(self, st: StreamState, batch: Batch, base_offset: int) -> None:
        offset = base_offset
        for f in batch.futures:
            if type(f) is Piece:
                f.offsets.record_acked(f.start, offset, f.count)
                offset += f.count
            else:
                if not f.done():  # type: ignore[union-attr]
                    f.set_result(offset)  # type: ignore[union-attr]
                offset += 1
        with contextlib.suppress(ValueError):
            st.in_flight.remove(batch)
        st.acked_next = max(st.acked_next, base_offset + batch.record_count)
        if batch.rng is not None and batch.rng.range_index > st.acked_range:
            st.acked_range = batch.rng.range_index
        self._done(batch)
        self._maybe_recover(st)

    def _failed(self, st: StreamState, batch: Batch, err: SbpError) -> None:
        """A send failed: stop sending on this stream; recover once all in flight settled."""
        batch.error = err
        if self._flow(st, FlowEvent.SEND_FAILED):
            self._maybe_recover(st)

    def _maybe_recover(self, st: StreamState) -> None:
        """Once every batch in flight on the stream has settled, recover the failed ones."""
        if st.flow.state is not DRAINING:
            return
        if not all(b.error is not None for b in st.in_flight):
            return
        if not st.in_flight:
            self._flow(st, FlowEvent.NONE_IN_FLIGHT)
            self._wake.set()
            return
        if self._flow(st, FlowEvent.ALL_FAILED):
            failed = list(st.in_flight)
            st.in_flight.clear()
            self._spawn(self._recover(st, failed))

    def _done(self, batch: Batch) -> None:
        batch.settled = True
        self._buffered -= batch.nbytes
        self._unacked_batches -= 1
        self._space.set()
        if not self._unacked_batches:
            self._idle.set()
        self._wake.set()

    async def _recover(self, st: StreamState, failed: list[Batch]) -> None:
        """After failed sends (in sequence order; the first error is the cause, later ones may
        be its consequence, e.g. OUT_OF_ORDER_SEQUENCE): seal and move on, refresh, or back
        off; then resend what is not stored, in order, or fail it."""
        first = failed[0]
        if first.attempts is None:
            first.attempts = Attempts(self._routing.retry)
        # the seal, the read-back and the backoff end by the first batch's deadline (issue 33)
        with deadline_scope(first.attempts.deadline, replace=True):
            await self._recover_by_deadline(st, failed)

    async def _recover_by_deadline(self, st: StreamState, failed: list[Batch]) -> None:
        first = failed[0]
        err, rng, attempts = first.error, first.rng, first.attempts
        assert err is not None and rng is not None and attempts is not None
        try:
            log.debug("event=append_retry stream=%d range=%d seq=%d batches=%d error=%s",
                      st.stream_id, rng.range_index, first.base_sequence, len(failed), err)
            resend = failed
            if err.code in MOVE_CODES and self._wait_for_primary(first, rng, err):
                # The only replica is unreachable: a seal now could not learn the range's end
                # from any replica, so give the primary time to come back (a retry is deduped).
                await attempts.backoff(err)
                if not await self._still_writable(st.stream_id, rng):
                    resend = await self._seal_and_settle(st, failed, rng)
            elif err.code in MOVE_CODES or (err.code == ErrorCode.OUT_OF_ORDER_SEQUENCE
                                            and st.sequence_gap):
                st.sequence_gap = False
                resend = await self._seal_and_settle(st, failed, rng)
            elif err.code == ErrorCode.RANGE_NOT_FOUND:
                await attempts.backoff(err)
                await self._routing.ranges(st.stream_id, refresh=True)
            elif err.retriable or err.code == ErrorCode.OUT_OF_ORDER_SEQUENCE:
                # a resend to the same range is deduplicated (the node remembers 5 batches)
                await attempts.backoff(err)
            else:
                raise err
            if resend and attempts.remaining_s <= 0:
                raise err
            for b in reversed(resend):
                b.attempts = b.attempts or attempts  # each keeps its own deadline
                st.ready.appendleft(b)
            if resend:
                self._active.add(st)
        except Exception as exc:
            cause = as_sbp_error(exc)
            if (attempts.remaining_s <= 0 and cause is not err
                    and (is_connection_error(cause) or isinstance(cause, NoPmReachableError))):
                # the seal or read-back was cut by the deadline: the APPEND's error is the cause
                cause = err
            remaining = [b for b in failed if not b.settled]
            if remaining:
                for b in reversed(remaining[1:]):
                    st.ready.appendleft(b)
                self._fail_batch(st, remaining[0], cause)
        finally:
            self._flow(st, FlowEvent.RECOVERY_DONE)
            self._wake.set()

    async def _seal_and_settle(self, st: StreamState, failed: list[Batch], rng: Range
                               ) -> list[Batch]:
        """Seal the range the batches went to; acknowledge those it holds (their offsets from
        the seal result, or by reading the sealed range); return the rest, to resend."""
        attempts = failed[0].attempts
        assert attempts is not None
        while True:
            try:
                res = await self._routing.seal(st.stream_id, rng.range_index)
                break
            except SbpError as exc:
                if not exc.retriable:
                    raise
                await attempts.backoff(exc)
        last: ProducerState | None = next(
            (p for p in res.producers if p.producer_id == self.producer_id), None)
        if last is None:
            return failed
        stored = [b for b in failed if seq_le(b.last_sequence, last.last_sequence)]
        if not stored:
            return failed
        sealed = next((r for r in res.ranges if r.range_index == rng.range_index), None)
        offsets: dict[int, int] = {}
        if stored[-1].last_sequence == last.last_sequence and (
                sealed is None or last.last_base_offset < sealed.end_offset):
            offsets[stored[-1].base_sequence] = last.last_base_offset
        if len(offsets) < len(stored) and sealed is not None:
            offsets.update(await locate(self._routing, self.producer_id, st, sealed, stored,
                                         attempts))
        resend: list[Batch] = []
        for b in stored:
            off = offsets.get(b.base_sequence)
            if off is None:
                # A replica was read through the sealed end without finding it: the seal cut it
                # (its end came from what every replica confirmed, and a replica's producer state
                # may run past that). It is not stored, so a resend cannot duplicate it.
                resend.append(b)
            else:
                self._acked(st, b, off)
        return resend + [b for b in failed if b not in stored]

    def _wait_for_primary(self, batch: Batch, rng: Range, err: SbpError) -> bool:
        assert batch.attempts is not None
        return (
            is_connection_error(err)
            and len(rng.replica_nodes) <= 1
            and batch.attempts.elapsed_s * 1000 < self.primary_retry_ms
        )

    async def _still_writable(self, stream_id: int, rng: Range) -> bool:
        """True when the PM still lists ``rng`` as the stream's writable range."""
        ranges = await self._routing.ranges(stream_id, refresh=True)
        cur = next((r for r in ranges if r.range_index == rng.range_index), None)
        return cur is not None and not cur.sealed

    def _fail_batch(self, st: StreamState, batch: Batch, exc: SbpError) -> None:
        """A batch failed for good (a FATAL error, or its deadline ran out); those queued behind
        it keep their own deadlines. No sequence is reused: a failed batch may be stored, and a
        later one with its sequence would be acknowledged at its offset (a lost record). The
        next batch leaves a gap, refused unless the failed ones were stored; then the range is
        sealed and the batch goes on in the next one (``StreamState.sequence_gap``)."""
        log.warning("event=append_failed stream=%d error=%s", st.stream_id, exc)
        self._fail_futures(batch, exc)
        self._done(batch)
        st.sequence_gap = True
        if not self._unacked_batches:
            self._idle.set()

    def _fail_stream(self, st: StreamState, exc: SbpError) -> None:
        """Fail everything a stream holds: its queued batches and its open one."""
        if st.builder is not None:
            self._close_builder(st)  # a batch like the others, failed below
        while st.ready:
            self._fail_batch(st, st.ready.popleft(), exc)

    @staticmethod
    def _fail_futures(batch: Batch, exc: SbpError) -> None:
        fail_waiters(batch.futures, exc)


def queue_values(producer: AsyncProducer, stream_id: int, values: Sequence[bytes],
                 offsets: Offsets) -> int:
    """Queue plain ``values`` of one stream for ``offsets`` without awaiting (send_batch minus
    its future and its wait for buffer space): as many as the buffer has room for. Returns how many
    were queued (send_rest queues the rest). On its loop; ProducerClosedError once closed."""
    producer._loop_or_start()
    st = producer._streams.get(stream_id)
    if st is None:
        st = producer._streams[stream_id] = StreamState(stream_id)
    return producer._queue_values(st, values, 0, None, time.time_ns() // 1_000_000, offsets)


async def send_rest(producer: AsyncProducer, stream_id: int, records: Sequence[bytes | Record],
                    offsets: Offsets, plain: bool, start: int = 0) -> None:
    """Queue ``records[start:]`` for ``offsets``, awaiting buffer space as
    :meth:`AsyncProducer.send_batch` does (``start`` > 0 only when ``plain``)."""
    producer._loop_or_start()
    await producer._send_into(stream_id, records, None, offsets, plain, start)
