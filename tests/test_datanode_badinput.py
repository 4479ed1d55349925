"""Every bad-input case of design.md section 2, as raw bytes over a real socket to a real data
node process. None of them takes the server down."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from raw_peer import RawPeer, raw_frame, system_error_code

from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.frame import encode_frame
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    GoAway,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("dnbad"), datanodes=1,
                      heartbeat_interval_ms=200, node_timeout_ms=20_000) as c:
        yield c


@pytest.fixture
def raw(cluster: LocalCluster) -> Iterator[RawPeer]:
    r = RawPeer(cluster.datanodes[0].address)
    yield r
    r.close()


def test_ping_vector(raw: RawPeer) -> None:
    raw.send(bytes.fromhex("00000010170001000000000101000000" "00000000"))
    f = raw.frames(1)[0]
    assert (f.opcode, f.flags, f.request_id) == (Opcode.PING, 0x03, 1)


def test_bad_magic_is_discarded(raw: RawPeer) -> None:
    raw.send(raw_frame(Opcode.PING, 5, magic=42))
    assert raw.ping_ok()  # the only answer is the PONG of the good frame


def test_unknown_opcode_is_discarded(raw: RawPeer) -> None:
    raw.send(raw_frame(0x7777, 5, b"", b"junk"))
    assert raw.ping_ok()


def test_crc_mismatch_gets_system_error_code(raw: RawPeer) -> None:
    raw.send(raw_frame(Opcode.APPEND, 6, b"", b"payload", crc=1234))
    f = raw.frames(1)[0]
    assert f.request_id == 6 and system_error_code(f) == ErrorCode.CHECKSUM_MISMATCH
    assert raw.ping_ok()


def test_bad_header_format_gets_system_error_code(raw: RawPeer) -> None:
    raw.send(raw_frame(Opcode.FETCH, 7, b"\x01\x02", header_format=2))
    f = raw.frames(1)[0]
    assert f.request_id == 7 and system_error_code(f) == ErrorCode.BAD_HEADER
    assert raw.ping_ok()


def test_undecodable_header_gets_system_error_code(raw: RawPeer) -> None:
    for rid, op in ((8, Opcode.APPEND), (9, Opcode.FETCH), (10, Opcode.SEAL_RANGES),
                    (11, Opcode.SYNC_RANGES), (12, Opcode.DESCRIBE_RANGES),
                    (13, Opcode.TRIM_STREAMS), (14, Opcode.DELETE_STREAMS)):
        raw.send(raw_frame(op, rid, b"\xff\xff\xff\x7f" + b"\x00" * 5))
        f = raw.frames(1)[0]
        assert f.request_id == rid and system_error_code(f) == ErrorCode.BAD_HEADER, op
    assert raw.ping_ok()


def test_frame_length_over_bound_goaway_and_close(raw: RawPeer) -> None:
    raw.send(struct.pack(">I", (16 << 20) + 1) + b"\x17")
    frames = raw.read_to_eof()
    assert raw.eof and [f.opcode for f in frames] == [Opcode.GOAWAY]
    assert GoAway.decode(frames[0].header).code == ErrorCode.INVALID_REQUEST


def test_header_length_beyond_frame_goaway_and_close(raw: RawPeer) -> None:
    raw.send(raw_frame(Opcode.APPEND, 3, b"", b"", header_length=100))
    frames = raw.read_to_eof()
    assert raw.eof and [f.opcode for f in frames] == [Opcode.GOAWAY]


def test_known_opcode_not_served_is_unsupported(raw: RawPeer) -> None:
    hdr = CreateStreamsRequest(items=(CreateStreamItem(replica_nums=1),)).encode()
    for rid, op in ((15, Opcode.CREATE_STREAMS), (16, Opcode.LIST_RANGES),
                    (17, Opcode.ALLOCATE_ID), (18, Opcode.REPORT_METRICS)):
        raw.send(raw_frame(op, rid, hdr))
        f = raw.frames(1)[0]
        assert f.request_id == rid and system_error_code(f) == ErrorCode.UNSUPPORTED_OPERATION
    assert raw.ping_ok()


def _create_stream(pm: str) -> int:
    r = RawPeer(pm)
    try:
        hdr = CreateStreamsRequest(timeout_ms=5000,
                                   items=(CreateStreamItem(replica_nums=1),)).encode()
        r.send(encode_frame(Opcode.CREATE_STREAMS, 1, 0, hdr))
        res = CreateStreamsResponse.decode(r.frames(1)[0].header).items[0]
        assert res.stream is not None
        return res.stream.stream_id
    finally:
        r.close()


def test_corrupt_batch_fails_only_its_item(cluster: LocalCluster, raw: RawPeer) -> None:
    sid = _create_stream(cluster.pm_address)
    good = build_batch([Record(value=b"good")])
    bad = bytearray(build_batch([Record(value=b"bad!")]))
    bad[12] = 9  # batch magic
    short = good[:30]  # truncated header
    batches = [good, bytes(bad), good, short, good]
    hdr = AppendRequest(timeout_ms=5000, items=tuple(
        AppendItem(stream_id=sid, request_index=i, batch_length=len(b))
        for i, b in enumerate(batches))).encode()
    raw.send(encode_frame(Opcode.APPEND, 20, 0, hdr, b"".join(batches)))
    results = {}
    while not raw.eof:
        f = raw.frames(1)[0]
        assert f.request_id == 20 and not f.flags & 0x04
        results.update({r.request_index: r for r in AppendResponse.decode(f.header).items})
        if f.is_end:
            break
    assert [results[i].status.code for i in range(5)] == [
        0, ErrorCode.CORRUPT_BATCH, 0, ErrorCode.CORRUPT_BATCH, 0]
    assert [results[i].base_offset for i in (0, 2, 4)] == [0, 1, 2]


def test_batch_lengths_must_add_up(cluster: LocalCluster, raw: RawPeer) -> None:
    sid = _create_stream(cluster.pm_address)
    good = build_batch([Record(value=b"x")])
    for rid, lengths in ((21, [len(good) + 1]), (22, [len(good) - 1]), (23, [0]), (24, [-5])):
        hdr = AppendRequest(items=tuple(
            AppendItem(stream_id=sid, request_index=i, batch_length=n)
            for i, n in enumerate(lengths))).encode()
        raw.send(encode_frame(Opcode.APPEND, rid, 0, hdr, good))
        f = raw.frames(1)[0]
        assert f.request_id == rid and system_error_code(f) == ErrorCode.INVALID_REQUEST
    assert raw.ping_ok()


def test_too_many_items_is_refused(cluster: LocalCluster, raw: RawPeer) -> None:
    hdr = AppendRequest(items=tuple(
        AppendItem(stream_id=1, request_index=i, batch_length=1) for i in range(5000))).encode()
    raw.send(encode_frame(Opcode.APPEND, 25, 0, hdr, b"\x00" * 5000))
    f = raw.frames(1)[0]
    assert system_error_code(f) == ErrorCode.LIMIT_EXCEEDED
    assert raw.ping_ok()


def test_server_survives_everything(cluster: LocalCluster) -> None:
    r = RawPeer(cluster.datanodes[0].address)
    try:
        assert r.ping_ok()
        assert cluster.datanodes[0].running
    finally:
        r.close()
