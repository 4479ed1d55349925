"""Several replication rounds out at once per set of secondaries, each range in at most one.

The channel is driven directly with a fake secondary that holds every round until told to answer
it (as tests/test_replication_seal_race.py does), so what is out at a given moment is observable
without timing assumptions.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from sbpstream.datanode import replication
from sbpstream.datanode.ranges import ReplicaRange
from sbpstream.datanode.replication import Replicators
from sbpstream.protocol.errors import ReplicaUnavailableError, StorageError
from sbpstream.protocol.frame import ChecksummedPayload, Frame, FrameDecoder, encode_frame_parts
from sbpstream.protocol.messages import (
    AppendRequest,
    AppendResponse,
    AppendResult,
    DataNode,
    ReplicaNode,
    Status,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import build_batch
from sbpstream.records.builder import Record
from sbpstream.records.header import patch_base_offset, read_header

PRIMARY, SECONDARY = 1, 2


@dataclass
class _Round:
    request: AppendRequest
    batches: list[bytes]  # the payload cut at the items' batch lengths
    answer: asyncio.Future[tuple[AppendResult, ...]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class _Secondary:
    """A secondary's connection: every round waits for the test to answer it."""

    def __init__(self) -> None:
        self.rounds: list[_Round] = []
        self.out = 0
        self.max_out = 0
        self.changed = asyncio.Event()

    async def get(self, addr: str) -> _Secondary:
        return self

    async def request(self, opcode: int, header: bytes, payload: Any,
                      timeout_s: float) -> list[Frame]:
        m = AppendRequest.decode(header)
        data = b"".join(bytes(p) for p in payload)
        batches, pos = [], 0
        for it in m.items:
            batches.append(data[pos:pos + it.batch_length])
            pos += it.batch_length
        assert pos == len(data)
        r = _Round(m, batches)
        self.rounds.append(r)
        self.out += 1
        self.max_out = max(self.max_out, self.out)
        self.changed.set()
        try:
            items = await r.answer
        finally:
            self.out -= 1
        return [Frame(opcode=opcode, request_id=1, flags=0,
                      header=AppendResponse(items=items).encode(), payload=b"")]

    async def wait_rounds(self, n: int) -> None:
        async with asyncio.timeout(10):
            while len(self.rounds) < n:
                self.changed.clear()
                await self.changed.wait()


def _ok(r: _Round) -> tuple[AppendResult, ...]:
    return tuple(AppendResult(stream_id=it.stream_id, request_index=it.request_index)
                 for it in r.request.items)


def _range(stream_id: int) -> ReplicaRange:
    rng = ReplicaRange(stream_id=stream_id, range_index=0, committed_offset=0)
    rng.replicas = (ReplicaNode(DataNode(PRIMARY, "127.0.0.1:1"), True),
                    ReplicaNode(DataNode(SECONDARY, "127.0.0.1:2"), False))
    rng.is_primary = True
    return rng


def _deadline() -> float:
    return time.monotonic() + 30.0


BATCH = build_batch([Record(value=b"v%d" % i) for i in range(5)])


def _expected(base: int) -> bytes:
    b = bytearray(BATCH)
    patch_base_offset(b, base)
    return bytes(b)


async def test_a_range_is_in_one_round_at_a_time_while_others_go_out() -> None:
    sec = _Secondary()
    reps = Replicators(SimpleNamespace(node_id=PRIMARY, pool=sec))
    a, b = _range(1), _range(2)
    fa0 = reps.get(a).submit(memoryview(BATCH), 0, _deadline())
    await sec.wait_rounds(1)  # round 1: a's first batch, held
    fa1 = reps.get(a).submit(memoryview(BATCH), 5, _deadline())
    fb0 = reps.get(b).submit(memoryview(BATCH), 0, _deadline())
    await sec.wait_rounds(2)  # round 2 carries b only: a has a round out
    r1, r2 = sec.rounds
    assert [it.stream_id for it in r1.request.items] == [1]
    assert [it.stream_id for it in r2.request.items] == [2]
    assert sec.out == 2
    assert not fa0.done() and not fa1.done() and not fb0.done()
    r2.answer.set_result(_ok(r2))
    await asyncio.wait_for(fb0, 10)  # b is settled while a's round is still out
    assert b.replicated_offset == 5 and a.replicated_offset < 5
    assert len(sec.rounds) == 2, "a's second batch went out before its first was answered"
    r1.answer.set_result(_ok(r1))
    await asyncio.wait_for(fa0, 10)
    await sec.wait_rounds(3)  # now a's second batch goes
    r3 = sec.rounds[2]
    r3.answer.set_result(_ok(r3))
    await asyncio.wait_for(fa1, 10)
    assert a.replicated_offset == 10
    # what the secondary got: each batch with its base offset written in, in offset order
    assert r1.batches == [_expected(0)] and r3.batches == [_expected(5)]
    assert r2.batches == [_expected(0)]
    assert read_header(r3.batches[0]).base_offset == 5
    reps.close()


