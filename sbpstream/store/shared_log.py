"""The segment files of the shared log: where entries are written, read back and released.

``SharedLog`` owns the segments (``log/<id>.seg``), the active one new entries go to, the
segments deleted while a reader still held views of them (``zombies``), and the group-commit
syncer. It knows nothing of streams or ranges beyond the index rows it is asked to release. Part
of the engine's internal interface (see state.py); the public API is ``Store`` in engine.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from sbpstream.protocol.errors import StorageError, StorageFullError
from sbpstream.records.header import HEADER_STRUCT, BatchHeader
from sbpstream.store.format import ENTRY_HEADER_SIZE, EntryKind, encode_entry
from sbpstream.store.index import StoredRange, StoredStream, pack_loc, unpack_loc
from sbpstream.store.limits import MAX_SEGMENT_ID
from sbpstream.store.segment import Segment, fsync_dir, parse_segment_name
from sbpstream.store.sync import Syncer
from sbpstream.store.types import StoreConfig

Buffer = bytes | bytearray | memoryview


class SharedLog:
    """Not thread-safe (one event loop owns it; fsyncs run in the syncer's thread)."""

    def __init__(self, directory: Path, config: StoreConfig) -> None:
        self.directory = directory
        self.config = config
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None
        self.zombies: list[Segment] = []
        self.syncer = Syncer(directory, config.fsync_policy, config.fsync_interval_ms)
        self.bytes_written = 0
        self.unindexed_bytes = 0  # written since the last checkpoint (replay work on open)
        self.closed = False

    # ------------------------------------------------------------------ open / close

    def open_segments(self) -> None:
        """Open every segment file of the directory (recovery then sets their ends)."""
        for path in sorted(self.directory.iterdir()):
            seg_id = parse_segment_name(path.name)
            if seg_id is not None:
                self.segments[seg_id] = Segment.open(path, seg_id)

    def open_active(self) -> None:
        """After recovery: the last segment takes new entries if it has room (preallocated to
        ``segment_bytes_max``); the syncer starts at the end of the log."""
        if not self.segments:
            return
        seg = self.segments[max(self.segments)]
        if seg.end < self.config.segment_bytes_max:
            if seg.file_size != self.config.segment_bytes_max:
                os.ftruncate(seg.fd, self.config.segment_bytes_max)
                seg.file_size = self.config.segment_bytes_max
                os.fsync(seg.fd)
            self.active = seg
        self.syncer.written = self.syncer.durable = pack_loc(seg.segment_id, seg.end)

    def release_all(self) -> None:
        self.closed = True
        self.syncer.close()
        for seg in [*self.segments.values(), *self.zombies]:
            seg.release()  # a map with live views is freed when the views go
        self.segments.clear()
        self.zombies.clear()

    # ------------------------------------------------------------------ writing

    @property
    def position(self) -> int:
        """The position after the last written entry (what ``Store.sync`` takes)."""
        return self.syncer.written

    def last_end(self) -> tuple[int, int]:
        """(segment id, end) of the newest segment: what a checkpoint covers; (0, 0) if none."""
        seg = self.active or (self.segments[max(self.segments)] if self.segments else None)
        return (seg.segment_id, seg.end) if seg is not None else (0, 0)

    def write(self, parts: list[Buffer], total: int) -> tuple[Segment, int]:
        """Append one entry (its parts) to the active segment; returns where it went."""
        if self.closed:
            raise StorageError("the store is closed")
        if self.syncer.error is not None:
            raise StorageError(f"an fsync failed; the store refuses writes: {self.syncer.error}")
        seg = self._room_for(total)
        try:
            position = seg.write(parts, total)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(f"disk full writing {seg.path}: {e}") from e
            raise StorageError(f"write to {seg.path} failed: {e}") from e
        self.syncer.note_write(seg, pack_loc(seg.segment_id, seg.end))
        self.bytes_written += total
        self.unindexed_bytes += total
        return seg, position

    def write_meta(self, kind: EntryKind, stream_id: int, range_index: int, arg: int) -> None:
        entry = encode_entry(kind, stream_id, range_index, arg)
        self.write([entry], len(entry))

    def _room_for(self, total: int) -> Segment:
        seg = self.active
        if seg is not None and seg.end + total <= seg.file_size:
            return seg
        if total > self.config.segment_bytes_max:
            raise StorageError(f"entry of {total} bytes exceeds segment_bytes_max")
        if seg is not None:
            seg.cut_to_end()  # fsyncs it: its bytes and new size are durable
            self.syncer.forget(seg)
            self.active = None
        new_id = max(self.segments, default=0) + 1
        if new_id > MAX_SEGMENT_ID:
            raise StorageError("segment ids exhausted")
        try:
            seg = Segment.create(self.directory, new_id, self.config.segment_bytes_max)
        except OSError as e:
            cls = StorageFullError if e.errno == errno.ENOSPC else StorageError
            raise cls(f"cannot create segment {new_id}: {e}") from e
        self.syncer.note_new_segment()
        self.segments[new_id] = seg
        self.active = seg
        return seg

    # ------------------------------------------------------------------ reading

    def header_at(self, loc: int) -> BatchHeader:
        """The header of the batch in the entry at ``loc``."""
        seg_id, position = unpack_loc(loc)
        buf = self.segments[seg_id].buffer()
        return BatchHeader(*HEADER_STRUCT.unpack_from(buf, position + ENTRY_HEADER_SIZE))

    def batch_view(self, loc: int, entry_length: int) -> memoryview:
        """The batch in the entry at ``loc`` (a view over the segment's map, no copy)."""
        seg_id, position = unpack_loc(loc)
        return self.segments[seg_id].view(position + ENTRY_HEADER_SIZE,
                                          entry_length - ENTRY_HEADER_SIZE)

    # ------------------------------------------------------------------ live bytes, garbage

    def release_rows(self, r: StoredRange, lo: int, hi: int) -> None:
        """Rows [lo, hi) of ``r`` are no longer live: their bytes become garbage."""
        for loc, size in zip(r.cols[lo * 4 + 1 : hi * 4 : 4], r.cols[lo * 4 + 2 : hi * 4 : 4],
                             strict=True):
            seg = self.segments.get(loc >> 32)
            if seg is not None:
                seg.live_bytes -= size

    def recount_live(self, streams: Iterable[StoredStream]) -> None:
        for seg in self.segments.values():
            seg.live_bytes = 0
        for s in streams:
            for r in s.ranges:
                for loc, size in zip(r.cols[1::4], r.cols[2::4], strict=True):
                    self.segments[loc >> 32].live_bytes += size

    def remove(self, segments: list[Segment]) -> None:
        """Delete segments whose live entries were copied away and checkpointed; one still
        mapped by a reader's views is released once they go (see ``retry_zombies``)."""
        for seg in segments:
            del self.segments[seg.segment_id]
            self.syncer.forget(seg)
            seg.path.unlink()
            if not seg.release():
                self.zombies.append(seg)
        fsync_dir(self.directory)

    def retry_zombies(self) -> None:
        self.zombies = [seg for seg in self.zombies if not seg.release()]
