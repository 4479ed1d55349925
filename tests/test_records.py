"""Record batch format (design.md section 4): pure codec tests, no I/O."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable

import lz4.frame
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpstream.records import (
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_ZSTD,
    HEADER_SIZE,
    MAX_DECOMPRESSED_BYTES,
    BatchBuilder,
    BatchError,
    BinaryColumn,
    Int64Column,
    Record,
    RecordTooLargeError,
    build_batch,
    decode_columns,
    iter_all_records,
    iter_batches,
    iter_records,
    patch_base_offset,
    read_header,
    validate_batch,
)
from sbpstream.records.header import HEADER_STRUCT, LENGTH_PREFIX_SIZE, compute_crc
from sbpstream.records.varint import decode_varint, encode_varint, encode_varint_slow

CODECS = [CODEC_NONE, CODEC_ZSTD, CODEC_LZ4]


def wrap_section(section: bytes, count: int, codec: int = CODEC_NONE, first_ts: int = 0) -> bytes:
    """A batch around arbitrary (possibly malformed) records bytes, with a valid CRC."""
    header = bytearray(
        HEADER_STRUCT.pack(
            -1,
            HEADER_SIZE - LENGTH_PREFIX_SIZE + len(section),
            2,
            0,
            codec,
            count,
            first_ts,
            first_ts,
            -1,
            -1,
            -1,
        )
    )
    out = bytearray(header + section)
    out[13:17] = compute_crc(out, 0, len(out)).to_bytes(4, "big")
    return bytes(out)


def small_batch() -> bytes:
    b = BatchBuilder()
    assert b.append(Record(value=b"v1", key=b"k", timestamp_ms=1000))
    assert b.append(Record(value=None, key=None, headers=[("h", b"x")], timestamp_ms=1005))
    return b.build()


# -- golden bytes -----------------------------------------------------------------------------

GOLDEN = bytes.fromhex(
    "ffffffffffffffff"  # base_offset -1
    "0000003a"  # batch_length 58 = 41 + 17
    "02"  # magic
    "0b111bc8"  # crc32c of [17, end)
    "0000"  # attributes: no codec
    "00000002"  # record_count
    "00000000000003e8"  # first_timestamp 1000
    "00000000000003ed"  # max_timestamp 1005
    "ffffffffffffffff"  # producer_id
    "ffff"  # producer_epoch
    "ffffffff"  # base_sequence
    "0e00026b04763100"  # len 7, delta 0, key "k", value "v1", 0 headers
    "100a01010202680278"  # len 8, delta 5, null key, null value, 1 header ("h", "x")
)


def test_golden_bytes() -> None:
    assert small_batch() == GOLDEN
    h = validate_batch(GOLDEN)
    assert (h.record_count, h.first_timestamp, h.max_timestamp) == (2, 1000, 1005)
    recs = list(iter_records(GOLDEN))
    assert [(r.offset, r.timestamp_ms) for r in recs] == [(-1, 1000), (0, 1005)]
    assert recs[0].key is not None and recs[0].value is not None
    assert (recs[0].key.tobytes(), recs[0].value.tobytes(), recs[0].headers) == (b"k", b"v1", ())
    assert recs[1].key is None and recs[1].value is None
    assert [(k, bytes(v)) for k, v in recs[1].headers] == [("h", b"x")]


# -- round trip -------------------------------------------------------------------------------

opt_bytes = st.none() | st.binary(max_size=300)
headers_st = st.lists(st.tuples(st.text(max_size=10), st.binary(max_size=20)), max_size=3)
records_st = st.lists(
    st.builds(
        Record,
        value=opt_bytes,
        key=opt_bytes,
        headers=headers_st,
        timestamp_ms=st.integers(0, 2**62) | st.integers(1_700_000_000_000, 1_700_000_100_000),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(records=records_st, codec=st.sampled_from(CODECS), base=st.integers(0, 2**40))
def test_round_trip(records: list[Record], codec: int, base: int) -> None:
    batch = bytearray(build_batch(records, codec=codec, producer_id=7, base_sequence=3))
    h = validate_batch(batch)
    assert h.base_offset == -1 and h.record_count == len(records)
    assert h.first_timestamp == records[0].timestamp_ms
    assert h.max_timestamp == max(r.timestamp_ms for r in records)
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (7, -1, 3)
    patch_base_offset(batch, base)
    decoded = list(iter_records(batch))
    assert len(decoded) == len(records)
    for i, (d, r) in enumerate(zip(decoded, records, strict=True)):
        assert d.offset == base + i
        assert d.timestamp_ms == r.timestamp_ms
        assert (None if d.key is None else bytes(d.key)) == r.key
        assert (None if d.value is None else bytes(d.value)) == r.value
        assert [(k, bytes(v)) for k, v in d.headers] == list(r.headers)
    cols = decode_columns(batch)
    assert cols.values == [r.value for r in records]
    assert cols.keys == [r.key for r in records]
    assert cols.headers == [tuple(r.headers) for r in records]


def test_compression_is_used_when_it_helps() -> None:
    records = [Record(value=b"abc" * 300, timestamp_ms=1) for _ in range(50)]
    for codec in (CODEC_ZSTD, CODEC_LZ4):
        batch = build_batch(records, codec=codec)
        assert read_header(batch).codec == codec
        assert len(batch) < 50 * 900 // 10
        assert [bytes(r.value or b"") for r in iter_records(batch)] == [b"abc" * 300] * 50


def test_incompressible_falls_back_to_no_codec() -> None:
    batch = build_batch([Record(value=bytes(range(256)), timestamp_ms=1)], codec=CODEC_ZSTD)
    assert read_header(batch).codec == CODEC_NONE


# -- builder bounds -----------------------------------------------------------------------------


def test_builder_size_bound() -> None:
    b = BatchBuilder(batch_bytes_max=1000)
    n = 0
    while b.append(Record(value=b"x" * 100, timestamp_ms=5)):
        n += 1
    assert n == (1000 - HEADER_SIZE) // 107  # 100 B value + 7 B: two 2-byte varints, three 1-byte
    assert len(b) == n
    batch = b.build()
    assert len(batch) == b.size_bytes <= 1000
    assert sum(1 for _ in iter_records(batch)) == n


def test_builder_rejects_what_never_fits() -> None:
    with pytest.raises(RecordTooLargeError):
        BatchBuilder(batch_bytes_max=100).append(Record(value=b"x" * 100))
    with pytest.raises(ValueError):
        BatchBuilder().build()
    with pytest.raises(ValueError):
        BatchBuilder().append(Record(value=b"", timestamp_ms=-1))
    with pytest.raises(ValueError):
        BatchBuilder(codec=5)
    b = BatchBuilder()
    b.append(Record(value=b"", timestamp_ms=10))
    with pytest.raises(ValueError):
        b.append(Record(value=b"", timestamp_ms=-10))  # small negative delta, negative time


def test_builder_default_timestamp_is_now() -> None:
    b = BatchBuilder()
    assert b.add(b"v")
    (rec,) = iter_records(b.build())
    assert rec.timestamp_ms > 1_600_000_000_000


# -- integrity ----------------------------------------------------------------------------------


def test_every_bit_flip_after_crc_start_is_detected() -> None:
    batch = small_batch()
    for pos in range(13, len(batch)):  # the CRC itself, then everything it covers
        for bit in range(8):
            bad = bytearray(batch)
            bad[pos] ^= 1 << bit
            with pytest.raises(BatchError):
                validate_batch(bad)
            with pytest.raises(BatchError):
                list(iter_records(bad))


@pytest.mark.parametrize("codec", CODECS)
def test_every_truncation_is_rejected(codec: int) -> None:
    batch = build_batch(
        [Record(value=b"value" * 20, key=b"k", headers=[("a", b"b")], timestamp_ms=9)] * 5,
        codec=codec,
    )
    for n in range(len(batch)):
        cut = batch[:n]
        with pytest.raises(BatchError):
            validate_batch(cut)
        with pytest.raises(BatchError):
            list(iter_records(cut))
        if n:
            with pytest.raises(BatchError):
                list(iter_batches(batch + cut))
        assert list(iter_batches(batch + cut, allow_partial_tail=True)) == [batch]


def test_patch_base_offset_keeps_crc() -> None:
    batch = bytearray(small_batch())
    patch_base_offset(batch, 1234)
    h = validate_batch(batch)
    assert h.base_offset == 1234 and h.next_offset == 1236
    assert [r.offset for r in iter_records(batch)] == [1234, 1235]
    view = memoryview(bytearray(b"\0" * 10) + batch)
    patch_base_offset(view, 99, offset=10)
    assert [r.offset for r in iter_records(view[10:])] == [99, 100]


# -- many batches -------------------------------------------------------------------------------


def test_decode_columns_skips_before_start_offset() -> None:
    buf = bytearray()
    for base in (0, 3, 6):
        batch = bytearray(
            build_batch([Record(value=b"%d" % (base + i), timestamp_ms=base) for i in range(3)])
        )
        patch_base_offset(batch, base)
        buf += batch
    cols = decode_columns(buf, start_offset=4)
    assert cols.offsets == [4, 5, 6, 7, 8]
    assert cols.values == [b"4", b"5", b"6", b"7", b"8"]
    assert cols.timestamps == [3, 3, 6, 6, 6]
    assert [r.offset for r in iter_all_records(bytes(buf), start_offset=7)] == [7, 8]
    assert [len(b) for b in iter_batches(buf)] == [len(buf) // 3] * 3


# -- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "count", "message"),
    [
        (bytes.fromhex("0e00026b0476310000"), 1, "after the last"),  # trailing byte
        (bytes.fromhex("0e00026b04763100"), 2, "cannot fit"),  # count too large
        (bytes.fromhex("0e00036b047631000000"), 2, "bad key length"),  # key past the record
        (bytes.fromhex("0e00026b057631000000"), 2, "bad value length"),
        (bytes.fromhex("0e00026b047631020000"), 2, "bad header"),  # 1 header, no room
        (bytes.fromhex("ffffffffffffffffffffff01"), 2, "longer than"),  # 11-byte varint
        (bytes.fromhex("140001010000000000000000000000"), 2, "unaccounted"),
    ],
)
def test_malformed_records_raise_batch_error(section: bytes, count: int, message: str) -> None:
    with pytest.raises(BatchError, match=message):
        list(iter_records(wrap_section(section, count)))


def test_bad_utf8_header_key() -> None:
    section = bytes.fromhex("0c0001010204fffe0278")  # 1 header, key ff fe, value "x"
    section = bytes.fromhex("%02x" % (2 * (len(section) - 1))) + section[1:]
    with pytest.raises(BatchError, match="UTF-8"):
        list(iter_records(wrap_section(section, 1)))


def bomb_batch(codec: int, store_size: bool) -> bytes:
    raw = bytes(MAX_DECOMPRESSED_BYTES + 1)
    if codec == CODEC_ZSTD:
        data = zstandard.ZstdCompressor(write_content_size=store_size).compress(raw)
    else:
        data = lz4.frame.compress(raw, store_size=store_size)
    return wrap_section(data, 1, codec)


@pytest.mark.parametrize("codec", [CODEC_ZSTD, CODEC_LZ4])
@pytest.mark.parametrize("store_size", [True, False])
def test_decompression_bomb_is_refused(codec: int, store_size: bool) -> None:
    with pytest.raises(BatchError, match=r"MAX_DECOMPRESSED_BYTES|decompress"):
        iter_records(bomb_batch(codec, store_size))


@pytest.mark.parametrize("codec", [CODEC_ZSTD, CODEC_LZ4])
def test_garbage_and_trailing_compressed_data(codec: int) -> None:
    with pytest.raises(BatchError, match="decompress"):
        iter_records(wrap_section(b"not compressed at all", 1, codec))
    good = build_batch([Record(value=b"a" * 500, timestamp_ms=1)], codec=codec)
    section = good[HEADER_SIZE:]
    with pytest.raises(BatchError):
        iter_records(wrap_section(section + section, 1, codec))  # two frames
    with pytest.raises(BatchError):
        iter_records(wrap_section(section + b"\0", 1, codec))


# -- fuzz ---------------------------------------------------------------------------------------


def drain(buf: bytes) -> None:
    for batch in iter_batches(buf):
        for rec in iter_records(batch):
            _ = (rec.key, rec.value, rec.headers)
    decode_columns(buf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(BatchError):
        drain(data)


@settings(max_examples=500, deadline=None)
@given(
    section=st.binary(max_size=120),
    count=st.integers(-2, 40),
    codec=st.sampled_from(CODECS),
)
def test_fuzz_records_section_behind_valid_crc(section: bytes, count: int, codec: int) -> None:
    with contextlib.suppress(BatchError):
        drain(wrap_section(section, count, codec))


@settings(max_examples=300, deadline=None)
@given(records=records_st, data=st.data())
def test_fuzz_mutated_valid_batch(records: list[Record], data: st.DataObject) -> None:
    batch = bytearray(build_batch(records))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(HEADER_SIZE, len(batch) - 1))
        batch[pos] = data.draw(st.integers(0, 255))
    batch[13:17] = compute_crc(batch, 0, len(batch)).to_bytes(4, "big")
    with contextlib.suppress(BatchError):
        drain(bytes(batch))


# -- varints ------------------------------------------------------------------------------------


@given(st.integers(-(2**63), 2**63 - 1))
def test_varint_round_trip(v: int) -> None:
    enc = encode_varint(v)
    assert enc == encode_varint_slow(v)
    assert decode_varint(enc + b"\xff", 0) == (v, len(enc))


def test_varint_limits() -> None:
    assert encode_varint(-1) == b"\x01" and encode_varint(1) == b"\x02"
    assert encode_varint(-64) == b"\x7f" and encode_varint(64) == b"\x80\x01"
    assert len(encode_varint(-(2**63))) == 10
    with pytest.raises(ValueError):
        encode_varint(2**63)
    with pytest.raises(BatchError, match="truncated"):
        decode_varint(b"\x80\x80", 0)
    with pytest.raises(BatchError, match="overflows"):
        decode_varint(b"\xff" * 9 + b"\x7f", 0)


def test_iter_all_records_bytes_matches_views() -> None:
    from sbpstream.records import Record, build_batch, iter_all_records, iter_all_records_bytes
    from sbpstream.records.header import patch_base_offset

    recs = [Record(value=b"v" * n, key=None if n % 2 else b"k%d" % n,
                   headers=(("h", b"x" * n),) if n % 3 == 0 else (), timestamp_ms=1000 + n)
            for n in (0, 1, 63, 64, 200, 5000, 9000)]
    b1 = bytearray(build_batch(recs[:4]))
    b2 = bytearray(build_batch(recs[4:]))
    patch_base_offset(b1, 10)
    patch_base_offset(b2, 14)
    buf = bytes(b1 + b2)
    views = [(r.offset, r.timestamp_ms, None if r.key is None else bytes(r.key),
              None if r.value is None else bytes(r.value),
              tuple((k, bytes(v)) for k, v in r.headers))
             for r in iter_all_records(buf, start_offset=11)]
    got = list(iter_all_records_bytes(buf, start_offset=11))
    assert got == views
    assert [g[0] for g in got] == list(range(11, 17))
    assert all(isinstance(g[3], bytes) for g in got)
    # the consumer's bulk form: the same records led by the stream id, in the given tuple type
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import stream_records

    for start in (0, 10, 11, 13, 14, 16, 17, 99):
        mine = stream_records(buf, 7, ConsumedRecord, start_offset=start)
        assert all(type(r) is ConsumedRecord and r.stream_id == 7 for r in mine)
        assert [tuple(r)[1:] for r in mine] == list(iter_all_records_bytes(buf, start_offset=start))


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.binary(max_size=300)), min_size=1, max_size=60),
    key=st.one_of(st.none(), st.binary(max_size=200)),
    ts=st.sampled_from([0, 1_700_000_000_000, 2**62]),
    limit=st.sampled_from([300, 2000, 1 << 20]),
    before=st.integers(0, 3),
)
def test_add_values_is_add_per_value(values: list[bytes | None], key: bytes | None, ts: int,
                                     limit: int, before: int) -> None:
    """The bulk path encodes exactly what ``add`` does value by value, and stops where it does."""
    bulk = BatchBuilder(batch_bytes_max=limit, producer_id=7, producer_epoch=1, base_sequence=3)
    one = BatchBuilder(batch_bytes_max=limit, producer_id=7, producer_epoch=1, base_sequence=3)
    for _ in range(before):  # an earlier record with another timestamp: deltas are exercised
        assert bulk.add(b"x", None, (), max(0, ts - 5)) == one.add(b"x", None, (), max(0, ts - 5))
    try:
        stop = bulk.add_values(values, 0, key, ts)
    except RecordTooLargeError:
        assert before == 0
        with pytest.raises(RecordTooLargeError):
            one.add(values[0], key, (), ts)
        return
    k = 0
    while k < len(values) and one.add(values[k], key, (), ts):
        k += 1
    assert stop == k and len(bulk) == len(one) and bulk.size_bytes == one.size_bytes
    if len(one):
        assert bulk.build() == one.build()
        recs = list(iter_records(one.build()))
        assert [r.value for r in recs] == [b"x"] * before + values[:k]
        assert [r.key for r in recs[before:]] == [key] * k
        assert {r.timestamp_ms for r in recs[before:]} <= {ts}
        assert {r.timestamp_ms for r in recs[:before]} <= {max(0, ts - 5)}


# ------------------------------------------------------------- compiled and pure-Python decode

def _python_decode(data: bytes, count: int, base: int, ts: int,
                   sid: int | None) -> tuple[str, object]:
    from sbpstream.records.reader import _decode_section

    try:
        return "ok", list(_decode_section(data, count, base, ts, tuple, sid))
    except BatchError as e:
        return "error", str(e)


def _compiled_decode(data: bytes, count: int, base: int, ts: int,
                     sid: int | None) -> tuple[str, object]:
    from sbpstream.records import reader

    assert reader._compiled is not None
    try:
        got = reader._compiled(data, count, base, ts, tuple, sid, reader._decode_headers)
    except BatchError as e:  # only from the Python header decoder it calls
        return "error", str(e)
    return ("malformed", None) if got is None else ("ok", got)


def _needs_compiled() -> None:
    from sbpstream.records import reader

    if reader._compiled is None:
        pytest.skip("the compiled decoder is not built here (no C compiler at install)")


@pytest.fixture(params=["compiled", "python"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the compiled decode loop and again with the pure-Python one."""
    from sbpstream.records import reader

    if request.param == "compiled":
        _needs_compiled()
        monkeypatch.setattr(reader, "_accelerated", reader._compiled)
    else:
        monkeypatch.setattr(reader, "_accelerated", None)
    return str(request.param)


