"""Differential fuzzing of the JVM reader's wire decoders (sbpstream/spark/java, ``wire``) against
the Python ones, through py4j: record batches (none/zstd/lz4), FETCH / LIST_RANGES /
DESCRIBE_STREAMS response headers and frames off a socket. Valid inputs decode to exactly what
Python decodes; mutated inputs decode to what Python decodes for the same bytes, or are a
ProtocolException/IOException with a message: never another exception, a hang or a huge
allocation (``WireProbe`` runs each input with a time limit and reports anything else thrown)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("pyspark")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spark_fixtures import spark_session_fixture  # noqa: F401

from sbpstream.protocol.frame import (
    FLAG_END,
    FLAG_RESPONSE,
    Frame,
    FrameDecoder,
    FramingError,
    encode_frame,
)
from sbpstream.protocol.messages import (
    DataNode,
    DescribeStreamsResponse,
    FetchResponse,
    FetchResult,
    ListRangesResponse,
    ListRangesResult,
    Range,
    ReplicaNode,
    Status,
    Stream,
    StreamResult,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record
from sbpstream.records.builder import build_batch
from sbpstream.records.header import (
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_ZSTD,
    compute_crc,
    read_header,
)
from sbpstream.records.reader import iter_batches, iter_records

TIMEOUT_MS = 5_000  # per input: far above any decode here, so "hang" means a loop
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Probe:
    """io.sbpstream.spark.wire.WireProbe (held, not passed: hypothesis inspects the arguments
    of a test, which a py4j class would answer as if they were Java members)."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls


@pytest.fixture(scope="module")
def probe(spark: Any) -> Probe:
    if not spark.conf.get("spark.jars", ""):
        pytest.skip("the sbpstream-jvm jar is not on the session's classpath (no JDK?)")
    try:
        return Probe(spark._jvm.io.sbpstream.spark.wire.WireProbe)
    except Exception:  # pragma: no cover - depends on the environment
        pytest.skip("the driver JVM does not see the reader's classes")


def _blob(inputs: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(x)) + x for x in inputs)


def _run(p: Probe, method: str, inputs: Sequence[bytes], *args: Any) -> list[str]:
    """One JVM call for every input: the outcome strings of WireProbe.``method``."""
    probe = p.cls
    fn = getattr(probe, method)
    cases = probe.unpack(_blob(inputs))
    if method == "decodeBatches":
        out = fn(cases, *args, TIMEOUT_MS)
    elif method == "decodeHeaders":
        out = fn(args[0], cases, TIMEOUT_MS)
    else:
        out = fn(cases, *args, TIMEOUT_MS)
    got: list[str] = str(probe.join(out)).split("\0")
    assert len(got) == len(inputs)
    return got


def _check_outcome(outcome: str, data: bytes) -> bool:
    """Whether the JVM decoded ``data`` (True) or refused it with its own error (False); a
    crash of any other kind or a hang fails the test."""
    if outcome.startswith("ok\n"):
        return True
    assert outcome.startswith("error ") and ": " in outcome and len(outcome) > 20, \
        f"{outcome[:300]} for input {data.hex()[:400]}"
    kind = outcome.split(":", 1)[0]
    assert kind in ("error ProtocolException", "error SbpException", "error IOException"), \
        f"{outcome[:300]} for input {data.hex()[:400]}"
    return False


# ------------------------------------------------------------------------------------ mutations


def _varint(n: int) -> bytes:
    zz = (n << 1) ^ (n >> 63)
    zz &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = zz & 0x7F
        zz >>= 7
        if zz:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


EXTREMES = [-1, -2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 31, 1 << 40, (1 << 63) - 1,
            -(1 << 63), 1 << 24, 1 << 20]


