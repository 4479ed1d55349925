"""The in-memory index and its checkpoint file. No log I/O.

Memory: one ``StoredStream`` per stream (slotted, ~100 bytes plus its ranges list), one
``StoredRange`` per range (slotted, ~120 bytes plus one ``array('q')`` of ~64 bytes), and per
indexed batch one row of 4 int64 cells in that array (32 bytes, plus array over-allocation of
up to ~12%):

    row = [base_offset, location = segment_id << 32 | position, entry_length, append_time_ms]

Rows are sorted by base_offset and dense (each batch's base is the previous one's next), so the
batch holding an offset is found by bisection. Producer state lives only on ranges that have
idempotent producers (``producers`` is None otherwise).
"""

from __future__ import annotations

import bisect
import os
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import crc32c

from sbpstream.private_files import open_private
from sbpstream.store.limits import MAX_CHECKPOINT_BYTES, PRODUCER_RECENT_BATCHES
from sbpstream.store.segment import fsync_dir
from sbpstream.store.types import RangeState, StoredProducerState

STRIDE: Final = 4
COL_BASE: Final = 0
COL_LOC: Final = 1
COL_SIZE: Final = 2
COL_TIME: Final = 3
LOC_SHIFT: Final = 32
LOC_MASK: Final = (1 << LOC_SHIFT) - 1


def pack_loc(segment_id: int, position: int) -> int:
    return (segment_id << LOC_SHIFT) | position


def unpack_loc(loc: int) -> tuple[int, int]:
    return loc >> LOC_SHIFT, loc & LOC_MASK


class Producer:
    """Idempotent-producer state in one range: epoch, last sequence, and the last few batches
    (base_sequence, base_offset, record_count) so a retried batch gets its original offset."""

    __slots__ = ("epoch", "last_base_offset", "last_sequence", "recent")

    def __init__(self, epoch: int, last_sequence: int, last_base_offset: int) -> None:
        self.epoch = epoch
        self.last_sequence = last_sequence
        self.last_base_offset = last_base_offset
        self.recent: list[tuple[int, int, int]] = []

    def record(self, epoch: int, base_sequence: int, base_offset: int, count: int) -> None:
        if epoch != self.epoch:
            self.recent.clear()
        self.epoch = epoch
        self.last_sequence = base_sequence + count - 1
        self.last_base_offset = base_offset
        self.recent.append((base_sequence, base_offset, count))
        if len(self.recent) > PRODUCER_RECENT_BATCHES:
            del self.recent[0]


class StoredRange:
    __slots__ = (
        "cols", "end_offset", "next_offset", "producers", "range_index", "sealed", "start_offset",
        "stream_id",
    )

    def __init__(self, stream_id: int, range_index: int, start_offset: int) -> None:
        self.stream_id = stream_id
        self.range_index = range_index
        self.start_offset = start_offset
        self.next_offset = start_offset
        self.end_offset = -1
        self.sealed = False
        self.cols = array("q")
        self.producers: dict[int, Producer] | None = None

    def __len__(self) -> int:
        return len(self.cols) // STRIDE

    def base(self, i: int) -> int:
        return self.cols[i * STRIDE + COL_BASE]

    def loc(self, i: int) -> int:
        return self.cols[i * STRIDE + COL_LOC]

    def size(self, i: int) -> int:
        return self.cols[i * STRIDE + COL_SIZE]

    def time(self, i: int) -> int:
        return self.cols[i * STRIDE + COL_TIME]

    def stored_bytes(self) -> int:
        """Bytes of the batches this range holds (what FETCH serves; trimmed ones excluded)."""
        return sum(self.cols[COL_SIZE::STRIDE])

    def batch_next(self, i: int) -> int:
        """The offset after batch ``i``."""
        return self.base(i + 1) if i + 1 < len(self) else self.next_offset

    def first_offset(self) -> int:
        return self.base(0) if len(self) else self.next_offset

    def find(self, offset: int) -> int:
        """Index of the batch holding ``offset``, or -1 when no indexed batch starts at or below
        it (the caller checks ``offset < next_offset``)."""
        cols = self.cols
        return bisect.bisect_right(range(len(self)), offset, key=lambda i: cols[i * STRIDE]) - 1

    def append_row(self, base: int, loc: int, size: int, time_ms: int) -> None:
        self.cols.extend((base, loc, size, time_ms))

    def set_loc(self, i: int, loc: int) -> None:
        self.cols[i * STRIDE + COL_LOC] = loc

    def drop_head(self, count: int) -> None:
        del self.cols[: count * STRIDE]

    def drop_tail(self, keep: int) -> None:
        del self.cols[keep * STRIDE :]

    def state(self) -> RangeState:
        return RangeState(
            self.stream_id, self.range_index, self.start_offset, self.next_offset,
            self.end_offset, self.sealed,
        )

    def producer_states(self) -> list[StoredProducerState]:
        if not self.producers:
            return []
        return [
            StoredProducerState(pid, p.epoch, p.last_sequence, p.last_base_offset)
            for pid, p in sorted(self.producers.items())
        ]


