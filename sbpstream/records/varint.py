"""Zigzag varints, as Kafka's record format uses them (design.md section 4). No I/O.

A value ``v`` is zigzag-mapped to ``(v << 1) ^ (v >> 63)`` (so -1 -> 1, 1 -> 2) and written in
little-endian groups of 7 bits, the high bit of each byte saying "more follows". Values are int64;
at most 10 bytes.

Encoding is on the producer's hot path, so the values that dominate (lengths under 8 KiB, small
timestamp deltas, -1 for null) come from a precomputed table of ``bytes`` objects.
"""

from __future__ import annotations

from typing import Final

from sbpstream.records.header import BatchError

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
MAX_VARINT_BYTES: Final = 10  # ceil(64 / 7): an int64 never needs more

# Table of encoded values for SMALL_MIN <= v < SMALL_MAX (all of them fit in 1 or 2 bytes).
SMALL_MIN: Final = -64
SMALL_MAX: Final = 8192


def encode_varint_slow(value: int) -> bytes:
    """Encode any int64; the table-free path."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"varint value {value} outside int64")
    zz = ((value << 1) ^ (value >> 63)) & 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while zz >= 0x80:
        out.append((zz & 0x7F) | 0x80)
        zz >>= 7
    out.append(zz)
    return bytes(out)


VARINT_TABLE: Final[tuple[bytes, ...]] = tuple(
    encode_varint_slow(v) for v in range(SMALL_MIN, SMALL_MAX)
)


def encode_varint(value: int) -> bytes:
    if SMALL_MIN <= value < SMALL_MAX:
        return VARINT_TABLE[value - SMALL_MIN]
    return encode_varint_slow(value)


# Decoding of a one-byte varint (b < 0x80): the hot case for every field of a small record.
ZIGZAG_BYTE: Final[tuple[int, ...]] = tuple((b >> 1) ^ -(b & 1) for b in range(0x80))


def decode_varint(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; return ``(value, next_pos)``. Raise BatchError if bad."""
    zz = 0
    shift = 0
    end = min(len(buf), pos + MAX_VARINT_BYTES)
    while pos < end:
        b = buf[pos]
        pos += 1
        zz |= (b & 0x7F) << shift
        if b < 0x80:
            if zz >> 64:
                raise BatchError("varint overflows int64")
            return (zz >> 1) ^ -(zz & 1), pos
        shift += 7
    if shift // 7 >= MAX_VARINT_BYTES:
        raise BatchError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    raise BatchError("truncated varint")
