"""Frame codec: golden vectors, every framing rule, and hypothesis over arbitrary bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpstream.protocol.frame import (
    CRC_SLICE_BYTES,
    FLAGS_SYSTEM_ERROR,
    Frame,
    FrameCorrupt,
    FrameDecoder,
    FrameDiscarded,
    FramingError,
    _crc,
    encode_frame,
    encode_frame_parts,
)
from sbpstream.protocol.frame import (
    crc32 as frame_crc32,
)
from sbpstream.protocol.limits import MAX_FRAME_LENGTH, MAX_REQUEST_ID
from sbpstream.protocol.opcodes import Opcode

PING_1 = bytes.fromhex("00000010 17 0001 00 00000001 01 000000 00000000".replace(" ", ""))
PONG_1 = bytes.fromhex("00000010 17 0001 03 00000001 01 000000 00000000".replace(" ", ""))
PING_7_ABC = bytes.fromhex(
    "00000013 17 0001 00 00000007 01 000000 616263 352441c2".replace(" ", "")
)


def decode_all(data: bytes, chunk: int | None = None) -> list[object]:
    d = FrameDecoder()
    out: list[object] = []
    if chunk is None:
        d.feed(data)
        out.extend(d.events())
    else:
        for i in range(0, len(data), chunk):
            d.feed(data[i : i + chunk])
            out.extend(d.events())
    return out


def test_golden_ping_vectors() -> None:
    assert encode_frame(Opcode.PING, 1, 0) == PING_1
    assert encode_frame(Opcode.PING, 1, 0x03) == PONG_1
    assert encode_frame(Opcode.PING, 7, 0, payload=b"abc") == PING_7_ABC
    (f,) = decode_all(PING_7_ABC)
    assert isinstance(f, Frame)
    assert (f.opcode, f.flags, f.request_id, bytes(f.payload), bytes(f.header)) == (
        1,
        0,
        7,
        b"abc",
        b"",
    )


def test_system_error_frame_flags() -> None:
    raw = encode_frame(Opcode.APPEND, 9, FLAGS_SYSTEM_ERROR, header=b"\x01\x02\x03\x04")
    assert raw[7] == 0x07
    (f,) = decode_all(raw)
    assert isinstance(f, Frame) and f.is_system_error and f.is_end and f.is_response
    assert bytes(f.header) == b"\x01\x02\x03\x04"


def test_payload_as_parts_equals_joined() -> None:
    parts = [b"ab", memoryview(b"cdef"), bytearray(b"g")]
    joined = b"".join(encode_frame_parts(Opcode.FETCH, 3, 1, b"hh", parts))
    assert joined == encode_frame(Opcode.FETCH, 3, 1, b"hh", b"abcdefg")


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_any_chunking(chunk: int) -> None:
    frames = [encode_frame(Opcode.APPEND, i, 0, b"h" * i, b"p" * (i * 3)) for i in range(20)]
    evs = decode_all(b"".join(frames), chunk)
    assert [e.request_id for e in evs if isinstance(e, Frame)] == list(range(20))


def test_length_bound_checked_on_first_four_bytes() -> None:
    d = FrameDecoder()
    d.feed((MAX_FRAME_LENGTH + 1).to_bytes(4, "big"))
    with pytest.raises(FramingError):
        d.next_event()
    assert d.buffered_bytes == 4  # nothing of the body was waited for
    with pytest.raises(FramingError):
        d.feed(b"more")


def test_length_too_small() -> None:
    d = FrameDecoder()
    d.feed((15).to_bytes(4, "big"))
    with pytest.raises(FramingError):
        d.next_event()


def test_header_length_exceeding_frame_is_framing_error() -> None:
    raw = bytearray(encode_frame(Opcode.PING, 1, 0, b"", b"abc"))
    raw[13:16] = (100).to_bytes(3, "big")
    with pytest.raises(FramingError):
        decode_all(bytes(raw))


def test_bad_magic_discarded_and_counted_stream_continues() -> None:
    bad = bytearray(encode_frame(Opcode.PING, 1, 0, b"", b"x"))
    bad[4] = 99
    good = encode_frame(Opcode.PING, 2, 0)
    d = FrameDecoder()
    d.feed(bytes(bad) + good)
    evs = d.events()
    assert isinstance(evs[0], FrameDiscarded) and evs[0].reason == "bad_magic"
    assert isinstance(evs[1], Frame) and evs[1].request_id == 2
    assert d.discarded_bad_magic == 1


def test_unknown_opcode_discarded_and_counted() -> None:
    d = FrameDecoder()
    d.feed(encode_frame(0x7777, 1, 0, b"", b"x") + encode_frame(Opcode.PING, 2, 0))
    evs = d.events()
    assert isinstance(evs[0], FrameDiscarded) and evs[0].reason == "unknown_opcode"
    assert isinstance(evs[1], Frame)
    assert d.discarded_unknown_opcode == 1


def test_crc_mismatch_reported_not_raised() -> None:
    raw = bytearray(encode_frame(Opcode.APPEND, 5, 0, b"", b"payload"))
    raw[-1] ^= 0xFF
    (ev,) = decode_all(bytes(raw))
    assert isinstance(ev, FrameCorrupt) and ev.reason == "crc_mismatch" and ev.request_id == 5


def test_crc_zero_when_no_payload_and_checked() -> None:
    raw = bytearray(encode_frame(Opcode.PING, 5, 0))
    assert raw[-4:] == b"\0\0\0\0"
    raw[-1] = 1
    (ev,) = decode_all(bytes(raw))
    assert isinstance(ev, FrameCorrupt)


def test_bad_header_format_reported() -> None:
    raw = bytearray(encode_frame(Opcode.PING, 5, 0, b"hdr", b""))
    raw[12] = 2
    (ev,) = decode_all(bytes(raw))
    assert isinstance(ev, FrameCorrupt) and ev.reason == "header_format"


def test_unknown_flag_bits_ignored() -> None:
    (f,) = decode_all(encode_frame(Opcode.PING, 5, 0xF0))
    assert isinstance(f, Frame) and not f.is_response


def test_encoder_refuses_oversize_and_bad_request_id() -> None:
    with pytest.raises(ValueError):
        encode_frame(Opcode.APPEND, 1, 0, b"", b"x" * MAX_FRAME_LENGTH)
    assert MAX_REQUEST_ID == (1 << 31) - 1  # the top bit stays clear
    d = FrameDecoder()
    d.feed(encode_frame(Opcode.APPEND, MAX_REQUEST_ID, 0))
    (top,) = d.events()
    assert isinstance(top, Frame) and top.request_id == MAX_REQUEST_ID
    with pytest.raises(ValueError, match="request id"):
        encode_frame(Opcode.APPEND, MAX_REQUEST_ID + 1, 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.integers(min_value=1, max_value=64))
def test_fuzz_any_bytes_yield_events_or_framing_error(data: bytes, chunk: int) -> None:
    d = FrameDecoder(max_frame_length=1024)
    try:
        for i in range(0, len(data), chunk):
            d.feed(data[i : i + chunk])
            for ev in d.events():
                assert isinstance(ev, Frame | FrameDiscarded | FrameCorrupt)
            assert d.buffered_bytes <= 1024 + 4 + chunk
    except FramingError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Opcode)),
            st.integers(0, (1 << 31) - 1),
            st.integers(0, 255),
            st.binary(max_size=64),
            st.binary(max_size=256),
        ),
        max_size=10,
    ),
    st.integers(min_value=1, max_value=50),
)
def test_roundtrip_whole_and_bytewise(
    frames: list[tuple[int, int, int, bytes, bytes]], chunk: int
) -> None:
    raw = b"".join(encode_frame(*f) for f in frames)
    for c in (None, chunk):
        evs = decode_all(raw, c)
        got = [
            (e.opcode, e.request_id, e.flags, bytes(e.header), bytes(e.payload))
            for e in evs
            if isinstance(e, Frame)
        ]
        assert got == [(o, s, fl, h, p) for o, s, fl, h, p in frames]
        for (_, _, _, _, p), e in zip(frames, evs, strict=True):
            assert isinstance(e, Frame)
            assert zlib.crc32(e.payload) == zlib.crc32(p)


@pytest.mark.parametrize("size", [0, 1, CRC_SLICE_BYTES, CRC_SLICE_BYTES + 1,
                                  3 * CRC_SLICE_BYTES + 17, 512 * 1024])
def test_payload_crc_in_slices_is_the_whole_crc(size: int) -> None:
    """Parts larger than CRC_SLICE_BYTES are checksummed in slices (keeping the GIL): the CRC is
    zlib.crc32 of the whole payload, whatever the parts' types, and the frame decodes."""
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    parts = [data[: size // 3], memoryview(data)[size // 3 :], bytearray(b"tail")]
    assert _crc(parts) == zlib.crc32(data + b"tail")
    (got,) = decode_all(b"".join(encode_frame_parts(Opcode.PING, 1, 0, b"", parts)))
    assert isinstance(got, Frame) and bytes(got.payload) == data + b"tail"
def _events(d: FrameDecoder, raw: bytes, chunks: list[int]) -> list[tuple[object, ...]]:
    """Feed ``raw`` in chunks of the given sizes (cycled; any Buffer type), as plain tuples."""
    out: list[tuple[object, ...]] = []
    i = k = 0
    while i < len(raw):
        n = chunks[k % len(chunks)]
        piece = raw[i : i + n]
        d.feed(bytearray(piece) if k % 3 == 1 else memoryview(piece) if k % 3 == 2 else piece)
        i, k = i + n, k + 1
        for e in d.events():
            if isinstance(e, Frame):
                out.append(("frame", e.opcode, e.request_id, e.flags, bytes(e.header),
                            bytes(e.payload)))
            else:
                out.append((type(e).__name__, e.request_id))
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(list(Opcode)), st.integers(0, (1 << 31) - 1),
                       st.binary(max_size=40), st.binary(max_size=300), st.booleans()),
             max_size=8),
    st.lists(st.integers(1, 700), min_size=1, max_size=5),
    st.sampled_from([1, 17, 64, 300]),
)
def test_large_frames_gathered_in_chunks_decode_the_same(
        frames: list[tuple[int, int, bytes, bytes, bool]], chunks: list[int],
        large: int) -> None:
    """A decoder gathering frames of ``large`` bytes or more chunk by chunk (LARGE_FRAME_BYTES,
    made small here) yields exactly what the buffering decoder yields fed the whole stream at
    once: frames, corrupt and discarded ones alike."""
    raw_frames = []
    for opcode, rid, header, payload, corrupt in frames:
        f = bytearray(encode_frame(opcode, rid, 0, header, payload))
        if corrupt and payload:
            f[-1] ^= 0xFF  # the payload CRC
        raw_frames.append(bytes(f))
    raw = b"".join(raw_frames)
    want = _events(FrameDecoder(large_frame_bytes=10**9), raw, [len(raw) or 1])
    d = FrameDecoder(large_frame_bytes=large)
    assert _events(d, raw, chunks) == want
    assert d.buffered_bytes == 0


