"""Runtime support of the generated sync client (:mod:`sbpstream.client.sync`).

A :class:`LoopThread` owns a private event loop (uvloop) in a daemon thread; sync methods submit
the async client's coroutines to it and block on the result. Every sync object made by one
:class:`~sbpstream.client.sync.Client` shares its loop thread.

The sync producer's ``send`` is the one hand-written method (the generator skips what a base
class here defines): it does not cross threads per record. Records are queued on the caller's
thread in *chunks* (one per stream, open until the loop thread takes it): per record one lock,
one dict lookup and one list append. The first record of a chunk schedules the loop thread's
feeder with one ``call_soon_threadsafe`` (none while a wake-up is pending); the feeder takes
every queued chunk at once and encodes each into the async producer's batches in one call
(:func:`~sbpstream.client.producer.queue_values`, no coroutine, future or wait unless the
buffer is full). A chunk has no future: its records' :class:`RecordFuture` objects read its
:class:`~sbpstream.client.producer.Offsets` once settled (record ``i`` at ``first + i`` when
the chunk went in at consecutive offsets), and only a thread that must wait makes an event.
Every other (generated) producer method first waits until the feeder has handed over
everything queued before it (``_before_call``), so the order of one thread's calls is the order
of the records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sbpstream.client.producer import Offsets, queue_values, send_rest
from sbpstream.client.types import Headers, Record
from sbpstream.net.loop import new_event_loop
from sbpstream.protocol.errors import ClientClosedError, ProducerClosedError
from sbpstream.records import HEADER_SIZE, BatchBuilder

if TYPE_CHECKING:
    from sbpstream.client.admin import AsyncAdmin
    from sbpstream.client.consumer import AsyncConsumer
    from sbpstream.client.producer import AsyncProducer
    from sbpstream.client.types import ConsumedRecord

T = TypeVar("T")

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # bound on joining the loop thread at close


class LoopThread:
    """A private event loop running in a daemon thread."""

    def __init__(self, name: str = "sbpstream-client") -> None:
        self._loop = new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and return its result (re-raising its exception)."""
        if self._closed:
            coro.close()
            raise ClientClosedError("the client is closed")
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise RuntimeError("a sync sbpstream call from the client's own event loop thread "
                               "would deadlock; use the AsyncClient there")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a plain function on the loop thread (objects that must be made there)."""

        async def _call() -> T:
            return fn(*args, **kwargs)

        return self.run(_call())

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread. Idempotent."""
        if self._closed:
            return

        async def _cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(_cancel_all())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


def _chain(fut: asyncio.Future[T]) -> concurrent.futures.Future[T]:
    """A concurrent future completed with ``fut`` (call on the loop thread)."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def _copy(f: asyncio.Future[T]) -> None:
        if f.cancelled():
            out.cancel()
        elif (exc := f.exception()) is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result())

    fut.add_done_callback(_copy)
    return out


async def to_cf(aw: Awaitable[asyncio.Future[T]]) -> concurrent.futures.Future[T]:
    """Await a coroutine returning an asyncio future; hand back a thread-safe future."""
    return _chain(await aw)


async def to_cf_list(aw: Awaitable[list[asyncio.Future[T]]]) -> list[
        concurrent.futures.Future[T]]:
    return [_chain(f) for f in await aw]


class SyncBase:
    """Base of the generated sync wrappers: the loop thread and the wrapped async object."""

    _runner: LoopThread

    def _setup(self) -> None:
        """Called by the generated ``_wrap`` once ``_runner`` and ``_async`` are set."""

    def _before_call(self) -> None:
        """Called first by every generated method."""


class ClientBase(SyncBase):
    """Context manager and close() of the sync client; closing stops its loop thread."""

    def _after_close(self) -> None:
        self._runner.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        close: Callable[[], None] = getattr(self, "close")  # noqa: B009 - generated method
        close()


class AdminBase(SyncBase):
    """The sync administration calls (``Client.admin``): run on the client's loop thread."""

    _async: AsyncAdmin


# Bytes of records queued on the caller's thread, not yet handed to the async producer, beyond
# which send() blocks (the async producer's own buffer bound applies after the hand-over).
SYNC_QUEUE_MAX_BYTES = 16 * 1024 * 1024
SEND_OVERHEAD_BYTES = 16  # per record, counted against SYNC_QUEUE_MAX_BYTES
VARINTS_MAX_BYTES = 40  # bound on a record's varints (length, timestamp, key, value, headers)


# Guards the waiting state of every chunk (its event and callbacks): taken by a thread that
# waits on a chunk not settled yet and by the loop thread settling one; never per record.
_WAIT_LOCK = threading.Lock()


