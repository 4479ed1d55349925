"""ListOffsets by timestamp: the binary search over batch timestamps, on a fake stream."""

from __future__ import annotations

import asyncio
import bisect
import math
import random

import pytest

from sbpstream.kafka.bytime import MAX_PROBES, ProbeLimitError, offset_for_time
from sbpstream.records import Record, build_batch, patch_base_offset


class FakeStream:
    """Batches of records with the given timestamps; a probe returns up to ``per_fetch``
    batches from the one holding the offset, and is counted."""

    def __init__(self, batches: list[list[int]], per_fetch: int = 1) -> None:
        self.bases: list[int] = []
        self.raw: list[memoryview] = []
        self.timestamps: list[int] = []
        base = 0
        for ts in batches:
            b = bytearray(build_batch([Record(b"v", None, (), t) for t in ts]))
            patch_base_offset(b, base)
            self.bases.append(base)
            self.raw.append(memoryview(bytes(b)))
            self.timestamps += ts
            base += len(ts)
        self.end = base
        self.per_fetch = per_fetch
        self.probes = 0

    async def probe(self, offset: int) -> list[memoryview]:
        self.probes += 1
        i = bisect.bisect_right(self.bases, offset) - 1
        return self.raw[i:i + self.per_fetch] if offset < self.end else []

    def expected(self, target: int, start: int = 0) -> tuple[int, int] | None:
        for o in range(start, self.end):
            if self.timestamps[o] >= target:
                return o, self.timestamps[o]
        return None


def _run(s: FakeStream, target: int, start: int = 0) -> tuple[int, int] | None:
    return asyncio.run(offset_for_time(s.probe, start, s.end, target))


@pytest.mark.parametrize("per_fetch", [1, 3])
def test_monotonic_timestamps_every_target(per_fetch: int) -> None:
    rng = random.Random(7)
    batches, t = [], 1000
    for _ in range(60):
        n = rng.randint(1, 9)
        ts = []
        for _ in range(n):
            t += rng.choice((0, 0, 1, 5))  # equal timestamps too
            ts.append(t)
        batches.append(ts)
    s = FakeStream(batches, per_fetch)
    bound = math.ceil(math.log2(s.end)) + 2
    for target in range(990, t + 3):
        s.probes = 0
        assert _run(s, target) == s.expected(target), target
        assert s.probes <= bound


def test_out_of_order_inside_a_batch_gets_the_first_record_at_or_after() -> None:
    # one batch whose records go back in time: the first record >= target, not the smallest
    s = FakeStream([[10, 11], [30, 20, 25, 40], [50]])
    assert _run(s, 21) == (2, 30)
    assert _run(s, 35) == (5, 40)
    assert _run(s, 41) == (6, 50)


def test_none_after_the_last_timestamp_and_empty_range() -> None:
    s = FakeStream([[1, 2], [3]])
    assert _run(s, 4) is None
    assert asyncio.run(offset_for_time(s.probe, 3, 3, 0)) is None


def test_start_inside_a_batch_skips_the_records_before_it() -> None:
    s = FakeStream([[5, 6, 7, 8], [9]])
    assert _run(s, 0, start=2) == (2, 7)
    assert _run(s, 8, start=2) == (3, 8)


def test_a_probe_that_never_advances_is_bounded() -> None:
    s = FakeStream([[1], [2]])

    async def stuck(offset: int) -> list[memoryview]:
        s.probes += 1
        return s.raw[:1] if offset >= 1 else s.raw[1:]  # batches not holding the offset

    with pytest.raises(ProbeLimitError):
        asyncio.run(offset_for_time(stuck, 0, s.end, 2))
    assert s.probes == MAX_PROBES