@st.composite
def mutation(draw: st.DrawFn, size: int) -> Callable[[bytes], bytes]:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "remove", "int32", "int64",
                                 "varint", "byte"]))
    at = draw(st.integers(0, max(0, size - 1)))
    if kind == "flip":
        bit = draw(st.integers(0, 7))
        return lambda b: b[:at] + bytes([b[at] ^ (1 << bit)]) + b[at + 1:] if at < len(b) else b
    if kind == "truncate":
        return lambda b: b[:at]
    if kind == "insert":
        extra = draw(st.binary(min_size=1, max_size=8))
        return lambda b: b[:at] + extra + b[at:]
    if kind == "remove":
        n = draw(st.integers(1, 8))
        return lambda b: b[:at] + b[at + n:]
    if kind == "byte":
        v = draw(st.integers(0, 255))
        return lambda b: b[:at] + bytes([v]) + b[at + 1:]
    v = draw(st.sampled_from(EXTREMES))
    if kind == "varint":
        raw = _varint(v if v < (1 << 63) else v - (1 << 64))
        return lambda b: b[:at] + raw + b[at + len(raw):]
    width = 4 if kind == "int32" else 8
    endian = draw(st.sampled_from(["big", "little"]))
    raw = (v % (1 << (8 * width))).to_bytes(width, endian)
    return lambda b: b[:at] + raw + b[at + width:]


def _fix_crcs(buf: bytes) -> bytes:
    """Each batch's CRC-32C recomputed where its header still frames it, so that a mutation
    reaches the decompressor and the records decoder instead of stopping at the CRC."""
    out = bytearray(buf)
    pos = 0
    while len(out) - pos >= 53:
        total = 12 + int.from_bytes(out[pos + 8:pos + 12], "big", signed=True)
        if total < 53 or total > len(out) - pos:
            break
        out[pos + 13:pos + 17] = compute_crc(out, pos, total).to_bytes(4, "big")
        pos += total
    return bytes(out)


# ------------------------------------------------------------------------------ record batches

key_or_value = st.one_of(st.none(), st.binary(max_size=24))
header_st = st.tuples(st.text(max_size=6), st.binary(max_size=8))
record_st = st.builds(Record, value=key_or_value, key=key_or_value,
                      headers=st.lists(header_st, max_size=3),
                      timestamp_ms=st.integers(0, 1 << 45))


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    """1-3 batches back to back, consecutive offsets from a drawn base."""
    base = draw(st.integers(0, 1 << 40))
    out = bytearray()
    for _ in range(draw(st.integers(1, 3))):
        recs = draw(st.lists(record_st, min_size=1, max_size=6))
        codec = draw(st.sampled_from([CODEC_NONE, CODEC_ZSTD, CODEC_LZ4]))
        raw = bytearray(build_batch(recs, codec=codec))
        raw[0:8] = base.to_bytes(8, "big")
        base += len(recs)
        out += raw
    return bytes(out)


def _py_records(buf: bytes, lo: int, hi: int) -> str | None:
    """What the Python decoder makes of ``buf`` over [lo, hi), rendered as WireProbe renders
    it (without the "next" line), or None when it refuses the bytes. The window's start moves
    past each record kept, as the reader's position does: a batch overlapping records already
    read (its base offset is not under the CRC) gives them once, not twice."""
    lines = []
    try:
        for batch in iter_batches(buf):
            h = read_header(batch)
            if h.base_offset + h.record_count <= lo or h.base_offset >= hi:
                continue
            for r in iter_records(batch):
                if lo <= r.offset < hi:
                    lo = r.offset + 1
                    hs = "".join(f"x{k.encode().hex()}=x{bytes(v).hex()}," for k, v in r.headers)
                    key = "null" if r.key is None else "x" + bytes(r.key).hex()
                    value = "null" if r.value is None else "x" + bytes(r.value).hex()
                    lines.append(f"{r.offset} {r.timestamp_ms} {key} {value} {hs}\n")
    except (ValueError, UnicodeDecodeError):
        return None
    return "".join(lines)


def _window(buf: bytes) -> tuple[int, int]:
    first = int.from_bytes(buf[:8], "big")
    return first, (1 << 63) - 1


def _records_agree(outcome: str, data: bytes, lo: int, hi: int) -> None:
    if not _check_outcome(outcome, data):
        return
    body, _, last = outcome[3:].rpartition("next ")
    py = _py_records(data, lo, hi)
    assert py is not None, f"the JVM decoded bytes Python refuses: {data.hex()[:400]}"
    assert body == py, f"JVM and Python disagree on {data.hex()[:400]}"
    n = body.count("\n")
    assert int(last) == (lo + n if n else lo)


