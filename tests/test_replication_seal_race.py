"""A replication round still out when the range is stopped here (a seal's first call) must not
acknowledge or commit its batches (issue 16's R=3 subscriber failure).

The race, as seen under load: the primary had a round with batches [1600, 1900) out to its
secondaries when the PM's stop (SEAL end -1) arrived; the stop answered replicated_offset 1600 as
this node's end, so the PM sealed the range at 1600. The round's answers came in afterwards, and
the channel resolved the batches: the writer was acknowledged and the range committed up to
1900, so a subscriber read records [1600, 1900) that the seal then cut (and a producer had
acknowledgements for records that were gone). The channel is driven here directly, with a fake
secondary whose answer is held until the range was stopped.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from sbpstream.datanode.ranges import ReplicaRange
from sbpstream.datanode.replication import Replicators
from sbpstream.protocol.errors import ReplicaUnavailableError
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.messages import (
    AppendRequest,
    AppendResponse,
    AppendResult,
    DataNode,
    ReplicaNode,
)
from sbpstream.records import build_batch
from sbpstream.records.builder import Record

PRIMARY, SECONDARY = 1, 2


class _HeldSecondary:
    """A secondary's connection: answers a round OK only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.rounds = 0
        self.arrived = asyncio.Event()

    async def get(self, addr: str) -> _HeldSecondary:
        return self

    async def request(self, opcode: int, header: bytes, payload: Any,
                      timeout_s: float) -> list[Frame]:
        self.rounds += 1
        self.arrived.set()
        await self.release.wait()
        m = AppendRequest.decode(header)
        ok = tuple(AppendResult(stream_id=it.stream_id, request_index=it.request_index)
                   for it in m.items)
        return [Frame(opcode=opcode, request_id=1, flags=0,
                      header=AppendResponse(items=ok).encode(), payload=b"")]


def _deadline() -> float:
    """A batch's deadline (monotonic), far enough out that it never decides these tests."""
    return time.monotonic() + 30.0


def _range() -> ReplicaRange:
    rng = ReplicaRange(stream_id=7, range_index=0, committed_offset=0)
    rng.replicas = (ReplicaNode(DataNode(PRIMARY, "127.0.0.1:1"), True),
                    ReplicaNode(DataNode(SECONDARY, "127.0.0.1:2"), False))
    rng.is_primary = True
    return rng


async def test_round_answered_after_the_stop_acknowledges_nothing() -> None:
    secondary = _HeldSecondary()
    ctx: Any = SimpleNamespace(node_id=PRIMARY, pool=secondary)
    reps = Replicators(ctx)
    rng = _range()
    batch = build_batch([Record(value=b"v%d" % i) for i in range(10)])
    before = reps.get(rng).submit(memoryview(batch), 0, _deadline())
    secondary.release.set()
    await before  # a round answered before any stop: acknowledged
    assert rng.replicated_offset == 10
    secondary.release.clear()
    secondary.arrived.clear()
    late = reps.get(rng).submit(memoryview(batch), 10, _deadline())
    await asyncio.wait_for(secondary.arrived.wait(), 10)  # the round is out
    reps.drop(rng.stream_id, rng.range_index)  # the seal's stop (control.seal)
    stop_end = rng.replicated_offset  # what the stop answers as this node's end
    secondary.release.set()  # every secondary answers the round OK, after the stop
    with pytest.raises(ReplicaUnavailableError, match="no longer replicated"):
        await asyncio.wait_for(late, 10)
    assert rng.replicated_offset == stop_end == 10, "the mark moved past the stop's end"
    reps.close()


async def test_round_answered_before_the_stop_is_below_its_end() -> None:
    """The other order: answered first, then stopped; the stop's end includes the batches."""
    secondary = _HeldSecondary()
    ctx: Any = SimpleNamespace(node_id=PRIMARY, pool=secondary)
    reps = Replicators(ctx)
    rng = _range()
    secondary.release.set()
    fut = reps.get(rng).submit(memoryview(build_batch([Record(value=b"x")] * 3)), 0,
                                _deadline())
    await asyncio.wait_for(fut, 10)
    reps.drop(rng.stream_id, rng.range_index)
    assert rng.replicated_offset == 3
    reps.close()