class StoredStream:
    __slots__ = ("deleted", "ranges", "retention_ms", "start_offset", "stream_id")

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.start_offset = 0  # the trim point; offsets below it are gone
        self.retention_ms = 0  # 0 = keep forever
        self.deleted = False
        self.ranges: list[StoredRange] = []

    def get(self, range_index: int) -> StoredRange | None:
        for r in self.ranges:
            if r.range_index == range_index:
                return r
        return None

    def add(self, rng: StoredRange) -> None:
        self.ranges.append(rng)
        self.ranges.sort(key=lambda r: r.range_index)

    def local_end(self) -> int:
        return self.ranges[-1].next_offset if self.ranges else self.start_offset

    def local_start(self) -> int:
        if not self.ranges:
            return self.start_offset
        return max(self.start_offset, self.ranges[0].first_offset())


# --- the checkpoint file
#
# header (big-endian): magic "SBIX", version u32, byteorder u8 (0 little, 1 big: the order of the
# index arrays, written natively), covered_segment i64, covered_position i64, body_length u64,
# body_crc u32 (CRC-32C of the body). Body: stream count u64, then per stream _STREAM, its
# ranges (_RANGE, the rows as raw int64 in the header's byte order, its producers (_PRODUCER and
# _RECENT each)).

CHECKPOINT_MAGIC: Final = b"SBIX"
CHECKPOINT_VERSION: Final = 1
_CK_HEADER: Final = struct.Struct(">4sIBqqQI")
_COUNT: Final = struct.Struct(">Q")
_STREAM: Final = struct.Struct(">qqqBI")
_RANGE: Final = struct.Struct(">iqqqBII")
_PRODUCER: Final = struct.Struct(">qhiqB")
_RECENT: Final = struct.Struct(">iqi")
_NATIVE_ORDER: Final = 0 if sys.byteorder == "little" else 1
_FLUSH_BYTES: Final = 1 << 20


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Checkpoint:
    covered_segment: int
    covered_position: int
    streams: dict[int, StoredStream]


