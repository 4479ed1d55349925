"""The LIST_RANGES fast path (sbpstream.protocol.rangelist) writes the builder's bytes exactly.

Random result vectors (defaults and extremes included, several alignments before them, vtables
written before and shared between vectors) are written twice: by the fast path and by the
builder path it replaces. The golden file pins the bytes of the messages that use it.
"""

from __future__ import annotations

import contextlib
import functools
import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from message_samples import write_vectors as _write

from sbpstream.protocol import fbtable, rangelist
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import BadHeaderError
from sbpstream.protocol.fbtable import put_tables

_DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, OverflowError)

_BUILD = m.ListRangesResult.SCHEMA.build
_FALLBACK = functools.partial(put_tables, build=_BUILD)
_I64 = (0, 1, -1, 7, 2**40, 2**63 - 1, -(2**63))


def _node(rnd: random.Random) -> m.DataNode:
    addr = rnd.choice(["", "h:1", "127.0.0.1:40001", "ü" * rnd.randrange(1, 9)])
    return m.DataNode(rnd.choice([0, 1, 3, -5, 2**31 - 1]), addr)


def _range(rnd: random.Random) -> m.Range:
    reps = tuple(m.ReplicaNode(_node(rnd), rnd.random() < 0.5) for _ in range(rnd.randrange(4)))
    return m.Range(rnd.choice(_I64), rnd.choice([0, 1, -1, 2**31 - 1]), rnd.choice(_I64),
                   rnd.choice(_I64), rnd.choice((-1, *_I64)), reps)


def _results(rnd: random.Random) -> tuple[m.ListRangesResult, ...]:
    return tuple(
        m.ListRangesResult(rnd.choice(_I64), m.STATUS_OK,
                           tuple(_range(rnd) for _ in range(rnd.randrange(4))))
        for _ in range(rnd.randrange(1, 12)))


def _fast(b: Any, items: Any) -> int:
    return rangelist.put_results(b, items, is_ok=m._status_omitted, fallback=_FALLBACK)


WRITERS = ["python"] + (["compiled"] if rangelist._compiled_writer is not None else [])


@pytest.fixture(params=WRITERS)
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the pure-Python writer and, where it was built, the compiled one."""
    compiled = rangelist._compiled_writer if request.param == "compiled" else None
    monkeypatch.setitem(rangelist.WRITER, "compiled", compiled)
    return str(request.param)


def test_fast_path_writes_the_builders_bytes(writer: str) -> None:
    rnd = random.Random(18)
    for _ in range(400):
        vectors = [_results(rnd) for _ in range(rnd.randrange(1, 4))]
        before = "x" * rnd.randrange(8)
        assert _write(_fast, before, vectors) == _write(_FALLBACK, before, vectors)


def test_a_failed_status_takes_the_builder_path_and_round_trips(writer: str) -> None:
    items = (m.ListRangesResult(5, m.Status(7, "gone")),
             m.ListRangesResult(6, m.STATUS_OK, (m.Range(6, 0),)))
    assert _write(_fast, "", [items]) == _write(_FALLBACK, "", [items])
    resp = m.ListRangesResponse(items=items)
    assert m.ListRangesResponse.decode(resp.encode()) == resp


def test_a_whole_node_listing_round_trips(writer: str) -> None:
    rnd = random.Random(1)
    items = tuple(r for _ in range(50) for r in _results(rnd))
    resp = m.ListRangesResponse(items=items)
    assert m.ListRangesResponse.decode(resp.encode()) == resp


# ------------------------------------------------------------------------- the fast reader

_READ_GENERIC = m.ListRangesResult.SCHEMA.read


def _generic(buf: bytes) -> tuple[m.ListRangesResult, ...]:
    """The generic reader's vector of a ListRangesResponse (its third slot)."""
    root = fbtable.U32(buf, 0)[0]
    at = root + fbtable.slots(buf, root, 3)[2]
    return fbtable.read_tables(buf, at, _READ_GENERIC, None)


READER = rangelist.ResultsReader(m.ListRangesResult, m.Range, m.ReplicaNode, m.DataNode,
                                 m.Status.SCHEMA.read)
READERS = {"python": READER.read_python}
"""The pure-Python reader always; the compiled one (which falls back to it on malformed
bytes) where it was built, even under SBPSTREAM_PURE_PYTHON=1."""
if rangelist._compiled is not None:
    READER.compiled = rangelist._compiled
    READERS["compiled"] = READER.read


def _fast_read(buf: bytes, kind: str = "python") -> tuple[m.ListRangesResult, ...]:
    root = fbtable.U32(buf, 0)[0]
    at = root + fbtable.slots(buf, root, 3)[2]
    return READERS[kind](buf, at, None)


def _outcome(read: Any, buf: bytes) -> Any:
    """What a reader gives, or "error". Which exception does not matter here: a message's
    ``decode`` turns every one of them into BadHeaderError (and nothing else escapes it:
    checked below), so the readers must agree on whether bytes decode, and to what."""
    try:
        return read(buf)
    except (BadHeaderError, *_DECODE_ERRORS):
        return "error"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), failed=st.booleans(), kind=st.sampled_from(sorted(READERS)))