def test_both_decoders_give_the_same_records(decoder: str) -> None:
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import iter_all_records_bytes, stream_records
    from sbpstream.records.header import patch_base_offset

    recs = [Record(value=None if n == 7 else b"v" * n, key=None if n % 2 else b"k%d" % n,
                   headers=(("h", b"x" * n), ("\u00e9", b"")) if n % 3 == 0 else (),
                   timestamp_ms=1000 + n * 977)
            for n in (0, 1, 7, 63, 64, 200, 5000, 9000, 70000)]
    b1 = bytearray(build_batch(recs[:4]))
    b2 = bytearray(build_batch(recs[4:]))
    patch_base_offset(b1, 10)
    patch_base_offset(b2, 14)
    buf = bytes(b1 + b2)
    want = [(10 + i, r.timestamp_ms, r.key, r.value, tuple(r.headers))
            for i, r in enumerate(recs)]
    assert list(iter_all_records_bytes(buf)) == want
    assert [tuple(r)[1:] for r in stream_records(buf, 3, ConsumedRecord, start_offset=12)] == \
        want[2:]
    cols = decode_columns(buf, start_offset=11)
    assert cols.offsets == list(range(11, 19)) and cols.values == [r[3] for r in want[1:]]


def test_a_malformed_section_raises_the_same_error(decoder: str) -> None:
    from sbpstream.records import iter_all_records_bytes

    good = bytearray(build_batch([Record(value=b"abc"), Record(value=b"defg")]))
    good[-3] ^= 0x40  # inside the last record's value: the CRC catches it
    with pytest.raises(BatchError, match="CRC"):
        list(iter_all_records_bytes(bytes(good)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.one_of(st.none(), st.binary(max_size=200)), min_size=1, max_size=8),
    headers=st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=20)), max_size=2),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3),
    cut=st.integers(0, 3),
    count_delta=st.integers(-1, 1),
    sid=st.one_of(st.none(), st.integers(0, 2**62)),
)
def test_compiled_decode_matches_python_on_any_bytes(
        values: list[bytes | None], headers: list[tuple[str, bytes]],
        flips: list[tuple[int, int]], cut: int, count_delta: int, sid: int | None) -> None:
    """On valid and corrupted records sections alike, the compiled loop returns what the Python
    loop returns, or None (malformed) exactly where the Python loop raises BatchError."""
    _needs_compiled()
    from sbpstream.records import open_batch

    batch = build_batch([Record(value=v, key=b"k", headers=tuple(headers),
                                timestamp_ms=5_000 + i) for i, v in enumerate(values)])
    h, section = open_batch(batch)
    data = bytearray(section.tobytes())
    for at, byte in flips:
        data[at % len(data)] = byte
    data = data[: len(data) - cut]
    count = max(0, h.record_count + count_delta)
    py = _python_decode(bytes(data), count, 100, h.first_timestamp, sid)
    c = _compiled_decode(bytes(data), count, 100, h.first_timestamp, sid)
    if py[0] == "ok":
        assert c == py
    else:
        assert c[0] in ("malformed", "error"), (py, c)
        if c[0] == "error":
            assert c == py


