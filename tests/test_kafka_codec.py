"""The Kafka codec, schemas and record batch conversion (sbpstream.kafka, no I/O): round trips of
every served API and version, bytes written by hand from the protocol guide, and fuzzing of the
decoders (only KafkaDecodeError ever escapes)."""

from __future__ import annotations

import contextlib
import gzip
import struct
from typing import Any

import cramjam
import crc32c
import lz4.frame
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpstream.kafka import errors as E
from sbpstream.kafka.codec import (
    F,
    KafkaDecodeError,
    Schema,
    decode,
    decode_header,
    encode,
    encode_response,
    peek_header,
    uvarint,
    varint,
)
from sbpstream.kafka.records import (
    KAFKA_HEADER,
    MAX_INFLATED_BATCH_BYTES,
    UnsupportedCompressionError,
    decode_batches,
    encode_batch,
    sbp_to_kafka,
)
from sbpstream.kafka.schemas import SUPPORTED
from sbpstream.kafka.topics import parse_stream_name, stream_name, topic_problem
from sbpstream.protocol.errors import ErrorCode, RequestTimeoutError, StreamNotFoundError
from sbpstream.records import Record, build_batch, patch_base_offset
from sbpstream.records.header import CODEC_LZ4, CODEC_NONE, CODEC_ZSTD
from sbpstream.records.reader import iter_all_records_bytes

# ---------------------------------------------------------------------------- sample values


def _sample(fields: tuple[F, ...], version: int, seed: int) -> dict[str, Any]:
    """A value for every field present at ``version`` (arrays of two items)."""
    out: dict[str, Any] = {}
    for i, f in enumerate(fields):
        if not f.vr[0] <= version <= f.vr[1]:
            continue
        k = seed + i
        if f.type == "[]":
            out[f.name] = [_sample(f.fields, version, k * 7 + j) for j in range(2)]
        elif f.type.startswith("[]"):
            out[f.name] = [_scalar(f.type[2:], k), _scalar(f.type[2:], k + 1)]
        else:
            out[f.name] = _scalar(f.type, k)
    return out


def _scalar(t: str, k: int) -> Any:
    return {
        "int8": k % 100, "int16": k * 3 % 30000, "int32": k * 1_000_003 % 2**31,
        "int64": -k * 10**12, "bool": bool(k % 2), "string": f"s{k}é",
        "bytes": bytes([k % 256]) * (k % 5), "records": b"r" * (k % 7),
        "uuid": bytes(range(k % 200, k % 200 + 16)),
    }[t]


ALL_VERSIONS = [(api.key, v, schema) for api in SUPPORTED.values()
                for v in range(api.min_version, api.max_version + 1)
                for schema in (api.request, api.response)]


@pytest.mark.parametrize(("key", "version", "schema"), ALL_VERSIONS,
                         ids=[f"{s.name}-v{v}" for _, v, s in ALL_VERSIONS])
def test_every_served_message_round_trips(key: int, version: int, schema: Schema) -> None:
    data = _sample(schema.fields, version, key + version)
    raw = b"".join(encode(schema, version, data))
    got = decode(schema, version, raw, strict=True)
    assert _present(got, data) == data


def _present(got: Any, sent: Any) -> Any:
    """``got`` restricted to the fields of ``sent`` (decode adds the absent ones' defaults)."""
    if isinstance(sent, dict):
        return {k: _present(got[k], v) for k, v in sent.items()}
    if isinstance(sent, list):
        return [_present(g, s) for g, s in zip(got, sent, strict=True)]
    return got


def test_versions_served_are_named_and_start_where_record_batch_v2_does() -> None:
    served = {a.name: (a.min_version, a.max_version) for a in SUPPORTED.values()}
    assert served == {
        "Produce": (3, 8), "Fetch": (4, 11), "ListOffsets": (1, 5), "Metadata": (0, 9),
        "ApiVersions": (0, 3), "CreateTopics": (0, 5), "DeleteTopics": (0, 4),
        "InitProducerId": (0, 2), "OffsetCommit": (2, 8), "OffsetFetch": (1, 6),
        "FindCoordinator": (0, 3), "JoinGroup": (0, 6), "Heartbeat": (0, 4),
        "LeaveGroup": (0, 4), "SyncGroup": (0, 4), "DescribeGroups": (0, 5),
        "ListGroups": (0, 3), "SaslHandshake": (0, 1), "SaslAuthenticate": (0, 2),
    }


# ------------------------------------------------------------------ bytes from the guide