def test_the_fast_reader_gives_the_generic_readers_objects(
    seed: int, failed: bool, kind: str
) -> None:
    rnd = random.Random(seed)
    items = _results(rnd)
    if failed:
        items = (m.ListRangesResult(9, m.Status(7, "gone", b"d")), *items)
    buf = m.ListRangesResponse(items=items).encode()
    assert _fast_read(buf, kind) == _generic(buf) == items
    assert m.ListRangesResponse.decode(buf).items == items


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), flips=st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 10**6), kind=st.sampled_from(sorted(READERS)))
@example(seed=83567, flips=[(75583, 1)], cut=2, kind="python")  # a struct.error, not BadHeader
def test_on_damaged_bytes_the_fast_reader_fails_where_the_generic_one_does(
    seed: int, flips: list[tuple[int, int]], cut: int, kind: str
) -> None:
    buf = bytearray(m.ListRangesResponse(items=_results(random.Random(seed))).encode())
    for at, value in flips:
        buf[4 + at % (len(buf) - 4)] = value  # the root offset kept: the vector is reached
    data = bytes(buf[: max(8, len(buf) - cut % 16)])
    want = _outcome(_generic, data)
    got = _outcome(lambda b: _fast_read(b, kind), data)
    assert got == want
    # what a receiver sees: the message, or one clear error, whichever reader ran
    with contextlib.suppress(BadHeaderError):
        m.ListRangesResponse.decode(data)


def test_maker_makes_what_the_dataclass_makes() -> None:
    rnd = random.Random(3)
    for r in (_range(rnd) for _ in range(50)):
        values = (r.stream_id, r.range_index, r.start_offset, r.next_offset, r.end_offset,
                  r.replica_nodes)
        made = fbtable.maker(m.Range)(*values)
        assert made == m.Range(*values) and hash(made) == hash(m.Range(*values))
        assert type(made) is m.Range
    with pytest.raises(TypeError):
        fbtable.maker(m.Range)(1, 2)  # every field is given


def test_maker_refuses_a_class_with_post_init() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        x: int = 0

        def __post_init__(self) -> None:
            raise AssertionError("never made")

    with pytest.raises(TypeError, match="__post_init__"):
        fbtable.maker(Checked)


@pytest.mark.parametrize("seed", range(40))
def test_stream_ranges_writer_writes_the_builders_bytes(seed: int) -> None:
    """SYNC_RANGES' StreamRanges vectors (no status slot): the pure writer, byte for byte."""
    rnd = random.Random(seed)
    vectors = [tuple(m.StreamRanges(r.stream_id, r.ranges) for r in _results(rnd))
               for _ in range(rnd.randrange(1, 4))]
    before = rnd.choice(["", "x", "abc", "seven!!"])
    fast = functools.partial(rangelist.put_results, is_ok=lambda s: True, status=False,
                             fallback=lambda b, items: pytest.fail("no fallback"))
    slow = functools.partial(put_tables, build=m.StreamRanges.SCHEMA.build)
    assert _write(fast, before, vectors) == _write(slow, before, vectors)  # type: ignore[arg-type]
    req = m.SyncRangesRequest(timeout_ms=5, items=vectors[0])
    assert m.SyncRangesRequest.decode(req.encode()) == req


_SYNC_GENERIC_READ = m.SyncResult.SCHEMA.read


def test_sync_results_take_the_fast_paths_with_the_generic_bytes_and_objects(writer: str) -> None:
    """SyncResult has ListRangesResult's layout: the same writer and reader serve it."""
    rnd = random.Random(7)
    for _ in range(100):
        items = tuple(m.SyncResult(r.stream_id, r.status, r.ranges) for r in _results(rnd))
        if rnd.random() < 0.2:
            items += (m.SyncResult(3, m.Status(7, "gone")),)
        resp = m.SyncRangesResponse(items=items)
        slow = functools.partial(put_tables, build=m.SyncResult.SCHEMA.build)
        fast = functools.partial(rangelist.put_results, is_ok=m._status_omitted, fallback=slow)
        assert _write(fast, "ab", [items]) == _write(slow, "ab", [items])  # type: ignore[arg-type]
        buf = resp.encode()
        root = fbtable.U32(buf, 0)[0]
        at = root + fbtable.slots(buf, root, 3)[2]
        assert fbtable.read_tables(buf, at, _SYNC_GENERIC_READ, None) == items
        assert m.SyncRangesResponse.decode(buf) == resp


# ------------------------------------------------------------------ CREATE_STREAMS' results


def _create_results(rnd: random.Random) -> tuple[m.CreateStreamResult, ...]:
    def stream() -> m.Stream | None:
        if rnd.random() < 0.2:
            return None
        return m.Stream(rnd.choice(_I64), rnd.choice([0, 1, 3, -1, 127, -128]), rnd.choice(_I64),
                        rnd.choice(_I64), rnd.choice(["", "a", "orders", "ü" * rnd.randrange(9)]))
    return tuple(
        m.CreateStreamResult(stream(), rnd.choice([0, 1, 3, -128]), rnd.choice(_I64))
        for _ in range(rnd.randrange(1, 12)))


def test_create_results_writer_writes_the_builders_bytes() -> None:
    rnd = random.Random(19)
    slow = functools.partial(put_tables, build=m.CreateStreamResult.SCHEMA.build)
    fast = functools.partial(rangelist.put_create_results, is_ok=m._status_omitted,
                             fallback=slow)
    for _ in range(400):
        vectors = [_create_results(rnd) for _ in range(rnd.randrange(1, 4))]
        before = "x" * rnd.randrange(8)
        assert _write(fast, before, vectors) == _write(slow, before, vectors)  # type: ignore[arg-type]
        resp = m.CreateStreamsResponse(items=vectors[0])
        assert m.CreateStreamsResponse.decode(resp.encode()) == resp


def test_a_failed_create_takes_the_builder_path_and_round_trips() -> None:
    items = (m.CreateStreamResult(None, 1, 5, m.Status(7, "no nodes")),
             m.CreateStreamResult(m.Stream(9, 1, 5, 0, "n"), 1, 5))
    resp = m.CreateStreamsResponse(items=items)
    assert m.CreateStreamsResponse.decode(resp.encode()) == resp
