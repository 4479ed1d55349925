"""PmService behaviour with a recording fake of the data node calls (no sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sbpstream.pm.metadata import (
    CreatedStream,
    NodeMetrics,
    ProducerStateMeta,
    RangeMeta,
    SealOutcome,
)
from sbpstream.pm.placement import NodeState
from sbpstream.pm.service import MAX_ITEMS_PER_REQUEST, DnSealReply, PmService
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    InvalidStreamConfigError,
    LimitExceededError,
    NotEnoughDataNodesError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)


@dataclass
class FakeDn:
    local_end: dict[int, int] = field(default_factory=dict)  # node -> end it reports for -1
    down: set[int] = field(default_factory=set)
    next_offset: int = 0
    calls: list[tuple[str, int, object]] = field(default_factory=list)
    seals: list[tuple[int, int, int, int]] = field(default_factory=list)  # node, sid, idx, end

    def _check(self, node: NodeState) -> None:
        if node.node_id in self.down:
            raise ConnectionRefusedError(f"node {node.node_id} down")

    async def sync_ranges(self, node: NodeState, ranges: Sequence[RangeMeta]) -> None:
        self._check(node)
        self.calls.append(("sync", node.node_id, [(r.stream_id, r.range_index) for r in ranges]))

    async def seal_range(self, node: NodeState, rng: RangeMeta, end_offset: int) -> DnSealReply:
        self._check(node)
        self.calls.append(("seal", node.node_id, (rng.stream_id, rng.range_index, end_offset)))
        self.seals.append((node.node_id, rng.stream_id, rng.range_index, end_offset))
        end = self.local_end.get(node.node_id, 0) if end_offset < 0 else end_offset
        return DnSealReply(end, (ProducerStateMeta(5, 0, node.node_id, 1),))

    async def describe_range(self, node: NodeState, stream_id: int, range_index: int) -> int:
        self._check(node)
        self.calls.append(("describe", node.node_id, (stream_id, range_index)))
        return self.next_offset

    async def trim_streams(self, node: NodeState, items: Sequence[tuple[int, int]]) -> None:
        self._check(node)
        self.calls.append(("trim", node.node_id, list(items)))

    async def delete_streams(self, node: NodeState, stream_ids: Sequence[int]) -> None:
        self._check(node)
        self.calls.append(("delete", node.node_id, list(stream_ids)))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[PmService, FakeDn, Clock]]:
    meta = SqliteMetadataStore(tmp_path / "pm.sqlite")
    await meta.open()
    dn = FakeDn()
    clock = Clock()
    svc = PmService(meta, dn, node_timeout_ms=5000, clock=clock)
    await svc.start()
    yield svc, dn, clock
    await meta.close()


async def add_nodes(svc: PmService, n: int) -> list[int]:
    ids = []
    for i in range(n):
        nid = await svc.allocate_node_id(f"host{i}")
        await svc.node_seen(nid, f"127.0.0.1:{9100 + nid}")
        ids.append(nid)
    return ids


async def test_create_places_and_syncs(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, _ = env
    (none,) = await svc.create_streams([(1, 0)])
    assert isinstance(none, NotEnoughDataNodesError)
    await add_nodes(svc, 2)
    out = await svc.create_streams([(1, 0), (8, 0), (0, 0), (1, -5), (1, 100)])
    assert isinstance(out[0], CreatedStream) and isinstance(out[4], CreatedStream)
    assert isinstance(out[1], InvalidStreamConfigError) and "at most 7" in out[1].message
    assert isinstance(out[2], InvalidStreamConfigError)
    assert isinstance(out[3], InvalidStreamConfigError)
    # Spread over both nodes, each told of its range.
    nodes = {out[0].first_range.node_ids[0], out[4].first_range.node_ids[0]}
    assert nodes == {1, 2}
    syncs = sorted((c[1], c[2]) for c in dn.calls if c[0] == "sync")
    assert [n for n, _ in syncs] == [1, 2]
    with pytest.raises(LimitExceededError):
        await svc.create_streams([(1, 0)] * (MAX_ITEMS_PER_REQUEST + 1))


async def test_create_survives_unreachable_node(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, _ = env
    await add_nodes(svc, 1)
    dn.down.add(1)
    out = await svc.create_streams([(1, 0)])
    assert isinstance(out[0], CreatedStream)
    assert (await svc.list_stream_ranges([out[0].stream.stream_id]))[0] == [out[0].first_range]


async def test_seal_min_end_idempotent(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, _ = env
    await add_nodes(svc, 2)
    (c,) = await svc.create_streams([(1, 0)])
    assert isinstance(c, CreatedStream)
    sid, node = c.stream.stream_id, c.first_range.node_ids[0]
    dn.local_end[node] = 17
    (res,) = await svc.seal_ranges([(sid, 0)])
    assert isinstance(res, SealOutcome) and res.created
    assert res.sealed.end_offset == 17 and res.new.start_offset == 17
    assert res.new.range_index == 1 and res.new.writable
    assert res.producers == (ProducerStateMeta(5, 0, node, 1),)
    seals = [c[2] for c in dn.calls if c[0] == "seal"]
    assert seals == [(sid, 0, -1), (sid, 0, 17)]
    (again,) = await svc.seal_ranges([(sid, 0)])
    assert isinstance(again, SealOutcome) and not again.created
    assert (again.sealed, again.new, again.producers) == (res.sealed, res.new, res.producers)
    listed = (await svc.list_stream_ranges([sid]))[0]
    assert isinstance(listed, list) and len(listed) == 2
    errs = await svc.seal_ranges([(sid, 9), (424242, 0)])
    assert isinstance(errs[0], RangeNotFoundError)
    assert isinstance(errs[1], StreamNotFoundError)
    (_, two) = await svc.seal_ranges([(sid, 1), (sid, 1)])  # concurrent duplicates: one seal
    assert isinstance(two, SealOutcome) and two.new.range_index == 2
    (old,) = await svc.seal_ranges([(sid, 0)])  # an older sealed range: its own pair
    assert isinstance(old, SealOutcome) and not old.created
    assert old.sealed.range_index == 0 and old.new.range_index == 1 and old.producers


async def test_dead_node_ranges_renewed(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, clock = env
    a, b = await add_nodes(svc, 2)
    out = await svc.create_streams([(1, 0)] * 4)
    on_a = [c for c in out if isinstance(c, CreatedStream) and c.first_range.node_ids == (a,)]
    assert len(on_a) == 2
    await svc.meta.record_next_offsets([(on_a[0].stream.stream_id, 0, 33)])
    dn.down.add(a)  # a stops heartbeating and answering
    clock.t += 3
    await svc.node_seen(b, "")  # b keeps heartbeating
    clock.t += 3
    # a does not answer: sealing at its last report (33) could cut off records it acknowledged
    # later, so nothing is sealed; the range waits for a replica (durability first).
    assert await svc.sweep_dead_nodes() == 0
    for c in on_a:
        ranges = (await svc.list_stream_ranges([c.stream.stream_id]))[0]
        assert isinstance(ranges, list) and len(ranges) == 1 and ranges[0].writable
    # New streams avoid the dead node.
    more = await svc.create_streams([(1, 0)] * 3)
    assert all(isinstance(c, CreatedStream) and c.first_range.node_ids == (b,) for c in more)
    # a answers again (still silent on heartbeats): the sweep seals at the end it reports.
    dn.down.clear()
    clock.t += 10
    await svc.node_seen(b, "")
    assert await svc.sweep_dead_nodes() == 2
    for c in on_a:
        ranges = (await svc.list_stream_ranges([c.stream.stream_id]))[0]
        assert isinstance(ranges, list) and len(ranges) == 2
        assert ranges[1].node_ids == (b,) and ranges[1].writable


async def test_trim_and_delete_forwarded(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, _ = env
    (n,) = await add_nodes(svc, 1)
    (c,) = await svc.create_streams([(1, 0)])
    assert isinstance(c, CreatedStream)
    sid = c.stream.stream_id
    dn.next_offset = 50
    out = await svc.trim_streams([(sid, 20), (sid + 100, 1), (sid, -1)], from_data_node=False)
    assert not isinstance(out[0], SbpError) and out[0].stream.start_offset == 20
    assert isinstance(out[1], StreamNotFoundError)
    assert isinstance(out[2], InvalidRequestError)
    assert ("trim", n, [(sid, 20)]) in dn.calls
    assert ("describe", n, (sid, 0)) in dn.calls  # 20 > known end 0: asked the primary
    (past,) = await svc.trim_streams([(sid, 51)], from_data_node=False)
    assert isinstance(past, OffsetOutOfRangeError)
    dn.calls.clear()
    (rep,) = await svc.trim_streams([(sid, 30)], from_data_node=True)
    assert not isinstance(rep, SbpError) and rep.stream.start_offset == 30
    assert not [c for c in dn.calls if c[0] == "trim"]  # retention reports are not echoed
    dels = await svc.delete_streams([sid, sid])
    assert not isinstance(dels[0], SbpError) and isinstance(dels[1], StreamDeletedError)
    assert ("delete", n, [sid]) in dn.calls
    (d,) = await svc.describe_streams([sid])
    assert isinstance(d, StreamDeletedError)


async def test_update_and_paging(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, _, _ = env
    await add_nodes(svc, 1)
    out = await svc.create_streams([(1, 0)] * 5)
    ids = [c.stream.stream_id for c in out if isinstance(c, CreatedStream)]
    ups = await svc.update_streams([(ids[0], 0, 99), (ids[1], 9, 1), (ids[2], 1, -2)])
    assert not isinstance(ups[0], SbpError) and ups[0].retention_period_ms == 99
    assert ups[0].replica_nums == 1
    assert isinstance(ups[1], InvalidStreamConfigError)
    assert isinstance(ups[2], InvalidStreamConfigError)
    page, cont = await svc.list_streams(-1, 2)
    assert [s.stream_id for s in page] == ids[:2] and cont == ids[1]
    page, cont = await svc.list_streams(cont, 3)
    assert [s.stream_id for s in page] == ids[2:] and cont == -1


async def test_unknown_node_rejected(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, _, _ = env
    with pytest.raises(DataNodeNotFoundError):
        await svc.node_seen(77, "127.0.0.1:1")
    (n,) = await add_nodes(svc, 1)
    await svc.report_metrics(n, "", NodeMetrics(disk_free_space=1))
    # Too little disk: not placed on.
    (c,) = await svc.create_streams([(1, 0)])
    assert isinstance(c, NotEnoughDataNodesError)


async def test_seal_takes_minimum_of_replicas(env: tuple[PmService, FakeDn, Clock]) -> None:
    svc, dn, _ = env
    a, b, c = await add_nodes(svc, 3)
    (cs,) = await svc.create_streams([(2, 0)])
    assert isinstance(cs, CreatedStream)
    r0 = cs.first_range
    assert len(set(r0.node_ids)) == 2 and r0.primary_node_id == r0.replicas[0].node_id
    assert sum(rep.is_primary for rep in r0.replicas) == 1
    first, second = r0.node_ids
    dn.local_end[first], dn.local_end[second] = 30, 25
    (res,) = await svc.seal_ranges([(cs.stream.stream_id, 0)])
    assert isinstance(res, SealOutcome)
    assert res.sealed.end_offset == 25 and res.new.start_offset == 25
    assert len(set(res.new.node_ids)) == 2
    finals = sorted((n, end) for n, _, _, end in dn.seals if end >= 0)
    assert finals == sorted([(first, 25), (second, 25)])
    # One replica unreachable: the other's end decides.
    sid = cs.stream.stream_id
    n1, n2 = res.new.node_ids
    dn.local_end[n1], dn.local_end[n2] = 40, 44
    dn.down.add(n1)
    (res2,) = await svc.seal_ranges([(sid, 1)])
    assert isinstance(res2, SealOutcome) and res2.sealed.end_offset == 44
    assert {a, b, c} >= set(res2.new.node_ids)
