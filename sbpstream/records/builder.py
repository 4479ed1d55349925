"""Build record batches (design.md section 4): the producer's hot path. No I/O.

Each record is encoded once, on ``append``, into small ``bytes`` pieces kept in a list; keys and
values are referenced, not copied, until ``build`` joins everything in one pass. The size bound is
on the *uncompressed* batch, which is what the builder knows as it goes; it also bounds what a
consumer must decompress.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import crc32c

from sbpstream.records.compression import compress
from sbpstream.records.header import (
    BATCH_MAGIC,
    CODEC_NONE,
    CRC_START,
    HEADER_SIZE,
    HEADER_STRUCT,
    KNOWN_CODECS,
    LENGTH_PREFIX_SIZE,
    MAX_BATCH_BYTES,
)
from sbpstream.records.varint import (
    INT64_MAX,
    INT64_MIN,
    SMALL_MAX,
    SMALL_MIN,
    VARINT_TABLE,
    encode_varint_slow,
)

# A producer's default batch bound: large enough to amortise per-batch costs (header, CRC,
# frame, one fsync share on the data node), small enough to keep latency and memory low.
DEFAULT_BATCH_BYTES_MAX: Final = 1024 * 1024
MAX_RECORDS_PER_BATCH: Final = (1 << 31) - 1  # record_count is an int32

_NULL: Final = VARINT_TABLE[-1 - SMALL_MIN]  # varint(-1): null key or value
_ZERO: Final = VARINT_TABLE[0 - SMALL_MIN]  # varint(0): no headers
# (timestamp delta, value length) -> (record prefix, record size) of plain records, all builders
PREFIX_CACHE_MAX: Final = 4096
_PREFIXES: dict[tuple[int, int], tuple[bytes, int]] = {}


_encode_rows: Callable[..., tuple[bytes, int, int, int]] | None
try:  # the compiled encoder of Arrow-layout columns (_speedups.pyx), when it was built
    from sbpstream.records._speedups import encode_rows as _encode_rows
except ImportError:  # pragma: no cover - a build without a C compiler
    _encode_rows = None
if os.environ.get("SBPSTREAM_PURE_PYTHON"):
    _encode_rows = None


@dataclass(frozen=True, slots=True)
class BinaryColumn:
    """An Arrow ``binary`` (or ``string``) column's buffers: int32 offsets, the bytes, the
    validity bitmap (None: no nulls), and the array's offset into them (a sliced array)."""

    offsets: Any
    data: Any
    validity: Any
    offset: int = 0

    def item(self, i: int) -> bytes | None:
        j = i + self.offset
        if self.validity is not None and not memoryview(self.validity)[j >> 3] >> (j & 7) & 1:
            return None
        offs = memoryview(self.offsets).cast("B").cast("i")
        return bytes(memoryview(self.data)[offs[j] : offs[j + 1]])


@dataclass(frozen=True, slots=True)
class Int64Column:
    """An Arrow int64-backed column (timestamps): values, validity (None: no nulls), the array's
    offset, and the divisor to milliseconds (1000 for Spark's microseconds; floor division)."""

    values: Any
    validity: Any
    offset: int = 0
    divisor: int = 1

    def item(self, i: int) -> int | None:
        j = i + self.offset
        if self.validity is not None and not memoryview(self.validity)[j >> 3] >> (j & 7) & 1:
            return None
        return int(memoryview(self.values).cast("B").cast("q")[j]) // self.divisor


class RecordTooLargeError(ValueError):
    """One record does not fit in an empty batch under the builder's size bound."""