def test_metadata_v1_request_bytes() -> None:
    """Metadata v1, header v1: api_key 3, version 1, correlation 7, client_id "c"; topics
    [ "ab" ] as an int32 count and int16-length strings."""
    frame = bytes.fromhex("0003 0001 00000007 0001 63" "00000001 0002 6162".replace(" ", ""))
    h = decode_header(frame, flexible=False)
    assert (h.api_key, h.api_version, h.correlation_id, h.client_id) == (3, 1, 7, "c")
    req = decode(SUPPORTED[3].request, 1, frame, h.body_offset, strict=True)
    assert req["topics"] == [{"name": "ab"}]
    assert req["allow_auto_topic_creation"] is True  # absent before v4: its default


def test_flexible_metadata_v9_request_bytes() -> None:
    """v9 is flexible: header v2 (client_id still int16-length, then tagged fields), compact
    nullable array (uvarint 0 = null), booleans, tagged fields."""
    frame = bytes.fromhex("0003 0009 00000001 0000 00" "00 01 00 01 00")
    h = decode_header(frame, flexible=True)
    req = decode(SUPPORTED[3].request, 9, frame, h.body_offset, strict=True)
    assert req["topics"] is None
    assert req["allow_auto_topic_creation"] is True
    assert req["include_cluster_authorized_operations"] is False
    assert req["include_topic_authorized_operations"] is True


def test_flexible_response_has_tagged_header_and_compact_fields() -> None:
    body = encode(SUPPORTED[22].response, 2, {"throttle_time_ms": 0, "error_code": 0,
                                              "producer_id": 5, "producer_epoch": 1})
    frame = encode_response(9, True, body)
    assert frame == struct.pack(">iib", 4 + 1 + 4 + 2 + 8 + 2 + 1, 9, 0) + struct.pack(
        ">ihqhb", 0, 0, 5, 1, 0)


def test_api_versions_v0_response_bytes() -> None:
    body = encode(SUPPORTED[18].response, 0, {"error_code": 35, "api_keys": [
        {"api_key": 18, "min_version": 0, "max_version": 3}]})
    assert b"".join(body) == bytes.fromhex("0023 00000001 0012 0000 0003".replace(" ", ""))


def test_varints_are_zigzag() -> None:
    assert [varint(n) for n in (0, -1, 1, -2, 63, -64, 64)] == [
        b"\x00", b"\x01", b"\x02", b"\x03", b"\x7e", b"\x7f", b"\x80\x01"]
    assert uvarint(300) == b"\xac\x02"


def test_malformed_requests_raise_decode_errors() -> None:
    md = SUPPORTED[3].request
    for bad in (b"", b"\x00\x00\x00", b"\x7f\xff\xff\xff", b"\xff\xff\xff\xfe",
                b"\x00\x00\x00\x01\x00\x05ab"):
        with pytest.raises(KafkaDecodeError):
            decode(md, 1, bad)
    with pytest.raises(KafkaDecodeError):  # a 10-byte varint that does not end
        decode(md, 9, b"\xff" * 12)
    with pytest.raises(KafkaDecodeError):  # a topic name that is not UTF-8
        decode(md, 1, b"\x00\x00\x00\x01\x00\x02\xff\xfe")
    with pytest.raises(KafkaDecodeError):
        decode(md, 1, b"\x00\x00\x00\x00\x01", strict=True)
    with pytest.raises(KafkaDecodeError):
        peek_header(b"\x00\x03")


# --------------------------------------------------------------------------- record batches


def _records(n: int) -> list[tuple[int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]]:
    return [(1_700_000_000_000 + i, None if i % 5 == 0 else b"k%d" % i,
             None if i % 7 == 3 else b"value-%d" % i,
             (("h", b"x" * i), ("n", b"")) if i % 2 else ()) for i in range(n)]


def test_kafka_batch_round_trip_keeps_keys_values_headers_timestamps() -> None:
    recs = _records(40)
    raw = encode_batch(100, recs)
    (b,) = decode_batches(raw)
    assert [(r.timestamp_ms, r.key, r.value, r.headers) for r in b.records] == recs
    base, length, _epoch, magic, _crc, attrs, last_delta, *_ts, count = KAFKA_HEADER.unpack_from(
        raw)[:13]
    assert (base, length, magic, attrs, last_delta, count) == (100, len(raw) - 12, 2, 0, 39, 40)


def _with_codec(raw: bytes, codec: int, compress: Any) -> bytes:
    head = bytearray(raw[:61])
    payload = compress(raw[61:])
    struct.pack_into(">i", head, 8, 61 - 12 + len(payload))
    struct.pack_into(">h", head, 21, codec)
    crc = crc32c.crc32c(payload, crc32c.crc32c(bytes(head[21:])))
    struct.pack_into(">I", head, 17, crc)
    return bytes(head) + payload