@FUZZ
@given(st.lists(batches(), min_size=1, max_size=8), st.data())
def test_valid_batches_decode_as_python_does(probe: Probe, bufs: list[bytes],
                                             data: st.DataObject) -> None:
    cases = []
    for b in bufs:
        lo, _ = _window(b)
        n = sum(read_header(x).record_count for x in iter_batches(b))
        cut = data.draw(st.integers(lo, lo + n))
        cases.append((b, lo, lo + n))
        cases.append((b, cut, lo + n))  # a window starting inside the buffer
    for b, lo, hi in cases:
        (out,) = _run(probe, "decodeBatches", [b], lo, hi)
        assert out.startswith("ok\n"), out
        _records_agree(out, b, lo, hi)


def mutants(data: st.DataObject, raw: bytes, count: int, chain: int) -> list[bytes]:
    """``count`` copies of ``raw``, each changed by a drawn chain of 1 to ``chain`` mutations."""
    out = []
    for ms in data.draw(st.lists(st.lists(mutation(len(raw)), min_size=1, max_size=chain),
                                 min_size=count, max_size=count)):
        m = raw
        for one in ms:
            m = one(m)
        out.append(m)
    return out


@FUZZ
@given(batches(), st.data())
def test_mutated_batches_are_an_error_or_what_python_decodes(probe: Probe, buf: bytes,
                                                             data: st.DataObject) -> None:
    muts = mutants(data, buf, 20, 3)
    fix = data.draw(st.lists(st.booleans(), min_size=20, max_size=20))
    inputs = [_fix_crcs(m) if f else m for m, f in zip(muts, fix, strict=True)]
    lo, hi = _window(buf)
    for out, m in zip(_run(probe, "decodeBatches", inputs, lo, hi), inputs, strict=True):
        _records_agree(out, m, lo, hi)


# ----------------------------------------------------------------------------- response headers

status_st = st.one_of(st.just(Status()), st.builds(Status, code=st.integers(0, 90),
                                                   message=st.text(max_size=8)))
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
fetch_st = st.builds(
    FetchResponse, status=status_st,
    items=st.lists(st.builds(FetchResult, stream_id=i64, batch_length=st.integers(0, 1 << 20),
                             status=status_st, start_offset=i64, range_end_offset=i64),
                   max_size=4).map(tuple))
replica_st = st.builds(ReplicaNode, data_node=st.builds(DataNode, advertise_addr=st.text(
    max_size=10)), is_primary=st.booleans())
range_st = st.builds(Range, stream_id=i64, range_index=st.integers(0, 1 << 31 - 1),
                     start_offset=i64, next_offset=i64, end_offset=i64,
                     replica_nodes=st.lists(replica_st, max_size=3).map(tuple))
ranges_st = st.builds(
    ListRangesResponse, status=status_st,
    items=st.lists(st.builds(ListRangesResult, stream_id=i64, status=status_st,
                             ranges=st.lists(range_st, max_size=3).map(tuple)),
                   max_size=3).map(tuple))
streams_st = st.builds(
    DescribeStreamsResponse, status=status_st, continuation=i64,
    items=st.lists(st.builds(StreamResult, status=status_st, stream=st.one_of(
        st.none(), st.builds(Stream, stream_id=i64, start_offset=i64, name=st.text(max_size=8)))),
        max_size=4).map(tuple))


def _h(s: str) -> str:
    return "x" + s.encode().hex()


def _status(s: Status) -> str:
    return f"{s.code} {_h(s.message)}"


def _render(kind: str, m: Any) -> str:
    """A decoded response as WireProbe.decodeHeaders renders what the JVM reads of it."""
    lines = [f"status {_status(m.status)}\n"]
    if kind == "fetch":
        lines += [f"{r.stream_id} {r.batch_length} {r.status.code} {_h(r.status.message)} "
                  f"{r.start_offset} {r.range_end_offset}\n" for r in m.items]
    elif kind == "ranges":
        for rl in m.items:
            lines.append(f"{rl.stream_id} {rl.status.code} {_h(rl.status.message)}\n")
            for r in rl.ranges:
                reps = [n.data_node.advertise_addr for n in r.replica_nodes if n.is_primary] + [
                    n.data_node.advertise_addr for n in r.replica_nodes if not n.is_primary]
                tail = "".join(" " + _h(a) for a in reps if a)
                lines.append(f"  {r.stream_id} {r.range_index} {r.start_offset} "
                             f"{r.next_offset} {r.end_offset}{tail}\n")
    else:
        for r in m.items:
            s = "" if r.stream is None else (
                f" {r.stream.stream_id} {r.stream.start_offset} {_h(r.stream.name)}")
            lines.append(f"{r.status.code} {_h(r.status.message)}{s}\n")
        lines.append(f"continuation {m.continuation}\n")
    return "".join(lines)