class _Chunk:
    """Records of one stream queued by sync ``send`` calls, handed over in one go, and their
    outcome once settled. No future of its own: a waiter makes an event only if it must wait.
    """

    __slots__ = ("callbacks", "done", "error", "event", "first", "offsets", "plain", "records",
                 "stream_id")

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.records: list[bytes | Record] = []
        self.plain = True  # no Record among the records (values only)
        self.done = False
        self.first = -1  # once done: record 0's offset when all are at consecutive offsets
        self.offsets: Offsets | None = None
        self.error: BaseException | None = None  # the hand-over failed: every record's error
        self.event: threading.Event | None = None
        self.callbacks: list[Callable[[], object]] | None = None

    def settle(self, offsets: Offsets | None, error: BaseException | None = None) -> None:
        """Record the outcome (first call wins), wake the waiters, run the callbacks."""
        if self.done:
            return
        if offsets is not None and error is None:
            first = offsets.first
            if first is not None:
                self.first = first
        self.offsets, self.error = offsets, error
        with _WAIT_LOCK:
            self.done = True
            event, callbacks, self.callbacks = self.event, self.callbacks, None
        if event is not None:
            event.set()
        for cb in callbacks or ():
            try:
                cb()
            except Exception:
                log.exception("event=record_future_callback_failed")

    def wait(self, timeout: float | None) -> None:
        """Until settled; TimeoutError after ``timeout`` seconds."""
        with _WAIT_LOCK:
            if self.done:
                return
            if self.event is None:
                self.event = threading.Event()
            event = self.event
        if not event.wait(timeout):
            raise TimeoutError(f"the record is not settled after {timeout} s")

    def add_callback(self, cb: Callable[[], object]) -> None:
        with _WAIT_LOCK:
            if not self.done:
                if self.callbacks is None:
                    self.callbacks = []
                self.callbacks.append(cb)
                return
        cb()


class RecordFuture:
    """The offset of one record sent by the sync ``Producer.send``: a view of the record's place
    in its chunk (made per record; it holds no lock, event or future of its own). ``result()``
    returns the offset or raises the record's error; a callback runs on the client's loop
    thread, or at once on the caller's when the record is already settled."""

    __slots__ = ("_chunk", "_index")

    def __init__(self, chunk: _Chunk, index: int) -> None:
        self._chunk = chunk
        self._index = index

    def result(self, timeout: float | None = None) -> int:
        c = self._chunk
        if not c.done:
            c.wait(timeout)
        if c.first >= 0:
            return c.first + self._index
        if c.error is not None:
            raise c.error
        assert c.offsets is not None
        return c.offsets[self._index]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        c = self._chunk
        if not c.done:
            c.wait(timeout)
        try:
            self.result()
        except Exception as e:
            return e
        return None

    def done(self) -> bool:
        return self._chunk.done

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        """A queued record cannot be taken back: always False."""
        return False

    def add_done_callback(self, fn: Callable[[RecordFuture], object]) -> None:
        self._chunk.add_callback(lambda: fn(self))