class RecordLike(Protocol):
    """What ``BatchBuilder.append`` reads from a record."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...
    @property
    def timestamp_ms(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Record:
    """A record to produce."""

    value: bytes | None
    key: bytes | None = None
    headers: Sequence[tuple[str, bytes]] = ()
    timestamp_ms: int = 0


@dataclass(frozen=True, slots=True)
class EncodedRecords:
    """Records already encoded as an sbpstream records section (the bytes after a batch's
    header, uncompressed): ``count`` records whose timestamps are ``first_timestamp`` plus each
    one's delta, the first delta 0. What the Kafka gateway makes of a Kafka batch without
    decoding its records (:meth:`BatchBuilder.add_encoded`); the maker vouches for the bytes."""

    section: bytes
    count: int
    first_timestamp: int
    max_timestamp: int


_time_ns = time.time_ns


def now_ms() -> int:
    return _time_ns() // 1_000_000


class BatchBuilder:
    """Accumulate records for one batch under a size bound, then ``build()`` the batch bytes.

    ``append``/``add`` return False, leaving the builder unchanged, when the record would push
    the batch past ``batch_bytes_max``: the producer then builds this batch and starts another.
    A record too large even for an empty batch raises RecordTooLargeError.
    """

    __slots__ = (
        "_base_sequence",
        "_batch_bytes_max",
        "_c_head",
        "_c_rec",
        "_c_ts",
        "_c_vlen",
        "_codec",
        "_count",
        "_first_ts",
        "_max_ts",
        "_parts",
        "_producer_epoch",
        "_producer_id",
        "_size",
    )

    def __init__(
        self,
        *,
        codec: int = CODEC_NONE,
        batch_bytes_max: int = DEFAULT_BATCH_BYTES_MAX,
        producer_id: int = -1,
        producer_epoch: int = -1,
        base_sequence: int = -1,
    ) -> None:
        if codec not in KNOWN_CODECS:
            raise ValueError(f"unknown codec {codec}")
        if not HEADER_SIZE < batch_bytes_max <= MAX_BATCH_BYTES:
            raise ValueError(f"batch_bytes_max {batch_bytes_max} not in (53, {MAX_BATCH_BYTES}]")
        self._codec = codec
        self._batch_bytes_max = batch_bytes_max
        self._producer_id = producer_id
        self._producer_epoch = producer_epoch
        self._base_sequence = base_sequence
        self._parts: list[bytes] = []
        self._count = 0
        self._size = HEADER_SIZE
        self._first_ts = 0
        self._max_ts = INT64_MIN
        # The prefix (length, timestamp delta, null key, value length) of the last plain record
        # (no key, no headers), for its timestamp and value length: records sent in the same
        # millisecond with the same size (the common case) reuse it.
        self._c_ts = -1
        self._c_vlen = -1
        self._c_head = b""
        self._c_rec = 0

    def __len__(self) -> int:
        return self._count

    @property
    def size_bytes(self) -> int:
        """Size of the batch built now, before compression."""
        return self._size

    def append(self, record: RecordLike) -> bool:
        return self.add(record.value, record.key, record.headers, record.timestamp_ms)

    def add(
        self,
        value: bytes | None,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        timestamp_ms: int | None = None,
    ) -> bool:
        """Encode one record; return False (and change nothing) if it does not fit."""
        ts = _time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms
        if key is None and value is not None and not headers:  # the plain record: fast path
            vlen = len(value)
            count = self._count
            if ts != self._c_ts or vlen != self._c_vlen:
                # another millisecond or size: the shared prefix cache, inline when it hits
                cached = _PREFIXES.get((ts - self._first_ts if count else 0, vlen))
                if cached is None or not 0 <= ts <= INT64_MAX:
                    self._plain_prefix(ts, vlen)
                else:
                    self._c_head, self._c_rec = cached
                    self._c_ts = ts
                    self._c_vlen = vlen
            size = self._size + self._c_rec
            if size > self._batch_bytes_max or count == MAX_RECORDS_PER_BATCH:
                if count == 0:
                    raise RecordTooLargeError(
                        f"record of {size - HEADER_SIZE} bytes exceeds the batch bound "
                        f"{self._batch_bytes_max} on its own"
                    )
                return False
            parts = self._parts
            parts.append(self._c_head)
            parts.append(value)
            parts.append(_ZERO)
            if count == 0:
                self._first_ts = ts
            if ts > self._max_ts:
                self._max_ts = ts
            self._count = count + 1
            self._size = size
            return True
        table = VARINT_TABLE
        if self._count:
            delta = ts - self._first_ts
            if not SMALL_MIN <= delta < SMALL_MAX or ts < 0:
                _check_timestamp(ts)
                d = encode_varint_slow(delta)
            else:
                d = table[delta - SMALL_MIN]
        else:
            _check_timestamp(ts)
            d = _ZERO
        if key is None:
            kl, klen = _NULL, 0
        else:
            klen = len(key)
            kl = table[klen - SMALL_MIN] if klen < SMALL_MAX else encode_varint_slow(klen)
        if value is None:
            vl, vlen = _NULL, 0
        else:
            vlen = len(value)
            vl = table[vlen - SMALL_MIN] if vlen < SMALL_MAX else encode_varint_slow(vlen)
        hdr = _encode_headers(headers) if headers else _ZERO
        body = len(d) + len(kl) + klen + len(vl) + vlen + len(hdr)
        ln = table[body - SMALL_MIN] if body < SMALL_MAX else encode_varint_slow(body)
        size = self._size + len(ln) + body
        if size > self._batch_bytes_max or self._count == MAX_RECORDS_PER_BATCH:
            if self._count == 0:
                raise RecordTooLargeError(
                    f"record of {size - HEADER_SIZE} bytes exceeds the batch bound "
                    f"{self._batch_bytes_max} on its own"
                )
            return False
        parts = self._parts
        parts.append(ln)
        parts.append(d)
        parts.append(kl)
        if key is not None:
            parts.append(key)
        parts.append(vl)
        if value is not None:
            parts.append(value)
        parts.append(hdr)
        if self._count == 0:
            self._first_ts = ts
        if ts > self._max_ts:
            self._max_ts = ts
        self._count += 1
        self._size = size
        return True

    def _plain_prefix(self, ts: int, vlen: int) -> None:
        """Cache the prefix of a record with no key and no headers (``add``'s fast path).

        Prefixes are shared by every builder through ``_PREFIXES``, keyed by (timestamp delta,
        value length): a producer writing to many streams adds each builder's records
        milliseconds apart (a per-builder miss), but the same few deltas and sizes recur.
        """
        if not 0 <= ts <= INT64_MAX:
            _check_timestamp(ts)
        delta = ts - self._first_ts if self._count else 0
        cached = _PREFIXES.get((delta, vlen))
        if cached is None:
            d = VARINT_TABLE[delta - SMALL_MIN] if SMALL_MIN <= delta < SMALL_MAX \
                else encode_varint_slow(delta)
            vl = VARINT_TABLE[vlen - SMALL_MIN] if vlen < SMALL_MAX else encode_varint_slow(vlen)
            body = len(d) + 1 + len(vl) + vlen + 1  # + null key, + no headers
            ln = VARINT_TABLE[body - SMALL_MIN] if body < SMALL_MAX else encode_varint_slow(body)
            cached = (b"".join((ln, d, _NULL, vl)), len(ln) + body)
            if len(_PREFIXES) >= PREFIX_CACHE_MAX:
                _PREFIXES.clear()
            _PREFIXES[(delta, vlen)] = cached
        self._c_head, self._c_rec = cached
        self._c_ts = ts
        self._c_vlen = vlen

    def add_values(
        self,
        values: Sequence[bytes | None],
        start: int,
        key: bytes | None,
        timestamp_ms: int,
    ) -> int:
        """Encode ``values[start:]`` (same key, no headers, one timestamp) until the batch is full;
        return the index of the first value not added (``start`` when none fitted).

        The bulk path of the producer: the same records as ``add`` per value, with the record
        prefix (length, timestamp delta, key, value length) computed once per run of equal value
        lengths. Raises RecordTooLargeError when the first value does not fit an empty batch.
        """
        count = self._count
        ts = timestamp_ms
        if count:
            delta = ts - self._first_ts
            if SMALL_MIN <= delta < SMALL_MAX and ts >= 0:
                d = VARINT_TABLE[delta - SMALL_MIN]
            else:
                _check_timestamp(ts)
                d = encode_varint_slow(delta)
        else:
            _check_timestamp(ts)
            d = _ZERO
        if key is None:
            dk = d + _NULL
        else:
            klen = len(key)
            dk = b"".join((d, VARINT_TABLE[klen - SMALL_MIN] if klen < SMALL_MAX
                           else encode_varint_slow(klen), key))
        fixed = len(dk) + 1  # + the headers count, varint(0)
        size = self._size
        limit = self._batch_bytes_max
        end = min(len(values), start + MAX_RECORDS_PER_BATCH - count)
        append = self._parts.append
        zero = _ZERO
        last_len = -2  # the value length the cached prefix is for (-1: null value)
        head = b""
        rec = 0
        i = start
        while i < end:
            v = values[i]
            vlen = -1 if v is None else len(v)
            if vlen != last_len:
                if vlen < 0:
                    vl, n = _NULL, 0
                else:
                    vl = VARINT_TABLE[vlen - SMALL_MIN] if vlen < SMALL_MAX \
                        else encode_varint_slow(vlen)
                    n = vlen
                body = fixed + len(vl) + n
                ln = VARINT_TABLE[body - SMALL_MIN] if body < SMALL_MAX \
                    else encode_varint_slow(body)
                head = b"".join((ln, dk, vl))
                rec = len(ln) + body
                last_len = vlen
            if size + rec > limit:
                break
            append(head)
            if v is not None:
                append(v)
            append(zero)
            size += rec
            i += 1
        if i == start:
            if count == 0 and start < len(values):
                raise RecordTooLargeError(
                    f"record of {rec} bytes exceeds the batch bound {limit} on its own")
            return i
        if count == 0:
            self._first_ts = ts
        if ts > self._max_ts:
            self._max_ts = ts
        self._count = count + i - start
        self._size = size
        return i

    def add_columns(self, values: BinaryColumn, keys: BinaryColumn | None,
                    stamps: Int64Column | None, default_ts: int, start: int, stop: int) -> int:
        """Encode rows ``[start, stop)`` of Arrow-layout columns (no headers) until the batch is
        full; return the index of the first row not added (``start`` when none fitted).

        The same records, byte for byte, and the same cut as calling ``add(value, key, (), ts)``
        per row (ts: the row's stamp in ms, or ``default_ts`` when null or absent), but with no
        Python object per row when the compiled encoder is built. RecordTooLargeError when the
        first row does not fit an empty batch."""
        count = self._count
        if _encode_rows is None:
            for i in range(start, stop):
                ts = stamps.item(i) if stamps is not None else None
                if not self.add(values.item(i), keys.item(i) if keys is not None else None, (),
                                default_ts if ts is None else ts):
                    return i
            return stop
        chunk, n, first, last = _encode_rows(
            (values.offsets, values.data, values.validity, values.offset),
            None if keys is None else (keys.offsets, keys.data, keys.validity, keys.offset),
            None if stamps is None else (stamps.values, stamps.validity, stamps.offset,
                                         stamps.divisor),
            default_ts, start, stop, self._batch_bytes_max - self._size,
            MAX_RECORDS_PER_BATCH - count, self._first_ts, count > 0)
        if n == 0:
            if count == 0 and start < stop:
                raise RecordTooLargeError(
                    f"record of row {start} exceeds the batch bound {self._batch_bytes_max} on "
                    "its own")
            return start
        self._parts.append(chunk)
        self._first_ts = first
        self._max_ts = max(self._max_ts, last)
        self._count = count + n
        self._size += len(chunk)
        self._c_ts = -1  # the plain-record prefix cache is per first timestamp
        return start + n

    def add_encoded(self, records: EncodedRecords) -> bool:
        """Take an encoded records section whole into an EMPTY builder (False, changing nothing,
        when the builder holds records: the section's timestamp deltas are from its own first
        timestamp). RecordTooLargeError when it exceeds the batch bound."""
        if self._count:
            return False
        size = HEADER_SIZE + len(records.section)
        if size > self._batch_bytes_max or not 0 < records.count <= MAX_RECORDS_PER_BATCH:
            raise RecordTooLargeError(
                f"{records.count} records of {size - HEADER_SIZE} bytes exceed the batch bound "
                f"{self._batch_bytes_max}")
        _check_timestamp(records.first_timestamp)
        self._parts.append(records.section)
        self._count = records.count
        self._size = size
        self._first_ts = records.first_timestamp
        self._max_ts = records.max_timestamp
        self._c_ts = -1  # the plain-record prefix cache is per first timestamp
        return True

    def build(self) -> bytes:
        """The batch, base_offset -1; stored uncompressed if compression does not shrink it."""
        if not self._count:
            raise ValueError("cannot build an empty batch")
        raw = b"".join(self._parts)
        codec = self._codec
        payload = compress(codec, raw) if codec != CODEC_NONE else raw
        if len(payload) >= len(raw):
            codec, payload = CODEC_NONE, raw
        header = bytearray(
            HEADER_STRUCT.pack(
                -1,
                HEADER_SIZE - LENGTH_PREFIX_SIZE + len(payload),
                BATCH_MAGIC,
                0,
                codec,
                self._count,
                self._first_ts,
                self._max_ts,
                self._producer_id,
                self._producer_epoch,
                self._base_sequence,
            )
        )
        # gil_release_mode=0: keep the GIL (a batch's CRC takes ~0.1 ms); released, the thread
        # waits up to a switch interval (5 ms) to get it back while another thread runs, as the
        # sync client's loop thread does behind the caller's sends (docs/benchmarks.md)
        crc = crc32c.crc32c(payload, crc32c.crc32c(memoryview(header)[CRC_START:]),
                            gil_release_mode=0)
        header[13:17] = crc.to_bytes(4, "big")
        return b"".join((header, payload))


def _check_timestamp(ts: int) -> None:
    # Deltas from the first timestamp must stay int64 too: keep timestamps non-negative.
    if not 0 <= ts <= INT64_MAX:
        raise ValueError(f"timestamp_ms {ts} not in [0, 2**63)")


def _encode_headers(headers: Sequence[tuple[str, bytes]]) -> bytes:
    parts = [encode_varint_slow(len(headers))]
    for name, value in headers:
        raw_name = name.encode("utf-8")
        parts += (encode_varint_slow(len(raw_name)), raw_name)
        parts += (encode_varint_slow(len(value)), value)
    return b"".join(parts)


def build_batch(
    records: Iterable[RecordLike],
    *,
    codec: int = CODEC_NONE,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> bytes:
    """One batch holding all ``records``; ValueError if they exceed MAX_BATCH_BYTES."""
    b = BatchBuilder(
        codec=codec,
        batch_bytes_max=MAX_BATCH_BYTES,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
    )
    for r in records:
        if not b.append(r):
            raise ValueError(f"records exceed MAX_BATCH_BYTES ({MAX_BATCH_BYTES})")
    return b.build()