@pytest.mark.parametrize(("codec", "compress"), [
    (1, gzip.compress), (3, lz4.frame.compress), (4, zstandard.ZstdCompressor().compress)])
def test_compressed_batches_decode(codec: int, compress: Any) -> None:
    recs = _records(25)
    (b,) = decode_batches(_with_codec(encode_batch(0, recs), codec, compress))
    assert [(r.timestamp_ms, r.key, r.value, r.headers) for r in b.records] == recs


def _xerial(data: bytes, block: int = 100) -> bytes:
    """snappy-java's framing, as Kafka's Java producer writes it."""
    out = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    for i in range(0, len(data), block):
        c = bytes(cramjam.snappy.compress_raw(data[i:i + block]))
        out += struct.pack(">i", len(c)) + c
    return out


@pytest.mark.parametrize("compress", [
    lambda b: bytes(cramjam.snappy.compress_raw(b)), _xerial], ids=["raw", "xerial"])
def test_snappy_batches_decode_raw_and_xerial_framed(compress: Any) -> None:
    recs = _records(25)
    (b,) = decode_batches(_with_codec(encode_batch(0, recs), 2, compress))
    assert [(r.timestamp_ms, r.key, r.value, r.headers) for r in b.records] == recs


def test_snappy_bombs_and_bad_frames_are_decode_errors() -> None:
    raw = encode_batch(0, _records(2))
    big = bytes(cramjam.snappy.compress_raw(b"\x00" * (MAX_INFLATED_BATCH_BYTES + 1)))
    for payload in (lambda b: big,  # over the bound: refused from the length preamble
                    lambda b: b"\x82SNAPPY\x00" + b"\x00" * 4,  # truncated header
                    lambda b: _xerial(b)[:-3],  # truncated block
                    lambda b: _xerial(b)[:16] + struct.pack(">i", -5),
                    lambda b: b"\xff" * 11):  # a preamble that never ends
        with pytest.raises(KafkaDecodeError):
            decode_batches(_with_codec(raw, 2, payload))


def test_unknown_codecs_are_unsupported() -> None:
    with pytest.raises(UnsupportedCompressionError):
        decode_batches(_with_codec(encode_batch(0, _records(2)), 6, lambda b: b))


def test_corrupt_batches_are_decode_errors() -> None:
    raw = bytearray(encode_batch(0, _records(3)))
    raw[-1] ^= 0xFF
    with pytest.raises(KafkaDecodeError, match="CRC"):
        decode_batches(bytes(raw))
    with pytest.raises(KafkaDecodeError):
        decode_batches(encode_batch(0, _records(3))[:-1])
    old = bytearray(encode_batch(0, _records(1)))
    old[16] = 1  # magic 1 (a message set): not accepted
    with pytest.raises(KafkaDecodeError, match="magic"):
        decode_batches(bytes(old))


def test_idempotence_fields_are_read() -> None:
    raw = bytearray(encode_batch(0, _records(4)))
    struct.pack_into(">qhi", raw, 43, 77, 3, 2**31 - 2)
    crc = crc32c.crc32c(bytes(raw[21:]))
    struct.pack_into(">I", raw, 17, crc)
    (b,) = decode_batches(bytes(raw))
    assert (b.producer_id, b.producer_epoch, b.base_sequence) == (77, 3, 2**31 - 2)
    assert b.last_sequence == 1  # sequences wrap at 2**31


def test_sbp_batches_become_kafka_batches_from_the_fetch_offset() -> None:
    batches = []
    for base, n in ((10, 5), (15, 3)):
        sb = bytearray(build_batch([Record(b"v%d" % (base + i), b"k", (("h", b"1"),),
                                           1_000 + i) for i in range(n)]))
        patch_base_offset(sb, base)
        batches.append(memoryview(bytes(sb)))
    data, nxt = sbp_to_kafka(batches, 12, 1 << 20)
    assert nxt == 18
    got = decode_batches(data)
    assert [len(b.records) for b in got] == [3, 3]
    assert [r.value for b in got for r in b.records] == [b"v%d" % i for i in range(12, 18)]
    assert KAFKA_HEADER.unpack_from(data)[0] == 12  # base offset of the first record sent
    first, _ = sbp_to_kafka(batches, 10, 1)  # max_bytes tiny: still the first batch, only
    assert len(decode_batches(first)) == 1


_SBP_RECORD = st.tuples(
    st.one_of(st.none(), st.binary(max_size=40), st.integers(8200, 8300).map(b"x".__mul__)),
    st.one_of(st.none(), st.binary(max_size=20)),
    st.lists(st.tuples(st.text(max_size=5), st.binary(max_size=10)), max_size=3),
    st.integers(0, 2**40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(_SBP_RECORD, min_size=1, max_size=12), min_size=1, max_size=4),
       st.sampled_from((CODEC_NONE, CODEC_ZSTD, CODEC_LZ4)), st.data())