def test_a_large_frame_is_views_of_one_joined_copy() -> None:
    raw = encode_frame(Opcode.FETCH, 5, 1, b"h" * 10, b"p" * 200_000) + PING_1
    d = FrameDecoder()
    for i in range(0, len(raw), 65_536):
        d.feed(raw[i : i + 65_536])
    ev = d.events()
    assert [type(e) for e in ev] == [Frame, Frame]
    frame = ev[0]
    assert isinstance(frame, Frame) and bytes(frame.payload) == b"p" * 200_000
    assert isinstance(frame.payload.obj, bytes) and len(frame.payload.obj) > 200_000  # joined


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3 * CRC_SLICE_BYTES), st.integers(0, 2**32 - 1))
def test_fast_crc32_is_zlibs_crc32(data: bytes, start: int) -> None:
    """The payload CRC (ISA-L's when installed) is exactly zlib.crc32, chained from any value."""
    assert frame_crc32(data, start) == zlib.crc32(data, start)
    assert _crc([data, memoryview(data)]) == zlib.crc32(data + data)


def test_pure_python_mode_uses_zlib() -> None:
    """With SBPSTREAM_PURE_PYTHON=1 the frame module checksums with zlib (the path kept for
    platforms without isal), and frames still decode."""
    code = (
        "import zlib\n"
        "from sbpstream.protocol import frame\n"
        "assert frame.crc32 is zlib.crc32, frame.crc32\n"
        "raw = b''.join(frame.encode_frame_parts(1, 1, 0, b'', [b'x' * 70000]))\n"
        "d = frame.FrameDecoder()\n"
        "d.feed(raw)\n"
        "e = d.next_event()\n"
        "assert isinstance(e, frame.Frame) and len(e.payload) == 70000, e\n"
    )
    env = dict(os.environ, SBPSTREAM_PURE_PYTHON="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
