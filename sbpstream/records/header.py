"""The fixed 53-byte header of a record batch (design.md section 4). No I/O.

Layout (big-endian)::

    offset size field
    0      8    base_offset       int64  -1 from producers; written in place by the primary
    8      4    batch_length      int32  bytes after this field
    12     1    magic             int8   = 2
    13     4    crc               uint32 CRC-32C of bytes [17, end)
    17     2    attributes        int16  bits 0-2 codec: 0 none, 1 zstd, 2 lz4
    19     4    record_count      int32
    23     8    first_timestamp   int64  ms
    31     8    max_timestamp     int64  ms
    39     8    producer_id       int64  -1 when not idempotent
    47     2    producer_epoch    int16
    49     4    base_sequence     int32  -1 when not idempotent

The CRC does not cover ``base_offset`` (nor ``batch_length``/``magic``), so the primary numbers a
batch by patching bytes [0, 8) without recomputing anything.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import crc32c

BATCH_MAGIC: Final = 2
HEADER_STRUCT: Final = struct.Struct(">qibIhiqqqhi")
HEADER_SIZE: Final = 53
assert HEADER_STRUCT.size == HEADER_SIZE

BASE_OFFSET_STRUCT: Final = struct.Struct(">q")
LENGTH_PREFIX_SIZE: Final = 12  # base_offset + batch_length: the bytes batch_length does not count
CRC_START: Final = 17  # the CRC covers [17, end)
CODEC_MASK: Final = 0x07
CODEC_NONE: Final = 0
CODEC_ZSTD: Final = 1
CODEC_LZ4: Final = 2
KNOWN_CODECS: Final = frozenset({CODEC_NONE, CODEC_ZSTD, CODEC_LZ4})

# A batch larger than this cannot travel in one frame anyway (max frame 16 MiB); rejecting it
# when the header is read keeps a corrupt length from making anyone buffer gigabytes.
MAX_BATCH_BYTES: Final = 16 * 1024 * 1024 - 4096


class BatchError(ValueError):
    """A record batch is malformed: truncated, wrong magic, bad length or CRC mismatch."""


@dataclass(frozen=True, slots=True)
class BatchHeader:
    base_offset: int
    batch_length: int
    magic: int
    crc: int
    attributes: int
    record_count: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int

    @property
    def total_size(self) -> int:
        """Bytes of the whole batch, header included."""
        return LENGTH_PREFIX_SIZE + self.batch_length

    @property
    def codec(self) -> int:
        return self.attributes & CODEC_MASK

    @property
    def last_offset_delta(self) -> int:
        return self.record_count - 1

    @property
    def next_offset(self) -> int:
        """The offset right after this batch (valid once base_offset is assigned)."""
        return self.base_offset + self.record_count

    @property
    def is_idempotent(self) -> bool:
        return self.producer_id >= 0 and self.base_sequence >= 0


def read_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> BatchHeader:
    """Parse the fixed header at ``offset`` and check what the header alone can check."""
    if len(buf) - offset < HEADER_SIZE:
        raise BatchError(f"truncated batch header: {len(buf) - offset} of {HEADER_SIZE} bytes")
    h = BatchHeader(*HEADER_STRUCT.unpack_from(buf, offset))
    if h.magic != BATCH_MAGIC:
        raise BatchError(f"bad batch magic {h.magic}, expected {BATCH_MAGIC}")
    if h.batch_length < HEADER_SIZE - LENGTH_PREFIX_SIZE or h.total_size > MAX_BATCH_BYTES:
        raise BatchError(f"bad batch_length {h.batch_length}")
    if h.record_count <= 0:
        raise BatchError(f"bad record_count {h.record_count}")
    if h.codec not in KNOWN_CODECS or h.attributes & ~CODEC_MASK:
        raise BatchError(f"bad attributes 0x{h.attributes:04x}")
    return h


def compute_crc(buf: bytes | bytearray | memoryview, offset: int, total_size: int) -> int:
    mv = memoryview(buf)[offset + CRC_START : offset + total_size]
    return int(crc32c.crc32c(mv))


def validate_batch(buf: bytes | bytearray | memoryview, offset: int = 0) -> BatchHeader:
    """Header checks plus length and CRC over the whole batch starting at ``offset``."""
    h = read_header(buf, offset)
    if len(buf) - offset < h.total_size:
        raise BatchError(f"truncated batch: {len(buf) - offset} of {h.total_size} bytes")
    actual = compute_crc(buf, offset, h.total_size)
    if actual != h.crc:
        raise BatchError(f"batch CRC mismatch: stored 0x{h.crc:08x}, computed 0x{actual:08x}")
    return h


def patch_base_offset(buf: bytearray | memoryview, base_offset: int, offset: int = 0) -> None:
    """Write ``base_offset`` in place; the CRC stays valid because it does not cover it."""
    BASE_OFFSET_STRUCT.pack_into(buf, offset, base_offset)


def split_batches(buf: bytes | bytearray | memoryview) -> list[tuple[int, BatchHeader]]:
    """Validate a buffer holding whole batches back to back; return (offset, header) of each."""
    out: list[tuple[int, BatchHeader]] = []
    pos = 0
    n = len(buf)
    while pos < n:
        h = validate_batch(buf, pos)
        out.append((pos, h))
        pos += h.total_size
    return out
