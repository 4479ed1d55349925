"""Subscriptions (FETCH with a window) and BUFFER_ACK, seen at the socket with a raw client.

The data node runs in the test's own event loop (its PM is a LocalCluster process), so the tests
read the node's own accounting (``Subscriptions.stats``) instead of guessing from timings.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from raw_sbp import append_ok, create_streams
from waiting import eventually_async

from sbpstream.cluster import LocalCluster
from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.node import DataNodeServer
from sbpstream.datanode.subscribe import MAX_WINDOW_BYTES, Subscriptions, SubscriptionStats
from sbpstream.net.client import Connection, ResponseStream
from sbpstream.protocol.errors import ErrorCode, LimitExceededError
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.messages import (
    BufferAckRequest,
    BufferAckResponse,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
    FetchResult,
    SealItem,
    SealRangesRequest,
    SealRangesResponse,
    Stream,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch, read_header
from sbpstream.store import FsyncPolicy

TIMEOUT_S = 10.0  # every in-test wait is bounded by this


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("sub"), datanodes=0,
                      heartbeat_interval_ms=200) as c:
        yield c


@pytest.fixture
async def node(pm: LocalCluster) -> AsyncIterator[DataNodeServer]:
    # one directory for the module: the node keeps its id, so the PM places streams only here
    n = DataNodeServer(DataNodeConfig(directory=pm.directory / "dn", pm=(pm.pm_address,),
                                heartbeat_interval_ms=200, fsync=FsyncPolicy.NONE))
    await n.start()
    try:
        yield n
    finally:
        await n.close()


def subs(node: DataNodeServer) -> Subscriptions:
    assert node.fetch is not None
    return node.fetch.subscriptions


async def create_stream(pm: LocalCluster) -> int:
    (sid,) = await create_streams(pm.pm_address)
    return sid


def batch(n: int, size: int = 100, tag: str = "r") -> bytes:
    return build_batch([Record(value=f"{tag}-{i}".encode().ljust(size, b"."))
                        for i in range(n)])


async def subscribe(conn: Connection, offsets: dict[int, int], window: int) -> ResponseStream:
    req = FetchRequest(max_wait_ms=0, min_bytes=0, window_bytes=window, items=tuple(
        FetchItem(stream_id=sid, request_index=i, fetch_offset=off)
        for i, (sid, off) in enumerate(offsets.items())))
    return await conn.stream(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)


async def ack(conn: Connection, rs: ResponseStream | int, nbytes: int, *,
              cancel: bool = False) -> BufferAckResponse:
    rid = rs if isinstance(rs, int) else rs.request_id
    f = await conn.request_one(Opcode.BUFFER_ACK, BufferAckRequest(
        bytes_acked=nbytes, fetch_request_id=rid, cancel=cancel).encode(), timeout_s=TIMEOUT_S)
    return BufferAckResponse.decode(f.header)


class Received:
    """What a raw subscriber got: results and batches, payload bytes counted as the node does."""

    def __init__(self) -> None:
        self.results: list[FetchResult] = []
        self.batches: list[tuple[int, bytes]] = []
        self.payload_bytes = 0
        self.frames: list[Frame] = []

    def take(self, frame: Frame) -> None:
        self.frames.append(frame)
        resp = FetchResponse.decode(frame.header)
        for item, chunk in resp.chunks(frame.payload):
            self.results.append(item)
            if item.batch_length:
                self.batches.append((item.stream_id, bytes(chunk)))
                self.payload_bytes += item.batch_length


async def receive_until(rs: ResponseStream, got: Received, cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not cond():
            got.take(await anext(rs))


def stats(node: DataNodeServer) -> SubscriptionStats:
    return subs(node).stats()


async def with_conn(node: DataNodeServer, fn: Callable[[Connection], Awaitable[None]]) -> None:
    conn = await Connection.open(node.address)
    try:
        await fn(conn)
    finally:
        await conn.aclose()


async def test_window_bounds_what_is_sent_and_each_ack_releases_exactly_that(
        pm: LocalCluster, node: DataNodeServer) -> None:
    sid = await create_stream(pm)
    b = batch(10)
    size = len(b)
    window = 3 * size + size // 2  # room for three batches and a half

    async def run(conn: Connection) -> None:
        await append_ok(conn, sid, [batch(10, tag=f"b{i}") for i in range(10)])
        rs = await subscribe(conn, {sid: 0}, window)
        got = Received()
        await receive_until(rs, got, lambda: len(got.batches) == 3)
        await eventually_async(lambda: stats(node).subscriptions == 1, what="the subscription")
        # the node has sent exactly what we received, and cannot send a fourth batch
        sub = subs(node).find(next(iter(subs(node).by_conn)), rs.request_id)
        assert sub is not None
        assert sub.unacked == sub.sent_bytes == got.payload_bytes == 3 * size
        assert not any(f.is_end for f in got.frames)
        for n in range(4, 8):  # each ack of one batch's bytes lets exactly one more go
            r = await ack(conn, rs, size)
            assert r.status.ok, r.status
            await receive_until(rs, got, lambda n=n: len(got.batches) == n)  # type: ignore[misc]
            assert sub.sent_bytes == got.payload_bytes == n * size
            assert sub.unacked == 3 * size
        offsets = [read_header(bb).base_offset for _, bb in got.batches]
        assert offsets == [i * 10 for i in range(7)]
        # new records are pushed without a new request, as soon as the window allows
        assert (await ack(conn, rs, 3 * size)).status.ok
        await receive_until(rs, got, lambda: len(got.batches) == 10)
        assert (await ack(conn, rs, 3 * size)).status.ok
        await append_ok(conn, sid, [batch(5, tag="late")])
        await receive_until(rs, got, lambda: len(got.batches) == 11)
        assert read_header(got.batches[-1][1]).base_offset == 100
        assert got.results[-1].high_watermark == 105
        await rs.aclose()

    await with_conn(node, run)


async def test_cancel_ends_the_subscription_with_end(pm: LocalCluster,
                                                     node: DataNodeServer) -> None:
    sid = await create_stream(pm)

    async def run(conn: Connection) -> None:
        await append_ok(conn, sid, [batch(3)])
        rs = await subscribe(conn, {sid: 0}, 1 << 20)
        got = Received()
        await receive_until(rs, got, lambda: len(got.batches) == 1)
        r = await ack(conn, rs, 0, cancel=True)
        assert r.status.ok, r.status
        async with asyncio.timeout(TIMEOUT_S):
            async for f in rs:
                got.take(f)
        assert got.frames[-1].is_end
        assert FetchResponse.decode(got.frames[-1].header).status.ok
        await eventually_async(lambda: stats(node).subscriptions == 0,
                               what="the subscription to go")
        # the subscription is gone: acking or cancelling it again is refused, clearly
        r = await ack(conn, rs, 1)
        assert r.status.code == ErrorCode.INVALID_REQUEST
        assert "no subscription" in r.status.message

    await with_conn(node, run)


async def test_connection_close_ends_subscriptions(pm: LocalCluster, node: DataNodeServer) -> None:
    sid = await create_stream(pm)
    conn = await Connection.open(node.address)
    try:
        await subscribe(conn, {sid: 0}, 1 << 20)
        await subscribe(conn, {sid: 0}, 1 << 20)
        await eventually_async(lambda: stats(node).subscriptions == 2, what="two subscriptions")
    finally:
        await conn.aclose()
    await eventually_async(lambda: stats(node).subscriptions == 0, what="the subscriptions to end")
    assert stats(node).streams == 0 and not subs(node).by_conn


async def test_hostile_acks_are_refused_and_nothing_breaks(
        pm: LocalCluster, node: DataNodeServer) -> None:
    sid = await create_stream(pm)
    size = len(batch(4))

    async def run(conn: Connection) -> None:
        await append_ok(conn, sid, [batch(4) for _ in range(4)])
        rs = await subscribe(conn, {sid: 0}, 2 * size)
        got = Received()
        await receive_until(rs, got, lambda: len(got.batches) == 2)
        for bad, words in ((0, "positive"), (-5, "positive"), (-(1 << 40), "positive"),
                           (2 * size + 1, "more than"), (1 << 62, "more than")):
            r = await ack(conn, rs, bad)
            assert r.status.code == ErrorCode.INVALID_REQUEST, (bad, r.status)
            assert words in r.status.message
        for rid in (rs.request_id + 1000, -1, 0):
            r = await ack(conn, rid, size)
            assert r.status.code == ErrorCode.INVALID_REQUEST
            assert "no subscription" in r.status.message
        assert stats(node).acks_refused == 8
        assert stats(node).unacked_bytes == 2 * size  # nothing changed
        # an ack for a subscription of another connection is refused too
        other = await Connection.open(node.address)
        try:
            r = await ack(other, rs, size)
            assert r.status.code == ErrorCode.INVALID_REQUEST
        finally:
            await other.aclose()
        # the subscription still works
        assert (await ack(conn, rs, 2 * size)).status.ok
        await receive_until(rs, got, lambda: len(got.batches) == 4)
        assert [read_header(b).base_offset for _, b in got.batches] == [0, 4, 8, 12]
        await rs.aclose()

    await with_conn(node, run)


async def test_slow_consumer_costs_the_node_at_most_its_window(
        pm: LocalCluster, node: DataNodeServer) -> None:
    sid = await create_stream(pm)
    window = 64 * 1024

    async def run(conn: Connection) -> None:
        rs = await subscribe(conn, {sid: 0}, window)
        got = Received()
        for round_ in range(20):  # ~1 MiB appended while the consumer never acks
            await append_ok(conn, sid, [batch(50, size=100, tag=f"s{round_}") for _ in range(10)])
            st = stats(node)
            assert st.max_unacked_bytes <= window and st.unacked_bytes <= window
        await receive_until(rs, got, lambda: got.payload_bytes + len(batch(50)) > window)
        st = stats(node)
        assert st.unacked_bytes == got.payload_bytes <= window
        assert node.store.stats().bytes_written > 10 * window
        await rs.aclose()

    await with_conn(node, run)


async def test_multi_stream_subscription_and_per_stream_ends(
        pm: LocalCluster, node: DataNodeServer) -> None:
    a, b, c = [await create_stream(pm) for _ in range(3)]

    async def run(conn: Connection) -> None:
        for sid in (a, b, c):
            await append_ok(conn, sid, [batch(5, tag=f"s{sid}")])
        rs = await subscribe(conn, {a: 0, b: 2, c: 0}, 1 << 20)
        got = Received()
        await receive_until(rs, got, lambda: len(got.batches) == 3)
        assert sorted(sid for sid, _ in got.batches) == sorted([a, b, c])
        # b's range is sealed: its item says where to continue; a's stream is deleted
        f = await conn.request_one(Opcode.SEAL_RANGES, SealRangesRequest(
            timeout_ms=5000, items=(SealItem(stream_id=b, range_index=0, end_offset=5),)
        ).encode(), timeout_s=TIMEOUT_S)
        assert SealRangesResponse.decode(f.header).items[0].status.ok
        await receive_until(rs, got, lambda: any(
            r.stream_id == b and r.range_end_offset >= 0 for r in got.results))
        ended = [r for r in got.results if r.stream_id == b and r.range_end_offset >= 0]
        assert ended[-1].range_end_offset == 5 and ended[-1].status.ok
        f = await conn.request_one(Opcode.DELETE_STREAMS, DeleteStreamsRequest(
            timeout_ms=5000, items=(Stream(stream_id=a),)).encode(), timeout_s=TIMEOUT_S)
        assert DeleteStreamsResponse.decode(f.header).items[0].status.ok
        await receive_until(rs, got, lambda: any(
            r.stream_id == a and not r.status.ok for r in got.results))
        gone = [r for r in got.results if r.stream_id == a and not r.status.ok]
        assert gone[-1].status.code in (ErrorCode.STREAM_DELETED, ErrorCode.STREAM_NOT_FOUND)
        # c still streams; no END yet
        assert not any(fr.is_end for fr in got.frames)
        await append_ok(conn, c, [batch(2, tag="c2")])
        await receive_until(rs, got, lambda: sum(1 for s, _ in got.batches if s == c) == 2)
        assert stats(node).streams == 3
        await rs.aclose()

    await with_conn(node, run)


async def test_limits_are_enforced(pm: LocalCluster, node: DataNodeServer) -> None:
    sid = await create_stream(pm)

    async def run(conn: Connection) -> None:
        rs = await subscribe(conn, {sid: 0}, MAX_WINDOW_BYTES + 1)
        with pytest.raises(LimitExceededError, match="window_bytes"):
            await anext(rs)
        # a long poll (no window) is unchanged
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, min_bytes=0, items=(FetchItem(stream_id=sid, fetch_offset=0),)
        ).encode(), timeout_s=TIMEOUT_S)
        assert frames[-1].is_end and len(frames) == 1
        assert stats(node).subscriptions == 0

    await with_conn(node, run)