# -- columns in Arrow layout (the Spark source's path) ------------------------------------------


def _column_buffers_both(buf: bytes, lo: int, hi: int | None) -> tuple[object, object]:
    """(compiled, pure-Python) decode_column_buffers results, or ("error", message)."""
    from sbpstream.records import decode_column_buffers, reader

    def run(f: object) -> object:
        try:
            return f() if callable(f) else None
        except BatchError as e:
            return "error", str(e)

    top = (1 << 63) - 1 if hi is None else hi
    return (run(lambda: decode_column_buffers(buf, start_offset=lo, until_offset=hi,
                                              ts_scale=1000)),
            run(lambda: reader._pure_column_buffers(buf, lo, top, 1000)))


def test_column_buffers_hold_the_records_in_arrow_layout() -> None:
    from array import array

    from sbpstream.records import decode_column_buffers

    recs = [Record(value=None if n == 2 else b"v%d" % n, key=None if n % 2 else b"k%d" % n,
                   headers=(("h", b"x"),) if n == 3 else (), timestamp_ms=1000 + n)
            for n in range(6)]
    b1, b2 = bytearray(build_batch(recs[:3])), bytearray(build_batch(recs[3:], codec=CODEC_ZSTD))
    patch_base_offset(b1, 10)
    patch_base_offset(b2, 13)
    cb = decode_column_buffers(bytes(b1 + b2), start_offset=11, until_offset=15, ts_scale=1000)
    assert cb.rows == 4
    assert list(array("q", cb.offsets)) == [11, 12, 13, 14]
    assert list(array("q", cb.timestamps)) == [1_001_000, 1_002_000, 1_003_000, 1_004_000]
    assert list(array("i", cb.value_offsets)) == [0, 2, 2, 4, 6] and cb.value_data == b"v1v3v4"
    assert cb.value_nulls == 1 and cb.value_validity == bytes([0b1101])
    assert list(array("i", cb.key_offsets)) == [0, 0, 2, 2, 4] and cb.key_data == b"k2k4"
    assert cb.key_nulls == 2 and cb.key_validity == bytes([0b1010])
    assert cb.headers == [(2, (("h", b"x"),))]
    assert _column_buffers_both(bytes(b1 + b2), 11, 15)[1] == cb
    empty = decode_column_buffers(b"")
    assert empty.rows == 0 and empty.key_validity is None
    assert list(array("i", empty.key_offsets)) == [0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.one_of(st.none(), st.binary(max_size=200)), min_size=1, max_size=8),
    keys=st.lists(st.one_of(st.none(), st.binary(max_size=20)), min_size=8, max_size=8),
    headers=st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=20)), max_size=2),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3),
    count_delta=st.integers(-1, 1),
    lo=st.integers(98, 110),
    span=st.one_of(st.none(), st.integers(0, 10)),
)
def test_compiled_column_buffers_match_python_on_any_bytes(
        values: list[bytes | None], keys: list[bytes | None], headers: list[tuple[str, bytes]],
        flips: list[tuple[int, int]], count_delta: int, lo: int, span: int | None) -> None:
    """Valid or corrupted (with a valid CRC), the compiled column decoder gives exactly what
    the pure-Python path gives: the same buffers, or the same BatchError."""
    _needs_compiled()
    from sbpstream.records import open_batch

    batch = build_batch([Record(value=v, key=keys[i], headers=tuple(headers) if i % 2 else (),
                                timestamp_ms=5_000 + i) for i, v in enumerate(values)])
    h, section = open_batch(batch)
    data = bytearray(section.tobytes())
    for at, byte in flips:
        data[at % len(data)] = byte
    count = max(0, h.record_count + count_delta)
    buf = bytearray(wrap_section(bytes(data), count, first_ts=h.first_timestamp))
    patch_base_offset(buf, 100)
    compiled, pure = _column_buffers_both(bytes(buf), lo, None if span is None else lo + span)
    assert compiled == pure