async def test_rounds_out_at_once_are_bounded() -> None:
    sec = _Secondary()
    reps = Replicators(SimpleNamespace(node_id=PRIMARY, pool=sec))
    most = replication.MAX_ROUNDS_IN_FLIGHT
    ranges = [_range(i + 1) for i in range(most + 3)]
    futs = []
    for i, rng in enumerate(ranges[:most]):  # one round each: the ones before are held
        futs.append(reps.get(rng).submit(memoryview(BATCH), 0, _deadline()))
        await sec.wait_rounds(i + 1)
    for rng in ranges[most:]:  # ready, but no round may go out
        futs.append(reps.get(rng).submit(memoryview(BATCH), 0, _deadline()))
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(sec.rounds) == most and sec.out == most
    first = sec.rounds[0]
    first.answer.set_result(_ok(first))
    await sec.wait_rounds(most + 1)  # one settled: the waiting ranges go, in one round
    last = sec.rounds[most]
    assert [it.stream_id for it in last.request.items] == [r.stream_id for r in ranges[most:]]
    for r in sec.rounds[1:]:
        r.answer.set_result(_ok(r))
    for f in futs:
        await asyncio.wait_for(f, 10)
    assert sec.max_out == most
    assert all(r.replicated_offset == 5 for r in ranges)
    reps.close()


async def test_a_refused_item_fails_its_range_and_its_queued_batches_only() -> None:
    sec = _Secondary()
    reps = Replicators(SimpleNamespace(node_id=PRIMARY, pool=sec))
    a, b = _range(1), _range(2)
    fa0 = reps.get(a).submit(memoryview(BATCH), 0, _deadline())
    fb0 = reps.get(b).submit(memoryview(BATCH), 0, _deadline())
    await sec.wait_rounds(1)
    fa1 = reps.get(a).submit(memoryview(BATCH), 5, _deadline())  # queued behind a's round
    r1 = sec.rounds[0]
    assert sorted(it.stream_id for it in r1.request.items) == [1, 2]
    refused = Status.of(StorageError("disk"))
    r1.answer.set_result(tuple(
        AppendResult(stream_id=it.stream_id, request_index=it.request_index,
                     status=refused if it.stream_id == 1 else Status())
        for it in r1.request.items))
    await asyncio.wait_for(fb0, 10)
    for f in (fa0, fa1):
        with pytest.raises(ReplicaUnavailableError):
            await asyncio.wait_for(f, 10)
    assert a.replicated_offset < 5 and b.replicated_offset == 5
    assert len(sec.rounds) == 1, "a broken range's batch was forwarded"
    reps.close()


async def test_closing_the_node_fails_rounds_out() -> None:
    sec = _Secondary()
    reps = Replicators(SimpleNamespace(node_id=PRIMARY, pool=sec))
    fut = reps.get(_range(1)).submit(memoryview(BATCH), 0, _deadline())
    await sec.wait_rounds(1)
    reps.close()
    with pytest.raises(ReplicaUnavailableError):
        await asyncio.wait_for(fut, 10)


def test_a_checksummed_payload_frames_like_its_parts() -> None:
    """The round's payload is checksummed once for every secondary: same bytes on the wire as
    the parts checksummed per frame, and the frame decodes."""
    parts = [b"\x00" * 8, memoryview(BATCH)[8:], b"", bytearray(b"tail" * 3000)]
    body = ChecksummedPayload(parts)
    assert len(body) == 3
    once = b"".join(bytes(p) for p in encode_frame_parts(Opcode.APPEND, 9, 0, b"hdr", body))
    each = b"".join(bytes(p) for p in encode_frame_parts(Opcode.APPEND, 9, 0, b"hdr", parts))
    assert once == each
    dec = FrameDecoder()
    dec.feed(once)
    ev = dec.next_event()
    assert isinstance(ev, Frame)
    assert bytes(ev.payload) == b"".join(bytes(p) for p in parts)
