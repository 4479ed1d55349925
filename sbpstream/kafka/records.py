"""Kafka record batch v2 to and from sbpstream records. No I/O.

Kafka's batch (protocol guide, "Record Batch")::

    baseOffset int64, batchLength int32, partitionLeaderEpoch int32, magic int8 (=2),
    crc uint32 (CRC-32C of attributes..end), attributes int16, lastOffsetDelta int32,
    baseTimestamp int64, maxTimestamp int64, producerId int64, producerEpoch int16,
    baseSequence int32, records [Record] (int32 count)

    Record: length varint, attributes int8, timestampDelta varlong, offsetDelta varint,
            key varint-length bytes, value varint-length bytes,
            headers [varint count] (key varint-length string, value varint-length bytes)

Attributes bits 0-2 are the codec (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd), bit 3 the timestamp
type (1: LogAppendTime), bit 4 transactional, bit 5 control. sbpstream's batch has the same
records minus the per-record attributes and offset delta (see :mod:`sbpstream.records`).
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import cramjam
import crc32c
import lz4.frame
import zstandard

from sbpstream.kafka.codec import KafkaDecodeError, uvarint
from sbpstream.records import (
    MAX_BATCH_BYTES,
    BatchError,
    EncodedRecords,
    Record,
    read_header,
)
from sbpstream.records.reader import open_batch
from sbpstream.records.varint import (
    INT64_MAX,
    SMALL_MAX,
    SMALL_MIN,
    VARINT_TABLE,
    ZIGZAG_BYTE,
    decode_varint,
)
from sbpstream.records.varint import encode_varint as varint

_Loop = Callable[[Any, int, int], "tuple[bytes, int] | None"]
_to_sbp: _Loop | None
_to_kafka: _Loop | None
try:  # the compiled record loops (_transcode.pyx), when they were built
    from sbpstream.kafka import _transcode

    _to_sbp, _to_kafka = _transcode.kafka_to_sbp, _transcode.sbp_to_kafka_records
except ImportError:  # pragma: no cover - a build without a C compiler
    _to_sbp = _to_kafka = None
if os.environ.get("SBPSTREAM_PURE_PYTHON"):
    _to_sbp = _to_kafka = None

KAFKA_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
KAFKA_HEADER_SIZE: Final = 61
assert KAFKA_HEADER.size == KAFKA_HEADER_SIZE
CRC_START: Final = 21  # attributes
LENGTH_PREFIX: Final = 12  # baseOffset + batchLength
MAGIC_OFFSET: Final = 16

CODEC_NONE: Final = 0
CODEC_GZIP: Final = 1
CODEC_SNAPPY: Final = 2
CODEC_LZ4: Final = 3
CODEC_ZSTD: Final = 4
ATTR_CODEC: Final = 0x07
ATTR_LOG_APPEND_TIME: Final = 0x08
ATTR_TRANSACTIONAL: Final = 0x10
ATTR_CONTROL: Final = 0x20

MAX_RECORDS_PER_BATCH: Final = 1_000_000
"""A produced batch claiming more records than this is refused (every record is >= 7 bytes, so
a 16 MiB batch holds fewer anyway)."""
MIN_RECORD_BYTES: Final = 7  # length, attributes, ts delta, offset delta, key, value, headers


class UnsupportedBatchError(KafkaDecodeError):
    """A well-formed batch the gateway does not store: snappy, transactional or control."""


MAX_INFLATED_BATCH_BYTES: Final = MAX_BATCH_BYTES
"""What one Kafka batch may decompress to: it is stored as one sbpstream batch, which cannot be
larger, so more is refused (MESSAGE_TOO_LARGE) the moment the decompressor's output passes it,
never after inflating the whole thing (a 32 MiB lz4 request of zeros inflates to ~8 GiB)."""
MAX_INFLATED_REQUEST_BYTES: Final = 4 * MAX_BATCH_BYTES
"""What all the batches of one Produce request may decompress to together: a request holds
many batches, each under :data:`MAX_INFLATED_BATCH_BYTES`, and their records are all held in
memory until stored."""


class InflateLimitError(KafkaDecodeError):
    """Compressed records inflate beyond a bound (MESSAGE_TOO_LARGE)."""


class InflateBudget:
    """Bytes the batches of one request may still decompress to (shared by its partitions)."""

    __slots__ = ("left",)

    def __init__(self, total: int = MAX_INFLATED_REQUEST_BYTES) -> None:
        self.left = total

    def limit(self) -> int:
        """The bound of the next batch: the per-batch bound or what the request has left."""
        return min(MAX_INFLATED_BATCH_BYTES, self.left)

    def spend(self, n: int) -> None:
        self.left -= n


class UnsupportedCompressionError(UnsupportedBatchError):
    pass


KafkaRecord = Record
"""A decoded Kafka record is the SDK's record to produce (value, key, headers, timestamp_ms):
the gateway hands them to the producer as they are."""


@dataclass(frozen=True, slots=True)
class KafkaBatch:
    """A produced batch's idempotence fields and its records: decoded (``records``), or, from
    ``decode_batches(..., encode=True)``, converted whole to an sbpstream records section
    (``encoded``; ``records`` then empty) when they can be."""

    producer_id: int
    producer_epoch: int
    base_sequence: int
    records: list[KafkaRecord]
    encoded: EncodedRecords | None = None

    @property
    def count(self) -> int:
        return self.encoded.count if self.encoded is not None else len(self.records)

    @property
    def last_sequence(self) -> int:
        return (self.base_sequence + self.count - 1) & 0x7FFFFFFF


XERIAL_MAGIC: Final = b"\x82SNAPPY\x00"
"""snappy-java's stream framing (Kafka's Java producer): magic, int32 version, int32 minimum
compatible version, then blocks of int32 length + a raw snappy block. librdkafka writes one
raw snappy block; both are read."""
XERIAL_HEADER: Final = len(XERIAL_MAGIC) + 8


def _snappy_block(block: memoryview, budget: int) -> bytes:
    """One raw snappy block, its declared length checked against ``budget`` first."""
    size, _ = _uvarint_prefix(block)
    if size > budget:
        raise InflateLimitError(f"snappy records exceed the decompression bound ({budget})")
    try:
        out = bytes(cramjam.snappy.decompress_raw(bytes(block)))
    except Exception as e:  # cramjam's DecompressionError
        raise KafkaDecodeError(f"cannot decompress snappy records: {e}") from None
    if len(out) != size:
        raise KafkaDecodeError("snappy block length does not match its preamble")
    return out


def _uvarint_prefix(buf: memoryview) -> tuple[int, int]:
    """(value, bytes used) of the unsigned varint at the start of ``buf``."""
    result = shift = 0
    for i, b in enumerate(buf[:10]):
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i + 1
        shift += 7
    raise KafkaDecodeError("bad snappy length preamble")


def _unsnappy(data: memoryview, limit: int) -> bytes:
    if bytes(data[:len(XERIAL_MAGIC)]) != XERIAL_MAGIC:
        return _snappy_block(data, limit)
    if len(data) < XERIAL_HEADER:
        raise KafkaDecodeError("truncated snappy stream header")
    parts: list[bytes] = []
    pos, total = XERIAL_HEADER, 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise KafkaDecodeError("truncated snappy block length")
        n = int.from_bytes(data[pos:pos + 4], "big", signed=True)
        pos += 4
        if n < 0 or pos + n > len(data):
            raise KafkaDecodeError(f"bad snappy block length {n}")
        parts.append(_snappy_block(data[pos:pos + n], limit - total))
        total += len(parts[-1])
        pos += n
    return b"".join(parts)


def _decompress(codec: int, data: memoryview, limit: int) -> bytes:
    """One records section decompressed, refused (InflateLimitError) as soon as the output
    passes ``limit``: every codec is driven with a maximum output, never run to its end first.
    """
    too_big = InflateLimitError(f"records inflate beyond {limit} bytes (codec {codec})")
    try:
        if codec == CODEC_GZIP:
            d = zlib.decompressobj(wbits=31)
            out = d.decompress(data, limit + 1)
            if len(out) > limit or d.unconsumed_tail:
                raise too_big
            if not d.eof:
                raise KafkaDecodeError("truncated gzip records")
            return out
        if codec == CODEC_LZ4:
            lz = lz4.frame.LZ4FrameDecompressor()
            out = lz.decompress(data, max_length=limit + 1)
            if len(out) > limit:
                raise too_big
            if not lz.eof:
                raise KafkaDecodeError("truncated lz4 records")
            return bytes(out)
        if codec == CODEC_ZSTD:
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(data, read_across_frames=True) as rd:
                out = rd.read(limit + 1)
            if len(out) > limit:
                raise too_big
            return bytes(out)
    except KafkaDecodeError:
        raise
    except Exception as e:  # every decompressor's own error types
        raise KafkaDecodeError(f"cannot decompress records (codec {codec}): {e}") from None
    if codec == CODEC_SNAPPY:
        return _unsnappy(data, limit)
    raise UnsupportedCompressionError(f"unknown compression codec {codec}")


def decode_batches(buf: bytes | memoryview, now_ms: int | None = None,
                   budget: InflateBudget | None = None, encode: bool = False
                   ) -> list[KafkaBatch]:
    """The batches of a Produce partition's ``records``: CRC checked, decompressed, decoded.

    ``encode``: each batch's records are converted to an sbpstream records section without
    being decoded (:func:`kafka_to_sbp`; the gateway's Produce), unless that cannot be done
    whole (LogAppendTime, a first timestamp delta other than 0, a null header value, anything
    malformed): then they are decoded (which raises the error of a malformed record).

    Decompression is bounded per batch and by ``budget`` (one request's, shared by its
    partitions; a fresh one when None): InflateLimitError beyond (MESSAGE_TOO_LARGE).

    KafkaDecodeError (CORRUPT_MESSAGE) for anything malformed; UnsupportedBatchError for a batch
    that is well-formed but not storable (magic < 2 is reported as malformed)."""
    mv = memoryview(buf)
    out: list[KafkaBatch] = []
    pos = 0
    budget = budget if budget is not None else InflateBudget()
    while pos < len(mv):
        if len(mv) - pos < KAFKA_HEADER_SIZE:
            raise KafkaDecodeError("truncated record batch header")
        (_base, length, _epoch, magic, crc, attrs, _last_delta, base_ts, _max_ts, pid, pepoch,
         base_seq, count) = KAFKA_HEADER.unpack_from(mv, pos)
        if magic != 2:
            raise KafkaDecodeError(f"record batch magic {magic}: only v2 batches are accepted")
        end = pos + LENGTH_PREFIX + length
        if length < KAFKA_HEADER_SIZE - LENGTH_PREFIX or end > len(mv):
            raise KafkaDecodeError(f"bad batch length {length}")
        if crc32c.crc32c(mv[pos + CRC_START : end]) != crc:
            raise KafkaDecodeError("record batch CRC mismatch")
        if attrs & (ATTR_TRANSACTIONAL | ATTR_CONTROL):
            raise UnsupportedBatchError("transactional and control batches are not supported")
        if not 0 < count <= MAX_RECORDS_PER_BATCH:
            raise KafkaDecodeError(f"bad record count {count}")
        section: memoryview | bytes = mv[pos + KAFKA_HEADER_SIZE : end]
        codec = attrs & ATTR_CODEC
        if codec != CODEC_NONE:
            section = _decompress(codec, memoryview(section), budget.limit())
            budget.spend(len(section))
        if count > len(section) // MIN_RECORD_BYTES:
            raise KafkaDecodeError(f"{count} records cannot fit in {len(section)} bytes")
        if attrs & ATTR_LOG_APPEND_TIME or base_ts < 0:
            base_ts = time.time_ns() // 1_000_000 if now_ms is None else now_ms
            fixed_ts: int | None = base_ts
        else:
            fixed_ts = None
        got = kafka_to_sbp(section, count, base_ts) if encode and fixed_ts is None else None
        if got is not None:
            enc = EncodedRecords(got[0], count, base_ts, got[1])
            out.append(KafkaBatch(pid, pepoch, base_seq, [], enc))
        else:
            out.append(KafkaBatch(pid, pepoch, base_seq,
                                  _decode_records(section, count, base_ts, fixed_ts)))
        pos = end
    return out


def kafka_to_sbp(section: memoryview | bytes, count: int, base_ts: int
                 ) -> tuple[bytes, int] | None:
    """(sbpstream records section, max timestamp) of a Kafka records section of ``count``
    records with timestamps ``base_ts`` (>= 0) + delta, each record copied behind a new length
    without its attributes byte and offset delta; None when the records cannot be taken whole
    (malformed, a first timestamp delta other than 0, a null header value, a timestamp out of
    int64): the caller decodes them instead. Compiled when built (_transcode.pyx)."""
    if _to_sbp is not None:
        return _to_sbp(section, count, base_ts)
    buf = bytes(section)
    end = len(buf)
    zz = ZIGZAG_BYTE
    table = VARINT_TABLE
    parts: list[bytes] = []
    pos = 0
    max_ts = base_ts

    def vint(pos: int) -> tuple[int, int]:
        b = buf[pos]
        if b < 0x80:
            return zz[b], pos + 1
        return decode_varint(buf, pos)

    try:
        for i in range(count):
            length, pos = vint(pos)
            rec_end = pos + length
            if length < MIN_RECORD_BYTES - 1 or rec_end > end:
                return None
            ts_start = pos + 1  # after the attributes byte
            ts_delta, ts_end = vint(ts_start)
            _, body = vint(ts_end)  # the offset delta: records are contiguous
            ts = base_ts + ts_delta
            if (i == 0 and ts_delta) or not 0 <= ts <= INT64_MAX:
                return None
            if ts > max_ts:
                max_ts = ts
            n, pos = vint(body)  # key
            if not -1 <= n <= rec_end - pos:
                return None
            pos += max(n, 0)
            n, pos = vint(pos)  # value
            if not -1 <= n <= rec_end - pos:
                return None
            pos += max(n, 0)
            hcount, pos = vint(pos)
            if not 0 <= hcount <= (rec_end - pos) // 2:
                return None
            for _h in range(hcount):
                n, pos = vint(pos)
                if not 0 <= n <= rec_end - pos:
                    return None
                str(buf[pos:pos + n], "utf-8")
                n, pos = vint(pos + n)
                if not 0 <= n <= rec_end - pos:
                    return None  # a null header value (-1) is converted the slow way
                pos += n
            if pos != rec_end:
                return None
            sl = (ts_end - ts_start) + (rec_end - body)
            parts += (table[sl - SMALL_MIN] if sl < SMALL_MAX else varint(sl),
                      buf[ts_start:ts_end], buf[body:rec_end])
    except (IndexError, BatchError, UnicodeDecodeError):
        return None
    if pos != end:
        return None
    return b"".join(parts), max_ts


def _decode_records(section: memoryview | bytes, count: int, base_ts: int,
                    fixed_ts: int | None) -> list[KafkaRecord]:
    """The hot loop of Produce: one- and two-byte varints (the usual case) are decoded
    without a call to the general decoder."""
    buf = bytes(section)
    end = len(buf)
    zz = ZIGZAG_BYTE
    out: list[KafkaRecord] = []
    pos = 0

    def vint(pos: int) -> tuple[int, int]:
        b = buf[pos]
        if b < 0x80:
            return zz[b], pos + 1
        c = buf[pos + 1]
        if c < 0x80:  # two bytes: lengths and timestamp deltas up to 8 KiB / 8 s
            u = (b & 0x7F) | (c << 7)
            return (u >> 1) ^ -(u & 1), pos + 2
        return decode_varint(buf, pos)

    try:
        for _ in range(count):
            length, pos = vint(pos)
            rec_end = pos + length
            if length < MIN_RECORD_BYTES - 1 or rec_end > end:
                raise KafkaDecodeError(f"bad record length {length}")
            # attributes (1 byte, unused), timestamp delta, offset delta (records are
            # contiguous: the position is the delta)
            ts_delta, pos = vint(pos + 1)
            _, pos = vint(pos)
            n, pos = vint(pos)
            if n == -1:
                key = None
            elif 0 <= n <= rec_end - pos:
                key = buf[pos:pos + n]
                pos += n
            else:
                raise KafkaDecodeError(f"bad key length {n}")
            n, pos = vint(pos)
            if n == -1:
                value = None
            elif 0 <= n <= rec_end - pos:
                value = buf[pos:pos + n]
                pos += n
            else:
                raise KafkaDecodeError(f"bad value length {n}")
            hcount, pos = vint(pos)
            if not 0 <= hcount <= rec_end - pos:
                raise KafkaDecodeError(f"bad header count {hcount}")
            headers: list[tuple[str, bytes]] = []
            for _h in range(hcount):
                n, pos = vint(pos)
                if not 0 <= n <= rec_end - pos:
                    raise KafkaDecodeError(f"bad header key length {n}")
                name = str(buf[pos:pos + n], "utf-8")
                pos += n
                n, pos = vint(pos)
                if n == -1:
                    headers.append((name, b""))
                elif 0 <= n <= rec_end - pos:
                    headers.append((name, buf[pos:pos + n]))
                    pos += n
                else:
                    raise KafkaDecodeError(f"bad header value length {n}")
            if pos != rec_end:
                raise KafkaDecodeError("record length does not match its fields")
            ts = fixed_ts if fixed_ts is not None else base_ts + ts_delta
            if ts < 0:
                raise KafkaDecodeError(f"negative record timestamp {ts}")
            out.append(Record(value, key, tuple(headers), ts))
    except IndexError:
        raise KafkaDecodeError("record runs past the end of the records section") from None
    except UnicodeDecodeError:
        raise KafkaDecodeError("header key is not UTF-8") from None
    except BatchError as e:  # decode_varint's
        raise KafkaDecodeError(str(e)) from None
    if pos != end:
        raise KafkaDecodeError(f"{end - pos} bytes after the last record")
    return out


# ------------------------------------------------------------------------------ sbp -> kafka

_NULL: Final = varint(-1)
_ZERO: Final = varint(0)


KRecord = tuple[int, bytes | memoryview | None, bytes | memoryview | None,
                tuple[tuple[str, bytes], ...]]


def encode_batch(base_offset: int, records: Sequence[KRecord]) -> bytes:
    """One uncompressed Kafka v2 batch of ``(timestamp_ms, key, value, headers)`` records at
    consecutive offsets from ``base_offset`` (no producer id: the gateway's, not the client's)."""
    base_ts = records[0][0]
    max_ts = base_ts
    parts: list[bytes] = []
    for delta, (ts, key, value, headers) in enumerate(records):
        if ts > max_ts:
            max_ts = ts
        body = [b"\x00", varint(ts - base_ts), varint(delta)]
        if key is None:
            body.append(_NULL)
        else:
            body += (varint(len(key)), bytes(key))
        if value is None:
            body.append(_NULL)
        else:
            body += (varint(len(value)), bytes(value))
        if headers:
            body.append(varint(len(headers)))
            for name, hv in headers:
                raw = name.encode("utf-8")
                body += (varint(len(raw)), raw, varint(len(hv)), bytes(hv))
        else:
            body.append(_ZERO)
        rec = b"".join(body)
        parts += (varint(len(rec)), rec)
    payload = b"".join(parts)
    header = bytearray(KAFKA_HEADER.pack(
        base_offset, KAFKA_HEADER_SIZE - LENGTH_PREFIX + len(payload), -1, 2, 0, 0,
        len(records) - 1, base_ts, max_ts, -1, -1, -1, len(records)))
    crc = crc32c.crc32c(payload, crc32c.crc32c(memoryview(header)[CRC_START:]))
    struct.pack_into(">I", header, 17, crc)
    return bytes(header) + payload


def sbp_to_kafka(batches: list[memoryview], start_offset: int, max_bytes: int) -> tuple[bytes, int]:
    """Kafka batches for the records at and after ``start_offset`` of sbpstream ``batches``,
    one Kafka batch per sbpstream batch, stopping once ``max_bytes`` is reached (the first batch
    always goes, as in Kafka). Returns the bytes and the offset after the last record.

    No record is decoded: an sbpstream record is a Kafka record without the attributes byte
    and the offset delta (length, timestamp delta from the batch's first timestamp, then key,
    value and headers encoded alike), so each one is copied behind a new length, a zero
    attributes byte, its timestamp delta's bytes and its offset delta."""
    out: list[bytes] = []
    size = 0
    next_offset = start_offset
    for b in batches:
        h = read_header(b)
        if h.base_offset + h.record_count <= start_offset:
            continue
        h, section = open_batch(b, verify_crc=False)  # the data node checked it
        first = max(h.base_offset, start_offset)
        payload, n = _kafka_records(section, h.record_count, first - h.base_offset)
        header = bytearray(KAFKA_HEADER.pack(
            first, KAFKA_HEADER_SIZE - LENGTH_PREFIX + len(payload), -1, 2, 0, 0, n - 1,
            h.first_timestamp, h.max_timestamp, -1, -1, -1, n))
        crc = crc32c.crc32c(payload, crc32c.crc32c(memoryview(header)[CRC_START:]))
        struct.pack_into(">I", header, 17, crc)
        if out and size + len(header) + len(payload) > max_bytes:
            break
        out += (bytes(header), payload)
        size += len(header) + len(payload)
        next_offset = first + n
    return b"".join(out), next_offset


def _kafka_records(section: memoryview, count: int, skip: int) -> tuple[bytes, int]:
    """The Kafka records section of an sbpstream records section, without its first ``skip``
    records; (bytes, records). Compiled when built (_transcode.pyx; a malformed section is
    walked again here, which raises the error)."""
    if _to_kafka is not None:
        got = _to_kafka(section, count, skip)
        if got is not None:
            return got
    buf = section.tobytes()
    zz = ZIGZAG_BYTE
    table = VARINT_TABLE
    parts: list[bytes] = []
    pos = 0
    try:
        for i in range(count):
            c = buf[pos]
            if c < 0x80:
                length, pos = zz[c], pos + 1
            elif buf[pos + 1] < 0x80:  # two bytes: records up to 8 KiB
                u = (c & 0x7F) | (buf[pos + 1] << 7)
                length, pos = (u >> 1) ^ -(u & 1), pos + 2
            else:
                length, pos = decode_varint(buf, pos)
            end = pos + length
            if i >= skip:
                ts_end = pos
                while buf[ts_end] & 0x80:
                    ts_end += 1
                ts_end += 1
                od = i - skip
                odv = table[od - SMALL_MIN] if od < SMALL_MAX else varint(od)
                kl = length + 1 + len(odv)
                parts += (table[kl - SMALL_MIN] if kl < SMALL_MAX else varint(kl), b"\x00",
                          buf[pos:ts_end], odv, buf[ts_end:end])
            pos = end
    except IndexError:
        raise BatchError("record runs past the end of the records section") from None
    if pos != len(buf):
        raise BatchError(f"{len(buf) - pos} bytes after the last record")
    return b"".join(parts), count - skip


__all__ = [
    "KafkaBatch",
    "KafkaRecord",
    "UnsupportedBatchError",
    "UnsupportedCompressionError",
    "decode_batches",
    "encode_batch",
    "kafka_to_sbp",
    "sbp_to_kafka",
    "uvarint",
]