HEADERS: dict[str, tuple[Any, Any]] = {
    "fetch": (fetch_st, FetchResponse),
    "ranges": (ranges_st, ListRangesResponse),
    "streams": (streams_st, DescribeStreamsResponse),
}


@FUZZ
@given(st.sampled_from(sorted(HEADERS)), st.data())
def test_response_headers_valid_and_mutated(probe: Probe, kind: str, data: st.DataObject) -> None:
    strategy, cls = HEADERS[kind]
    msg = data.draw(strategy)
    raw = msg.encode()
    inputs = [raw, *mutants(data, raw, 20, 3)]
    outs = _run(probe, "decodeHeaders", inputs, kind)
    assert outs[0] == "ok\n" + _render(kind, msg), outs[0]
    for out, m in zip(outs[1:], inputs[1:], strict=True):
        if not _check_outcome(out, m):
            continue
        try:
            py = cls.decode(m)
        except Exception:  # Python refuses: the JVM may read less of it
            continue
        assert out == "ok\n" + _render(kind, py), f"{kind} {m.hex()}"


# -------------------------------------------------------------------------------------- frames


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """One FETCH answer of 1-3 frames (the last with END) to request id 1."""
    n = draw(st.integers(1, 3))
    out = b""
    for i in range(n):
        header = draw(fetch_st).encode()
        payload = draw(st.binary(max_size=64))
        flags = FLAG_RESPONSE | (FLAG_END if i == n - 1 else 0)
        out += encode_frame(int(Opcode.FETCH), 1, flags, header, payload)
    return out


def _py_frames(buf: bytes) -> list[Frame] | None:
    """The frames Python decodes from ``buf`` (None when it breaks the framing first)."""
    d = FrameDecoder()
    frames: list[Frame] = []
    try:
        d.feed(buf)
        while (ev := d.next_event()) is not None:
            if isinstance(ev, Frame):
                frames.append(ev)
    except FramingError:
        return frames or None
    return frames


def _answer_frames(frames: list[Frame]) -> list[Frame]:
    """The frames that answer a FETCH: responses of opcode FETCH (the JVM discards others)."""
    return [f for f in frames if f.is_response and f.opcode == Opcode.FETCH]


def _render_frames(frames: list[Frame]) -> str:
    return "".join(f"{f.opcode} {f.flags} {f.request_id} x{bytes(f.header).hex()} "
                   f"x{bytes(f.payload).hex()}\n" for f in frames)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(answers(), st.data())
def test_frames_valid_and_mutated(probe: Probe, buf: bytes, data: st.DataObject) -> None:
    inputs = [buf, *mutants(data, buf, 15, 2)]
    outs = _run(probe, "readFrames", inputs, 2_000)
    assert outs[0] == "ok\n" + _render_frames(_answer_frames(_py_frames(buf) or [])), outs[0]
    for out, m in zip(outs[1:], inputs[1:], strict=True):
        if not _check_outcome(out, m):
            continue
        py = _py_frames(m)
        assert py is not None, f"the JVM read frames Python refuses: {m.hex()}"
        java = out[3:]
        assert _render_frames(_answer_frames(py)).startswith(java), f"{m.hex()}: {java} vs {py}"


