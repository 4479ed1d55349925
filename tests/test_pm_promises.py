"""The PM keeps the protocol's promises: an in-process PM, over the real wire.

timeout_ms is answered TIMEOUT, SDK clients are known from their heartbeats, UPDATE_STREAMS leaves
absent fields alone, ALLOCATE_ID is idempotent per host, data nodes' committed offsets reach
LIST_RANGES and never go back, and the SDK's create retries NOT_ENOUGH_DATA_NODES until a node
comes. A fake data node (an SBP server played by the test) stands in where one is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import pytest
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.net.client import Connection
from sbpstream.net.server import Request, Responder, Server
from sbpstream.pm.config import PmConfig
from sbpstream.pm.server import PmServer
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import ErrorCode, RequestTimeoutError
from sbpstream.protocol.messages import ClientRole
from sbpstream.protocol.opcodes import Opcode

CALL_TIMEOUT_S = 10.0
RespT = TypeVar("RespT", bound=m.Message)


@pytest.fixture
async def pm(tmp_path: Path) -> AsyncIterator[PmServer]:
    server = PmServer(PmConfig(metadata=f"sqlite:{tmp_path / 'pm.sqlite3'}", port=0,
                               heartbeat_interval_ms=100, node_timeout_ms=1000))
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def call(conn: Connection, req: m.Message, resp_cls: type[RespT]) -> RespT:
    frame = await conn.request_one(req.OPCODE, req.encode(), timeout_s=CALL_TIMEOUT_S)
    return resp_cls.decode(frame.header)


class FakeNode:
    """Registers and heartbeats; SEAL_RANGES hangs when ``hang`` is set."""

    def __init__(self, pm_address: str) -> None:
        self.pm_address = pm_address
        self.hang = asyncio.Event()
        self.server = Server({Opcode.SYNC_RANGES: self._sync, Opcode.SEAL_RANGES: self._seal},
                             name="fake-dn")
        self.node_id = 0
        self.conn: Connection | None = None
        self._beat: asyncio.Task[None] | None = None

    async def start(self) -> FakeNode:
        await self.server.start("127.0.0.1", 0)
        self.conn = await Connection.open(self.pm_address)
        a = await call(self.conn, m.AllocateIdRequest(host=self.server.address),
                       m.AllocateIdResponse)
        self.node_id = a.id
        await self.heartbeat()
        self._beat = asyncio.get_running_loop().create_task(self._beats())
        return self

    async def heartbeat(self, committed: tuple[m.Range, ...] = ()) -> m.HeartbeatResponse:
        assert self.conn is not None
        return await call(self.conn, m.HeartbeatRequest(
            f"dn-{self.node_id}", ClientRole.DATA_NODE,
            m.DataNode(self.node_id, self.server.address), committed), m.HeartbeatResponse)

    async def _beats(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            await self.heartbeat()

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self.conn is not None:
            await self.conn.aclose()
        await self.server.close(drain_timeout_s=0.1)

    async def _sync(self, req: Request, resp: Responder) -> None:
        r = m.SyncRangesRequest.decode(req.header)
        await resp.send(m.SyncRangesResponse(items=tuple(
            m.SyncResult(sr.stream_id, m.STATUS_OK, sr.ranges) for sr in r.items)).encode())

    async def _seal(self, req: Request, resp: Responder) -> None:
        await asyncio.Event().wait()  # never answers: the PM must give up by the deadline


@pytest.fixture
async def node(pm: PmServer) -> AsyncIterator[FakeNode]:
    n = await FakeNode(pm.address).start()
    try:
        yield n
    finally:
        await n.close()


async def test_timeout_ms_is_answered_timeout(pm: PmServer, node: FakeNode) -> None:
    async with AsyncClient(pm.address, retry_deadline_ms=5000) as c:
        sid = await c.create_stream(replica_nums=1)
    conn = await Connection.open(pm.address)
    try:
        req = m.SealRangesRequest(timeout_ms=300, items=(m.SealItem(sid, 0, -1),))
        with pytest.raises(RequestTimeoutError) as got:
            await conn.request_one(req.OPCODE, req.encode(), timeout_s=CALL_TIMEOUT_S)
        assert got.value.code == ErrorCode.TIMEOUT and "timeout_ms 300" in got.value.message
    finally:
        await conn.aclose()


async def test_sdk_clients_are_known_from_heartbeats(pm: PmServer) -> None:
    async with AsyncClient(pm.address) as c:
        await c.list_streams()  # any call starts the client's heartbeats

        def known() -> bool:
            return c.client_id in {x.client_id for x in pm.service.live_clients()}

        await eventually_async(known, timeout=10, what="the client in the PM's table")
    conn = await Connection.open(pm.address)
    try:
        hb = await call(conn, m.HeartbeatRequest("", ClientRole.CLIENT), m.HeartbeatResponse)
        assert hb.status.code == ErrorCode.INVALID_REQUEST
    finally:
        await conn.aclose()


async def test_update_streams_leaves_absent_fields(pm: PmServer, node: FakeNode) -> None:
    async with AsyncClient(pm.address, retry_deadline_ms=5000) as c:
        sid = await c.create_stream(replica_nums=1, retention_ms=5000)
        s = await c.update_stream(sid, retention_ms=7000)
        assert (s.replica_nums, s.retention_period_ms) == (1, 7000)
        s = await c.update_stream(sid, replica_nums=1)
        assert s.retention_period_ms == 7000
        s = await c.update_stream(sid, retention_ms=0)  # 0 is a value: keep forever
        assert s.retention_period_ms == 0
    conn = await Connection.open(pm.address)
    try:
        r = await call(conn, m.UpdateStreamsRequest(items=(
            m.Stream(sid, 0, -1), m.Stream(sid, 0, -2))), m.UpdateStreamsResponse)
        assert r.items[0].status.ok and r.items[0].stream is not None
        assert r.items[0].stream.retention_period_ms == 0
        assert r.items[1].status.code == ErrorCode.INVALID_STREAM_CONFIG
    finally:
        await conn.aclose()


async def test_allocate_id_is_idempotent_per_host(pm: PmServer) -> None:
    conn = await Connection.open(pm.address)
    try:
        async def alloc(host: str) -> int:
            r = await call(conn, m.AllocateIdRequest(host=host), m.AllocateIdResponse)
            assert r.status.ok
            return r.id

        a, b, c = await alloc("10.0.0.1:12379"), await alloc("10.0.0.2:12379"), \
            await alloc("10.0.0.1:12379")
        assert a == c and a != b and a > 0 and b > 0
    finally:
        await conn.aclose()


async def test_committed_offsets_from_heartbeats_never_go_back(
        pm: PmServer, node: FakeNode) -> None:
    async with AsyncClient(pm.address, retry_deadline_ms=5000) as c:
        sid = await c.create_stream(replica_nums=1)
        (r0,) = await c.list_ranges(sid)
        assert r0.next_offset == 0
        hb = await node.heartbeat((m.Range(sid, 0, 0, 120),))
        assert hb.status.ok
        (r0,) = await c.list_ranges(sid)
        assert r0.next_offset == 120 and not r0.sealed
        await node.heartbeat((m.Range(sid, 0, 0, 80),))  # a stale report never lowers it
        (r0,) = await c.list_ranges(sid)
        assert r0.next_offset == 120


async def test_create_is_retried_until_a_node_is_live(pm: PmServer) -> None:
    async with AsyncClient(pm.address, retry_deadline_ms=30_000) as c:
        create = asyncio.ensure_future(c.create_stream(replica_nums=1))
        await eventually_async(
            lambda: pm.server.stats.opcode(Opcode.CREATE_STREAMS).requests >= 2,
            timeout=10, what="the create refused and retried")
        assert not create.done()
        n = await FakeNode(pm.address).start()
        try:
            sid = await create
            (r0,) = await c.list_ranges(sid)
            assert r0.replica_nodes[0].data_node.node_id == n.node_id
        finally:
            await n.close()
