"""Group commit: one fsync covers everything written before it started.

Writers call ``note_write`` after each write (the log position grows monotonically). ``sync``
waits until ``durable >= position``: if no fsync is running it starts one in a thread (so the
event loop never blocks on the disk) that covers everything written so far; callers arriving
while it runs wait for it, and if it did not cover them, the next single fsync does. So N
concurrent appenders cost at most two fsyncs, not N.

An fsync error poisons the syncer for good (after a failed fsync the kernel may have dropped the
dirty pages: retrying could report success for data that is gone, "fsyncgate").
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-fsync")
        self._inflight: asyncio.Future[None] | None = None
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
        while self.durable < position:
            fut = self._inflight
            if fut is None or fut.done():  # a done one not yet cleared would spin the loop
                loop = asyncio.get_running_loop()
                fut = asyncio.ensure_future(loop.run_in_executor(self._executor, self.fsync_now))
                self._inflight = fut
                fut.add_done_callback(self._clear_inflight)
            await asyncio.shield(fut)

    def _clear_inflight(self, fut: asyncio.Future[None]) -> None:
        if self._inflight is fut:
            self._inflight = None
        if not fut.cancelled():
            fut.exception()  # retrieved here; every waiter re-raises it through shield()

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
        self._executor.shutdown(wait=True)
