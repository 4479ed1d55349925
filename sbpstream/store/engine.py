"""The data node's storage engine: one shared append-only log for every stream of the node.

Writes go to the active segment with ``pwritev`` (no fsync); ``sync`` makes them durable per the
fsync policy (group commit, see sync.py). The in-memory index (index.py) maps each range's batches
to log locations; it is checkpointed to ``index.ckpt`` with the log position it covers, and on
open the log tail after that position is replayed (every entry CRC-checked). Data first, pointer
second, garbage last: the log is fsynced before a checkpoint that points into it is written, and
a compacted segment is deleted only after its live entries were copied, fsynced and a checkpoint
covering the copies is durable. See docs/storage.md.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from sbpstream.protocol.errors import (
    CorruptBatchError,
    OffsetMismatchError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    RangeAlreadyExistsError,
    RangeNotFoundError,
    RangeSealedError,
    StorageError,
    StorageFullError,
    StreamDeletedError,
)
from sbpstream.protocol.limits import SEQUENCE_WRAP
from sbpstream.records.header import (
    HEADER_STRUCT,
    BatchError,
    BatchHeader,
    patch_base_offset,
    validate_batch,
)
from sbpstream.store.format import (
    ENTRY_HEADER_SIZE,
    Entry,
    EntryError,
    EntryKind,
    decode_entry,
    encode_entry,
    encode_header,
)
from sbpstream.store.index import (
    Producer,
    Range,
    Stream,
    read_checkpoint,
    unpack_loc,
    write_checkpoint,
)
from sbpstream.store.index import (
    pack_loc as _pack_loc,
)
from sbpstream.store.limits import MAX_OFFSET, MAX_SEGMENT_ID
from sbpstream.store.segment import Segment, parse_segment_name
from sbpstream.store.sync import Syncer
from sbpstream.store.types import (
    AppendOutcome,
    CompactionReport,
    ProducerState,
    RangeState,
    ReadResult,
    StoreConfig,
    StoreStats,
)

log = logging.getLogger(__name__)

LOG_DIR: Final = "log"
CHECKPOINT_FILE: Final = "index.ckpt"
LOCK_FILE: Final = "LOCK"

Buffer = bytes | bytearray | memoryview
# (base_offset, record_count, location, entry_length, append_time_ms, producer_id, epoch, seq)
_Pending = tuple[int, int, int, int, int, int, int, int]


class Store:
    """Use ``Store.open``; not thread-safe (one event loop owns it; fsyncs run in a thread)."""

    def __init__(self, directory: Path, config: StoreConfig, lock_fd: int) -> None:
        self.directory = directory
        self.config = config
        self._log_dir = directory / LOG_DIR
        self._lock_fd = lock_fd
        self._streams: dict[int, Stream] = {}
        self._segments: dict[int, Segment] = {}
        self._active: Segment | None = None
        self._zombies: list[Segment] = []
        self._syncer = Syncer(self._log_dir, config.fsync_policy, config.fsync_interval_ms)
        self._checkpointed_position = 0
        self._unindexed_bytes = 0
        self._bytes_written = 0
        self._bytes_read = 0
        self._appends = 0
        self._reads = 0
        self._closed = False
        self.recovery_findings: list[str] = []

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, directory: Path, config: StoreConfig | None = None) -> Store:
        config = config or StoreConfig()
        directory = Path(directory)
        (directory / LOG_DIR).mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(lock_fd)
            raise StorageError(f"{directory} is in use by another store: {e}") from e
        store = cls(directory, config, lock_fd)
        try:
            store._recover()
        except BaseException:
            store._release_all()
            raise
        return store

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._syncer.error is None and self._active is not None:
                self.checkpoint()
        finally:
            self._release_all()

    def _release_all(self) -> None:
        self._closed = True
        self._syncer.close()
        for seg in [*self._segments.values(), *self._zombies]:
            seg.release()  # a map with live views is freed when the views go
        self._segments.clear()
        self._zombies.clear()
        os.close(self._lock_fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        for path in sorted(self._log_dir.iterdir()):
            seg_id = parse_segment_name(path.name)
            if seg_id is not None:
                self._segments[seg_id] = Segment.open(path, seg_id)
        start = self._load_checkpoint()
        pending = self._replay(start)
        self._merge(pending)
        self._normalize()
        self._recount_live()
        self._open_active()
        if self._unindexed_bytes or (start == (0, 0) and self._segments):
            self.checkpoint()

    def _load_checkpoint(self) -> tuple[int, int]:
        """Load the index checkpoint; returns where the replay starts. A missing or unusable
        checkpoint means a rebuild from the start of the log (logged loudly when corrupt)."""
        path = self.directory / CHECKPOINT_FILE
        if not path.exists():
            if self._segments:
                log.warning("%s: no index checkpoint; rebuilding the index from the log", path)
            return (0, 0)
        try:
            ck = read_checkpoint(path)
            self._validate_checkpoint(ck.covered_segment, ck.covered_position, ck.streams)
        except ValueError as e:
            msg = f"{path}: unusable index checkpoint ({e}); rebuilding the index from the log"
            log.error(msg)
            self.recovery_findings.append(msg)
            return (0, 0)
        self._streams = ck.streams
        self._checkpointed_position = _pack_loc(ck.covered_segment, ck.covered_position)
        return (ck.covered_segment, ck.covered_position)

    def _validate_checkpoint(self, seg_id: int, position: int, streams: dict[int, Stream]) -> None:
        seg = self._segments.get(seg_id)
        if self._segments and (seg is None or position > seg.file_size):
            raise ValueError(f"covers segment {seg_id}:{position} which the log does not hold")
        for s in streams.values():
            for r in s.ranges:
                for loc in r.cols[1::4]:
                    sid, pos = unpack_loc(loc)
                    if sid not in self._segments or pos > self._segments[sid].file_size:
                        raise ValueError(f"points at missing segment {sid}:{pos}")

    def _replay(self, start: tuple[int, int]) -> dict[tuple[int, int], list[_Pending]]:
        """Walk the log from ``start``: apply metadata entries in order, collect batch entries
        per range (merged afterwards, see _merge). Cuts a bad tail aside (never silently)."""
        pending: dict[tuple[int, int], list[_Pending]] = {}
        ids = sorted(self._segments)
        for seg_id in ids:
            seg = self._segments[seg_id]
            if seg_id < start[0]:
                seg.end = seg.file_size
                continue
            first = start[1] if seg_id == start[0] else 0
            seg.end = first
            for entry in self._walk_for_replay(seg, first, last=seg_id == ids[-1]):
                self._unindexed_bytes += entry.length
                if entry.kind is EntryKind.BATCH:
                    self._collect_batch(seg, entry, pending)
                else:
                    self._apply_meta(entry.kind, entry.stream_id, entry.range_index, entry.arg)
        return pending

    def _walk_for_replay(self, seg: Segment, first: int, *, last: bool) -> Iterator[Entry]:
        position = first
        buf = seg.buffer() if seg.file_size else b""
        while position < seg.file_size:
            try:
                entry = decode_entry(buf, position, seg.file_size)
            except EntryError as e:
                self._cut_tail(seg, position, str(e), last=last)
                return
            seg.end = entry.end
            yield entry
            position = entry.end
        seg.end = position

    def _cut_tail(self, seg: Segment, position: int, reason: str, *, last: bool) -> None:
        seg.end = position
        stop = seg.find_nonzero_end(position) if last else seg.file_size
        if stop <= position:
            return  # the zeroed, preallocated rest of the active segment: nothing was lost
        side = seg.copy_aside(position, stop)
        msg = (
            f"{seg.path}: invalid entry at {position} ({reason}); cut {stop - position} bytes "
            f"to {side}"
        )
        log.error(msg)
        self.recovery_findings.append(msg)
        if last:
            seg.zero_from(position)
        else:
            os.ftruncate(seg.fd, position)
            seg.file_size = position
        os.fsync(seg.fd)

    def _collect_batch(
        self, seg: Segment, entry: Entry, pending: dict[tuple[int, int], list[_Pending]]
    ) -> None:
        h = BatchHeader(*HEADER_STRUCT.unpack_from(seg.buffer(), entry.body_position))
        item = (
            h.base_offset, h.record_count, _pack_loc(seg.segment_id, entry.position), entry.length,
            entry.arg, h.producer_id, h.producer_epoch, h.base_sequence,
        )
        pending.setdefault((entry.stream_id, entry.range_index), []).append(item)

    def _merge(self, pending: dict[tuple[int, int], list[_Pending]]) -> None:
        """Fold replayed batches into the index: the next batch extends its range, a batch the
        index already holds at an earlier location (a compaction copy) moves it."""
        for (sid, ridx), items in pending.items():
            s = self._streams.get(sid)
            r = s.get(ridx) if s is not None and not s.deleted else None
            if s is None or r is None:
                continue  # deleted, or dropped below the trim point
            items.sort(key=lambda it: (it[0], it[2]))
            for base, count, loc, size, time_ms, pid, epoch, seq in items:
                if r.sealed and 0 <= r.end_offset <= base:
                    continue
                if base < r.next_offset:
                    i = r.find(base)
                    if i >= 0 and r.base(i) == base and loc > r.loc(i):
                        r.set_loc(i, loc)
                    continue
                if base > r.next_offset and not (len(r) == 0 and base <= s.start_offset):
                    msg = f"stream {sid} range {ridx}: gap in the log at {r.next_offset}..{base}"
                    log.error(msg)
                    self.recovery_findings.append(msg)
                    break
                r.append_row(base, loc, size, time_ms)
                r.next_offset = base + count
                if pid >= 0 and seq >= 0:
                    self._record_producer(r, pid, epoch, seq, base, count)
            self._drop_trimmed(s, r)

    def _normalize(self) -> None:
        """Drop ranges that lie wholly below their stream's trim point."""
        for s in self._streams.values():
            s.ranges = [
                r for r in s.ranges
                if not (r.sealed and 0 <= r.end_offset <= s.start_offset and len(r) == 0)
            ]

    def _recount_live(self) -> None:
        for seg in self._segments.values():
            seg.live_bytes = 0
        for s in self._streams.values():
            for r in s.ranges:
                for loc, size in zip(r.cols[1::4], r.cols[2::4], strict=True):
                    self._segments[loc >> 32].live_bytes += size

    def _open_active(self) -> None:
        if not self._segments:
            return
        seg = self._segments[max(self._segments)]
        if seg.end < self.config.segment_bytes_max:
            if seg.file_size != self.config.segment_bytes_max:
                os.ftruncate(seg.fd, self.config.segment_bytes_max)
                seg.file_size = self.config.segment_bytes_max
                os.fsync(seg.fd)
            self._active = seg
        self._syncer.written = self._syncer.durable = _pack_loc(seg.segment_id, seg.end)

    # ------------------------------------------------------------------ writing the log

    @property
    def log_position(self) -> int:
        """The position after the last written entry (what ``sync`` takes)."""
        return self._syncer.written

    def _write(self, parts: list[Buffer], total: int) -> tuple[Segment, int]:
        """Append one entry (its parts) to the active segment; returns where it went."""
        if self._closed:
            raise StorageError("the store is closed")
        if self._syncer.error is not None:
            raise StorageError(f"an fsync failed; the store refuses writes: {self._syncer.error}")
        seg = self._room_for(total)
        try:
            position = seg.write(parts, total)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(f"disk full writing {seg.path}: {e}") from e
            raise StorageError(f"write to {seg.path} failed: {e}") from e
        self._syncer.note_write(seg, _pack_loc(seg.segment_id, seg.end))
        self._bytes_written += total
        self._unindexed_bytes += total
        return seg, position

    def _room_for(self, total: int) -> Segment:
        seg = self._active
        if seg is not None and seg.end + total <= seg.file_size:
            return seg
        if total > self.config.segment_bytes_max:
            raise StorageError(f"entry of {total} bytes exceeds segment_bytes_max")
        if seg is not None:
            seg.cut_to_end()  # fsyncs it: its bytes and new size are durable
            self._syncer.forget(seg)
            self._active = None
        new_id = max(self._segments, default=0) + 1
        if new_id > MAX_SEGMENT_ID:
            raise StorageError("segment ids exhausted")
        try:
            seg = Segment.create(self._log_dir, new_id, self.config.segment_bytes_max)
        except OSError as e:
            cls = StorageFullError if e.errno == errno.ENOSPC else StorageError
            raise cls(f"cannot create segment {new_id}: {e}") from e
        self._syncer.note_new_segment()
        self._segments[new_id] = seg
        self._active = seg
        return seg

    def _write_meta(self, kind: EntryKind, stream_id: int, range_index: int, arg: int) -> None:
        entry = encode_entry(kind, stream_id, range_index, arg)
        self._write([entry], len(entry))

    async def sync(self, log_position: int) -> None:
        """Return once everything up to ``log_position`` is durable per the fsync policy."""
        await self._syncer.sync(log_position)

    def sync_now(self) -> None:
        """Blocking fsync of everything written so far (tools, tests, shutdown)."""
        self._syncer.fsync_now()

    def checkpoint(self) -> None:
        """Fsync the log, then write the index checkpoint covering it (data first, pointer
        second). Blocks for O(index size): ~1 s per million streams."""
        self.sync_now()
        seg = self._active or (self._segments[max(self._segments)] if self._segments else None)
        covered = (seg.segment_id, seg.end) if seg is not None else (0, 0)
        write_checkpoint(self.directory / CHECKPOINT_FILE, *covered, self._streams)
        self._checkpointed_position = _pack_loc(*covered)
        self._unindexed_bytes = 0

    def _maybe_checkpoint(self) -> None:
        if self._unindexed_bytes >= self.config.index_checkpoint_interval_bytes:
            self.checkpoint()

    # ------------------------------------------------------------------ ranges

    def _stream(self, stream_id: int) -> Stream:
        s = self._streams.get(stream_id)
        if s is None:
            raise RangeNotFoundError(f"stream {stream_id} has no range on this node")
        if s.deleted:
            raise StreamDeletedError(f"stream {stream_id} was deleted")
        return s

    def _range(self, stream_id: int, range_index: int) -> Range:
        r = self._stream(stream_id).get(range_index)
        if r is None:
            raise RangeNotFoundError(f"range {stream_id}/{range_index} is not on this node")
        return r

    def create_range(self, stream_id: int, range_index: int, start_offset: int) -> RangeState:
        """Create a writable range; idempotent when it exists with the same start."""
        s = self._streams.get(stream_id)
        if s is not None and s.deleted:
            raise StreamDeletedError(f"stream {stream_id} was deleted")
        if not 0 <= start_offset <= MAX_OFFSET or range_index < 0:
            raise OffsetOutOfRangeError(f"bad range {range_index} start {start_offset}")
        existing = s.get(range_index) if s is not None else None
        if existing is not None:
            if existing.start_offset != start_offset:
                raise RangeAlreadyExistsError(
                    f"range {stream_id}/{range_index} exists from {existing.start_offset}, "
                    f"not {start_offset}"
                )
            return existing.state()
        self._write_meta(EntryKind.CREATE_RANGE, stream_id, range_index, start_offset)
        return self._apply_create(stream_id, range_index, start_offset).state()

    def _apply_create(self, stream_id: int, range_index: int, start_offset: int) -> Range:
        s = self._streams.get(stream_id)
        if s is None:
            s = self._streams[stream_id] = Stream(stream_id)
        r = s.get(range_index)
        if r is None and not s.deleted:
            r = Range(stream_id, range_index, start_offset)
            s.add(r)
        return r if r is not None else Range(stream_id, range_index, start_offset)

    def describe_range(self, stream_id: int, range_index: int) -> RangeState:
        return self._range(stream_id, range_index).state()

    def ranges(self) -> list[RangeState]:
        return [
            r.state() for s in self._streams.values() if not s.deleted for r in s.ranges
        ]

    def producer_states(self, stream_id: int, range_index: int) -> list[ProducerState]:
        return self._range(stream_id, range_index).producer_states()

    def seal_range(self, stream_id: int, range_index: int, end_offset: int | None) -> int:
        """None: stop accepting client writes and return the local end. An int: the range is
        sealed at that end; anything stored past it is dropped. Idempotent."""
        r = self._range(stream_id, range_index)
        if end_offset is None:
            if not r.sealed:
                self._write_meta(EntryKind.SEAL, stream_id, range_index, -1)
                self._apply_seal(r, -1)
            return r.next_offset
        if r.sealed and r.end_offset >= 0:
            if r.end_offset != end_offset:
                raise RangeSealedError(
                    f"range {stream_id}/{range_index} is sealed at {r.end_offset}, not {end_offset}"
                )
            return end_offset
        if end_offset < r.start_offset:
            raise OffsetOutOfRangeError(f"seal end {end_offset} below start {r.start_offset}")
        if end_offset < r.next_offset:
            i = r.find(end_offset)
            if i >= 0 and r.base(i) != end_offset:
                raise OffsetMismatchError(
                    f"seal end {end_offset} falls inside the batch at {r.base(i)}"
                )
        self._write_meta(EntryKind.SEAL, stream_id, range_index, end_offset)
        self._apply_seal(r, end_offset)
        return end_offset

    def _apply_seal(self, r: Range, end_offset: int) -> None:
        r.sealed = True
        if end_offset < 0 or r.end_offset >= 0:
            return
        r.end_offset = end_offset
        if end_offset < r.next_offset:
            i = r.find(end_offset)
            keep = i + 1 if i >= 0 and r.base(i) < end_offset else max(i, 0)
            self._release_rows(r, keep, len(r))
            r.drop_tail(keep)
            r.next_offset = end_offset
            self._rebuild_producers(r, end_offset)

    def _rebuild_producers(self, r: Range, end_offset: int) -> None:
        """After a truncation, forget producer batches past the end and find each affected
        producer's last surviving batch."""
        if not r.producers:
            return
        lost = {pid for pid, p in r.producers.items() if p.last_base_offset >= end_offset}
        for pid in lost:
            del r.producers[pid]
        for i in range(len(r) - 1, -1, -1):
            if not lost:
                break
            h = self._header_at(r.loc(i))
            if h.producer_id in lost and h.base_sequence >= 0:
                lost.discard(h.producer_id)
                self._record_producer(
                    r, h.producer_id, h.producer_epoch, h.base_sequence, h.base_offset,
                    h.record_count,
                )

    def _header_at(self, loc: int) -> BatchHeader:
        seg_id, position = unpack_loc(loc)
        buf = self._segments[seg_id].buffer()
        return BatchHeader(*HEADER_STRUCT.unpack_from(buf, position + ENTRY_HEADER_SIZE))

    def _release_rows(self, r: Range, lo: int, hi: int) -> None:
        """Rows [lo, hi) are no longer live: their bytes become garbage in their segments."""
        for loc, size in zip(r.cols[lo * 4 + 1 : hi * 4 : 4], r.cols[lo * 4 + 2 : hi * 4 : 4],
                             strict=True):
            seg = self._segments.get(loc >> 32)
            if seg is not None:
                seg.live_bytes -= size

    # ------------------------------------------------------------------ append

    def append(
        self, stream_id: int, range_index: int, batch: Buffer, *, assign_offset: bool = True
    ) -> AppendOutcome:
        """Validate and store one batch. ``assign_offset``: a client append (the range's next
        offset is written into a copy of the batch); else a replication append whose batch
        must already start at the range's next offset. Not durable until ``sync``."""
        r = self._range(stream_id, range_index)
        try:
            h = validate_batch(batch)
        except BatchError as e:
            raise CorruptBatchError(str(e)) from e
        if h.total_size != len(batch):
            raise CorruptBatchError(f"{len(batch) - h.total_size} bytes after the batch")
        if assign_offset:
            return self._append_client(r, h, batch)
        return self._append_replica(r, h, batch)

    def _append_client(self, r: Range, h: BatchHeader, batch: Buffer) -> AppendOutcome:
        if r.sealed:
            raise RangeSealedError(f"range {r.stream_id}/{r.range_index} is sealed")
        original = self._check_producer(r, h)
        if original is not None:
            return AppendOutcome(original, original + h.record_count, self.log_position, True)
        data = bytearray(batch)
        patch_base_offset(data, r.next_offset)
        return self._store(r, h, data, r.next_offset)

    def _append_replica(self, r: Range, h: BatchHeader, batch: Buffer) -> AppendOutcome:
        base = h.base_offset
        if base < r.next_offset and self._same_batch(r, base, batch):
            return AppendOutcome(base, base + h.record_count, self.log_position, True)
        if base != r.next_offset:
            raise OffsetMismatchError(
                f"range {r.stream_id}/{r.range_index}: batch at {base}, next offset is "
                f"{r.next_offset}"
            )
        if r.sealed and not (r.end_offset >= 0 and base + h.record_count <= r.end_offset):
            raise RangeSealedError(f"range {r.stream_id}/{r.range_index} is sealed")
        return self._store(r, h, batch, base)

    def _same_batch(self, r: Range, base: int, batch: Buffer) -> bool:
        i = r.find(base)
        if i < 0 or r.base(i) != base:
            return False
        seg_id, position = unpack_loc(r.loc(i))
        stored = self._segments[seg_id].view(position + ENTRY_HEADER_SIZE,
                                             r.size(i) - ENTRY_HEADER_SIZE)
        with stored:
            return stored == memoryview(batch)

    def _check_producer(self, r: Range, h: BatchHeader) -> int | None:
        """The original base offset when ``h`` duplicates a stored batch; None when it is new.
        Raises on a stale epoch or a sequence gap."""
        p = r.producers.get(h.producer_id) if r.producers and h.is_idempotent else None
        if p is None:
            return None
        if h.producer_epoch < p.epoch:
            raise ProducerFencedError(
                f"producer {h.producer_id} epoch {h.producer_epoch} < current {p.epoch}"
            )
        if h.producer_epoch > p.epoch:
            return None
        for base_seq, base_offset, count in p.recent:
            if base_seq == h.base_sequence and count == h.record_count:
                return base_offset
        if h.base_sequence == (p.last_sequence + 1) % SEQUENCE_WRAP:
            return None
        raise OutOfOrderSequenceError(
            f"producer {h.producer_id}: sequence {h.base_sequence} after {p.last_sequence}"
        )

    def _record_producer(
        self, r: Range, pid: int, epoch: int, seq: int, base: int, count: int
    ) -> None:
        if r.producers is None:
            r.producers = {}
        p = r.producers.get(pid)
        if p is None:
            p = r.producers[pid] = Producer(epoch, seq + count - 1, base)
        elif epoch < p.epoch:
            return
        p.record(epoch, seq, base, count)

    def _store(self, r: Range, h: BatchHeader, batch: Buffer, base: int) -> AppendOutcome:
        if base + h.record_count > MAX_OFFSET:
            raise OffsetOutOfRangeError("offsets exhausted")
        now = self.config.clock_ms()
        header = encode_header(EntryKind.BATCH, r.stream_id, r.range_index, now, batch)
        total = ENTRY_HEADER_SIZE + len(batch)
        seg, position = self._write([header, batch], total)
        r.append_row(base, _pack_loc(seg.segment_id, position), total, now)
        seg.live_bytes += total
        r.next_offset = base + h.record_count
        if h.is_idempotent:
            self._record_producer(
                r, h.producer_id, h.producer_epoch, h.base_sequence, base, h.record_count
            )
        self._appends += 1
        outcome = AppendOutcome(base, r.next_offset, self.log_position, False)
        self._maybe_checkpoint()
        return outcome

    # ------------------------------------------------------------------ read

    def read(
        self, stream_id: int, offset: int, max_bytes: int, *, max_offset: int | None = None
    ) -> ReadResult:
        """Whole batches from the one holding ``offset``, as views over mmaps (no copies): at
        least one batch (even past ``max_bytes``) unless none is readable, never a batch with
        base_offset >= ``max_offset``. Crosses into the next local range of the stream."""
        s = self._stream(stream_id)
        start, end = s.local_start(), s.local_end()
        if offset < s.start_offset:
            raise OffsetTrimmedError(f"offset {offset} < stream start {s.start_offset}")
        if offset < start or offset > end:
            raise OffsetOutOfRangeError(f"offset {offset} outside [{start}, {end}] here")
        limit = end if max_offset is None else min(end, max_offset)
        batches: list[memoryview] = []
        total, position, last = 0, offset, None
        for r in s.ranges:
            if r.next_offset <= position:
                last = r
                continue
            if r.first_offset() > position:
                break
            last = r
            i = r.find(position)
            while i < len(r) and r.base(i) < limit and total < max_bytes:
                size = r.size(i) - ENTRY_HEADER_SIZE
                if batches and total + size > max_bytes:
                    break
                seg_id, pos = unpack_loc(r.loc(i))
                batches.append(self._segments[seg_id].view(pos + ENTRY_HEADER_SIZE, size))
                total += size
                position = r.batch_next(i)
                i += 1
            if i < len(r):
                break
        range_end = (
            last is not None and last.sealed and position == last.end_offset
            and last is s.ranges[-1]
        )
        self._reads += 1
        self._bytes_read += total
        return ReadResult(batches, position, start, end, range_end)

    # ------------------------------------------------------------------ trim, delete, retention

    def trim(self, stream_id: int, offset: int) -> None:
        """Drop the stream's batches wholly below ``offset``; reads below it fail afterwards."""
        s = self._stream(stream_id)
        if offset <= s.start_offset:
            return
        self._write_meta(EntryKind.TRIM, stream_id, -1, offset)
        self._apply_trim(s, offset)

    def _apply_trim(self, s: Stream, offset: int) -> None:
        s.start_offset = max(s.start_offset, offset)
        for r in s.ranges:
            self._drop_trimmed(s, r)
        self._normalize_stream(s)

    def _drop_trimmed(self, s: Stream, r: Range) -> None:
        n = 0
        while n < len(r) and r.batch_next(n) <= s.start_offset:
            n += 1
        if n:
            self._release_rows(r, 0, n)
            r.drop_head(n)

    def _normalize_stream(self, s: Stream) -> None:
        s.ranges = [
            r for r in s.ranges
            if not (r.sealed and 0 <= r.end_offset <= s.start_offset and len(r) == 0)
        ]

    def delete_stream(self, stream_id: int) -> None:
        """Reject the stream's writes and reads from now on; its bytes become garbage."""
        s = self._streams.get(stream_id)
        if s is not None and s.deleted:
            return
        self._write_meta(EntryKind.DELETE, stream_id, -1, 0)
        self._apply_delete(stream_id)

    def _apply_delete(self, stream_id: int) -> None:
        s = self._streams.get(stream_id)
        if s is None:
            s = self._streams[stream_id] = Stream(stream_id)
        for r in s.ranges:
            self._release_rows(r, 0, len(r))
        s.ranges = []
        s.deleted = True

    def set_retention(self, stream_id: int, retention_period_ms: int) -> None:
        """Keep the stream's batches this long after their append (0 = forever)."""
        s = self._stream(stream_id)
        if retention_period_ms < 0:
            raise ValueError("retention_period_ms must be >= 0")
        if s.retention_ms != retention_period_ms:
            self._write_meta(EntryKind.RETENTION, stream_id, -1, retention_period_ms)
            s.retention_ms = retention_period_ms

    def apply_retention(self, now_ms: int) -> list[tuple[int, int]]:
        """Trim every stream's batches appended before now - retention; returns
        (stream_id, new start offset) for each stream it trimmed."""
        out: list[tuple[int, int]] = []
        for s in list(self._streams.values()):
            if s.deleted or s.retention_ms <= 0:
                continue
            cutoff = now_ms - s.retention_ms
            new_start = s.start_offset
            for r in s.ranges:
                i = 0
                while i < len(r) and r.time(i) < cutoff:
                    new_start = max(new_start, r.batch_next(i))
                    i += 1
                if i < len(r):
                    break
            if new_start > s.start_offset:
                self.trim(s.stream_id, new_start)
                out.append((s.stream_id, new_start))
        return out

    def _apply_meta(self, kind: EntryKind, stream_id: int, range_index: int, arg: int) -> None:
        """Replay one metadata entry (idempotent, so replaying copies is harmless)."""
        s = self._streams.get(stream_id)
        if kind is EntryKind.CREATE_RANGE:
            self._apply_create(stream_id, range_index, arg)
        elif kind is EntryKind.DELETE:
            self._apply_delete(stream_id)
        elif s is None or s.deleted:
            return
        elif kind is EntryKind.SEAL:
            r = s.get(range_index)
            if r is not None:
                self._apply_seal(r, arg)
        elif kind is EntryKind.TRIM:
            self._apply_trim(s, arg)
        elif kind is EntryKind.RETENTION:
            s.retention_ms = arg

    # ------------------------------------------------------------------ compaction

    def compact(self) -> CompactionReport:
        """Reclaim space: copy the live entries of sealed segments whose live share is below
        ``compaction_live_ratio`` forward into the active segment, fsync, checkpoint, then
        delete the old segments (data first, pointer second, garbage last)."""
        from sbpstream.store.compaction import compact

        return compact(self)

    def _retry_zombies(self) -> None:
        self._zombies = [seg for seg in self._zombies if not seg.release()]

    # ------------------------------------------------------------------ check and stats

    def check(self) -> list[str]:
        """Cross-check index, segments and CRCs; returns findings (empty when all is well)."""
        from sbpstream.store.checker import check

        return check(self)

    def stats(self) -> StoreStats:
        try:
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = -1
        live = [s for s in self._streams.values() if not s.deleted]
        return StoreStats(
            unindexed_bytes=self._unindexed_bytes,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
            appends=self._appends,
            reads=self._reads,
            fsyncs=self._syncer.fsyncs,
            segment_count=len(self._segments),
            log_bytes=sum(seg.end for seg in self._segments.values()),
            live_bytes=sum(seg.live_bytes for seg in self._segments.values()),
            streams=len(live),
            ranges=sum(len(s.ranges) for s in live),
            indexed_batches=sum(len(r) for s in live for r in s.ranges),
            disk_free_bytes=free,
        )
