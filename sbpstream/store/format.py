"""The log entry: the one on-disk record of the shared log. No I/O.

Every entry describes itself, so recovery can find the valid tail of a segment by walking it
(big-endian)::

    offset size field
    0      4    magic        u32  = 0x53425331 ("SBS1")
    4      4    length       u32  bytes of the whole entry, header included
    8      4    crc          u32  CRC-32C of bytes [12, length): everything after this field
    12     1    kind         u8   EntryKind
    13     1    flags        u8   0 (reserved)
    14     2    reserved     u16  0
    16     8    stream_id    i64
    24     4    range_index  i32  (-1 for stream-level entries: TRIM, DELETE, RETENTION)
    28     8    arg          i64  BATCH: append time (ms); CREATE_RANGE: start_offset;
                                  SEAL: end_offset (-1 = stop writes, end not yet known);
                                  TRIM: new start offset; RETENTION: retention_period_ms; DELETE: 0
    36     ...  body              BATCH: the record batch (base_offset already assigned); else empty
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

import crc32c

from sbpstream.records.header import MAX_BATCH_BYTES

ENTRY_MAGIC: Final = 0x53425331
ENTRY_STRUCT: Final = struct.Struct(">IIIBBHqiq")
ENTRY_HEADER_SIZE: Final = 36
assert ENTRY_STRUCT.size == ENTRY_HEADER_SIZE
CRC_FROM: Final = 12  # the entry CRC covers [12, length)
# The largest entry: a maximal batch plus the header.
MAX_ENTRY_BYTES: Final = ENTRY_HEADER_SIZE + MAX_BATCH_BYTES
# The tail of the header after the crc, packed separately so the CRC can be computed before the
# whole header is assembled.
_TAIL_STRUCT: Final = struct.Struct(">BBHqiq")
assert _TAIL_STRUCT.size == ENTRY_HEADER_SIZE - CRC_FROM


class EntryKind(enum.IntEnum):
    BATCH = 1
    CREATE_RANGE = 2
    SEAL = 3
    TRIM = 4
    DELETE = 5
    RETENTION = 6


META_KINDS: Final = frozenset(k for k in EntryKind if k is not EntryKind.BATCH)
_KIND_VALUES: Final = frozenset(int(k) for k in EntryKind)


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded entry header; ``position`` is where it starts in its segment."""

    position: int
    length: int
    kind: EntryKind
    stream_id: int
    range_index: int
    arg: int

    @property
    def body_position(self) -> int:
        return self.position + ENTRY_HEADER_SIZE

    @property
    def end(self) -> int:
        return self.position + self.length


def encode_header(
    kind: EntryKind, stream_id: int, range_index: int, arg: int,
    body: bytes | bytearray | memoryview = b"",
) -> bytes:
    """The 36 header bytes of an entry carrying ``body`` (the body is written after it)."""
    tail = _TAIL_STRUCT.pack(int(kind), 0, 0, stream_id, range_index, arg)
    crc = crc32c.crc32c(body, crc32c.crc32c(tail)) if body else crc32c.crc32c(tail)
    length = ENTRY_HEADER_SIZE + len(body)
    return struct.pack(">III", ENTRY_MAGIC, length, crc) + tail


def encode_entry(kind: EntryKind, stream_id: int, range_index: int, arg: int) -> bytes:
    """A whole metadata entry (no body)."""
    return encode_header(kind, stream_id, range_index, arg)


class EntryError(ValueError):
    """The bytes at a position are not a valid entry (torn, corrupt, or not an entry at all)."""


def decode_entry(buf: ReadableBuffer, position: int, limit: int) -> Entry:
    """Parse and verify (length bounds, CRC) the entry at ``position``; ``limit`` is the end of
    the readable region. Raises EntryError when the bytes there are not a whole valid entry."""
    if limit - position < ENTRY_HEADER_SIZE:
        raise EntryError(f"truncated entry header at {position}")
    magic, length, crc, kind, flags, reserved, stream_id, range_index, arg = (
        ENTRY_STRUCT.unpack_from(buf, position)
    )
    if magic != ENTRY_MAGIC:
        raise EntryError(f"bad entry magic 0x{magic:08x} at {position}")
    if length < ENTRY_HEADER_SIZE or length > MAX_ENTRY_BYTES:
        raise EntryError(f"bad entry length {length} at {position}")
    if length > limit - position:
        raise EntryError(f"truncated entry at {position}: {length} bytes, {limit - position} left")
    if kind not in _KIND_VALUES or flags or reserved:
        raise EntryError(f"bad entry kind/flags {kind}/{flags}/{reserved} at {position}")
    actual = crc32c.crc32c(memoryview(buf)[position + CRC_FROM : position + length])
    if actual != crc:
        raise EntryError(f"entry CRC mismatch at {position}: 0x{crc:08x} != 0x{actual:08x}")
    entry_kind = EntryKind(kind)
    if (entry_kind is EntryKind.BATCH) != (length > ENTRY_HEADER_SIZE):
        raise EntryError(f"entry kind {entry_kind.name} with body of {length} bytes at {position}")
    return Entry(position, length, entry_kind, stream_id, range_index, arg)