# -- records encoded from Arrow-layout columns (the Spark sink's path) --------------------------


def _arrow_like(items: list[bytes | None], offset: int) -> BinaryColumn:
    """Arrow binary buffers of ``items`` behind ``offset`` leading filler rows."""
    from array import array

    rows = [b"filler"] * offset + items
    ends = array("i", [0])
    valid = bytearray((len(rows) + 7) // 8)
    for i, r in enumerate(rows):
        if r is not None:
            valid[i >> 3] |= 1 << (i & 7)
        ends.append(ends[-1] + len(r or b""))
    nulls = any(r is None for r in rows)
    return BinaryColumn(ends.tobytes(), b"".join(r or b"" for r in rows),
                        bytes(valid) if nulls else None, offset)


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.tuples(st.one_of(st.none(), st.binary(max_size=300)),
                            st.one_of(st.none(), st.binary(max_size=20)),
                            st.one_of(st.none(), st.integers(-5_000, 10**12))),
                  min_size=0, max_size=40),
    offset=st.integers(0, 9),
    bound=st.integers(120, 2_000),
    use_keys=st.booleans(),
    use_stamps=st.booleans(),
)
def test_add_columns_makes_the_batches_add_makes(
        compiled: bool, rows: list[tuple[bytes | None, bytes | None, int | None]], offset: int,
        bound: int, use_keys: bool, use_stamps: bool) -> None:
    """Row by row through ``add`` or in bulk through ``add_columns`` (compiled or not): the
    same batches, cut at the same rows, byte for byte."""
    from array import array

    from sbpstream.records import builder

    if compiled and builder._encode_rows is None:
        pytest.skip("the compiled encoder is not built here")
    saved = builder._encode_rows
    builder._encode_rows = saved if compiled else None
    try:
        values = _arrow_like([r[0] for r in rows], offset)
        keys = _arrow_like([r[1] for r in rows], offset) if use_keys else None
        us = [None] * offset + [r[2] for r in rows]
        valid = bytearray((len(us) + 7) // 8)
        for i, u in enumerate(us):
            if u is not None:
                valid[i >> 3] |= 1 << (i & 7)
        stamps = Int64Column(array("q", [u or 0 for u in us]).tobytes(), bytes(valid), offset,
                             1000) if use_stamps else None

        def batches(bulk: bool) -> list[bytes] | str:
            out: list[bytes] = []
            b = BatchBuilder(batch_bytes_max=bound)
            i = 0
            try:
                while i < len(rows):
                    if bulk:
                        i = b.add_columns(values, keys, stamps, 77, i, len(rows))
                    else:
                        v, k, u = rows[i]
                        ts = 77 if not use_stamps or u is None else u // 1000
                        if b.add(v, k if use_keys else None, (), ts):
                            i += 1
                            continue
                    if i < len(rows):
                        out.append(b.build())
                        b = BatchBuilder(batch_bytes_max=bound)
            except ValueError as e:  # RecordTooLargeError or a negative timestamp
                return type(e).__name__ + (": timestamp" if "timestamp" in str(e) else "")
            if len(b):
                out.append(b.build())
            return out

        assert batches(True) == batches(False)
    finally:
        builder._encode_rows = saved
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.one_of(st.none(), st.binary(max_size=300)), min_size=1, max_size=8),
    keyed=st.booleans(),
    headers=st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=20)), max_size=2),
    base=st.one_of(st.integers(0, 2**40), st.integers(2**63 - 20, 2**63 + 5),
                   st.integers(-5, -1)),
    first_ts=st.one_of(st.integers(-(2**40), 2**40), st.integers(2**63 - 3, 2**63 + 3),
                       st.integers(-(2**63) - 3, -(2**63) + 3)),
    deltas=st.lists(st.integers(-(2**62), 2**62), min_size=8, max_size=8),
    flip=st.one_of(st.none(), st.tuples(st.integers(0, 10_000), st.integers(0, 255))),
)
def test_compiled_records_led_by_a_stream_are_the_python_ones(
        values: list[bytes | None], keyed: bool, headers: list[tuple[str, bytes]], base: int,
        first_ts: int, deltas: list[int], flip: tuple[int, int] | None) -> None:
    """The compiled loop builds ConsumedRecords (and tuples) led by a stream id in place, with
    C arithmetic: the same records, of the same class, as the Python loop, also where offsets
    or timestamps leave int64 (Python ints then), and None exactly where it raises."""
    _needs_compiled()
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import open_batch, reader

    batch = build_batch([Record(value=v, key=b"k" if keyed else None, headers=tuple(headers),
                                timestamp_ms=10**12 + deltas[i] // 2**25)
                         for i, v in enumerate(values)])
    h, section = open_batch(batch)
    data = bytearray(section.tobytes())
    if flip is not None:
        data[flip[0] % len(data)] = flip[1]
    for cls in (ConsumedRecord, tuple):
        try:
            py: object = list(reader._decode_section(bytes(data), h.record_count, base, first_ts,
                                                     cls, 7))
        except BatchError:
            py = None
        assert reader._compiled is not None
        try:
            got = reader._compiled(bytes(data), h.record_count, base, first_ts, cls, 7,
                                   reader._decode_headers)
        except BatchError:
            got = None
        if py is None:
            assert got is None
        else:
            assert got == py and all(type(r) is cls for r in got)


def test_compiled_records_without_headers_are_not_tracked_by_the_gc() -> None:
    """Records of atomic values (no headers) cannot be in a cycle: the compiled loop untracks
    them at once (a buffer of thousands of them made every young collection walk them), unless
    their class gives instances a ``__dict__``."""
    import gc

    _needs_compiled()
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import open_batch, reader
    from sbpstream.records.header import patch_base_offset

    class WithDict(tuple):  # type: ignore[type-arg]
        pass

    batch = bytearray(build_batch([Record(value=b"v"), Record(value=b"w", headers=(("h", b""),)),
                                   Record(value=None, key=b"k")]))
    patch_base_offset(batch, 40)
    h, section = open_batch(bytes(batch))
    assert reader._compiled is not None
    got = reader._compiled(section.tobytes(), h.record_count, h.base_offset, h.first_timestamp,
                           ConsumedRecord, 9, reader._decode_headers)
    assert [r.offset for r in got] == [40, 41, 42]
    assert [gc.is_tracked(r) for r in got] == [False, True, False]
    plain = reader._compiled(section.tobytes(), h.record_count, h.base_offset,
                             h.first_timestamp, WithDict, 9, reader._decode_headers)
    assert all(type(r) is WithDict and gc.is_tracked(r) for r in plain)
    assert [tuple(r) for r in plain] == [tuple(r) for r in got]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.binary(max_size=60), min_size=1, max_size=6),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=2),
    cut=st.integers(0, 70),
    start=st.integers(0, 20),
)
def test_stream_records_fails_as_the_batch_walk_does(
        values: list[bytes], flips: list[tuple[int, int]], cut: int, start: int) -> None:
    """stream_records reads each header once (iter_batches and open_batch in one pass): on
    corrupted and truncated buffers it returns the same records, or raises the same
    BatchError, as the walk it replaces (iter_all_records_bytes)."""
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import iter_all_records_bytes, stream_records
    from sbpstream.records.header import patch_base_offset

    b1 = bytearray(build_batch([Record(value=v) for v in values]))
    b2 = bytearray(build_batch([Record(value=v, key=b"k") for v in reversed(values)]))
    patch_base_offset(b1, 3)
    patch_base_offset(b2, 3 + len(values))
    buf = bytearray(b1 + b2)
    for at, byte in flips:
        buf[at % len(buf)] = byte
    data = bytes(buf[: max(0, len(buf) - cut)])

    def run(f: Callable[[], object]) -> tuple[str, object]:
        try:
            return "ok", f()
        except BatchError as e:
            return "error", str(e)

    want = run(lambda: list(iter_all_records_bytes(data, start_offset=start)))
    got = run(lambda: [tuple(r)[1:] for r in stream_records(data, 1, ConsumedRecord,
                                                           start_offset=start)])
    assert got == want