def write_checkpoint(
    path: Path, covered_segment: int, covered_position: int, streams: dict[int, StoredStream]
) -> int:
    """Write the index to ``path`` atomically: temp file, fsync, ``os.replace``, fsync dir.
    Returns its size."""
    tmp = path.with_name(path.name + ".tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
    try:
        os.pwrite(fd, bytes(_CK_HEADER.size), 0)
        crc, length = 0, 0
        buf = bytearray(_COUNT.pack(len(streams)))
        for s in streams.values():
            buf += _STREAM.pack(
                s.stream_id, s.start_offset, s.retention_ms, s.deleted, len(s.ranges)
            )
            for r in s.ranges:
                _pack_range(buf, r)
            if len(buf) >= _FLUSH_BYTES:
                crc, length = _flush(fd, buf, crc, length)
        crc, length = _flush(fd, buf, crc, length)
        header = _CK_HEADER.pack(
            CHECKPOINT_MAGIC, CHECKPOINT_VERSION, _NATIVE_ORDER, covered_segment,
            covered_position, length, crc,
        )
        os.pwrite(fd, header, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return _CK_HEADER.size + length


def _pack_range(buf: bytearray, r: StoredRange) -> None:
    producers = r.producers or {}
    buf += _RANGE.pack(
        r.range_index, r.start_offset, r.next_offset, r.end_offset, r.sealed, len(r),
        len(producers),
    )
    buf += r.cols.tobytes()
    for pid, p in producers.items():
        buf += _PRODUCER.pack(pid, p.epoch, p.last_sequence, p.last_base_offset, len(p.recent))
        for item in p.recent:
            buf += _RECENT.pack(*item)


def _flush(fd: int, buf: bytearray, crc: int, length: int) -> tuple[int, int]:
    os.pwrite(fd, buf, _CK_HEADER.size + length)
    crc = crc32c.crc32c(buf, crc)
    length += len(buf)
    buf.clear()
    return crc, length


def read_checkpoint(path: Path) -> Checkpoint:
    """Load and verify a checkpoint; CheckpointError when missing pieces or corrupt."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if len(data) < _CK_HEADER.size or len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"bad checkpoint size {len(data)}")
    magic, version, order, seg, pos, length, crc = _CK_HEADER.unpack_from(data, 0)
    if magic != CHECKPOINT_MAGIC or version != CHECKPOINT_VERSION or order not in (0, 1):
        raise CheckpointError(f"bad checkpoint header {magic!r} v{version} order {order}")
    body = memoryview(data)[_CK_HEADER.size :]
    if len(body) != length or crc32c.crc32c(body) != crc:
        raise CheckpointError("checkpoint body length or CRC mismatch")
    try:
        streams = _parse_body(body, swap=order != _NATIVE_ORDER)
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"malformed checkpoint body: {e}") from e
    return Checkpoint(seg, pos, streams)


def _parse_body(body: memoryview, *, swap: bool) -> dict[int, StoredStream]:
    (n_streams,) = _COUNT.unpack_from(body, 0)
    at = _COUNT.size
    streams: dict[int, StoredStream] = {}
    for _ in range(n_streams):
        sid, start, retention, deleted, n_ranges = _STREAM.unpack_from(body, at)
        at += _STREAM.size
        s = StoredStream(sid)
        s.start_offset, s.retention_ms, s.deleted = start, retention, bool(deleted)
        for _ in range(n_ranges):
            r, at = _parse_range(body, at, sid, swap=swap)
            s.ranges.append(r)
        streams[sid] = s
    if at != len(body):
        raise ValueError(f"{len(body) - at} trailing bytes")
    return streams


def _parse_range(body: memoryview, at: int, sid: int, *, swap: bool) -> tuple[StoredRange, int]:
    index, start, nxt, end, sealed, n_rows, n_producers = _RANGE.unpack_from(body, at)
    at += _RANGE.size
    r = StoredRange(sid, index, start)
    r.next_offset, r.end_offset, r.sealed = nxt, end, bool(sealed)
    nbytes = n_rows * STRIDE * 8
    if at + nbytes > len(body):
        raise ValueError("truncated index rows")
    r.cols.frombytes(body[at : at + nbytes])
    if swap:
        r.cols.byteswap()
    at += nbytes
    if n_producers:
        r.producers = {}
    for _ in range(n_producers):
        pid, epoch, last_seq, last_base, n_recent = _PRODUCER.unpack_from(body, at)
        at += _PRODUCER.size
        p = Producer(epoch, last_seq, last_base)
        for _ in range(n_recent):
            p.recent.append(_RECENT.unpack_from(body, at))
            at += _RECENT.size
        assert r.producers is not None
        r.producers[pid] = p
    return r, at
