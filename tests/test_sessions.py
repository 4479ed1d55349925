"""Fetch sessions at the socket (a data node in the test's process, its PM a LocalCluster): the
incremental responses against a full-fetch model (a hypothesis state machine), epoch errors and
recovery, a connection's sessions dying with it, and the SDK consumer reading in sessions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test
from raw_sbp import append_ok, create_streams
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.node import DataNodeServer
from sbpstream.datanode.sessions import FetchSessionCache, Waker
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
)
from sbpstream.protocol.messages import (
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.records import Record, build_batch
from sbpstream.store import FsyncPolicy

TIMEOUT_S = 10.0

View = tuple[int, int, int]  # (high watermark, range end, status code) as last reported


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("sess"), datanodes=0,
                      heartbeat_interval_ms=200) as c:
        yield c


def node_config(pm: LocalCluster) -> DataNodeConfig:
    return DataNodeConfig(directory=pm.directory / "dn", pm=(pm.pm_address,),
                          heartbeat_interval_ms=200, fsync=FsyncPolicy.NONE)


@pytest.fixture
async def node(pm: LocalCluster) -> AsyncIterator[DataNodeServer]:
    n = DataNodeServer(node_config(pm))
    await n.start()
    try:
        yield n
    finally:
        await n.close()


def sessions(node: DataNodeServer) -> FetchSessionCache:
    assert node.fetch is not None
    return node.fetch.sessions


async def append(conn: Connection, sid: int, n: int, tag: str) -> None:
    await append_ok(conn, sid, [build_batch([Record(value=f"{tag}-{i}".encode())
                                             for i in range(n)])])


async def fetch(conn: Connection, req: FetchRequest) -> tuple[int, dict[int, bytes],
                                                                dict[int, View]]:
    """(session id, payload bytes per stream, the last result's view per stream answered)."""
    data: dict[int, bytes] = {}
    view: dict[int, View] = {}
    session_id = -1
    for f in await conn.request(req.OPCODE, req.encode(), timeout_s=TIMEOUT_S):
        resp = FetchResponse.decode(f.header)
        resp.status.raise_for_error()
        session_id = resp.session_id
        for item, chunk in resp.chunks(f.payload):
            data[item.stream_id] = data.get(item.stream_id, b"") + bytes(chunk)
            view[item.stream_id] = (item.high_watermark, item.range_end_offset,
                                    item.status.code)
    return session_id, data, view


def item(sid: int, offset: int) -> FetchItem:
    return FetchItem(stream_id=sid, fetch_offset=offset, batch_max_bytes=1 << 20)


# ----------------------------------------------------------------------------- the protocol


async def test_session_lifecycle_and_epoch_errors(pm: LocalCluster, node: DataNodeServer) -> None:
    a, b, c = await create_streams(pm.pm_address, 3)
    conn = await Connection.open(node.address)
    try:
        await append(conn, a, 3, "a")
        sid, data, view = await fetch(conn, FetchRequest(
            items=(item(a, 0), item(b, 0), item(c, 0)), session_epoch=0))
        assert sid > 0 and sessions(node).sessions[sid].size == 3
        assert set(view) == {a, b, c} and data[a] and not data.get(b)  # full: every stream
        # a's position moves to its end, nothing else changed: an empty incremental answer
        assert await fetch(conn, FetchRequest(session_id=sid, session_epoch=1,
                                              items=(item(a, 3),))) == (sid, {}, {})
        # a new batch on b; c forgotten
        await append(conn, b, 2, "b")
        _, data, view = await fetch(conn, FetchRequest(
            session_id=sid, session_epoch=2, forgotten=(c,)))
        assert set(view) == {b} and data[b] and view[b][0] == 2
        assert set(sessions(node).sessions[sid].streams) == {a, b}
        # a wrong epoch, an unknown id: both retriable, nothing changes on the node
        with pytest.raises(InvalidFetchSessionEpochError) as e1:
            await fetch(conn, FetchRequest(session_id=sid, session_epoch=7))
        with pytest.raises(FetchSessionIdNotFoundError) as e2:
            await fetch(conn, FetchRequest(session_id=sid ^ 0x5A5A, session_epoch=1))
        with pytest.raises(InvalidFetchSessionEpochError):
            await fetch(conn, FetchRequest(session_id=0, session_epoch=3))
        assert e1.value.retriable and e2.value.retriable
        # recovery: a full FETCH (sid, 0) from the client's positions replaces the session
        sid2, data, view = await fetch(conn, FetchRequest(
            session_id=sid, session_epoch=0, items=(item(a, 3), item(b, 2))))
        assert sid2 > 0 and sid2 != sid and sid not in sessions(node).sessions
        assert set(view) == {a, b} and not any(data.values())  # all reported, none re-read
        # another connection cannot use it
        other = await Connection.open(node.address)
        try:
            with pytest.raises(FetchSessionIdNotFoundError):
                await fetch(other, FetchRequest(session_id=sid2, session_epoch=1))
        finally:
            await other.aclose()
        # epoch -1 closes it (and serves its items sessionless)
        assert (await fetch(conn, FetchRequest(session_id=sid2, session_epoch=-1)))[0] == 0
        assert not sessions(node).sessions
        # a session dies with its connection
        sid3, _, _ = await fetch(conn, FetchRequest(items=(item(a, 0),), session_epoch=0))
        assert sid3 in sessions(node).sessions
    finally:
        await conn.aclose()
    await eventually_async(lambda: not sessions(node).sessions,
                           what="the session to die with its connection")
    # no session left a waker behind in a stream's waiter set
    assert not [w for info in node.ctx.table.streams.values() for w in info.waiters
                if isinstance(w, Waker)]


async def test_incremental_long_poll_wakes_on_a_commit(pm: LocalCluster,
                                                       node: DataNodeServer) -> None:
    streams = await create_streams(pm.pm_address, 50)
    conn = await Connection.open(node.address)
    writer = await Connection.open(node.address)
    try:
        sid, _, view = await fetch(conn, FetchRequest(
            items=tuple(item(s, 0) for s in streams), session_epoch=0))
        assert len(view) == 50
        poll = asyncio.ensure_future(fetch(conn, FetchRequest(
            session_id=sid, session_epoch=1, max_wait_ms=5000, min_bytes=1)))
        await eventually_async(lambda: sessions(node).sessions[sid].busy,
                               what="the long poll to park")
        await append(writer, streams[17], 1, "x")
        _, data, view = await asyncio.wait_for(poll, TIMEOUT_S)
        assert set(view) == {streams[17]} and data[streams[17]]
    finally:
        await writer.aclose()
        await conn.aclose()


# --------------------------------------------------------- incremental against a full fetch


class SessionMachine(RuleBasedStateMachine):
    """A consumer's session against the model: a sessionless full FETCH of the same streams at
    the same positions, right after. What the incremental answers tell the consumer (the last
    view of every stream, the batches) must equal what the full FETCH says."""

    loop: asyncio.AbstractEventLoop
    conn: Connection
    writer: Connection
    pool: list[int]

    def __init__(self) -> None:
        super().__init__()
        self.positions: dict[int, int] = {}  # the consumer's streams and positions
        self.ends: dict[int, int] = {}  # records appended per stream in this example
        self.base: dict[int, int] = {}
        self.session_id = 0
        self.epoch = 0  # of the next FETCH (0 = a full one)
        self.expected = 0  # the epoch the node expects next
        self.sent: dict[int, int] = {}
        self.view: dict[int, View] = {}  # what the consumer was told

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    @rule(k=st.integers(0, 3), back=st.integers(0, 3))
    def add(self, k: int, back: int) -> None:
        sid = self.pool[k]
        if sid not in self.positions:
            self.positions[sid] = max(self.hwm(sid) - back, 0)

    @rule(k=st.integers(0, 3))
    def forget(self, k: int) -> None:
        self.positions.pop(self.pool[k], None)

    @rule(k=st.integers(0, 3), n=st.integers(1, 3))
    def advance(self, k: int, n: int) -> None:
        sid = self.pool[k]
        self.run(append(self.writer, sid, n, "m"))
        self.ends[sid] = self.ends.get(sid, 0) + n

    @rule(i=st.integers(0, 3), n=st.integers(1, 3))
    def advance_a_consumed_stream(self, i: int, n: int) -> None:
        if self.positions:
            self.advance(self.pool.index(sorted(self.positions)[i % len(self.positions)]), n)

    @rule(k=st.integers(0, 3), back=st.integers(0, 4))
    def seek(self, k: int, back: int) -> None:
        sid = self.pool[k]
        if sid in self.positions:
            self.positions[sid] = max(self.hwm(sid) - back, 0)

    @rule(k=st.integers(0, 3), past=st.integers(1, 2))
    def seek_past_the_end(self, k: int, past: int) -> None:
        sid = self.pool[k]
        if sid in self.positions:  # answered with an error until the stream grows
            self.positions[sid] = self.hwm(sid) + past

    @rule()
    def bad_epoch(self) -> None:
        if self.session_id:
            with pytest.raises(InvalidFetchSessionEpochError):
                self.run(fetch(self.conn, FetchRequest(session_id=self.session_id,
                                                        session_epoch=self.expected + 5)))
            self.epoch = 0  # the consumer starts a full session again

    @rule()
    def poll(self) -> None:
        items = tuple(item(s, p) for s, p in self.positions.items())
        if self.epoch == 0:
            req = FetchRequest(items=items, session_id=self.session_id, session_epoch=0)
        else:
            req = FetchRequest(
                session_id=self.session_id, session_epoch=self.epoch,
                items=tuple(i for i in items if self.sent.get(i.stream_id) != i.fetch_offset),
                forgotten=tuple(s for s in self.sent if s not in self.positions))
        sid, data, view = self.run(fetch(self.conn, req))  # type: ignore[misc]
        _, full_data, full_view = self.run(fetch(  # type: ignore[misc]
            self.conn, FetchRequest(items=items)))
        if req.session_epoch == 0:
            assert sid > 0
            self.session_id, self.epoch = sid, 1
            self.view = {}
        else:
            assert sid == self.session_id
            self.epoch += 1
            assert set(view) <= set(self.positions), "a stream not in the session"
        self.sent = dict(self.positions)
        self.expected = self.epoch
        for s in self.view.keys() - self.positions.keys():
            del self.view[s]
        self.view.update(view)
        assert {s: b for s, b in data.items() if b} == {s: b for s, b in full_data.items() if b}
        assert self.view == full_view, (self.view, full_view)
        for s, b in data.items():  # the consumer reads what it got
            if b:
                self.positions[s] = full_view[s][0]

    @rule()
    def poll_again(self) -> None:
        self.poll()

    def hwm(self, sid: int) -> int:
        return self.base[sid] + self.ends.get(sid, 0)


def test_incremental_matches_full_fetch_model(pm: LocalCluster) -> None:
    loop = asyncio.new_event_loop()
    node = DataNodeServer(node_config(pm))
    loop.run_until_complete(node.start())
    try:
        pool = loop.run_until_complete(create_streams(pm.pm_address, 4))
        conn = loop.run_until_complete(Connection.open(node.address))
        writer = loop.run_until_complete(Connection.open(node.address))

        class Machine(SessionMachine):
            pass

        Machine.loop, Machine.conn, Machine.writer, Machine.pool = loop, conn, writer, pool
        ends: dict[int, int] = {}
        original_init = Machine.__init__

        def init(self: SessionMachine) -> None:
            original_init(self)
            self.base = {s: ends.get(s, 0) for s in pool}

        def teardown(self: SessionMachine) -> None:
            for s in pool:
                ends[s] = self.hwm(s)
            if self.session_id:
                self.run(fetch(conn, FetchRequest(session_id=self.session_id,
                                                  session_epoch=-1)))

        Machine.__init__ = init  # type: ignore[method-assign]
        Machine.teardown = teardown  # type: ignore[method-assign]
        run_state_machine_as_test(Machine, settings=settings(
            max_examples=40, stateful_step_count=30, deadline=None,
            suppress_health_check=list(HealthCheck)))
        assert node.fetch is not None and not node.fetch.sessions.sessions
        loop.run_until_complete(conn.aclose())
        loop.run_until_complete(writer.aclose())
    finally:
        loop.run_until_complete(node.close())
        loop.close()


# ------------------------------------------------------------------------------- the SDK


async def test_consumer_pulls_in_one_session_per_node(pm: LocalCluster,
                                                      node: DataNodeServer) -> None:
    streams = await create_streams(pm.pm_address, 200)
    async with AsyncClient(pm.pm_address) as client:
        conn = await Connection.open(node.address)
        try:
            for s in streams[::20]:
                await append(conn, s, 2, "v")
        finally:
            await conn.aclose()
        cons = client.consumer(streams, "earliest", subscribe=False, max_wait_ms=50)
        got: list[tuple[int, int]] = []
        try:
            for _ in range(200):
                got += [(r.stream_id, r.offset) for r in await cons.poll(timeout_ms=50)]
                if len(got) >= 20:
                    break
            assert sorted(got) == sorted((s, o) for s in streams[::20] for o in (0, 1))
            cache = sessions(node)
            assert len(cache.sessions) == 1  # one session for the 200 streams on this node
            (s,) = cache.sessions.values()
            assert s.size == 200
            # the rounds after the records name the streams whose positions moved; then idle
            # rounds name none
            epoch = s.epoch
            await eventually_async(lambda: s.epoch >= epoch + 2, what="two more rounds")
            epoch, requests = s.epoch, node.ctx.metrics.c.fetch_requests
            items = node.ctx.metrics.c.fetch_items
            await eventually_async(lambda: s.epoch >= epoch + 3, what="three idle rounds")
            assert node.ctx.metrics.c.fetch_requests - requests >= 3
            assert node.ctx.metrics.c.fetch_items == items  # idle: no stream named again
            assert await cons.poll(timeout_ms=0) == []
        finally:
            await cons.close()
        await eventually_async(lambda: not sessions(node).sessions,
                               what="the consumer to close its session")