def test_a_batch_overlapping_an_earlier_one_repeats_no_record(
        decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base offset is outside the batch CRC: a FETCH answer whose second batch claims
    offsets the first already gave (a corrupt or hostile node) must not hand them out twice,
    by any of the decoders (the consumer's, the columns', the Spark source's)."""
    from sbpstream.client.types import ConsumedRecord
    from sbpstream.records import iter_all_records, iter_all_records_bytes, reader, stream_records
    from sbpstream.records.header import patch_base_offset

    first = bytearray(build_batch([Record(value=b"a%d" % i) for i in range(3)]))
    second = bytearray(build_batch([Record(value=b"b%d" % i) for i in range(3)]))
    patch_base_offset(first, 0)  # a built batch's base is -1 until a data node numbers it
    patch_base_offset(second, 1)  # offsets 1..3, where the first batch holds 0..2
    buf = bytes(first + second)
    want = [0, 1, 2, 3]
    got = stream_records(buf, 9, ConsumedRecord)
    assert [r[1] for r in got] == want
    assert [r.offset for r in iter_all_records(buf)] == want
    assert [r[0] for r in iter_all_records_bytes(buf)] == want
    assert decode_columns(buf).offsets == want
    assert [r[1] for r in stream_records(buf, 9, ConsumedRecord, start_offset=2)] == [2, 3]
    for sink in ([reader._column_sink, None] if decoder == "compiled" else [None]):
        monkeypatch.setattr(reader, "_column_sink", sink)
        cols = reader.decode_column_buffers(buf)
        assert list(array("q", cols.offsets)) == want
        assert reader.decode_column_buffers(buf, start_offset=1, until_offset=3).rows == 2


def test_a_timestamp_past_int64_when_scaled_is_an_error_not_a_wrap(
        decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark source scales timestamps to microseconds in int64 buffers: a record whose
    timestamp does not fit is a clear error (it wrapped to a wrong time before)."""
    from sbpstream.records import reader
    from sbpstream.records.header import patch_base_offset

    big = 2**61  # ms: fits int64, but not once made microseconds
    buf = bytearray(build_batch([Record(value=b"ok", timestamp_ms=1000),
                                 Record(value=b"far", timestamp_ms=big)]))
    patch_base_offset(buf, 0)  # a built batch's base is -1 until a data node numbers it
    for sink in ([reader._column_sink, None] if decoder == "compiled" else [None]):
        monkeypatch.setattr(reader, "_column_sink", sink)
        assert list(array("q", reader.decode_column_buffers(buf).timestamps)) == [1000, big]
        with pytest.raises(OverflowError, match=f"offset 1 has timestamp_ms {big}, outside"):
            reader.decode_column_buffers(buf, ts_scale=1000)
        cols = reader.decode_column_buffers(buf, ts_scale=1000, until_offset=1)
        assert list(array("q", cols.timestamps)) == [1_000_000]
