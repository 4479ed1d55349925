"""The engine's internal interface: the index over the shared log, and every change to it.

``StoreState`` is what ``Store`` (engine.py) is built on and what its helpers take instead of
reaching into the engine: recovery.py replays the log into it, compaction.py copies live entries
through it, checker.py cross-checks it. It holds the streams (index.py) and the ``SharedLog``,
and applies the metadata changes (create, seal, trim, delete, retention) the same way whether
they come from a live call or from replaying the log (each apply is idempotent). Validation and
writing the log entry are the caller's job; these methods only change the index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from sbpstream.protocol.errors import RangeNotFoundError, StreamDeletedError
from sbpstream.store import producers
from sbpstream.store.format import EntryKind
from sbpstream.store.index import StoredRange, StoredStream, write_checkpoint
from sbpstream.store.shared_log import SharedLog

CHECKPOINT_FILE: Final = "index.ckpt"


class StoreState:
    def __init__(self, directory: Path, log: SharedLog) -> None:
        self.directory = directory
        self.log = log
        self.streams: dict[int, StoredStream] = {}
        self.recovery_findings: list[str] = []

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / CHECKPOINT_FILE

    # ------------------------------------------------------------------ lookups

    def stream(self, stream_id: int) -> StoredStream:
        s = self.streams.get(stream_id)
        if s is None:
            raise RangeNotFoundError(f"stream {stream_id} has no range on this node")
        if s.deleted:
            raise StreamDeletedError(f"stream {stream_id} was deleted")
        return s

    def range(self, stream_id: int, range_index: int) -> StoredRange:
        r = self.stream(stream_id).get(range_index)
        if r is None:
            raise RangeNotFoundError(f"range {stream_id}/{range_index} is not on this node")
        return r

    # ------------------------------------------------------------------ checkpoint

    def checkpoint(self) -> None:
        """Fsync the log, then write the index checkpoint covering it (data first, pointer
        second). Blocks for O(index size): ~1 s per million streams."""
        self.log.syncer.fsync_now()
        write_checkpoint(self.checkpoint_path, *self.log.last_end(), self.streams)
        self.log.unindexed_bytes = 0

    def maybe_checkpoint(self) -> None:
        if self.log.unindexed_bytes >= self.log.config.index_checkpoint_interval_bytes:
            self.checkpoint()

    # ------------------------------------------------------------------ applying changes

    def apply_meta(self, kind: EntryKind, stream_id: int, range_index: int, arg: int) -> None:
        """Replay one metadata entry (idempotent, so replaying copies is harmless)."""
        s = self.streams.get(stream_id)
        if kind is EntryKind.CREATE_RANGE:
            self.apply_create(stream_id, range_index, arg)
        elif kind is EntryKind.DELETE:
            self.apply_delete(stream_id)
        elif s is None or s.deleted:
            return
        elif kind is EntryKind.SEAL:
            r = s.get(range_index)
            if r is not None:
                self.apply_seal(r, arg)
        elif kind is EntryKind.TRIM:
            self.apply_trim(s, arg)
        elif kind is EntryKind.RETENTION:
            s.retention_ms = arg

    def apply_create(self, stream_id: int, range_index: int, start_offset: int) -> StoredRange:
        s = self.streams.get(stream_id)
        if s is None:
            s = self.streams[stream_id] = StoredStream(stream_id)
        r = s.get(range_index)
        if r is None and not s.deleted:
            r = StoredRange(stream_id, range_index, start_offset)
            s.add(r)
        return r if r is not None else StoredRange(stream_id, range_index, start_offset)

    def apply_seal(self, r: StoredRange, end_offset: int) -> None:
        r.sealed = True
        if end_offset < 0 or r.end_offset >= 0:
            return
        r.end_offset = end_offset
        if end_offset < r.next_offset:
            i = r.find(end_offset)
            keep = i + 1 if i >= 0 and r.base(i) < end_offset else max(i, 0)
            self.log.release_rows(r, keep, len(r))
            r.drop_tail(keep)
            r.next_offset = end_offset
            producers.rebuild(r, end_offset, self.log.header_at)

    def apply_trim(self, s: StoredStream, offset: int) -> None:
        s.start_offset = max(s.start_offset, offset)
        for r in s.ranges:
            self.drop_trimmed(s, r)
        self.normalize(s)

    def drop_trimmed(self, s: StoredStream, r: StoredRange) -> None:
        """Drop the range's batches wholly below the stream's trim point."""
        n = 0
        while n < len(r) and r.batch_next(n) <= s.start_offset:
            n += 1
        if n:
            self.log.release_rows(r, 0, n)
            r.drop_head(n)

    @staticmethod
    def normalize(s: StoredStream) -> None:
        """Drop ranges that lie wholly below the stream's trim point."""
        s.ranges = [
            r for r in s.ranges
            if not (r.sealed and 0 <= r.end_offset <= s.start_offset and len(r) == 0)
        ]

    def apply_delete(self, stream_id: int) -> None:
        s = self.streams.get(stream_id)
        if s is None:
            s = self.streams[stream_id] = StoredStream(stream_id)
        for r in s.ranges:
            self.log.release_rows(r, 0, len(r))
        s.ranges = []
        s.deleted = True
