"""The data node's storage engine: one shared append-only log for every stream of the node.

Writes go to the active segment with ``pwritev`` (no fsync); ``sync`` makes them durable per the
fsync policy (group commit, see sync.py). The in-memory index (index.py) maps each range's batches
to log locations; it is checkpointed to ``index.ckpt`` with the log position it covers, and on
open the log tail after that position is replayed (every entry CRC-checked, recovery.py). Data
first, pointer second, garbage last: the log is fsynced before a checkpoint that points into it is
written, and a compacted segment is deleted only after its live entries were copied, fsynced and a
checkpoint covering the copies is durable. See docs/storage.md.

``Store`` is the public API: it validates each call, writes the log entry and applies the change
to its ``StoreState`` (state.py: the index and the ``SharedLog`` of segment files), the internal
interface recovery.py, compaction.py and checker.py work through. Producer bookkeeping is in
producers.py.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Final

from sbpstream.private_files import open_private, private_dir
from sbpstream.protocol.errors import (
    CorruptBatchError,
    OffsetMismatchError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    RangeAlreadyExistsError,
    RangeSealedError,
    StorageError,
    StreamDeletedError,
)
from sbpstream.records.header import BatchError, BatchHeader, patch_base_offset, validate_batch
from sbpstream.store import producers
from sbpstream.store.format import ENTRY_HEADER_SIZE, EntryKind, encode_header
from sbpstream.store.index import StoredRange, pack_loc
from sbpstream.store.limits import MAX_OFFSET
from sbpstream.store.recovery import recover
from sbpstream.store.shared_log import Buffer, SharedLog
from sbpstream.store.state import StoreState
from sbpstream.store.types import (
    AppendOutcome,
    CompactionReport,
    RangeState,
    ReadResult,
    StoreConfig,
    StoredProducerState,
    StoreStats,
)

LOG_DIR: Final = "log"
LOCK_FILE: Final = "LOCK"


class Store:
    """Use ``Store.open``; not thread-safe (one event loop owns it; fsyncs run in a thread)."""

    def __init__(self, directory: Path, config: StoreConfig, lock_fd: int) -> None:
        self.directory = directory
        self.config = config
        self._lock_fd = lock_fd
        self._log = SharedLog(directory / LOG_DIR, config)
        self._state = StoreState(directory, self._log)
        self._bytes_read = 0
        self._appends = 0
        self._reads = 0

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, directory: Path, config: StoreConfig | None = None) -> Store:
        config = config or StoreConfig()
        directory = Path(directory)
        private_dir(directory)  # 0700, and the log directory in it too: records are data
        private_dir(directory / LOG_DIR)
        lock_fd = open_private(directory / LOCK_FILE, os.O_RDWR)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(lock_fd)
            raise StorageError(f"{directory} is in use by another store: {e}") from e
        store = cls(directory, config, lock_fd)
        try:
            recover(store._state)
        except BaseException:
            store._release_all()
            raise
        return store

    @property
    def recovery_findings(self) -> list[str]:
        """What opening the store found and repaired (cut tails, a bad checkpoint, gaps)."""
        return self._state.recovery_findings

    def close(self) -> None:
        if self._log.closed:
            return
        try:
            if self._log.syncer.error is None and self._log.active is not None:
                self.checkpoint()
        finally:
            self._release_all()

    def _release_all(self) -> None:
        """Close without the final checkpoint (what a crash leaves; benchmarks use it)."""
        self._log.release_all()
        os.close(self._lock_fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ durability

    @property
    def log_position(self) -> int:
        """The position after the last written entry (what ``sync`` takes)."""
        return self._log.position

    async def sync(self, log_position: int) -> None:
        """Return once everything up to ``log_position`` is durable per the fsync policy."""
        await self._log.syncer.sync(log_position)

    def sync_now(self) -> None:
        """Blocking fsync of everything written so far (tools, tests, shutdown)."""
        self._log.syncer.fsync_now()

    def checkpoint(self) -> None:
        """Fsync the log, then write the index checkpoint covering it (data first, pointer
        second). Blocks for O(index size): ~1 s per million streams."""
        self._state.checkpoint()

    # ------------------------------------------------------------------ ranges

    def create_range(self, stream_id: int, range_index: int, start_offset: int) -> RangeState:
        """Create a writable range; idempotent when it exists with the same start."""
        s = self._state.streams.get(stream_id)
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
        self._log.write_meta(EntryKind.CREATE_RANGE, stream_id, range_index, start_offset)
        return self._state.apply_create(stream_id, range_index, start_offset).state()

    def describe_range(self, stream_id: int, range_index: int) -> RangeState:
        return self._state.range(stream_id, range_index).state()

    def range_bytes(self, stream_id: int, range_index: int) -> int:
        """Bytes of the record batches the range holds here (O(batches): introspection only)."""
        return self._state.range(stream_id, range_index).stored_bytes()

    def ranges(self) -> list[RangeState]:
        return [
            r.state() for s in self._state.streams.values() if not s.deleted for r in s.ranges
        ]

    def producer_states(self, stream_id: int, range_index: int) -> list[StoredProducerState]:
        return self._state.range(stream_id, range_index).producer_states()

    def seal_range(self, stream_id: int, range_index: int, end_offset: int | None) -> int:
        """None: stop accepting client writes and return the local end. An int: the range is
        sealed at that end; anything stored past it is dropped. Idempotent."""
        r = self._state.range(stream_id, range_index)
        if end_offset is None:
            if not r.sealed:
                self._log.write_meta(EntryKind.SEAL, stream_id, range_index, -1)
                self._state.apply_seal(r, -1)
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
        self._log.write_meta(EntryKind.SEAL, stream_id, range_index, end_offset)
        self._state.apply_seal(r, end_offset)
        return end_offset

    # ------------------------------------------------------------------ append

    def append(
        self, stream_id: int, range_index: int, batch: Buffer, *, assign_offset: bool = True
    ) -> AppendOutcome:
        """Validate and store one batch. ``assign_offset``: a client append (the range's next
        offset is written into a copy of the batch); else a replication append whose batch
        must already start at the range's next offset. Not durable until ``sync``."""
        r = self._state.range(stream_id, range_index)
        try:
            h = validate_batch(batch)
        except BatchError as e:
            raise CorruptBatchError(str(e)) from e
        if h.total_size != len(batch):
            raise CorruptBatchError(f"{len(batch) - h.total_size} bytes after the batch")
        if assign_offset:
            return self._append_client(r, h, batch)
        return self._append_replica(r, h, batch)

    def _append_client(self, r: StoredRange, h: BatchHeader, batch: Buffer) -> AppendOutcome:
        if r.sealed:
            raise RangeSealedError(f"range {r.stream_id}/{r.range_index} is sealed")
        original = producers.check(r, h)
        if original is not None:
            return AppendOutcome(original, original + h.record_count, self.log_position, True)
        data = bytearray(batch)
        patch_base_offset(data, r.next_offset)
        return self._store(r, h, data, r.next_offset)

    def _append_replica(self, r: StoredRange, h: BatchHeader, batch: Buffer) -> AppendOutcome:
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

    def _same_batch(self, r: StoredRange, base: int, batch: Buffer) -> bool:
        i = r.find(base)
        if i < 0 or r.base(i) != base:
            return False
        with self._log.batch_view(r.loc(i), r.size(i)) as stored:
            return stored == memoryview(batch)

    def _store(self, r: StoredRange, h: BatchHeader, batch: Buffer, base: int) -> AppendOutcome:
        if base + h.record_count > MAX_OFFSET:
            raise OffsetOutOfRangeError("offsets exhausted")
        now = self.config.clock_ms()
        header = encode_header(EntryKind.BATCH, r.stream_id, r.range_index, now, batch)
        total = ENTRY_HEADER_SIZE + len(batch)
        seg, position = self._log.write([header, batch], total)
        r.append_row(base, pack_loc(seg.segment_id, position), total, now)
        seg.live_bytes += total
        r.next_offset = base + h.record_count
        if h.is_idempotent:
            producers.record(
                r, h.producer_id, h.producer_epoch, h.base_sequence, base, h.record_count
            )
        self._appends += 1
        outcome = AppendOutcome(base, r.next_offset, self.log_position, False)
        self._state.maybe_checkpoint()
        return outcome

    # ------------------------------------------------------------------ read

    def read(
        self, stream_id: int, offset: int, max_bytes: int, *, max_offset: int | None = None
    ) -> ReadResult:
        """Whole batches from the one holding ``offset``, as views over mmaps (no copies): at
        least one batch (even past ``max_bytes``) unless none is readable, never a batch with
        base_offset >= ``max_offset``. Crosses into the next local range of the stream."""
        s = self._state.stream(stream_id)
        start, end = s.local_start(), s.local_end()
        if offset < s.start_offset:
            raise OffsetTrimmedError(f"offset {offset} < stream start {s.start_offset}")
        if offset < start or offset > end:
            raise OffsetOutOfRangeError(f"offset {offset} outside [{start}, {end}] here")
        limit = end if max_offset is None else min(end, max_offset)
        batch_view = self._log.batch_view
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
                entry_size = r.size(i)
                size = entry_size - ENTRY_HEADER_SIZE
                if batches and total + size > max_bytes:
                    break
                batches.append(batch_view(r.loc(i), entry_size))
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
        s = self._state.stream(stream_id)
        if offset <= s.start_offset:
            return
        self._log.write_meta(EntryKind.TRIM, stream_id, -1, offset)
        self._state.apply_trim(s, offset)

    def delete_stream(self, stream_id: int) -> None:
        """Reject the stream's writes and reads from now on; its bytes become garbage."""
        s = self._state.streams.get(stream_id)
        if s is not None and s.deleted:
            return
        self._log.write_meta(EntryKind.DELETE, stream_id, -1, 0)
        self._state.apply_delete(stream_id)

    def set_retention(self, stream_id: int, retention_period_ms: int) -> None:
        """Keep the stream's batches this long after their append (0 = forever)."""
        s = self._state.stream(stream_id)
        if retention_period_ms < 0:
            raise ValueError("retention_period_ms must be >= 0")
        if s.retention_ms != retention_period_ms:
            self._log.write_meta(EntryKind.RETENTION, stream_id, -1, retention_period_ms)
            s.retention_ms = retention_period_ms

    def apply_retention(self, now_ms: int) -> list[tuple[int, int]]:
        """Trim every stream's batches appended before now - retention; returns
        (stream_id, new start offset) for each stream it trimmed."""
        out: list[tuple[int, int]] = []
        for s in list(self._state.streams.values()):
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

    # ------------------------------------------------------------------ compaction, check, stats

    def compact(self) -> CompactionReport:
        """Reclaim space: copy the live entries of sealed segments whose live share is below
        ``compaction_live_ratio`` forward into the active segment, fsync, checkpoint, then
        delete the old segments (data first, pointer second, garbage last)."""
        from sbpstream.store.compaction import compact

        return compact(self._state)

    def check(self) -> list[str]:
        """Cross-check index, segments and CRCs; returns findings (empty when all is well)."""
        from sbpstream.store.checker import check

        return check(self._state)

    def stats(self) -> StoreStats:
        try:
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = -1
        log = self._log
        live = [s for s in self._state.streams.values() if not s.deleted]
        return StoreStats(
            unindexed_bytes=log.unindexed_bytes,
            bytes_written=log.bytes_written,
            bytes_read=self._bytes_read,
            appends=self._appends,
            reads=self._reads,
            fsyncs=log.syncer.fsyncs,
            segment_count=len(log.segments),
            log_bytes=sum(seg.end for seg in log.segments.values()),
            live_bytes=sum(seg.live_bytes for seg in log.segments.values()),
            streams=len(live),
            ranges=sum(len(s.ranges) for s in live),
            indexed_batches=sum(len(r) for s in live for r in s.ranges),
            disk_free_bytes=free,
        )