def test_sbp_to_kafka_keeps_every_field_of_every_record(
        batches: list[list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]], int]]],
        codec: int, data: st.DataObject) -> None:
    """Records copied without decoding read back, through the Kafka decoder, as the records
    the sbpstream reader gives: offsets, timestamps (any order), keys, values, headers."""
    raw, base = [], 100
    for recs in batches:
        sb = bytearray(build_batch([Record(v, k, tuple(h), ts) for v, k, h, ts in recs],
                                   codec=codec))
        patch_base_offset(sb, base)
        raw.append(memoryview(bytes(sb)))
        base += len(recs)
    start = data.draw(st.integers(100, base - 1))
    out, nxt = sbp_to_kafka(raw, start, 1 << 30)
    assert nxt == base
    want = [(o, ts, k, v, tuple(h)) for b in raw
            for o, ts, k, v, h in iter_all_records_bytes(b, start_offset=start)]
    got = []
    at = 0
    for kb in decode_batches(out):
        (first,) = struct.unpack_from(">q", out, at)
        at += 12 + struct.unpack_from(">i", out, at + 8)[0]
        got += [(first + i, r.timestamp_ms, r.key, r.value, r.headers)
                for i, r in enumerate(kb.records)]
    assert got == want


# --------------------------------------------------------------------------------- fuzzing

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.sampled_from(ALL_VERSIONS), st.binary(max_size=300))
def test_fuzz_decoders_raise_only_decode_errors(case: tuple[int, int, Schema],
                                               data: bytes) -> None:
    _key, version, schema = case
    with contextlib.suppress(KafkaDecodeError):
        decode(schema, version, data)


@_FUZZ
@given(st.sampled_from(ALL_VERSIONS), st.data())
def test_fuzz_mutated_valid_messages(case: tuple[int, int, Schema], data: st.DataObject) -> None:
    key, version, schema = case
    raw = bytearray(b"".join(encode(schema, version, _sample(schema.fields, version, key))))
    for _ in range(data.draw(st.integers(1, 4))):
        if raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(KafkaDecodeError):
        decode(schema, version, bytes(raw[:cut]))


@_FUZZ
@given(st.data())
def test_fuzz_snappy_batches(data: st.DataObject) -> None:
    """Mutated snappy payloads (raw and framed) behind a valid CRC reach the decompressor."""
    framing = data.draw(st.sampled_from([lambda b: bytes(cramjam.snappy.compress_raw(b)),
                                         _xerial]))
    payload = bytearray(framing(encode_batch(5, _records(data.draw(st.integers(1, 6))))[61:]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    payload = payload[: data.draw(st.integers(0, len(payload)))]
    raw = _with_codec(encode_batch(5, _records(1)), 2, lambda b: bytes(payload))
    with contextlib.suppress(KafkaDecodeError):
        decode_batches(raw)


@_FUZZ
@given(st.data())
def test_fuzz_record_batches(data: st.DataObject) -> None:
    raw = bytearray(encode_batch(5, _records(data.draw(st.integers(1, 6)))))
    fix_crc = data.draw(st.booleans())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if fix_crc and len(raw) > 21:  # get past the CRC to the record decoder
        struct.pack_into(">I", raw, 17, crc32c.crc32c(bytes(raw[21:])))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    with contextlib.suppress(KafkaDecodeError):
        decode_batches(bytes(raw))


# --------------------------------------------------------------------------- mapping rules


def test_stream_naming_rule() -> None:
    assert stream_name("orders", 3) == "orders.3"
    assert parse_stream_name("orders.3") == ("orders", 3)
    assert parse_stream_name("a.0.12") == ("a.0", 12)
    assert parse_stream_name("orders") is None
    assert parse_stream_name("orders.03") is None  # one spelling per partition
    assert topic_problem("ok_topic-1.x") is None
    assert topic_problem("bad topic") is not None
    assert topic_problem("x" * 248, partitions=10) is not None  # "x...x.9" exceeds 249


def test_error_mapping() -> None:
    assert E.kafka_code(StreamNotFoundError("gone")) == E.UNKNOWN_TOPIC_OR_PARTITION
    assert E.kafka_code(RequestTimeoutError("slow")) == E.REQUEST_TIMED_OUT
    assert E.kafka_code(ValueError()) == E.UNKNOWN_SERVER_ERROR
    assert int(ErrorCode.OUT_OF_ORDER_SEQUENCE) in E._MAP