def test_frame_of_another_opcode_is_not_the_answer(probe: Probe) -> None:
    """A frame answering the request id with another opcode (here unknown: the spec discards
    it) or that is no response is not the FETCH answer: its header is not read as one."""
    fetch = FetchResponse(items=(FetchResult(stream_id=7, batch_length=0),)).encode()
    other = FetchResponse(items=(FetchResult(stream_id=666, batch_length=0),)).encode()
    answer = (encode_frame(0x1102, 1, FLAG_RESPONSE | FLAG_END, other)
              + encode_frame(int(Opcode.FETCH), 1, 0, other)
              + encode_frame(int(Opcode.FETCH), 1, FLAG_RESPONSE | FLAG_END, fetch))
    (out,) = _run(probe, "readFrames", [answer], 2_000)
    assert out == f"ok\n{int(Opcode.FETCH)} 3 1 x{fetch.hex()} x\n"


# ----------------------------------------------------------------- compressed sections, by hand


def _with_section(plain_batch: bytes, codec: int, section: bytes) -> bytes:
    """``plain_batch`` (uncompressed) with its records section replaced by ``section`` under
    ``codec``: batch_length, attributes and CRC-32C rewritten, so only the section is at fault."""
    head = bytearray(plain_batch[:53])
    head[8:12] = (53 - 12 + len(section)).to_bytes(4, "big")
    head[17:19] = codec.to_bytes(2, "big")
    return _fix_crcs(bytes(head) + section)


def _sections() -> list[tuple[str, int, bytes, bytes]]:
    """(what, codec, plain batch, section): odd but decodable compressed sections, and broken
    ones, including decompression bombs past MAX_DECOMPRESSED_BYTES."""
    import os

    import lz4.frame
    import zstandard

    plain = build_batch([Record(value=b"v%d" % i, key=b"k") for i in range(4)])
    big = build_batch([Record(value=b"%d" % i * 400) for i in range(600)])  # 4 blocks of 64 KiB
    noise = build_batch([Record(value=os.urandom(3000)) for i in range(50)])  # incompressible
    sec = plain[53:]
    half = len(sec) // 2
    z = zstandard.ZstdCompressor()
    zs = z.compress(sec)
    lz = lz4.frame.compress(sec, store_size=True)
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"skip"
    bomb = b"\0" * (65 * 1024 * 1024)
    return [
        ("zstd", CODEC_ZSTD, plain, zs),
        ("zstd two frames", CODEC_ZSTD, plain, z.compress(sec[:half]) + z.compress(sec[half:])),
        ("zstd then a skippable frame", CODEC_ZSTD, plain, zs + skippable),
        ("zstd then garbage", CODEC_ZSTD, plain, zs + b"\x01\x02\x03"),
        ("zstd truncated", CODEC_ZSTD, plain, zs[:-3]),
        ("zstd without content size", CODEC_ZSTD, plain,
         zstandard.ZstdCompressor(write_content_size=False).compress(sec)),
        ("zstd empty", CODEC_ZSTD, plain, b""),
        ("zstd bomb", CODEC_ZSTD, plain, z.compress(bomb)),
        ("zstd bomb without content size", CODEC_ZSTD, plain,
         zstandard.ZstdCompressor(write_content_size=False).compress(bomb)),
        ("lz4", CODEC_LZ4, plain, lz),
        ("lz4 two frames", CODEC_LZ4, plain,
         lz4.frame.compress(sec[:half], store_size=True)
         + lz4.frame.compress(sec[half:], store_size=True)),
        ("lz4 then a skippable frame", CODEC_LZ4, plain, lz + skippable),
        ("lz4 then garbage", CODEC_LZ4, plain, lz + b"\x01\x02\x03"),
        ("lz4 truncated", CODEC_LZ4, plain, lz[:-3]),
        ("lz4 without content size", CODEC_LZ4, plain, lz4.frame.compress(sec)),
        ("lz4 empty", CODEC_LZ4, plain, b""),
        ("lz4 checksums", CODEC_LZ4, plain,
         lz4.frame.compress(sec, content_checksum=True, block_checksum=True)),
        ("lz4 linked blocks", CODEC_LZ4, big, lz4.frame.compress(big[53:], store_size=True)),
        ("lz4 independent blocks", CODEC_LZ4, big, lz4.frame.compress(
            big[53:], block_linked=False, content_checksum=True, block_checksum=True)),
        ("lz4 stored blocks", CODEC_LZ4, noise, lz4.frame.compress(noise[53:])),
        ("lz4 bomb", CODEC_LZ4, plain, lz4.frame.compress(bomb, store_size=True)),
        ("lz4 bomb without content size", CODEC_LZ4, plain, lz4.frame.compress(bomb)),
    ]


