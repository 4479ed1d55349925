"""The Kafka gateway's record conversion without decoding (sbpstream.kafka.records, no I/O):
Produce's Kafka records section -> sbpstream records section (``kafka_to_sbp``) and Fetch's
sbpstream -> Kafka loop, each in its compiled (_transcode.pyx, where built) and pure-Python
form. Properties: a converted batch reads back, through the sbpstream reader, as the records the
Kafka decoder gives; what cannot be converted whole falls back to decoding; fuzzed input never
raises from the converter, and both forms agree byte for byte."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpstream.kafka import records as kr
from sbpstream.kafka.codec import KafkaDecodeError
from sbpstream.kafka.records import KAFKA_HEADER, decode_batches, encode_batch, kafka_to_sbp
from sbpstream.records import BatchBuilder, BatchError, Record, build_batch, iter_records
from sbpstream.records.varint import encode_varint as varint

FORMS = ["python"] + (["compiled"] if kr._to_sbp is not None else [])
"""The forms under test: the compiled one only where it was built (and not switched off by
SBPSTREAM_PURE_PYTHON)."""


@pytest.fixture(params=FORMS)
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(kr, "_to_sbp", None)
        monkeypatch.setattr(kr, "_to_kafka", None)
    yield request.param


KRec = tuple[int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]

_RECORD = st.tuples(
    st.integers(-(2**20), 2**33),  # timestamp delta from the first record (any order)
    st.one_of(st.none(), st.binary(max_size=30), st.integers(8190, 8300).map(b"k".__mul__)),
    st.one_of(st.none(), st.binary(max_size=60), st.integers(16380, 16400).map(b"v".__mul__)),
    st.lists(st.tuples(st.text(max_size=6), st.binary(max_size=12)), max_size=3).map(tuple))


def _as_records(base: int, recs: list[Any]) -> list[KRec]:
    """Absolute timestamps (the first record's delta 0, as every Kafka client writes it)."""
    return [(base + (d if i else 0), k, v, h) for i, (d, k, v, h) in enumerate(recs)]


def _readback(enc: Any) -> list[KRec]:
    """The records of an sbpstream batch built from ``enc``, as the sbpstream reader gives."""
    b = BatchBuilder(batch_bytes_max=16 * 1024 * 1024 - 4096)
    assert b.add_encoded(enc)
    return [(r.timestamp_ms, None if r.key is None else bytes(r.key),
             None if r.value is None else bytes(r.value),
             tuple((n, bytes(v)) for n, v in r.headers)) for r in iter_records(b.build())]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(_RECORD, min_size=1, max_size=20), st.integers(2**20, 2**41))
def test_converted_batches_read_back_as_the_decoded_records(form: str, recs: list[Any],
                                                            base: int) -> None:
    want = _as_records(base, recs)
    raw = encode_batch(7, want)
    (plain,) = decode_batches(raw)
    (conv,) = decode_batches(raw, encode=True)
    assert conv.encoded is not None and conv.records == []
    assert (conv.count, conv.last_sequence) == (plain.count, plain.last_sequence)
    assert conv.encoded.first_timestamp == base
    assert conv.encoded.max_timestamp == max(r[0] for r in want)
    assert _readback(conv.encoded) == want == [
        (r.timestamp_ms, r.key, r.value, tuple(r.headers)) for r in plain.records]


def _kafka_record(ts_delta: int, key: bytes | None, value: bytes | None,
                  headers: list[tuple[bytes, bytes | None]], offset_delta: int = 0) -> bytes:
    body = [b"\x00", varint(ts_delta), varint(offset_delta)]
    for f in (key, value):
        body += [varint(-1)] if f is None else [varint(len(f)), f]
    body.append(varint(len(headers)))
    for n, v in headers:
        body += [varint(len(n)), n] + ([varint(-1)] if v is None else [varint(len(v)), v])
    rec = b"".join(body)
    return varint(len(rec)) + rec


