"""Extended headers (sbpstream.protocol.messages): round trips, defaults, golden bytes, fuzz."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from typing import Any

import flatbuffers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from message_samples import ERR, ERR2, SAMPLES
from sbp_fbs import sbp_generated as G  # the test oracle (flatc's code)

from sbpstream.protocol import fbbuilder, fbtable, flatc, message_base
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    BadHeaderError,
    ErrorCode,
    LimitExceededError,
    PmNotLeaderError,
    UnknownServerError,
)
from sbpstream.protocol.fbtable import Table
from sbpstream.protocol.opcodes import Opcode


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
    monkeypatch.setattr(message_base, "MAX_ITEMS_PER_REQUEST", over)  # let the encoder write it
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


# ----------------------------------------------------------------- the schema is the source

SCHEMA = fbtable.parse_schema(flatc.SCHEMA_PATH.read_text())
TABLE_CLASSES = [
    c for c in (getattr(m, n) for n in m.__all__) if isinstance(c, type) and issubclass(c, Table)
    and dataclasses.is_dataclass(c)
]  # fmt: skip
# Python names that differ from the schema's (the spec's names are longer or repeat the table's).
RENAMED = {
    (cls.__name__, "items", schema)
    for cls, schema in [
        (m.AppendRequest, "append_requests"), (m.AppendResponse, "append_responses"),
        (m.FetchRequest, "fetch_requests"), (m.FetchResponse, "fetch_responses"),
        (m.ListRangesRequest, "range_owners"), (m.ListRangesResponse, "list_responses"),
        (m.SealRangesRequest, "ranges"), (m.SealRangesResponse, "seal_responses"),
        (m.SyncRangesRequest, "stream_ranges"), (m.SyncRangesResponse, "sync_responses"),
        (m.DescribeRangesRequest, "ranges"), (m.DescribeRangesResponse, "describe_responses"),
        (m.CreateStreamsRequest, "streams"), (m.CreateStreamsResponse, "create_responses"),
        (m.DeleteStreamsRequest, "streams"), (m.DeleteStreamsResponse, "delete_responses"),
        (m.UpdateStreamsRequest, "streams"), (m.UpdateStreamsResponse, "update_responses"),
        (m.DescribeStreamsResponse, "describe_responses"),
        (m.TrimStreamsRequest, "trimmed_streams"), (m.TrimStreamsResponse, "streams"),
    ]
} | {("TrimResult", "stream", "trimmed_stream")}  # fmt: skip


def test_every_schema_table_has_a_class() -> None:
    # RangeOwnerEntry stands for its union member (flatc's Python has no vectors of unions).
    assert {c.__name__ for c in TABLE_CLASSES} == set(SCHEMA.tables) - {"RangeOwnerEntry"}
    assert len(TABLE_CLASSES) == len({c.__name__ for c in TABLE_CLASSES})  # no name twice


def _schema_default(field: fbtable.Field, value: Any) -> bool:
    """What a Python default must be for the schema field (checked apart from the codec)."""
    if field.kind in (fbtable.Kind.SCALAR, fbtable.Kind.ENUM):
        return bool(value == field.default and type(value) is not float)
    if field.kind is fbtable.Kind.TABLE:
        ref = getattr(m, field.ref)
        return value is None or value == ref()  # absent: None, STATUS_OK, or DataNode()
    return bool(value == {fbtable.Kind.STRING: "", fbtable.Kind.BYTES: b""}.get(field.kind, ()))


@pytest.mark.parametrize("cls", TABLE_CLASSES, ids=lambda c: c.__name__)
def test_class_matches_the_schema(cls: type[Table]) -> None:
    table = SCHEMA.tables[cls.__name__]
    assert cls.SCHEMA.table == table
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    assert len(fields) == len(table.fields)
    for py, field in zip(fields, table.fields, strict=True):  # same order
        if py.name != field.name:
            assert (cls.__name__, py.name, field.name) in RENAMED
        assert _schema_default(field, py.default), (cls.__name__, py.name, py.default)
    status = [f for f in fields if f.name == "status"]
    assert not status or status[0].default is m.STATUS_OK


def test_enum_matches_the_schema() -> None:
    assert {r.name: r.value for r in m.ClientRole} == SCHEMA.enums["ClientRole"]


def test_fixed_layouts_derive_from_the_field_table() -> None:
    # 8-byte fields first, then 4-byte ones, each in slot order, then the status's uoffset.
    formats = {
        m.AppendItem: "<iqiii0x",  # 24 bytes
        m.FetchItem: "<iqqiii0x",  # 32 bytes
        m.AppendResult: "<iqqqqiI4x",  # 44 bytes, padded to 48
        m.FetchResult: "<iqqqqiiI0x",  # 48 bytes
    }
    for cls, fmt in formats.items():
        layout = cls.SCHEMA.fixed
        assert layout is not None and layout.row.format == fmt, cls
    assert m.Range.SCHEMA.fixed is None


def test_binding_refuses_drift_from_the_schema() -> None:
    codec = fbtable.Codec(SCHEMA)

    @dataclasses.dataclass(frozen=True)
    class DataNode(Table):  # a default that is not the schema's
        node_id: int = 1
        advertise_addr: str = ""

    with pytest.raises(TypeError, match="default"):
        codec.bind(DataNode)

    @dataclasses.dataclass(frozen=True)
    class StreamOwner(Table):  # a field the schema does not have
        stream_id: int = 0
        extra: int = 0

    with pytest.raises(TypeError, match="declares"):
        codec.bind(StreamOwner)

    @dataclasses.dataclass(frozen=True)
    class TrimItem(Table):  # schema fields in another order
        trim_offset: int = 0
        stream_id: int = 0

    with pytest.raises(TypeError, match="declares"):
        codec.bind(TrimItem)

    @dataclasses.dataclass(frozen=True)
    class NoSuchTable(Table):
        x: int = 0

    with pytest.raises(TypeError, match="no table"):
        codec.bind(NoSuchTable)

    @dataclasses.dataclass(frozen=True)
    class DescribeRangeItem(Table):
        stream_id: int = 0
        range_index: int = 0
        digest_end_offset: int = -1
        digest_start_offset: int = -1

    codec.bind(DescribeRangeItem)
    with pytest.raises(TypeError, match="bound twice"):
        codec.bind(DescribeRangeItem)


def test_registry_refuses_a_second_class_for_an_opcode() -> None:
    with pytest.raises(TypeError, match="two classes"):

        @m.request(Opcode.PING)
        class PingRequest(m.Message):
            pass


@pytest.mark.parametrize(
    "text",
    [
        "struct S { x:int; }",
        "table T { x:int (deprecated); }",
        "table T { x:int; } root_type T;",
        "table T { x:[int] = 1; }",
        "table T { x:Missing; }",
        "enum E : byte { A = 1 }",
    ],
)
def test_parser_refuses_what_it_does_not_support(text: str) -> None:
    with pytest.raises(ValueError):
        fbtable.parse_schema(text)


def test_generated_code_is_off_the_runtime_path() -> None:
    code = (
        "import sys, sbpstream.protocol.messages\n"
        "assert not [n for n in sys.modules if n.startswith('sbpstream.protocol.fbs')]\n"
        "assert 'flatbuffers' in sys.modules  # the runtime builder, not generated code\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------- round trips from the schema

_INT_RANGES = {
    fmt: (-(1 << (8 * w - 1)), (1 << (8 * w - 1)) - 1)
    for fmt, w in (("b", 1), ("h", 2), ("i", 4), ("q", 8))
} | {fmt: (0, (1 << (8 * w)) - 1) for fmt, w in (("B", 1), ("H", 2), ("I", 4), ("Q", 8))}


def _value(field: fbtable.Field, default: Any) -> st.SearchStrategy[Any]:
    kind = field.kind
    if kind is fbtable.Kind.SCALAR:
        return st.booleans() if field.fmt == "?" else st.integers(*_INT_RANGES[field.fmt])
    if kind is fbtable.Kind.ENUM:
        return st.sampled_from(type(default))
    if kind is fbtable.Kind.STRING:
        return st.text(max_size=6)
    if kind is fbtable.Kind.BYTES:
        return st.binary(max_size=6)
    if kind is fbtable.Kind.SCALARS:
        return st.lists(st.integers(*_INT_RANGES[field.fmt]), max_size=3).map(tuple)
    if kind is fbtable.Kind.TABLE:
        table = st.deferred(lambda: _instances(getattr(m, field.ref)))
        return table if default is not None else st.none() | table
    element = SCHEMA.tables[field.ref]
    if field.ref in SCHEMA.tables and not hasattr(m, field.ref):  # a union entry
        members = SCHEMA.unions[element.fields[0].ref]
        items = st.one_of([st.deferred(lambda n=n: _instances(getattr(m, n))) for n in members])
    else:
        items = st.deferred(lambda: _instances(getattr(m, field.ref)))
    return st.lists(items, max_size=3).map(tuple)


def _instances(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Instances of a table class, every field drawn from its schema type."""
    bound = cls.SCHEMA
    kwargs = {
        name: _value(field, py.default)
        for field, name, py in zip(
            bound.table.fields, bound.names, dataclasses.fields(cls), strict=True
        )
    }
    return st.builds(cls, **kwargs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_of_values_drawn_from_the_schema(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(TABLE_CLASSES))
    obj = data.draw(_instances(cls))
    assert cls.decode(obj.encode()) == obj


def _google_bytes(obj: Any, size: int = 16) -> bytes:
    """``obj`` written by the Google builder (the reference the lean one must match)."""
    b = flatbuffers.Builder(size)
    b.Finish(type(obj).SCHEMA.build(b, obj))
    return bytes(b.Output())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lean_builder_writes_the_google_builders_bytes(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(TABLE_CLASSES))
    obj = data.draw(_instances(cls))
    want = _google_bytes(obj)
    assert obj.encode() == want
    lean = fbbuilder.Builder(data.draw(st.sampled_from([0, 8, 16, 64])))  # grows as it goes
    root = cls.SCHEMA.build(lean, obj)
    if data.draw(st.booleans()):
        assert lean.finish(root) == want
    else:
        lean.Finish(root)
        assert bytes(lean.Output()) == want


@pytest.mark.parametrize("msg", [s for s in SAMPLES if isinstance(s, Table)], ids=_id)
def test_lean_builder_matches_on_the_samples(msg: Table) -> None:
    assert msg.encode() == _google_bytes(msg)


def test_lean_builder_writes_the_same_bytes_after_clear() -> None:
    msg = m.FetchResponse(items=(m.FetchResult(1, 2, 3, high_watermark=9),), session_id=4)
    b = fbbuilder.Builder(64)
    b.Finish(m.FetchResponse.SCHEMA.build(b, m.FetchResponse(session_id=-1)))
    b.Bytes[:] = b"\xff" * len(b.Bytes)  # what was written before no longer shows in padding
    b.Clear()
    assert b.finish(m.FetchResponse.SCHEMA.build(b, msg)) == _google_bytes(msg)


def test_lean_builder_refuses_what_the_google_builder_refuses() -> None:
    with pytest.raises(ValueError, match="cannot encode"):
        m.AppendRequest(replication=2).encode()  # type: ignore[arg-type]  # a bool field
    with pytest.raises(ValueError, match="cannot encode"):
        m.AppendRequest(items=(m.AppendItem(stream_id=1 << 63),)).encode()  # fixed layout
    with pytest.raises(ValueError, match="cannot encode"):
        m.Status(message=5).encode()  # type: ignore[arg-type]  # not a string
    b = fbbuilder.Builder(64)
    with pytest.raises(NotImplementedError):
        b.ForceDefaults(True)
    b.StartObject(1)
    with pytest.raises(flatbuffers.builder.IsNestedError):
        b.StartObject(1)
    with pytest.raises(flatbuffers.builder.IsNestedError):
        b.CreateString("x")


class _StartProbe:
    def StartObject(self, slots: int) -> None:
        self.slots = slots


@pytest.mark.parametrize("name", sorted(SCHEMA.tables))
def test_parser_agrees_with_flatc(name: str) -> None:
    # flatc's generated code is an independent reading of sbp.fbs: same slots, same defaults.
    probe = _StartProbe()
    getattr(G, name + "Start")(probe)
    assert probe.slots == SCHEMA.tables[name].slots
    b = flatbuffers.Builder(64)
    b.StartObject(0)
    b.Finish(b.EndObject())
    empty = getattr(G, name).GetRootAs(bytes(b.Output()), 0)
    for field in SCHEMA.tables[name].fields:
        if field.kind in (fbtable.Kind.SCALAR, fbtable.Kind.ENUM):
            accessor = "".join(part.title() for part in field.name.split("_"))
            assert getattr(empty, accessor)() == field.default, (name, field.name)
