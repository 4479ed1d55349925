"""``sbpstream check``'s digest comparison, against a model of replicas (no cluster: the rounds
and windows are the subject; tests/test_convergence.py runs it against real data nodes).

Each modelled replica holds batches of 10 offsets and hashes at most ``budget`` offsets per
request, as a data node hashes at most MAX_DIGEST_BYTES_PER_REQUEST: a range longer than that
must be compared window after window, never reported short; a dead replica is one problem."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest

from sbpstream.protocol.messages import (
    DataNode,
    DescribeRangeResult,
    Range,
    ReplicaNode,
    Status,
    Stream,
)
from sbpstream.tools import check

END = 200
BATCH = 10
REPLICAS = ("a:1", "b:1", "c:1")


class FakeClient:
    def __init__(self) -> None:
        self.rng = Range(stream_id=1, range_index=0, start_offset=0, next_offset=END,
                         end_offset=END, replica_nodes=tuple(
                             ReplicaNode(DataNode(i, a)) for i, a in enumerate(REPLICAS)))

    async def list_streams(self) -> list[Stream]:
        return [Stream(stream_id=1, replica_nums=3)]

    async def list_ranges(self, sid: int) -> list[Range]:
        return [self.rng]


def model(budget: int, dead: Sequence[str] = (), bad: dict[str, int] | None = None) -> Any:
    """A ``_digests`` over replicas holding [0, END) in batches; ``bad[addr]`` = an offset whose
    batch differs on that replica."""
    bad = bad or {}
    windows: list[tuple[str, int, int]] = []

    async def digests(client: Any, asks: dict[Any, tuple[int, int]]) -> dict[Any, Any]:
        out = {}
        for key, (start, end) in asks.items():
            addr = key[2]
            if addr in dead:
                out[key] = check._Answer(error="ConnectionRefusedError")
                continue
            s = 0 if start < 0 else start
            e = min(end, END)
            stop = s
            h = hashlib.blake2b(digest_size=16)
            while stop + BATCH <= e and stop + BATCH - s <= budget:
                tag = b"x" if bad.get(addr, -1) in range(stop, stop + BATCH) else b"."
                h.update(stop.to_bytes(8, "big") + tag)
                stop += BATCH
            windows.append((addr, s, stop))
            out[key] = check._Answer(result=DescribeRangeResult(
                stream_id=1, status=Status(), range=FakeClient().rng, digest=h.hexdigest(),
                digest_start_offset=s, digest_end_offset=stop))
        return out

    digests.windows = windows  # type: ignore[attr-defined]
    return digests


async def test_a_range_longer_than_the_budget_is_compared_window_by_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = model(budget=50)
    monkeypatch.setattr(check, "_digests", fake)
    report = await check.check_cluster(FakeClient())  # type: ignore[arg-type]
    assert report.ok, [str(p) for p in report.problems]
    covered = sorted({(s, e) for a, s, e in fake.windows if a == "a:1"})
    assert covered[-1][1] == END  # the last window reached the range's end
    assert [w for w in covered if w[0] < w[1]] == [(0, 50), (50, 100), (100, 150), (150, 200)]


async def test_a_difference_past_the_first_window_is_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "_digests", model(budget=50, bad={"b:1": 170}))
    report = await check.check_cluster(FakeClient())  # type: ignore[arg-type]
    assert [(p.kind, p.detail.split(":")[0]) for p in report.problems] == \
        [("digest_mismatch", "replicas differ over [150, 200)")]


async def test_a_dead_replica_is_one_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "_digests", model(budget=1000, dead=("c:1",)))
    report = await check.check_cluster(FakeClient())  # type: ignore[arg-type]
    assert [(p.kind, p.node) for p in report.problems] == [("unreachable", "c:1")]
