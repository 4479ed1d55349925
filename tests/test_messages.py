"""Extended headers (sbpstream.protocol.messages): round trips, defaults, golden bytes, fuzz."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    BadHeaderError,
    ErrorCode,
    LimitExceededError,
    PmNotLeaderError,
    UnknownServerError,
)
from sbpstream.protocol.fbs import sbp_generated as G
from sbpstream.protocol.opcodes import Opcode

# ----------------------------------------------------------------- samples: every field non-default

NODE = m.DataNode(7, "dn-7.example:12379")
NODE2 = m.DataNode(8, "[::1]:12380")
ERR = m.Status(int(ErrorCode.RANGE_SEALED), "sealed", b"\x00\x01detail")
ERR2 = m.Status(int(ErrorCode.PM_NOT_LEADER), "not leader", b"10.0.0.2:12378")
RANGE = m.Range(
    stream_id=42,
    range_index=3,
    start_offset=1_000,
    next_offset=1_500,
    end_offset=1_500,
    replica_nodes=(m.ReplicaNode(NODE, True), m.ReplicaNode(NODE2, True)),
)
RANGE2 = dataclasses.replace(RANGE, range_index=4, start_offset=1_500, next_offset=1_600)
STREAM = m.Stream(42, 3, 86_400_000, 1_000)
PRODUCER = m.ProducerState(1 << 40, 3, 99, 1_400)

SAMPLES: list[m.Message] = [
    m.PingRequest(),
    m.PingResponse(),
    m.GoAway(int(ErrorCode.SHUTTING_DOWN), "maintenance", 12345),
    m.GoAwayResponse(ERR),
    m.HeartbeatRequest("client-1", m.ClientRole.DATA_NODE, NODE),
    m.HeartbeatResponse("client-1", m.ClientRole.CLIENT, NODE, ERR2),
    m.AllocateIdRequest(3_000, "host-a"),
    m.AllocateIdResponse(17, ERR),
    m.AppendRequest(
        5_000,
        (m.AppendItem(42, 1, 4096, 3), m.AppendItem(-(1 << 62), 2, 123, 0)),
        True,
        1_234,
    ),
    m.AppendResponse(
        10,
        ERR,
        (m.AppendResult(42, 1, 1_000, 1_700_000_000_000, ERR, 1_010),),
    ),
    m.FetchRequest(
        500,
        1_024,
        (m.FetchItem(42, 1, 1_000, 1 << 20, 2), m.FetchItem(43, 2, 0, 65_536, 0)),
        9,
        4,
        (44, 45, -1),
        1 << 24,
    ),
    m.FetchResponse(
        20,
        ERR,
        (
            m.FetchResult(42, 1, 4096, ERR, 100, 2_000, 1_500),
            m.FetchResult(43, 7, 0, ERR2, 0, 1, 2),
        ),
    ),
    m.BufferAckRequest(1 << 33, 7, True),
    m.BufferAckResponse(ERR),
    m.ListRangesRequest(1_000, (m.StreamOwner(42), NODE, m.StreamOwner(-5))),
    m.ListRangesResponse(1, ERR, (m.ListRangesResult(42, ERR, (RANGE, RANGE2)),)),
    m.SealRangesRequest(1_000, (m.SealItem(42, 3, 1_500), m.SealItem(43, 0, 0))),
    m.SealRangesResponse(
        2, ERR, (m.SealResult(42, ERR, (RANGE, RANGE2), (PRODUCER, m.ProducerState(5, 0, 0, 0))),)
    ),
    m.SyncRangesRequest(1_000, (m.StreamRanges(42, (RANGE2,)),)),
    m.SyncRangesResponse(3, ERR, (m.SyncResult(42, ERR, (RANGE2,)),)),
    m.DescribeRangesRequest(1_000, (m.DescribeRangeItem(42, 4),)),
    m.DescribeRangesResponse(4, ERR, (m.DescribeRangeResult(42, ERR, RANGE),)),
    m.CreateStreamsRequest(1_000, (m.CreateStreamItem(3, 86_400_000), m.CreateStreamItem(1, 1))),
    m.CreateStreamsResponse(5, ERR, (m.CreateStreamResult(STREAM, 3, 86_400_000, ERR),)),
    m.DeleteStreamsRequest(1_000, (STREAM,)),
    m.DeleteStreamsResponse(6, ERR, (m.StreamResult(STREAM, ERR),)),
    m.UpdateStreamsRequest(1_000, (STREAM, m.Stream(43, 1, 5, 6))),
    m.UpdateStreamsResponse(7, ERR, (m.StreamResult(STREAM, ERR),)),
    m.DescribeStreamsRequest(1_000, (42, 43, 1 << 50), 100, 41),
    m.DescribeStreamsResponse(8, ERR, (m.StreamResult(STREAM, ERR),), 43),
    m.TrimStreamsRequest(1_000, (m.TrimItem(42, 1_200),)),
    m.TrimStreamsResponse(9, ERR, (m.TrimResult(STREAM, ERR, RANGE),)),
    m.ReportMetricsRequest(NODE, *range(1, 18)),
    m.ReportMetricsResponse(NODE, ERR),
]


def _assert_non_default(obj: Any, path: str) -> None:
    """Every field of obj (and of the first table of every vector) differs from its default."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{path}.{f.name}"
        assert value != f.default, f"{where} is at its default: the round trip would not test it"
        if dataclasses.is_dataclass(value):
            _assert_non_default(value, where)
        elif isinstance(value, tuple) and dataclasses.is_dataclass(value[0]):
            # The first item is checked; later ones may mix in defaults on purpose.
            _assert_non_default(value[0], f"{where}[0]")


