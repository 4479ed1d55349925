"""The fast writers of a many-stream consumer's start-up vectors (sbpstream.protocol.rangelist:
LIST_RANGES's StreamOwner entries, DESCRIBE_STREAMS's StreamResults; fbtable's packed integer
vectors, e.g. DESCRIBE_STREAMS's stream ids) write the builder's bytes.

Hypothesis draws vectors (defaults and extremes, names of any length and script, statuses that
send the vector down the builder path, data-node owners likewise), several alignments before
them and several vectors per buffer (vtables written before and shared between vectors); each
is written by the fast path and by the builder path it replaces, into fresh builders, and the
bytes must be equal. The messages using them round-trip.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import flatbuffers
from hypothesis import given, settings
from hypothesis import strategies as st
from message_samples import write_vectors as _write

from sbpstream.protocol import fbtable, rangelist
from sbpstream.protocol import messages as m
from sbpstream.protocol.fbtable import put_tables

I64 = st.one_of(st.just(0), st.integers(-(2**63), 2**63 - 1))
I8 = st.one_of(st.just(0), st.integers(-128, 127))
NAME = st.one_of(st.just(""), st.text(max_size=12))
STATUS = st.one_of(st.just(m.STATUS_OK), st.just(m.Status()),
                   st.builds(m.Status, st.integers(1, 300), st.text(max_size=6)))
STREAM = st.builds(m.Stream, I64, I8, I64, I64, NAME)
RESULTS = st.lists(st.builds(m.StreamResult, st.one_of(st.none(), STREAM),
                             st.one_of(st.just(m.STATUS_OK), STATUS)), min_size=1, max_size=8)
OWNERS = st.lists(st.one_of(st.builds(m.StreamOwner, I64),
                            st.builds(m.DataNode, st.integers(-(2**31), 2**31 - 1), NAME)),
                  min_size=1, max_size=8)
STREAM_OWNERS = st.lists(st.builds(m.StreamOwner, I64), min_size=1, max_size=8)

def _owners_builder(b: Any, items: Sequence[Any]) -> int:
    return m._CODEC.builder_vector_writer("RangeOwnerEntry")(b, items)


def _owners_fast(b: Any, items: Sequence[Any]) -> int:
    return rangelist.put_stream_owners(b, items, owner=m.StreamOwner, kind=1,
                                       fallback=_owners_builder)


def _results_builder(b: Any, items: Sequence[Any]) -> int:
    return put_tables(b, items, build=m.StreamResult.SCHEMA.build)


def _results_fast(b: Any, items: Sequence[Any]) -> int:
    return rangelist.put_stream_results(b, items, is_ok=m._status_omitted,
                                        fallback=_results_builder)


@settings(max_examples=300, deadline=None)
@given(st.lists(OWNERS, min_size=1, max_size=3), st.text(max_size=9))
def test_stream_owner_entries_are_the_builders_bytes(vectors: list[list[Any]],
                                                     before: str) -> None:
    assert _write(_owners_fast, before, vectors) == _write(_owners_builder, before, vectors)


@settings(max_examples=300, deadline=None)
@given(st.lists(STREAM_OWNERS, min_size=1, max_size=3), st.text(max_size=9))
def test_stream_owner_entries_of_streams_only_are_the_builders_bytes(
        vectors: list[list[Any]], before: str) -> None:
    assert _write(_owners_fast, before, vectors) == _write(_owners_builder, before, vectors)


@settings(max_examples=300, deadline=None)
@given(st.lists(RESULTS, min_size=1, max_size=3), st.text(max_size=9))
def test_stream_results_are_the_builders_bytes(vectors: list[list[Any]], before: str) -> None:
    assert _write(_results_fast, before, vectors) == _write(_results_builder, before, vectors)


@settings(max_examples=100, deadline=None)
@given(OWNERS, RESULTS)
def test_the_messages_round_trip(owners: list[Any], results: list[Any]) -> None:
    req = m.ListRangesRequest(timeout_ms=5, items=tuple(owners))
    assert m.ListRangesRequest.decode(req.encode()) == req
    resp = m.DescribeStreamsResponse(items=tuple(results), continuation=3)
    got = m.DescribeStreamsResponse.decode(resp.encode())
    assert got.continuation == 3 and len(got.items) == len(results)
    for a, b in zip(got.items, results, strict=True):
        assert a.stream == b.stream and (a.status.code, a.status.message) == (
            b.status.code, b.status.message)


def test_the_messages_use_the_fast_writers() -> None:
    """Both writers are registered and the generated writers call them, and a
    1,000-stream LIST_RANGES and DESCRIBE_STREAMS answer are what the builder writes."""
    assert "RangeOwnerEntry" in m._CODEC.union_puts and m.StreamResult.SCHEMA.put is not None
    # the generated writers call them (by name)
    assert "put_RangeOwnerEntry_vector" in m.ListRangesRequest.SCHEMA.build.__code__.co_names
    assert "put_StreamResult_vector" in m.DescribeStreamsResponse.SCHEMA.build.__code__.co_names
    owners = [m.StreamOwner(i) for i in range(1000)]
    results = [m.StreamResult(m.Stream(i, 3, 0, i // 2, f"s{i}" if i % 3 else ""))
               for i in range(1000)]
    assert _write(_owners_fast, "", [owners]) == _write(_owners_builder, "", [owners])
    assert _write(_results_fast, "", [results]) == _write(_results_builder, "", [results])
    assert m.ListRangesRequest.decode(m.ListRangesRequest(items=tuple(owners)).encode()).items \
        == tuple(owners)


def _scalars_builder(b: Any, values: Sequence[int], fmt: str) -> int:
    """The builder's own way: one prepend per element."""
    width = struct.calcsize(fmt)
    prepend = getattr(b, fbtable._ELEMENT_WRITER[fmt])
    b.StartVector(width, len(values), width)
    for v in reversed(values):
        prepend(v)
    return int(b.EndVector())


_INT_FORMATS = {"b": 8, "B": 8, "h": 16, "H": 16, "i": 32, "I": 32, "q": 64, "Q": 64}


@st.composite
def _scalar_vectors(draw: st.DrawFn) -> tuple[str, list[int]]:
    fmt = draw(st.sampled_from(sorted(_INT_FORMATS)))
    bits = _INT_FORMATS[fmt]
    lo, hi = (0, 2**bits - 1) if fmt.isupper() else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return fmt, draw(st.lists(st.integers(lo, hi), min_size=1, max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.lists(_scalar_vectors(), min_size=1, max_size=3), st.text(max_size=9))
def test_integer_vectors_are_the_builders_bytes(vectors: list[tuple[str, list[int]]],
                                                before: str) -> None:
    def write(put: Callable[[Any, Sequence[int], str], int]) -> bytes:
        b = flatbuffers.Builder(16)
        if before:
            b.CreateString(before)
        last = 0
        for fmt, values in vectors:
            last = put(b, values, fmt)
        b.Finish(last)
        return bytes(b.Output())

    assert write(fbtable.put_scalars) == write(_scalars_builder)
