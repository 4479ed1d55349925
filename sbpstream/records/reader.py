"""Decode record batches (design.md section 4), lazily and without copying. No I/O.

``iter_batches`` walks a buffer of whole batches back to back (what FETCH returns) and yields a
memoryview per batch; ``iter_records`` validates one batch and yields its records, whose key and
value are memoryviews into the batch (or into its decompressed records): nothing is copied that
the consumer does not touch. Those views keep the underlying buffer alive.

Every malformation raises BatchError, never IndexError, UnicodeDecodeError or a decompressor's
own exception; decompression is bounded by MAX_DECOMPRESSED_BYTES.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, cast

from sbpstream.records.compression import decompress
from sbpstream.records.header import (
    CODEC_NONE,
    HEADER_SIZE,
    BatchError,
    BatchHeader,
    compute_crc,
    read_header,
    validate_batch,
)
from sbpstream.records.varint import ZIGZAG_BYTE, decode_varint

# Smallest record: length, timestamp_delta, key_length, value_length, header_count, 1 byte each.
MIN_RECORD_BYTES: Final = 5
MIN_RECORD_BODY_BYTES: Final = MIN_RECORD_BYTES - 1
_INT64_MAX: Final = (1 << 63) - 1
"""Column buffers hold int64 timestamps: a scaled one past this is an error, not a wrap."""

Buffer = bytes | bytearray | memoryview

_Accelerated = Callable[..., "list[tuple[Any, ...]] | None"]
_compiled: _Accelerated | None
_compiled_sink: Callable[[int], Any] | None
try:  # the compiled decode loop (_speedups.pyx), when it was built
    from sbpstream.records import _speedups

    _compiled = _speedups.decode_section
    _compiled_sink = _speedups.ColumnSink
except ImportError:  # pragma: no cover - a build without a C compiler
    _compiled = _compiled_sink = None
_pure = bool(os.environ.get("SBPSTREAM_PURE_PYTHON"))
_accelerated: _Accelerated | None = None if _pure else _compiled
# Arrow buffers are little-endian; the compiled sink writes native integers.
_column_sink = None if _pure or sys.byteorder != "little" else _compiled_sink
"""The compiled ``bytes`` decode loop used by ``iter_all_records_bytes``, ``stream_records`` and
``decode_columns``, or None: the pure-Python loop (no C compiler at install time, or
``SBPSTREAM_PURE_PYTHON=1``). Both give the same records and the same errors."""
Headers = tuple[tuple[str, memoryview], ...]


class DecodedRecord(NamedTuple):
    offset: int  # base_offset + index in the batch
    timestamp_ms: int  # first_timestamp + timestamp_delta
    key: memoryview | None
    value: memoryview | None
    headers: Headers


@dataclass(slots=True)
class Columns:
    """Records as parallel lists (the Spark/Arrow path); keys and values are copied to bytes."""

    offsets: list[int] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    headers: list[tuple[tuple[str, bytes], ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets)


def _view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def iter_batches(buf: Buffer, *, allow_partial_tail: bool = False) -> Iterator[memoryview]:
    """Yield a view of each batch in a buffer of batches back to back.

    Checks each fixed header and that the batch is whole; the CRC is left to ``iter_records``.
    With ``allow_partial_tail`` a cut-off last batch ends the iteration instead of raising.
    """
    mv = _view(buf)
    n = len(mv)
    pos = 0
    while pos < n:
        if allow_partial_tail and n - pos < HEADER_SIZE:
            return
        end = pos + read_header(mv, pos).total_size
        if end > n:
            if allow_partial_tail:
                return
            raise BatchError(f"truncated batch at byte {pos}: {n - pos} of {end - pos} bytes")
        yield mv[pos:end]
        pos = end


def open_batch(batch: Buffer, *, verify_crc: bool = True) -> tuple[BatchHeader, memoryview]:
    """Validate one whole batch; return its header and its (decompressed) records section."""
    mv = _view(batch)
    h = validate_batch(mv) if verify_crc else read_header(mv)
    if h.total_size != len(mv):
        raise BatchError(f"batch of {h.total_size} bytes in a buffer of {len(mv)}")
    return h, _section(mv, h)


def _section(mv: memoryview, h: BatchHeader) -> memoryview:
    """The (decompressed) records section of the whole batch ``mv`` whose header is ``h``."""
    section = mv[HEADER_SIZE:]
    if h.codec != CODEC_NONE:
        section = memoryview(decompress(h.codec, section))
    if h.record_count > len(section) // MIN_RECORD_BYTES:
        raise BatchError(f"record_count {h.record_count} cannot fit in {len(section)} bytes")
    return section


def iter_records(batch: Buffer, *, verify_crc: bool = True) -> Iterator[DecodedRecord]:
    """Records of one whole batch. The batch is validated (and decompressed) on this call."""
    h, section = open_batch(batch, verify_crc=verify_crc)
    records = _decode_section(section, h.record_count, h.base_offset, h.first_timestamp)
    return cast(Iterator[DecodedRecord], records)


def _batches_from(buf: Buffer, start_offset: int,
                  until_offset: int | None = None) -> Iterator[tuple[memoryview, int]]:
    """Each batch of a FETCH buffer holding offsets in [start_offset, until_offset), with the
    offset its records are kept from: ``start_offset``, then the end of every batch before it.
    So a batch overlapping an earlier one repeats none of its records (the base offset is
    outside the batch CRC: a corrupt or hostile node could otherwise hand one out twice)."""
    for batch in iter_batches(buf):
        h = read_header(batch)
        end = h.base_offset + h.record_count
        if end <= start_offset or (until_offset is not None and h.base_offset >= until_offset):
            continue
        yield batch, start_offset
        start_offset = end


def iter_all_records(buf: Buffer, *, start_offset: int = 0) -> Iterator[DecodedRecord]:
    """Records of every batch in a FETCH buffer, skipping offsets before ``start_offset`` (and
    those an earlier batch gave: :func:`_batches_from`)."""
    for batch, lo in _batches_from(buf, start_offset):
        for record in iter_records(batch):
            if record.offset >= lo:
                yield record


def _byte_sections(buf: Buffer, start_offset: int) -> Iterator[Iterator[tuple[Any, ...]]]:
    """Per batch of :func:`_batches_from`: its records from the offset it is kept from,
    decoded from ONE ``bytes`` copy of the records section (so keys, values and header values
    are ``bytes`` slices straight away, cheaper than a memoryview slice plus ``tobytes`` per
    field)."""
    for batch, lo in _batches_from(buf, start_offset):
        h, section = open_batch(batch)
        recs = _decode_bytes(section.tobytes(), h.record_count, h.base_offset,
                             h.first_timestamp, tuple, None)
        yield iter(recs) if h.base_offset >= lo else (r for r in recs if r[0] >= lo)


def iter_all_records_bytes(
    buf: Buffer, *, start_offset: int = 0
) -> Iterator[tuple[int, int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]]:
    """Like :func:`iter_all_records`, but keys, values and header values are ``bytes``.

    Yields ``(offset, timestamp_ms, key, value, headers)`` tuples.
    """
    for records in _byte_sections(buf, start_offset):
        for record in records:
            if record[0] >= start_offset:
                yield record


def stream_records(
    buf: Buffer, stream_id: int, cls: type[tuple[Any, ...]], *, start_offset: int = 0
) -> list[tuple[Any, ...]]:
    """Every record of a FETCH buffer at or after ``start_offset``, as ``cls((stream_id, offset,
    timestamp_ms, key, value, headers))`` with ``bytes`` fields: the consumer's bulk path (one
    tuple per record, built by the decode loop itself; a batch that starts before the position
    is sliced, its offsets being consecutive)."""
    out: list[tuple[Any, ...]] = []
    mv = _view(buf)
    n = len(mv)
    pos = 0
    while pos < n:  # iter_batches and open_batch in one pass: one header read per batch
        h = read_header(mv, pos)
        end = pos + h.total_size
        if end > n:
            raise BatchError(f"truncated batch at byte {pos}: {n - pos} of {end - pos} bytes")
        base = h.base_offset
        if base + h.record_count > start_offset:
            actual = compute_crc(mv, pos, h.total_size)
            if actual != h.crc:
                raise BatchError(
                    f"batch CRC mismatch: stored 0x{h.crc:08x}, computed 0x{actual:08x}")
            section = _section(mv[pos:end], h)
            recs = _decode_bytes(section.tobytes(), h.record_count, base, h.first_timestamp,
                                 cls, stream_id)
            if base >= start_offset:
                out.extend(recs)
            else:
                out.extend(list(recs)[start_offset - base :])
            start_offset = base + h.record_count  # an overlapping later batch repeats none
        pos = end
    return out


def _decode_bytes(data: bytes, count: int, base_offset: int, first_ts: int,
                  cls: type[tuple[Any, ...]], stream_id: int | None,
                  ) -> Sequence[tuple[Any, ...]] | Iterator[tuple[Any, ...]]:
    """A ``bytes`` records section's records: compiled when built (a list), else, or when the
    compiled loop finds the section malformed, the Python loop (which raises the BatchError)."""
    if _accelerated is not None:
        recs = _accelerated(data, count, base_offset, first_ts, cls, stream_id, _decode_headers)
        if recs is not None:
            return recs
    return _decode_section(data, count, base_offset, first_ts, cls, stream_id)


def decode_columns(buf: Buffer, *, start_offset: int = 0) -> Columns:
    """Decode a buffer of batches into columns, skipping offsets before ``start_offset``."""
    cols = Columns()
    offsets, timestamps = cols.offsets, cols.timestamps
    keys, values, headers = cols.keys, cols.values, cols.headers
    for records in _byte_sections(buf, start_offset):
        for offset, ts, key, value, hdrs in records:
            if offset >= start_offset:
                offsets.append(offset)
                timestamps.append(ts)
                keys.append(key)
                values.append(value)
                headers.append(hdrs)
    return cols


@dataclass(frozen=True, slots=True)
class ColumnBuffers:
    """Records in Arrow's memory layout (little-endian), ready for ``pyarrow.Array.from_buffers``
    with no Python object per record: what the Spark source yields. Keys and values are Arrow
    ``binary`` columns: int32 offsets (rows + 1), the bytes back to back, and a validity bitmap
    (bit set = not null; None when no row is null)."""

    rows: int
    offsets: bytes  # int64 per row
    timestamps: bytes  # int64 per row: timestamp_ms * ts_scale
    key_offsets: bytes
    key_data: bytes
    key_validity: bytes | None
    key_nulls: int
    value_offsets: bytes
    value_data: bytes
    value_validity: bytes | None
    value_nulls: int
    headers: list[tuple[int, tuple[tuple[str, bytes], ...]]]
    """(row, headers) for the rows that have headers (the others have none)."""


def decode_column_buffers(buf: Buffer, *, start_offset: int = 0, until_offset: int | None = None,
                          ts_scale: int = 1) -> ColumnBuffers:
    """Decode a buffer of batches (CRC-checked) into :class:`ColumnBuffers`, keeping offsets in
    [start_offset, until_offset). Compiled when built; otherwise (or with
    SBPSTREAM_PURE_PYTHON=1) through :func:`decode_columns`, with the same result."""
    hi = (1 << 63) - 1 if until_offset is None else until_offset
    if _column_sink is None:
        return _pure_column_buffers(buf, start_offset, hi, ts_scale)
    sink = _column_sink(ts_scale)
    for batch, lo in _batches_from(buf, start_offset, hi):
        h, section = open_batch(batch)
        data = section.tobytes()
        if not sink.add_section(data, h.record_count, h.base_offset, h.first_timestamp,
                                lo, hi, _decode_headers):
            for _ in _decode_section(data, h.record_count, h.base_offset, h.first_timestamp):
                pass  # raises the BatchError the compiled loop found
            raise BatchError("malformed records section")  # pragma: no cover - loops agree
    (offsets, stamps, koffs, kdata, kvalid, voffs, vdata, vvalid) = sink.buffers()
    return ColumnBuffers(sink.rows, offsets, stamps, koffs, kdata,
                         kvalid if sink.key_nulls else None, sink.key_nulls, voffs, vdata,
                         vvalid if sink.value_nulls else None, sink.value_nulls,
                         [(row, _bytes_headers(hs)) for row, hs in sink.headers])


def _bytes_headers(hs: Sequence[tuple[str, Any]]) -> tuple[tuple[str, bytes], ...]:
    return tuple((k, bytes(v)) for k, v in hs)


def _binary_column(items: Sequence[bytes | None]) -> tuple[bytes, bytes, bytes | None, int]:
    """Arrow binary buffers (offsets, data, validity or None, null count) of ``items``."""
    ends = array("i", [0])
    validity = bytearray((len(items) + 7) // 8)
    nulls = total = 0
    for i, item in enumerate(items):
        if item is None:
            nulls += 1
        else:
            total += len(item)
            validity[i >> 3] |= 1 << (i & 7)
        ends.append(total)
    if sys.byteorder != "little":
        ends.byteswap()
    data = b"".join(x for x in items if x is not None)
    return ends.tobytes(), data, bytes(validity) if nulls else None, nulls


def _pure_column_buffers(buf: Buffer, start: int, hi: int, ts_scale: int) -> ColumnBuffers:
    cols = Columns()
    for batch, lo in _batches_from(buf, start, hi):
        h, section = open_batch(batch)
        for offset, ts, key, value, hdrs in _decode_bytes(
                section.tobytes(), h.record_count, h.base_offset, h.first_timestamp, tuple, None):
            if lo <= offset < hi:
                scaled = ts * ts_scale
                if not -_INT64_MAX <= scaled <= _INT64_MAX:
                    raise OverflowError(
                        f"record at offset {offset} has timestamp_ms {ts}, outside what an int64 "
                        "timestamp at this scale (a Spark timestamp: microseconds) holds")
                cols.offsets.append(offset)
                cols.timestamps.append(scaled)
                cols.keys.append(key)
                cols.values.append(value)
                cols.headers.append(hdrs)
    offsets = array("q", cols.offsets)
    stamps = array("q", cols.timestamps)
    if sys.byteorder != "little":
        offsets.byteswap()
        stamps.byteswap()
    keys = _binary_column(cols.keys)
    values = _binary_column(cols.values)
    headers = [(i, _bytes_headers(h)) for i, h in enumerate(cols.headers) if h]
    return ColumnBuffers(len(cols), offsets.tobytes(), stamps.tobytes(), *keys, *values, headers)


def _decode_section(
    mv: memoryview | bytes,
    count: int,
    base_offset: int,
    first_ts: int,
    cls: type[tuple[Any, ...]] = DecodedRecord,
    stream_id: int | None = None,
) -> Iterator[tuple[Any, ...]]:
    """The hot loop, yielding ``cls`` tuples whose slices have the type of ``mv``, led by
    ``stream_id`` when it is given.

    One- and two-byte varints (lengths below 8 KiB: the usual case) are decoded inline.
    """
    zz = ZIGZAG_BYTE
    new = tuple.__new__
    end = len(mv)
    pos = 0
    try:
        for index in range(count):
            b = mv[pos]
            if b < 0x80:
                length = zz[b]
                pos += 1
            elif pos + 1 < end and mv[pos + 1] < 0x80:  # two-byte varint: records of 64 B..8 KiB
                u = (b & 0x7F) | (mv[pos + 1] << 7)
                length = (u >> 1) ^ -(u & 1)
                pos += 2
            else:
                length, pos = decode_varint(mv, pos)
            rec_end = pos + length
            if length < MIN_RECORD_BODY_BYTES or rec_end > end:
                raise BatchError(f"record {index}: bad length {length} at byte {pos}")
            b = mv[pos]
            if b < 0x80:
                delta = zz[b]
                pos += 1
            elif pos + 1 < end and mv[pos + 1] < 0x80:  # two-byte varint: records of 64 B..8 KiB
                u = (b & 0x7F) | (mv[pos + 1] << 7)
                delta = (u >> 1) ^ -(u & 1)
                pos += 2
            else:
                delta, pos = decode_varint(mv, pos)
            b = mv[pos]
            if b < 0x80:
                n = zz[b]
                pos += 1
            elif pos + 1 < end and mv[pos + 1] < 0x80:  # two-byte varint: records of 64 B..8 KiB
                u = (b & 0x7F) | (mv[pos + 1] << 7)
                n = (u >> 1) ^ -(u & 1)
                pos += 2
            else:
                n, pos = decode_varint(mv, pos)
            if n >= 0 and pos + n <= rec_end:
                key: memoryview | bytes | None = mv[pos : pos + n]
                pos += n
            elif n == -1:
                key = None
            else:
                raise BatchError(f"record {index}: bad key length {n}")
            b = mv[pos]
            if b < 0x80:
                n = zz[b]
                pos += 1
            elif pos + 1 < end and mv[pos + 1] < 0x80:  # two-byte varint: records of 64 B..8 KiB
                u = (b & 0x7F) | (mv[pos + 1] << 7)
                n = (u >> 1) ^ -(u & 1)
                pos += 2
            else:
                n, pos = decode_varint(mv, pos)
            if n >= 0 and pos + n <= rec_end:
                value: memoryview | bytes | None = mv[pos : pos + n]
                pos += n
            elif n == -1:
                value = None
            else:
                raise BatchError(f"record {index}: bad value length {n}")
            b = mv[pos]
            pos += 1
            if b == 0:
                headers: tuple[tuple[str, Any], ...] = ()
            else:
                headers, pos = _decode_headers(mv, pos - 1, rec_end)
            if pos != rec_end:
                raise BatchError(f"record {index}: {rec_end - pos} bytes unaccounted for")
            if stream_id is None:
                yield new(cls, (base_offset + index, first_ts + delta, key, value, headers))
            else:
                yield new(cls, (stream_id, base_offset + index, first_ts + delta, key, value,
                                headers))
    except IndexError:
        raise BatchError(f"record runs past the end of the records section ({end} bytes)") from None
    if pos != end:
        raise BatchError(f"{end - pos} bytes after the last of {count} records")


def _decode_headers(
    mv: memoryview | bytes, pos: int, end: int
) -> tuple[tuple[tuple[str, Any], ...], int]:
    count, pos = decode_varint(mv, pos)
    if not 0 <= count <= (end - pos) // 2:
        raise BatchError(f"bad header count {count}")
    out: list[tuple[str, memoryview | bytes]] = []
    for _ in range(count):
        n, pos = decode_varint(mv, pos)
        if not 0 <= n <= end - pos:
            raise BatchError(f"bad header key length {n}")
        try:
            name = str(mv[pos : pos + n], "utf-8")
        except UnicodeDecodeError as e:
            raise BatchError(f"header key is not UTF-8: {e}") from None
        pos += n
        n, pos = decode_varint(mv, pos)
        if not 0 <= n <= end - pos:
            raise BatchError(f"bad header value length {n}")
        out.append((name, mv[pos : pos + n]))
        pos += n
    return tuple(out), pos
