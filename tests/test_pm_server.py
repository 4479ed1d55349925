"""The PM as a real process, over the real wire, with fake data nodes played by the test.

A :class:`FakeDataNode` is an SBP server on the shared net layer: it registers with the PM
(ALLOCATE_ID, HEARTBEAT, REPORT_METRICS), answers SYNC_RANGES / SEAL_RANGES / TRIM_STREAMS /
DELETE_STREAMS / DESCRIBE_RANGES, and records what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from cluster_helpers import PmProcess
from waiting import eventually_async

from sbpstream.net.client import Connection
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    BadHeaderError,
    ErrorCode,
    UnsupportedOperationError,
)
from sbpstream.protocol.messages import ClientRole, Status
from sbpstream.protocol.opcodes import Opcode

HEARTBEAT_MS = 100
NODE_TIMEOUT_MS = 600
CALL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 20.0

RespT = TypeVar("RespT", bound=m.Message)


@pytest.fixture
def pm(tmp_path: Path) -> Iterator[PmProcess]:
    p = PmProcess(tmp_path)
    p.start()
    try:
        yield p
    finally:
        p.stop()


async def call(conn: Connection, req: m.Message, resp_cls: type[RespT]) -> RespT:
    frame = await conn.request_one(req.OPCODE, req.encode(), timeout_s=CALL_TIMEOUT_S)
    return resp_cls.decode(frame.header)


@dataclass
class FakeDataNode:
    pm_address: str
    free_disk: int = 10**12
    node_id: int = 0
    server: Server | None = None
    pm: Connection | None = None
    ranges: dict[tuple[int, int], m.Range] = field(default_factory=dict)
    local_end: dict[tuple[int, int], int] = field(default_factory=dict)
    got: list[tuple[str, object]] = field(default_factory=list)
    _beat: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    async def start(self) -> FakeDataNode:
        self.server = Server({
            Opcode.SYNC_RANGES: self._sync,
            Opcode.SEAL_RANGES: self._seal,
            Opcode.TRIM_STREAMS: self._trim,
            Opcode.DELETE_STREAMS: self._delete,
            Opcode.DESCRIBE_RANGES: self._describe,
        }, name="fake-dn")
        await self.server.start("127.0.0.1", 0)
        self.pm = await Connection.open(self.pm_address)
        if not self.node_id:
            r = await call(self.pm, m.AllocateIdRequest(host=self.address), m.AllocateIdResponse)
            assert r.status.ok and r.id > 0, r
            self.node_id = r.id
        await self.heartbeat()
        await self.report_metrics()
        self._beat = asyncio.get_running_loop().create_task(self._beat_loop())
        return self

    async def pm_conn(self) -> Connection:
        """The connection to the PM, reopened after a PM restart (as a real node does)."""
        if self.pm is None or not self.pm.usable:
            self.pm = await Connection.open(self.pm_address)
        return self.pm

    async def heartbeat(self) -> m.HeartbeatResponse:
        return await call(await self.pm_conn(), m.HeartbeatRequest(
            client_id=f"dn-{self.node_id}", client_role=ClientRole.DATA_NODE,
            data_node=m.DataNode(self.node_id, self.address)), m.HeartbeatResponse)

    async def report_metrics(self) -> m.ReportMetricsResponse:
        return await call(await self.pm_conn(), m.ReportMetricsRequest(
            data_node=m.DataNode(self.node_id, self.address), disk_free_space=self.free_disk),
            m.ReportMetricsResponse)

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_MS / 1000)
            with contextlib.suppress(Exception):
                await self.heartbeat()

    def stop_heartbeats(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None

    async def close(self) -> None:
        self.stop_heartbeats()
        if self.pm is not None:
            await self.pm.aclose()
        if self.server is not None:
            await self.server.close(drain_timeout_s=0.5)

    def received(self, kind: str) -> list[object]:
        return [x for k, x in self.got if k == kind]

    async def _sync(self, req: Request, resp: Responder) -> None:
        r = m.SyncRangesRequest.decode(req.header)
        for sr in r.items:
            for rng in sr.ranges:
                self.ranges[(rng.stream_id, rng.range_index)] = rng
                self.got.append(("sync", (rng.stream_id, rng.range_index)))
        await resp.send(m.SyncRangesResponse(items=tuple(
            m.SyncResult(sr.stream_id, m.STATUS_OK, sr.ranges) for sr in r.items)).encode())

    async def _seal(self, req: Request, resp: Responder) -> None:
        r = m.SealRangesRequest.decode(req.header)
        out = []
        for it in r.items:
            key = (it.stream_id, it.range_index)
            self.got.append(("seal", (it.stream_id, it.range_index, it.end_offset)))
            rng = self.ranges.get(key)
            if rng is None:
                out.append(m.SealResult(it.stream_id, Status(int(ErrorCode.RANGE_NOT_FOUND), "?")))
                continue
            end = self.local_end.get(key, rng.start_offset) if it.end_offset < 0 else it.end_offset
            out.append(m.SealResult(
                it.stream_id, m.STATUS_OK,
                (m.Range(rng.stream_id, rng.range_index, rng.start_offset, end, end),),
                (m.ProducerState(9, 0, 4, 100),),
            ))
        await resp.send(m.SealRangesResponse(items=tuple(out)).encode())

    async def _trim(self, req: Request, resp: Responder) -> None:
        r = m.TrimStreamsRequest.decode(req.header)
        for it in r.items:
            self.got.append(("trim", (it.stream_id, it.trim_offset)))
        await resp.send(m.TrimStreamsResponse(items=tuple(
            m.TrimResult(m.Stream(stream_id=it.stream_id)) for it in r.items)).encode())

    async def _delete(self, req: Request, resp: Responder) -> None:
        r = m.DeleteStreamsRequest.decode(req.header)
        for s in r.items:
            self.got.append(("delete", s.stream_id))
        await resp.send(m.DeleteStreamsResponse(items=tuple(
            m.StreamResult(s) for s in r.items)).encode())

    async def _describe(self, req: Request, resp: Responder) -> None:
        r = m.DescribeRangesRequest.decode(req.header)
        out = []
        for it in r.items:
            key = (it.stream_id, it.range_index)
            rng = self.ranges[key]
            nxt = self.local_end.get(key, rng.start_offset)
            out.append(m.DescribeRangeResult(it.stream_id, m.STATUS_OK, m.Range(
                it.stream_id, it.range_index, rng.start_offset, nxt, -1)))
        await resp.send(m.DescribeRangesResponse(items=tuple(out)).encode())


@pytest.fixture
async def client(pm: PmProcess) -> AsyncIterator[Connection]:
    c = await Connection.open(pm.address)
    yield c
    await c.aclose()


@pytest.fixture
async def nodes(pm: PmProcess) -> AsyncIterator[list[FakeDataNode]]:
    made: list[FakeDataNode] = []
    try:
        for _ in range(2):
            made.append(await FakeDataNode(pm.address).start())
        yield made
    finally:
        for n in made:
            await n.close()


async def create(conn: Connection, *items: tuple[int, int]) -> m.CreateStreamsResponse:
    return await call(conn, m.CreateStreamsRequest(items=tuple(
        m.CreateStreamItem(rn, ret) for rn, ret in items)), m.CreateStreamsResponse)


async def list_ranges(conn: Connection, *owners: m.RangeOwner) -> list[m.ListRangesResult]:
    frames = await conn.request(Opcode.LIST_RANGES, m.ListRangesRequest(items=owners).encode(),
                                timeout_s=CALL_TIMEOUT_S)
    return [it for f in frames for it in m.ListRangesResponse.decode(f.header).items]


# ------------------------------------------------------------------------------------------ tests
async def test_create_places_on_live_node_and_syncs(
    client: Connection, nodes: list[FakeDataNode]
) -> None:
    r = await create(client, (1, 1000), (8, 0), (0, 0), (1, -1), (1, 0))
    st = [it.status for it in r.items]
    assert st[0].ok and st[4].ok
    assert st[1].code == ErrorCode.INVALID_STREAM_CONFIG and "at most 7" in st[1].message
    assert st[2].code == ErrorCode.INVALID_STREAM_CONFIG
    assert st[3].code == ErrorCode.INVALID_STREAM_CONFIG
    good = [it.stream for it in (r.items[0], r.items[4])]
    assert all(s is not None and s.stream_id > 0 for s in good)
    assert r.items[0].retention_period_ms == 1000 and r.items[0].replica_nums == 1
    ids = [s.stream_id for s in good if s is not None]
    results = await list_ranges(client, *(m.StreamOwner(i) for i in ids))
    by_node = {n.node_id: n for n in nodes}
    for res, sid in zip(results, ids, strict=True):
        assert res.status.ok and res.stream_id == sid
        (rng,) = res.ranges
        assert (rng.range_index, rng.start_offset, rng.end_offset) == (0, 0, -1)
        (rep,) = rng.replica_nodes
        assert rep.is_primary and rep.data_node.node_id in by_node
        dn = by_node[rep.data_node.node_id]
        assert rep.data_node.advertise_addr == dn.address
        assert ("sync", (sid, 0)) in dn.got  # told before CREATE_STREAMS answered
    # Both nodes used (placement spreads), and a node's listing has exactly its ranges.
    holders = {res.ranges[0].replica_nodes[0].data_node.node_id for res in results}
    assert holders == set(by_node)
    for n in nodes:
        mine = await list_ranges(client, m.DataNode(n.node_id, ""))
        assert [(x.stream_id, x.ranges[0].range_index) for x in mine] == [
            k for k in n.ranges]
    unknown = await list_ranges(client, m.DataNode(999, ""), m.StreamOwner(424242))
    assert unknown[0].status.code == ErrorCode.DATA_NODE_NOT_FOUND
    assert unknown[1].status.code == ErrorCode.STREAM_NOT_FOUND


async def test_restart_keeps_everything(pm: PmProcess, tmp_path: Path) -> None:
    dn = await FakeDataNode(pm.address).start()
    c = await Connection.open(pm.address)
    try:
        r = await create(c, (1, 5), (1, 6), (1, 7))
        ids = [it.stream.stream_id for it in r.items if it.stream is not None]
        dn.local_end[(ids[0], 0)] = 12
        seal = await call(c, m.SealRangesRequest(items=(m.SealItem(ids[0], 0),)),
                          m.SealRangesResponse)
        assert seal.items[0].status.ok
        trim = await call(c, m.TrimStreamsRequest(items=(m.TrimItem(ids[1], 0),)),
                          m.TrimStreamsResponse)
        assert trim.items[0].status.ok
        before = await list_ranges(c, *(m.StreamOwner(i) for i in ids))
        await c.aclose()
        pm.kill()  # SIGKILL: nothing but what was acknowledged survives
        pm.start()
        c = await Connection.open(pm.address)
        d = await call(c, m.DescribeStreamsRequest(stream_ids=tuple(ids)),
                       m.DescribeStreamsResponse)
        assert [(x.stream.stream_id, x.stream.retention_period_ms) for x in d.items
                if x.stream is not None] == [(ids[0], 5), (ids[1], 6), (ids[2], 7)]
        after = await list_ranges(c, *(m.StreamOwner(i) for i in ids))
        assert after == before
        assert [x.end_offset for x in after[0].ranges] == [12, -1]
        # The node keeps its id across the restart; new ids never reuse old ones.
        hb = await dn.heartbeat()
        assert hb.status.ok
        a = await call(c, m.AllocateIdRequest(host="other"), m.AllocateIdResponse)
        assert a.id > dn.node_id
    finally:
        await c.aclose()
        await dn.close()


async def test_dead_nodes_avoided_and_ranges_renewed(pm: PmProcess, client: Connection) -> None:
    silent = await FakeDataNode(pm.address).start()  # stops heartbeating, still answers
    gone = await FakeDataNode(pm.address).start()  # stops entirely
    alive = await FakeDataNode(pm.address).start()
    try:
        r = await create(client, *([(1, 0)] * 6))
        ids = [it.stream.stream_id for it in r.items if it.stream is not None]
        assert len(ids) == 6
        owner = {}
        for res in await list_ranges(client, *(m.StreamOwner(i) for i in ids)):
            owner[res.stream_id] = res.ranges[0].replica_nodes[0].data_node.node_id
        assert set(owner.values()) == {silent.node_id, gone.node_id, alive.node_id}
        on_silent = [s for s, n in owner.items() if n == silent.node_id]
        for s in on_silent:
            silent.local_end[(s, 0)] = 7
        silent.stop_heartbeats()
        await gone.close()

        async def renewed() -> bool:
            res = await list_ranges(client, *(m.StreamOwner(i) for i in ids))
            return all(
                x.ranges[-1].replica_nodes[0].data_node.node_id == alive.node_id for x in res
                if owner[x.stream_id] != gone.node_id
            )

        await eventually_async(renewed, timeout=10, interval=0.1,
                               what="ranges of dead nodes renewed")
        listed = await list_ranges(client, *(m.StreamOwner(i) for i in ids))
        by_stream = {x.stream_id: x for x in listed}
        for s, n in owner.items():
            if n == alive.node_id:
                assert len(by_stream[s].ranges) == 1
                continue
            if n == gone.node_id:
                # No replica answers: sealing could lose acknowledged records, so the range
                # stays as it is until a replica is back (durability over availability).
                (still,) = by_stream[s].ranges
                assert still.end_offset == -1
                continue
            sealed, new = by_stream[s].ranges
            # Reachable replica: sealed where it says it stopped.
            assert sealed.end_offset == 7 and new.start_offset == 7
            assert ("sync", (s, 1)) in alive.got
        for s in on_silent:
            assert ("seal", (s, 0, -1)) in silent.got and ("seal", (s, 0, 7)) in silent.got
        # New streams go to the live node only.
        r2 = await create(client, *([(1, 0)] * 4))
        new_ids = [it.stream.stream_id for it in r2.items if it.stream is not None]
        res2 = await list_ranges(client, *(m.StreamOwner(i) for i in new_ids))
        assert {x.ranges[0].replica_nodes[0].data_node.node_id for x in res2} == {alive.node_id}
    finally:
        for dn in (silent, gone, alive):
            await dn.close()


async def test_seal_ranges_never_makes_a_third_range(
    client: Connection, nodes: list[FakeDataNode]
) -> None:
    r = await create(client, (1, 0))
    sid = r.items[0].stream.stream_id if r.items[0].stream else 0
    (res,) = await list_ranges(client, m.StreamOwner(sid))
    holder = next(n for n in nodes if n.node_id == res.ranges[0].replica_nodes[0].data_node.node_id)
    holder.local_end[(sid, 0)] = 40
    replies = await asyncio.gather(*(
        call(client, m.SealRangesRequest(items=(m.SealItem(sid, 0),)), m.SealRangesResponse)
        for _ in range(3)
    ))
    first = replies[0].items[0]
    assert first.status.ok
    sealed, new = first.ranges
    assert (sealed.range_index, sealed.end_offset) == (0, 40)
    assert (new.range_index, new.start_offset, new.end_offset) == (1, 40, -1)
    assert first.producers == (m.ProducerState(9, 0, 4, 100),)
    for rep in replies[1:]:
        assert rep.items[0] == first
    again = await call(client, m.SealRangesRequest(items=(m.SealItem(sid, 0),)),
                       m.SealRangesResponse)
    assert again.items[0] == first
    (res,) = await list_ranges(client, m.StreamOwner(sid))
    assert [x.range_index for x in res.ranges] == [0, 1]
    assert holder.received("seal") == [(sid, 0, -1), (sid, 0, 40)]
    bad = await call(client, m.SealRangesRequest(items=(
        m.SealItem(sid, 5), m.SealItem(sid + 1000, 0))), m.SealRangesResponse)
    assert bad.items[0].status.code == ErrorCode.RANGE_NOT_FOUND
    assert bad.items[1].status.code == ErrorCode.STREAM_NOT_FOUND
    d = await call(client, m.DescribeRangesRequest(items=(
        m.DescribeRangeItem(sid, 0), m.DescribeRangeItem(sid, 1), m.DescribeRangeItem(sid, 2))),
        m.DescribeRangesResponse)
    assert d.items[0].range is not None and d.items[0].range.end_offset == 40
    assert d.items[1].range is not None and d.items[1].range.end_offset == -1
    assert d.items[2].status.code == ErrorCode.RANGE_NOT_FOUND


async def test_trim_and_delete_forwarded(client: Connection, nodes: list[FakeDataNode]) -> None:
    r = await create(client, (1, 0), (1, 0))
    a, b = (it.stream.stream_id for it in r.items if it.stream is not None)
    holders = {}
    for res in await list_ranges(client, m.StreamOwner(a), m.StreamOwner(b)):
        nid = res.ranges[0].replica_nodes[0].data_node.node_id
        holders[res.stream_id] = next(n for n in nodes if n.node_id == nid)
    holders[a].local_end[(a, 0)] = 100
    t = await call(client, m.TrimStreamsRequest(items=(
        m.TrimItem(a, 30), m.TrimItem(b, 5), m.TrimItem(999_999, 1), m.TrimItem(a, -2))),
        m.TrimStreamsResponse)
    assert t.items[0].status.ok and t.items[0].stream is not None
    assert t.items[0].stream.start_offset == 30
    assert t.items[0].range is not None and t.items[0].range.start_offset == 30
    assert t.items[1].status.code == ErrorCode.OFFSET_OUT_OF_RANGE  # b has nothing past 0
    assert t.items[2].status.code == ErrorCode.STREAM_NOT_FOUND
    assert t.items[3].status.code == ErrorCode.INVALID_REQUEST
    assert (a, 30) in holders[a].received("trim")
    # A data node's retention report (on its heartbeating connection) only moves the metadata.
    dn = holders[a]
    assert dn.pm is not None
    rep = await call(dn.pm, m.TrimStreamsRequest(items=(m.TrimItem(a, 60),)),
                     m.TrimStreamsResponse)
    assert rep.items[0].status.ok and rep.items[0].stream is not None
    assert rep.items[0].stream.start_offset == 60
    assert (a, 60) not in dn.received("trim")
    d = await call(client, m.DeleteStreamsRequest(items=(
        m.Stream(stream_id=a), m.Stream(stream_id=a), m.Stream(stream_id=424242))),
        m.DeleteStreamsResponse)
    assert d.items[0].status.ok
    assert d.items[1].status.code == ErrorCode.STREAM_DELETED
    assert d.items[2].status.code == ErrorCode.STREAM_NOT_FOUND
    assert a in holders[a].received("delete")
    desc = await call(client, m.DescribeStreamsRequest(stream_ids=(a, b)),
                      m.DescribeStreamsResponse)
    assert desc.items[0].status.code == ErrorCode.STREAM_DELETED and desc.items[1].status.ok
    (gone,) = await list_ranges(client, m.StreamOwner(a))
    assert gone.status.code == ErrorCode.STREAM_DELETED
    u = await call(client, m.UpdateStreamsRequest(items=(
        m.Stream(stream_id=b, retention_period_ms=777), m.Stream(stream_id=b, replica_nums=9),
        m.Stream(stream_id=a, retention_period_ms=1))), m.UpdateStreamsResponse)
    assert u.items[0].status.ok and u.items[0].stream is not None
    assert u.items[0].stream.retention_period_ms == 777 and u.items[0].stream.replica_nums == 1
    assert u.items[1].status.code == ErrorCode.INVALID_STREAM_CONFIG
    assert u.items[2].status.code == ErrorCode.STREAM_DELETED


async def test_describe_streams_pages(client: Connection, nodes: list[FakeDataNode]) -> None:
    r = await create(client, *([(1, 0)] * 25))
    ids = [it.stream.stream_id for it in r.items if it.stream is not None]
    seen: list[int] = []
    cont = -1
    pages = 0
    while True:
        d = await call(client, m.DescribeStreamsRequest(limit=10, continuation=cont),
                       m.DescribeStreamsResponse)
        seen += [x.stream.stream_id for x in d.items if x.stream is not None]
        pages += 1
        cont = d.continuation
        if cont == -1:
            break
    assert seen == ids and pages == 3
    whole = await call(client, m.DescribeStreamsRequest(), m.DescribeStreamsResponse)
    assert [x.stream.stream_id for x in whole.items if x.stream] == ids
    assert whole.continuation == -1


async def test_unsupported_and_bad_input(client: Connection, nodes: list[FakeDataNode]) -> None:
    with pytest.raises(UnsupportedOperationError):
        await client.request_one(Opcode.APPEND, m.AppendRequest().encode(), timeout_s=5)
    with pytest.raises(UnsupportedOperationError):
        await client.request_one(Opcode.FETCH, b"", timeout_s=5)
    with pytest.raises(BadHeaderError):
        await client.request_one(Opcode.CREATE_STREAMS, b"\xff" * 7, timeout_s=5)
    hb = await call(client, m.HeartbeatRequest(
        client_role=ClientRole.DATA_NODE, data_node=m.DataNode(12345, "127.0.0.1:1")),
        m.HeartbeatResponse)
    assert hb.status.code == ErrorCode.DATA_NODE_NOT_FOUND
    hb = await call(client, m.HeartbeatRequest(client_id="sdk", client_role=ClientRole.CLIENT),
                    m.HeartbeatResponse)
    assert hb.status.ok and hb.client_id == "sdk"
    rm = await call(client, m.ReportMetricsRequest(), m.ReportMetricsResponse)
    assert rm.status.code == ErrorCode.INVALID_REQUEST
    # Still serving after all that.
    pong = await client.ping(b"x")
    assert bytes(pong.payload) == b"x"
    ok = await create(client, (1, 0))
    assert ok.items[0].status.ok


async def test_not_enough_nodes_per_item(pm: PmProcess, client: Connection) -> None:
    r = await create(client, (1, 0), (2, 0))
    assert r.items[0].status.code == ErrorCode.NOT_ENOUGH_DATA_NODES
    assert r.items[1].status.code == ErrorCode.NOT_ENOUGH_DATA_NODES
    full = await FakeDataNode(pm.address, free_disk=1).start()  # disk full: never chosen
    try:
        r = await create(client, (1, 0))
        assert r.items[0].status.code == ErrorCode.NOT_ENOUGH_DATA_NODES
    finally:
        await full.close()


def test_cli_rejects_bad_config(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sbpstream.pm", "--port", "0", "--metadata", "etcd://x:99999"],
        capture_output=True, timeout=30, env={**os.environ},
    )
    assert out.returncode == 2 and b"etcd" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sbpstream.pm", "--port", "0",
         "--metadata", f"sqlite:{tmp_path / 'x.sqlite'}",
         "--heartbeat-interval-ms", "1000", "--node-timeout-ms", "500"],
        capture_output=True, timeout=30,
    )
    assert out.returncode == 2 and b"node-timeout-ms" in out.stderr
