"""Group commit: one fsync covers everything written before it started.

Writers call ``note_write`` after each write (the log position grows monotonically). ``sync``
waits until ``durable >= position``: if no fsync is running it starts one in the syncer's own
thread (so the event loop never blocks on the disk) that covers everything written so far;
callers arriving while it runs wait for it, and if it did not cover them, the next single fsync
does. So N concurrent appenders cost at most two fsyncs, not N.

The hand-off is as cheap as a thread hand-off gets, since it runs once per group commit on the
latency path (issue 34): the loop puts its loop on a ``queue.SimpleQueue`` (a C queue: one
futex wake of the fsync thread), the thread fsyncs and answers with one
``call_soon_threadsafe`` (one wake of the loop), and the loop resolves every waiter the fsync
covered, each a plain future (no executor work item, no concurrent future chained to an asyncio
one, no shield), then starts the next fsync at once if some waiter is not covered.

An fsync error poisons the syncer for good (after a failed fsync the kernel may have dropped the
dirty pages: retrying could report success for data that is gone, "fsyncgate").
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from pathlib import Path

from sbpstream.protocol.errors import StorageError
from sbpstream.store.segment import Segment, fsync_dir
from sbpstream.store.types import FsyncPolicy

log = logging.getLogger(__name__)


class Syncer:
    def __init__(self, directory: Path, policy: FsyncPolicy, interval_ms: int) -> None:
        self._directory = directory
        self._policy = policy
        self._interval_s = interval_ms / 1000.0
        self._lock = threading.Lock()
        self._dirty: dict[int, Segment] = {}
        self._dir_dirty = False
        self.written = 0
        self.durable = 0
        self.fsyncs = 0
        self.error: BaseException | None = None
        # the group commit (loop thread only): who waits for which position, whether an fsync
        # was handed to the thread and not yet reported back, and on which loop
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._running: asyncio.AbstractEventLoop | None = None
        self._requests: queue.SimpleQueue[asyncio.AbstractEventLoop | None] = queue.SimpleQueue()
        self._committer: threading.Thread | None = None  # started at the first sync
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if policy is FsyncPolicy.INTERVAL:
            self._thread = threading.Thread(
                target=self._interval_loop, name="store-fsync-interval", daemon=True
            )
            self._thread.start()

    def note_write(self, segment: Segment, position: int) -> None:
        with self._lock:
            self._dirty[segment.segment_id] = segment
            self.written = position

    def note_new_segment(self) -> None:
        with self._lock:
            self._dir_dirty = True

    def forget(self, segment: Segment) -> None:
        """The segment was fsynced by its owner (cut) or is going away."""
        with self._lock:
            self._dirty.pop(segment.segment_id, None)

    def fsync_now(self) -> None:
        """Make everything written so far durable (blocking; any thread)."""
        if self.error is not None:
            raise StorageError(f"an earlier fsync failed: {self.error}")
        with self._lock:
            target = self.written
            segments = list(self._dirty.values())
            self._dirty.clear()
            dir_dirty, self._dir_dirty = self._dir_dirty, False
        try:
            for seg in segments:
                if seg.fd >= 0:
                    os.fdatasync(seg.fd)
            if dir_dirty:
                fsync_dir(self._directory)
        except OSError as e:
            self.error = e
            log.critical("fsync failed; the store refuses further writes: %s", e)
            raise StorageError(f"fsync failed: {e}") from e
        with self._lock:
            self.fsyncs += 1
            self.durable = max(self.durable, target)

    async def sync(self, position: int) -> None:
        if self._policy is not FsyncPolicy.ALWAYS:
            if self.error is not None:
                raise StorageError(f"an earlier fsync failed: {self.error}")
            return
        if self.durable >= position:
            return
        if self.error is not None:
            raise StorageError(f"an earlier fsync failed: {self.error}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((position, fut))
        if self._running is not loop:  # none in flight (or a finished loop's, never answered)
            self._request(loop)
        await fut

    def _request(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand one fsync to the syncer's thread; it reports back to ``loop``."""
        self._running = loop
        if self._committer is None:
            self._committer = threading.Thread(target=self._commit_loop, name="store-fsync",
                                               daemon=True)
            self._committer.start()
        self._requests.put(loop)

    def _commit_loop(self) -> None:
        """The fsync thread: one fsync per request, answered on the requesting loop."""
        while True:
            loop = self._requests.get()
            if loop is None:
                return
            err: StorageError | None = None
            try:
                self.fsync_now()
            except StorageError as e:
                err = e
            except BaseException as e:  # never leave the waiters hanging
                err = StorageError(f"fsync failed: {type(e).__name__}: {e}")
            try:
                loop.call_soon_threadsafe(self._settle, loop, err)
            except RuntimeError:  # the loop is closed: nobody waits on it any more
                self._running = None

    def _settle(self, loop: asyncio.AbstractEventLoop, err: StorageError | None) -> None:
        """On the loop: resolve the waiters the fsync covered (all of them with ``err``); start
        the next fsync for the rest."""
        if self._running is loop:
            self._running = None
        durable = self.durable
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for pos, fut in self._waiters:
            if fut.done():  # cancelled (its request's deadline)
                continue
            if fut.get_loop() is not loop:  # another loop's (tests run several in turn)
                if not fut.get_loop().is_closed():
                    keep.append((pos, fut))
            elif err is not None:
                fut.set_exception(StorageError(str(err)))
            elif pos <= durable:
                fut.set_result(None)
            else:
                keep.append((pos, fut))
        self._waiters = keep
        if self._running is None and any(f.get_loop() is loop for _, f in keep):
            self._request(loop)

    def _interval_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self.written > self.durable and self.error is None:
                try:
                    self.fsync_now()
                except StorageError:
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._committer is not None:  # the fsync in progress finishes first
            self._requests.put(None)
            self._committer.join()
            self._committer = None
