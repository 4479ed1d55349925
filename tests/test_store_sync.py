"""The group commit's hand-off to its fsync thread (store/sync.py): waiters covered by one fsync,
a cancelled waiter, a loop that ended with an fsync in flight, a failed fsync poisoning all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path

import pytest
from store_crash_child import make_batch

from sbpstream.protocol.errors import StorageError
from sbpstream.store import FsyncPolicy, Store, StoreConfig
from sbpstream.store import sync as sync_mod

WAIT_S = 30.0  # a bound on every wait here: a hang fails the test, never stalls the suite


def _store(tmp_path: Path) -> Store:
    s = Store.open(tmp_path, StoreConfig(fsync_policy=FsyncPolicy.ALWAYS))
    s.create_range(1, 0, 0)
    return s


def test_a_cancelled_waiter_leaves_the_others_and_later_syncs_working(tmp_path: Path) -> None:
    s = _store(tmp_path)

    async def run() -> None:
        first = s.append(1, 0, make_batch(1, 100))
        gone = asyncio.ensure_future(s.sync(first.log_position))
        kept = asyncio.ensure_future(s.sync(first.log_position))
        await asyncio.sleep(0)
        gone.cancel()
        async with asyncio.timeout(WAIT_S):
            await kept
            later = s.append(1, 0, make_batch(1, 100, fill=2))
            await s.sync(later.log_position)
        assert gone.cancelled()
        assert s._log.syncer.durable >= later.log_position

    asyncio.run(run())
    assert s.check() == []
    s.close()


def test_a_loop_that_ended_with_an_fsync_in_flight(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The next loop's sync is answered although the first loop never saw its fsync end."""
    s = _store(tmp_path)
    started, release = threading.Event(), threading.Event()
    real = sync_mod.Syncer.fsync_now

    def slow(self: sync_mod.Syncer) -> None:
        started.set()
        release.wait(WAIT_S)
        real(self)

    monkeypatch.setattr(sync_mod.Syncer, "fsync_now", slow)

    async def first() -> None:
        out = s.append(1, 0, make_batch(1, 100))
        t = asyncio.ensure_future(s.sync(out.log_position))
        while not started.is_set():
            await asyncio.sleep(0.001)
        t.cancel()

    asyncio.run(first())  # ends while the fsync is still running
    release.set()

    async def second() -> int:
        out = s.append(1, 0, make_batch(1, 100, fill=3))
        async with asyncio.timeout(WAIT_S):
            await s.sync(out.log_position)
        return out.log_position

    pos = asyncio.run(second())
    assert s._log.syncer.durable >= pos
    s.close()


def test_a_failed_fsync_fails_every_waiter_and_every_later_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _store(tmp_path)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)

    async def run() -> None:
        outs = [s.append(1, 0, make_batch(1, 100, fill=i)) for i in range(5)]
        async with asyncio.timeout(WAIT_S):
            got = await asyncio.gather(*(s.sync(o.log_position) for o in outs),
                                       return_exceptions=True)
        assert len(got) == 5 and all(isinstance(g, StorageError) for g in got), got
        with pytest.raises(StorageError):
            await s.sync(s.append(1, 0, make_batch(1, 100)).log_position)

    try:
        asyncio.run(run())
    finally:
        monkeypatch.undo()
        with contextlib.suppress(StorageError):  # the store knows its log is not durable
            s.close()