class ProducerBase(SyncBase):
    """The sync producer's send queue (see the module docstring) and context manager."""

    _async: AsyncProducer

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # signalled when queued bytes drop
        self._open: dict[int, _Chunk] = {}  # stream -> its chunk still taking records
        self._queue: list[_Chunk] = []  # chunks not yet taken by the feeder (= _open's values)
        self._queued_bytes = 0  # of records not yet handed over (taken by the feeder or not)
        self._kicked = False  # a feeder wake-up is scheduled and has not run yet
        self._feeding = 0  # chunks taken by the feeder and not yet handed over
        self._wake: asyncio.Event | None = None  # loop side, made by the feeder
        self._idle: asyncio.Event | None = None
        self._feeder: asyncio.Task[None] | None = None
        self._loop = self._runner.loop
        self._batch_max = self._async.batch_max_bytes
        # a record of at most this many counted bytes surely fits an empty batch
        self._surely_fits = self._batch_max - HEADER_SIZE - VARINTS_MAX_BYTES

    def send(
        self,
        stream_id: int,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Headers = (),
        timestamp_ms: int | None = None,
    ) -> RecordFuture:
        """Queue one record; return a future of its offset (a :class:`RecordFuture`).

        Does not wait for the loop thread: records are handed over in chunks, one per stream
        per hand-over. Blocks while more than SYNC_QUEUE_MAX_BYTES wait for the hand-over. A
        record too large for an empty batch raises RecordTooLargeError here. ``timestamp_ms`` 0
        means "now", as for :class:`Record`.
        """
        # the per-record hot path of the sync SDK: one lock, one dict lookup, one append
        if key is None and timestamp_ms is None and not headers and value is not None:
            size = SEND_OVERHEAD_BYTES + len(value)
            item: bytes | Record = value
            plain = True
        else:
            size = SEND_OVERHEAD_BYTES + (len(value) if value is not None else 0)
            if key is not None:
                size += len(key)
            if headers:
                size += sum(len(k) + len(v) for k, v in headers)
            item = Record(value, key, headers, timestamp_ms or 0)
            plain = False
        if size > self._surely_fits:
            # RecordTooLargeError now, as the async send raises it (exact: encode it)
            BatchBuilder(batch_bytes_max=self._batch_max).add(value, key, headers, timestamp_ms)
        with self._lock:
            if self._runner._closed:
                raise ClientClosedError("the client is closed")
            if self._queued_bytes + size > SYNC_QUEUE_MAX_BYTES:
                self._wait_for_room_locked(size)
            chunk = self._open.get(stream_id)
            if chunk is None:
                chunk = self._open[stream_id] = _Chunk(stream_id)
                self._queue.append(chunk)
                if not self._kicked:
                    self._kick_locked()
            if not plain:
                chunk.plain = False
            records = chunk.records
            records.append(item)
            self._queued_bytes += size
            return RecordFuture(chunk, len(records) - 1)

    def _wait_for_room_locked(self, size: int) -> None:
        while self._queued_bytes and self._queued_bytes + size > SYNC_QUEUE_MAX_BYTES:
            self._kick_locked()
            self._room.wait()
            if self._runner.closed:
                raise ClientClosedError("the client is closed")

    def _kick_locked(self) -> None:
        if not self._kicked:
            self._kicked = True
            self._loop.call_soon_threadsafe(self._wake_feeder)

    # ---------------------------------------------------------------------- loop thread side

    def _wake_feeder(self) -> None:
        if self._feeder is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._feeder = self._loop.create_task(self._feed())
        assert self._wake is not None
        self._wake.set()

    async def _feed(self) -> None:
        """Hand everything queued over, chunk by chunk in queue order, then wait for more."""
        assert self._wake is not None and self._idle is not None
        producer = self._async
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                self._kicked = False
                chunks, self._queue, self._open = self._queue, [], {}
                taken = self._queued_bytes  # nothing else taken is still being handed over
                self._feeding = len(chunks)
            try:
                for i, c in enumerate(chunks):
                    records = c.records
                    offsets = Offsets(len(records), None, c.settle)
                    try:
                        if not c.plain:
                            await send_rest(producer, c.stream_id, records, offsets, False)
                        elif (k := queue_values(producer, c.stream_id,
                                                records,  # type: ignore[arg-type]  # plain
                                                offsets)) < len(records):
                            await send_rest(producer, c.stream_id, records, offsets, True, k)
                    except asyncio.CancelledError:
                        closed = ProducerClosedError("the sync producer stopped")
                        for rest in chunks[i:]:
                            rest.settle(None, closed)
                        raise
                    except BaseException as exc:
                        c.settle(None, exc)
            finally:
                with self._lock:
                    self._feeding = 0
                    self._queued_bytes -= taken
                    self._room.notify_all()
            self._idle.set()  # a round is over: _handed_over checks again

    async def _handed_over(self) -> None:
        """Wait until every chunk queued so far was handed to the async producer."""
        while True:
            with self._lock:
                if not self._queue and not self._feeding:
                    return
            if self._feeder is not None and self._feeder.done():
                raise ProducerClosedError("the sync producer's feeder stopped")
            self._wake_feeder()
            assert self._idle is not None
            self._idle.clear()
            await self._idle.wait()

    def _before_call(self) -> None:
        with self._lock:
            if not self._queue and not self._feeding:
                return
        self._runner.run(self._handed_over())

    def _after_close(self) -> None:
        feeder = self._feeder
        if feeder is not None and not self._runner.closed:
            self._runner.call(feeder.cancel)
        with self._lock:
            self._room.notify_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        close: Callable[[], None] = getattr(self, "close")  # noqa: B009 - generated method
        close()


class ConsumerBase(SyncBase):
    """The sync consumer is a plain iterator over the async consumer's buffer.

    Records are fetched a round at a time on the loop thread (while this thread waits), then
    handed out here one by one without crossing threads; ``position`` stays exact.
    """

    _async: AsyncConsumer

    def _after_close(self) -> None:
        pass

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> ConsumedRecord:
        a = self._async
        while (rec := a.next_buffered()) is None:
            if a.at_end or a.closed:
                raise StopIteration
            self._runner.run(a.fill())
        return rec

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.run(self._async.close())
