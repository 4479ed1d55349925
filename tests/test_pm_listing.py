"""The whole-node LIST_RANGES hot path: the same frames as the per-stream path, GC pause."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from sbpstream.pm import metadata as md
from sbpstream.pm import server as srv
from sbpstream.protocol import messages as m


class _Frames:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bool]] = []

    async def send(self, header: bytes, end: bool = False) -> None:
        self.sent.append((header, end))


def _ranges(rnd: random.Random, streams: int) -> list[md.RangeMeta]:
    sets = [(md.ReplicaMeta(1, True),), (md.ReplicaMeta(1, True), md.ReplicaMeta(2, False)),
            (md.ReplicaMeta(3, True), md.ReplicaMeta(1, False), md.ReplicaMeta(2, False))]
    out = []
    for sid in range(1, streams + 1):
        start = 0
        for idx in range(rnd.choice((1, 1, 1, 2, 4, 7))):
            end = start + rnd.randrange(0, 50)
            sealed = rnd.random() < 0.5
            # equal sets as equal (not identical) tuples too: the cache must not rely on identity
            reps = tuple(sets[rnd.randrange(3)]) if rnd.random() < 0.5 else sets[0]
            out.append(md.RangeMeta(sid, idx, start, end if sealed else -1, end, reps))
            start = end
    return out


@pytest.mark.parametrize("cap", [1, 3, 5000])
def test_add_by_stream_sends_the_frames_of_add_ranges(
    monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    monkeypatch.setattr(srv, "LIST_RANGES_FRAME_MAX", cap)
    ranges = _ranges(random.Random(cap), 300)
    dn = srv.WireDataNodeApi(lambda nid: f"10.0.0.{nid}:9000")

    async def old() -> list[tuple[bytes, bool]]:
        out = _Frames()
        sender = srv._FramedResults(out)  # type: ignore[arg-type]
        by: dict[int, list[m.Range]] = {}
        for r in ranges:
            by.setdefault(r.stream_id, []).append(dn.to_range(r))
        for sid, rs in by.items():
            await sender.add_ranges(sid, rs)
        await sender.finish()
        return out.sent

    async def new() -> list[tuple[bytes, bool]]:
        out = _Frames()
        sender = srv._FramedResults(out)  # type: ignore[arg-type]
        await sender.add(m.ListRangesResult(0, m.Status(7, "first")), 0)
        await sender.add_by_stream(ranges, dn.replica_nodes)
        await sender.finish()
        return out.sent

    async def old_with_first() -> list[tuple[bytes, bool]]:
        out = _Frames()
        sender = srv._FramedResults(out)  # type: ignore[arg-type]
        await sender.add(m.ListRangesResult(0, m.Status(7, "first")), 0)
        by: dict[int, list[m.Range]] = {}
        for r in ranges:
            by.setdefault(r.stream_id, []).append(dn.to_range(r))
        for sid, rs in by.items():
            await sender.add_ranges(sid, rs)
        await sender.finish()
        return out.sent

    want, got = asyncio.run(old_with_first()), asyncio.run(new())
    assert got == want
    assert len(want) > (1 if cap < 5000 else 0)
    decoded = [it for h, _ in asyncio.run(old()) for it in m.ListRangesResponse.decode(h).items]
    assert sum(len(it.ranges) for it in decoded) == len(ranges)


def test_gc_pause_nests_and_restores() -> None:
    assert gc.isenabled()
    pause = srv._GcPause()
    with pause():
        assert not gc.isenabled()
        with pause():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), pause():
        raise RuntimeError("listing failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with pause():
            pass
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