def _id(msg: object) -> str:
    return type(msg).__name__


def test_samples_cover_every_message_class() -> None:
    assert [type(s) for s in SAMPLES] == list(m.MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_samples_have_no_default_field(msg: m.Message) -> None:
    _assert_non_default(msg, type(msg).__name__)


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_round_trip(msg: m.Message) -> None:
    raw = msg.encode()
    assert type(msg).decode(raw) == msg
    assert type(msg).decode(memoryview(raw)) == msg
    assert type(msg).decode(bytearray(raw)) == msg
    decode = m.decode_response if msg.IS_RESPONSE else m.decode_request
    assert decode(msg.OPCODE, raw) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_round_trip_inside_a_larger_buffer(msg: m.Message) -> None:
    # The frame codec hands over a memoryview slice of its receive buffer.
    raw = msg.encode()
    frame = b"\xee" * 16 + raw + b"payload"
    view = memoryview(frame)[16 : 16 + len(raw)]
    assert type(msg).decode(view) == msg


@pytest.mark.parametrize("cls", m.MESSAGES, ids=lambda c: c.__name__)
def test_empty_header_decodes_to_defaults(cls: type[m.Message]) -> None:
    assert cls.decode(b"") == cls()
    assert cls.decode(memoryview(b"")) == cls()
    assert cls.decode(cls().encode()) == cls()


def test_defaults_cost_no_bytes() -> None:
    # Defaults and OK statuses are not written: a default item is a bare table.
    ok = m.AppendResponse(items=(m.AppendResult(),)).encode()
    assert len(ok) < len(m.AppendResponse(items=(m.AppendResult(status=ERR),)).encode())
    assert (
        m.FetchResponse(items=(m.FetchResult(),)).encode()
        == m.FetchResponse(items=(m.FetchResult(status=m.Status()),)).encode()
    )


def test_system_error_response_round_trip() -> None:
    msg = m.SystemErrorResponse(ERR)
    assert m.SystemErrorResponse.decode(msg.encode()) == msg
    assert m.SystemErrorResponse.decode(b"") == m.SystemErrorResponse()


def test_empty_vectors_and_optional_tables() -> None:
    msg = m.SealRangesResponse(items=(m.SealResult(stream_id=1),))
    assert m.SealRangesResponse.decode(msg.encode()) == msg
    msg2 = m.TrimStreamsResponse(items=(m.TrimResult(),))
    assert m.TrimStreamsResponse.decode(msg2.encode()).items[0].range is None
    hb = m.HeartbeatRequest("sdk", m.ClientRole.CLIENT)
    assert m.HeartbeatRequest.decode(hb.encode()).data_node is None


def test_extreme_integers_round_trip() -> None:
    i64 = (-(1 << 63), (1 << 63) - 1)
    msg = m.FetchRequest(
        max_wait_ms=(1 << 31) - 1,
        min_bytes=-(1 << 31),
        items=tuple(m.FetchItem(v, -1, v, 0, (1 << 31) - 1) for v in i64),
        forgotten=i64,
    )
    assert m.FetchRequest.decode(msg.encode()) == msg
    assert (
        m.GoAway.decode(m.GoAway(last_stream_id=(1 << 32) - 1).encode()).last_stream_id
        == (1 << 32) - 1
    )


def test_unicode_strings_round_trip() -> None:
    msg = m.HeartbeatRequest("клиент-✓", m.ClientRole.CLIENT, m.DataNode(1, "hôte:1"))
    assert m.HeartbeatRequest.decode(msg.encode()) == msg


def test_value_out_of_range_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        m.ReportMetricsRequest(network_append_rate=40_000).encode()  # int16 field
    with pytest.raises(ValueError):
        m.AppendRequest(timeout_ms=1 << 31).encode()


def test_unknown_client_role_decodes_as_unspecified() -> None:
    b = __import__("flatbuffers").Builder(64)
    G.HeartbeatRequestStart(b)
    G.HeartbeatRequestAddClientRole(b, 99)
    b.Finish(G.HeartbeatRequestEnd(b))
    assert m.HeartbeatRequest.decode(bytes(b.Output())).client_role is m.ClientRole.UNSPECIFIED


# ----------------------------------------------------------------- golden bytes (pin the schema)

GOLDEN: list[tuple[m.Header, str]] = [
    (
        m.SystemErrorResponse(m.Status(int(ErrorCode.BAD_HEADER), "bad header", b"x")),
        "0c000000000006000a000400060000001000000000000a0010000e00080004000a0000000c000000"
        "1000000000000a0001000000780000000a000000626164206865616465720000",
    ),
    (
        # Items take the fixed-layout path: one shared vtable, every field written.
        m.AppendRequest(1000, (m.AppendItem(1, 0, 100), m.AppendItem(2, 1, 200, 0))),
        "0c00000008000c00080004000800000008000000e803000002000000180000002c0000000c0018000400"
        "0c0010001400000000001000000001000000000000000000000064000000ffffffff2800000002000000"
        "0000000001000000c80000000000000000000000",
    ),
    (
        m.FetchResponse(items=(m.FetchResult(5, 0, 512, start_offset=0, high_watermark=10),)),
        "1000000000000a0008000000000004000a00000004000000010000001800000012003000040024002800"
        "00000c0014001c00000014000000050000000000000000000000000000000a00000000000000ffffffff"
        "ffffffff00000000000200000000000000000000",
    ),
    (m.PingRequest(), "080000000400040004000000"),
    (m.GoAway(), "080000000400040004000000"),
]


@pytest.mark.parametrize("msg,hex_bytes", GOLDEN, ids=lambda x: type(x).__name__)
def test_golden_bytes(msg: m.Header, hex_bytes: str) -> None:
    assert msg.encode().hex() == hex_bytes
    assert type(msg).decode(bytes.fromhex(hex_bytes)) == msg


def test_golden_generated_reader_agrees() -> None:
    # The generated accessors read what messages.py wrote: the schema, not messages.py, rules.
    raw = SAMPLES[8].encode()
    t = G.AppendRequest.GetRootAs(raw, 0)
    assert (t.TimeoutMs(), t.AppendRequestsLength(), t.Replication(), t.CommittedOffset()) == (
        5_000,
        2,
        True,
        1_234,
    )
    item = t.AppendRequests(0)
    assert (item.StreamId(), item.RequestIndex(), item.BatchLength(), item.RangeIndex()) == (
        42,
        1,
        4096,
        3,
    )


# Slot widths of the hot item tables (written by the fixed-layout path when statuses are OK).
_WIDTHS = {
    "AppendItem": (8, 4, 4, 4),
    "FetchItem": (8, 4, 8, 4, 4),
    "AppendResult": (8, 4, 8, 8, 4, 8),
    "FetchResult": (8, 4, 4, 4, 8, 8, 8),
}
_MIXED = (m.FetchResult(1, 2, 3), m.FetchResult(4, 5, 6, ERR2), m.FetchResult(7, 8, 9, ERR))
_HOT = [
    (SAMPLES[8], "AppendRequests", "AppendItem"),
    (SAMPLES[10], "FetchRequests", "FetchItem"),
    (SAMPLES[9], "AppendResponses", "AppendResult"),
    (
        m.AppendResponse(items=(m.AppendResult(1, 2, 3, 4, m.Status(), 5),) * 3),
        "AppendResponses",
        "AppendResult",
    ),
    (SAMPLES[11], "FetchResponses", "FetchResult"),
    (m.FetchResponse(items=(m.FetchResult(1, 2, 3),) * 3), "FetchResponses", "FetchResult"),
    (m.FetchResponse(items=_MIXED * 5), "FetchResponses", "FetchResult"),
]


@pytest.mark.parametrize("msg,vector,item", _HOT, ids=lambda x: type(x).__name__)
def test_hot_items_are_aligned_and_read_by_generated_code(
    msg: m.Message, vector: str, item: str
) -> None:
    # Other languages' verifiers check alignment; Python does not, so check it here.
    raw = msg.encode()
    assert type(msg).decode(raw) == msg
    assert len(raw) % 8 == 0
    root = getattr(G, type(msg).__name__).GetRootAs(raw, 0)
    items = msg.items  # type: ignore[attr-defined]
    assert getattr(root, vector + "Length")() == len(items)
    for j, expected in enumerate(items):
        view = getattr(root, vector)(j)
        pos = view._tab.Pos
        assert pos % 4 == 0
        for slot, width in enumerate(_WIDTHS[item]):
            off = view._tab.Offset(4 + 2 * slot)
            assert off == 0 or (pos + off) % width == 0, (item, slot)
        assert view.StreamId() == expected.stream_id
        assert view.RequestIndex() == expected.request_index
        if hasattr(expected, "status"):
            st = view.Status()
            assert (st is None) == expected.status.ok
            if st is not None:
                assert (st.Code(), st.Message().decode()) == (
                    expected.status.code,
                    expected.status.message,
                )


# ----------------------------------------------------------------- registries


def test_registries_cover_every_opcode() -> None:
    assert set(m.REQUESTS) == set(Opcode)
    assert set(m.RESPONSES) == set(Opcode)
    for opcode, cls in m.REQUESTS.items():
        assert cls.OPCODE is opcode and not cls.IS_RESPONSE
    for opcode, cls in m.RESPONSES.items():
        assert cls.OPCODE is opcode and cls.IS_RESPONSE


def test_messages_are_frozen_and_slotted() -> None:
    for cls in m.MESSAGES:
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, cls
        assert "__dict__" not in dir(cls()), cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.AppendRequest().timeout_ms = 1  # type: ignore[misc]


def test_decode_unknown_opcode() -> None:
    with pytest.raises(ValueError):
        m.decode_request(0x7777, b"")


# ----------------------------------------------------------------- status helpers


def test_status_helpers() -> None:
    assert m.STATUS_OK.ok and not ERR.ok
    m.STATUS_OK.raise_for_error()
    with pytest.raises(PmNotLeaderError) as info:
        ERR2.raise_for_error()
    assert info.value.detail == b"10.0.0.2:12378"
    assert m.Status.of(info.value) == ERR2
    assert isinstance(m.Status(999, "what").error(), UnknownServerError)


# ----------------------------------------------------------------- limits


def test_too_many_items_on_encode() -> None:
    items = (m.AppendItem(),) * (m.MAX_ITEMS_PER_REQUEST + 1)
    with pytest.raises(LimitExceededError):
        m.AppendRequest(items=items).encode()
    with pytest.raises(LimitExceededError):
        m.DescribeStreamsRequest(stream_ids=(1,) * (m.MAX_ITEMS_PER_REQUEST + 1)).encode()


def test_too_many_items_on_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    over = m.MAX_ITEMS_PER_REQUEST + 1
    monkeypatch.setattr(m, "MAX_ITEMS_PER_REQUEST", over)  # let the encoder write it
    raw = m.AppendRequest(items=(m.AppendItem(1),) * over).encode()
    raw_ids = m.DescribeStreamsRequest(stream_ids=(1,) * over).encode()
    monkeypatch.undo()
    with pytest.raises(LimitExceededError):
        m.AppendRequest.decode(raw)
    with pytest.raises(LimitExceededError):
        m.DescribeStreamsRequest.decode(raw_ids)
    # Responses are bounded by the header's size only (a data node may hold many streams).
    many = m.ListRangesResponse(items=(m.ListRangesResult(1),) * over)
    assert len(m.ListRangesResponse.decode(many.encode()).items) == over


def test_max_items_is_accepted() -> None:
    msg = m.FetchRequest(items=(m.FetchItem(1, 2, 3, 4),) * m.MAX_ITEMS_PER_REQUEST)
    assert len(m.FetchRequest.decode(msg.encode()).items) == m.MAX_ITEMS_PER_REQUEST


def test_huge_vector_length_is_rejected_quickly() -> None:
    raw = bytearray(m.AppendRequest(items=(m.AppendItem(1),)).encode())
    t = G.AppendRequest.GetRootAs(raw, 0)
    vec = t._tab.Vector(t._tab.Offset(6)) - 4  # the vector's length word
    raw[vec : vec + 4] = (0xFFFFFFF0).to_bytes(4, "little")
    with pytest.raises(BadHeaderError):
        m.AppendRequest.decode(bytes(raw))


# ----------------------------------------------------------------- fuzz

_ALLOWED = (BadHeaderError, LimitExceededError)
_CLASSES = [*m.MESSAGES, m.SystemErrorResponse]


def _decode_or_reject(cls: type[m.Header], data: bytes) -> None:
    with contextlib.suppress(*_ALLOWED):
        cls.decode(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(_CLASSES), data=st.binary(max_size=256))
def test_fuzz_random_bytes(cls: type[m.Header], data: bytes) -> None:
    _decode_or_reject(cls, data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_headers(data: st.DataObject) -> None:
    sample = data.draw(st.sampled_from(SAMPLES))
    raw = bytearray(sample.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for cls in (type(sample), data.draw(st.sampled_from(_CLASSES))):
        _decode_or_reject(cls, bytes(raw))
        _decode_or_reject(cls, bytes(raw[:cut]))


def test_every_truncation_of_every_sample() -> None:
    for sample in SAMPLES:
        raw = sample.encode()
        for cut in range(len(raw)):
            _decode_or_reject(type(sample), raw[:cut])