def test_compressed_sections_odd_and_broken(probe: Probe) -> None:
    cases = _sections()
    inputs = [_with_section(plain, codec, sec) for _, codec, plain, sec in cases]
    # each input alone, then with one bit of its section flipped (the CRC recomputed)
    flipped = [_fix_crcs(m[:-2] + bytes([m[-2] ^ 0x10]) + m[-1:]) for m in inputs]
    outs = _run(probe, "decodeBatches", inputs + flipped, 0, 1 << 62)
    for out, m in zip(outs[len(inputs):], flipped, strict=True):
        _records_agree(out, m, 0, 1 << 62)
    for (what, *_), out, m in zip(cases, outs, inputs, strict=False):
        assert out.startswith(("ok\n", "error ProtocolException")), f"{what}: {out[:300]}"
        _records_agree(out, m, 0, 1 << 62)
        if "bomb" in what:
            assert "MAX_DECOMPRESSED_BYTES" in out, f"{what}: {out[:300]}"
        if what in ("zstd", "lz4", "zstd without content size", "lz4 without content size",
                    "lz4 checksums", "lz4 linked blocks", "lz4 independent blocks",
                    "lz4 stored blocks"):
            assert out.startswith("ok\n"), f"{what}: {out[:300]}"


@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_ZSTD, CODEC_LZ4])
def test_batch_of_several_compression_blocks(probe: Probe, codec: int) -> None:
    """A records section over 64 KiB: python-lz4 writes it as a frame of *linked* blocks (each
    may refer to the one before), which the JVM must read as Python does."""
    recs = [Record(value=bytes([i % 251]) * 3000 + b"%d" % i, key=b"k%d" % i) for i in range(60)]
    buf = build_batch(recs, codec=codec)
    (out,) = _run(probe, "decodeBatches", [buf], 0, 60)
    assert out.startswith("ok\n"), out[:300]
    _records_agree(out, buf, 0, 60)


def test_offsets_and_timestamps_past_int64(probe: Probe) -> None:
    """A batch whose offsets or timestamps do not fit in int64 is an error, not skipped (its
    ``base_offset + record_count`` wrapped negative: the batch looked wholly before the window)
    nor wrapped around into a wrong timestamp."""
    top = (1 << 63) - 1
    recs = [Record(value=b"a", timestamp_ms=0), Record(value=b"b", timestamp_ms=5),
            Record(value=b"c", timestamp_ms=9)]
    offsets = bytearray(build_batch(recs))
    offsets[0:8] = (top - 1).to_bytes(8, "big")  # offsets top-1, top, top+1
    stamps = bytearray(build_batch(recs))
    stamps[0:8] = bytes(8)
    stamps[23:31] = (top - 3).to_bytes(8, "big")  # first_timestamp: the deltas overflow
    outs = _run(probe, "decodeBatches", [bytes(offsets), _fix_crcs(bytes(stamps))], 0, top)
    assert outs[0].startswith("error ProtocolException: "), outs[0]
    assert "offset" in outs[0]
    assert outs[1].startswith("error ProtocolException: "), outs[1]
    assert "timestamp" in outs[1]


_LINKED = bytearray(build_batch([Record(value=b"%d" % i * 400, key=b"k%d" % i)
                                 for i in range(200)], codec=CODEC_LZ4))
_LINKED[0:8] = bytes(8)  # base offset 0; the section: an lz4 frame of linked 64 KiB blocks


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_mutated_lz4_frame_of_linked_blocks(probe: Probe, data: st.DataObject) -> None:
    """Mutations inside a multi-block lz4 section, the batch CRC recomputed so that they reach
    the frame decoder (Lz4Frame): an error or what Python decodes."""
    buf = bytes(_LINKED)
    muts = data.draw(st.lists(mutation(len(buf)), min_size=10, max_size=10))
    inputs = [_fix_crcs(buf[:53] + m(buf)[53:]) for m in muts]
    for out, m in zip(_run(probe, "decodeBatches", inputs, 0, 200), inputs, strict=True):
        _records_agree(out, m, 0, 200)
