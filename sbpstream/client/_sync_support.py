"""Runtime support of the generated sync client (:mod:`sbpstream.client.sync`).

A :class:`LoopThread` owns a private event loop (uvloop) in a daemon thread; sync methods submit
the async client's coroutines to it and block on the result. Every sync object made by one
:class:`~sbpstream.client.sync.Client` shares its loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sbpstream.net.loop import new_event_loop
from sbpstream.protocol.errors import ClientClosedError

if TYPE_CHECKING:
    from sbpstream.client.consumer import AsyncConsumer
    from sbpstream.client.producer import AsyncProducer
    from sbpstream.client.types import ConsumedRecord

T = TypeVar("T")

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


class ClientBase(SyncBase):
    """Context manager and close() of the sync client; closing stops its loop thread."""

    def _after_close(self) -> None:
        self._runner.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        close: Callable[[], None] = getattr(self, "close")  # noqa: B009 - generated method
        close()


class ProducerBase(SyncBase):
    _async: AsyncProducer

    def _after_close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.run(self._async.close())


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