def _kafka_batch(section: bytes, count: int, base_ts: int, attrs: int = 0) -> bytes:
    head = bytearray(KAFKA_HEADER.pack(0, 49 + len(section), -1, 2, 0, attrs, count - 1,
                                       base_ts, base_ts, -1, -1, -1, count))
    struct.pack_into(">I", head, 17, crc32c.crc32c(section, crc32c.crc32c(bytes(head[21:]))))
    return bytes(head) + section


@pytest.mark.parametrize(("section", "count"), [
    # a first timestamp delta other than 0: sbpstream's first timestamp is the first record's
    (_kafka_record(5, b"k", b"v", []) + _kafka_record(0, None, b"w", [], 1), 2),
    # a null header value: decoded as b"" the slow way
    (_kafka_record(0, b"k", b"v", [(b"h", None)]), 1),
], ids=["first-delta", "null-header"])
def test_batches_not_converted_whole_are_decoded(form: str, section: bytes, count: int) -> None:
    raw = _kafka_batch(section, count, 1_000)
    (b,) = decode_batches(raw, encode=True)
    assert b.encoded is None and b.count == count
    assert [(r.timestamp_ms, r.key, r.value) for r in b.records] == [
        (r.timestamp_ms, r.key, r.value) for r in decode_batches(raw)[0].records]


def test_log_append_time_batches_are_decoded(form: str) -> None:
    raw = _kafka_batch(_kafka_record(0, b"k", b"v", []), 1, 1_000, attrs=0x08)
    (b,) = decode_batches(raw, now_ms=5_000, encode=True)
    assert b.encoded is None and b.records[0].timestamp_ms == 5_000


@settings(max_examples=300, deadline=None)
@given(st.lists(_RECORD, min_size=1, max_size=6), st.data())
def test_fuzzed_sections_convert_alike_in_both_forms(recs: list[Any], data: st.DataObject) -> None:
    """Any bytes: kafka_to_sbp never raises; the compiled and Python forms agree; whatever is
    converted is exactly what the decoder accepts, record for record."""
    raw = encode_batch(0, _as_records(1_000, recs))
    section = bytearray(raw[61:])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(section) - 1))
        section[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        section = section[:data.draw(st.integers(0, len(section)))]
    count = data.draw(st.integers(1, len(recs) + 1))
    sec = bytes(section)
    python = _pure(kafka_to_sbp, sec, count, 1_000)
    if kr._to_sbp is not None:
        assert kr._to_sbp(sec, count, 1_000) == python
    try:
        decoded = kr._decode_records(sec, count, 1_000, None)
    except KafkaDecodeError:
        decoded = None
    if python is None:
        return
    assert decoded is not None  # converted: the decoder takes it too, with the same records
    from sbpstream.records import EncodedRecords
    enc = EncodedRecords(python[0], count, 1_000, python[1])
    assert _readback(enc) == [(r.timestamp_ms, r.key, r.value, tuple(r.headers))
                              for r in decoded]


def _pure(fn: Any, *args: Any) -> Any:
    saved = kr._to_sbp, kr._to_kafka
    kr._to_sbp = kr._to_kafka = None
    try:
        return fn(*args)
    finally:
        kr._to_sbp, kr._to_kafka = saved


@settings(max_examples=300, deadline=None)
@given(st.lists(_RECORD, min_size=1, max_size=6), st.data())
def test_fuzzed_sbp_sections_become_kafka_alike_in_both_forms(recs: list[Any],
                                                             data: st.DataObject) -> None:
    """Fetch's loop over any bytes: the same Kafka records from both forms, or BatchError
    from both."""
    sb = build_batch([Record(v, k, h, 1_000 + abs(d)) for d, k, v, h in recs])
    section = bytearray(sb[53:])
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(section) - 1))
        section[i] = data.draw(st.integers(0, 255))
    count = data.draw(st.integers(1, len(recs) + 1))
    skip = data.draw(st.integers(0, count - 1))
    mv = memoryview(bytes(section))

    def run(compiled: bool) -> Any:
        try:
            if compiled:
                return kr._kafka_records(mv, count, skip)
            return _pure(kr._kafka_records, mv, count, skip)
        except BatchError:
            return "error"

    python = run(False)
    if kr._to_kafka is not None:
        assert run(True) == python
