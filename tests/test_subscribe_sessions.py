"""A subscription is a fetch session in push mode (issue 17), seen at the socket.

A subscribing FETCH with ``(session_id 0, epoch 0)`` makes a session; every frame of the
subscription carries its id. An incremental FETCH ``(id, epoch)`` on the same connection adds
streams to the live subscription (``items``) and drops some (``forgotten``), under Kafka's epoch
rules, and is answered at once with one empty END frame; the added streams' records come on the
subscription. The data node runs in the test's loop (fixtures of test_subscribe.py), so the tests
read its own state instead of guessing from timings.
"""

from __future__ import annotations

import asyncio

import pytest
import test_subscribe
from raw_sbp import append_ok
from test_subscribe import (
    TIMEOUT_S,
    Received,
    ack,
    batch,
    create_stream,
    receive_until,
    stats,
    subs,
)
from waiting import eventually_async

from sbpstream.cluster import LocalCluster
from sbpstream.datanode import subscribe as subscribe_mod
from sbpstream.datanode.node import DataNodeServer
from sbpstream.net.client import Connection, ResponseStream
from sbpstream.protocol.errors import (
    ErrorCode,
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    LimitExceededError,
    SbpError,
)
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import read_header

WINDOW = 1 << 20

pm = test_subscribe.pm  # the fixtures: a PM process, and a data node in the test's loop
node = test_subscribe.node


async def open_session(conn: Connection, offsets: dict[int, int], first_index: int = 0,
                       ) -> tuple[ResponseStream, int, Received]:
    """Subscribe in a session; returns the stream, the session id and what came first."""
    req = FetchRequest(window_bytes=WINDOW, session_id=0, session_epoch=0, items=tuple(
        FetchItem(stream_id=sid, request_index=first_index + i, fetch_offset=off)
        for i, (sid, off) in enumerate(offsets.items())))
    rs = await conn.stream(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)
    got = Received()
    await receive_until(rs, got, lambda: len({r.stream_id for r in got.results}) == len(offsets))
    ids = {FetchResponse.decode(f.header).session_id for f in got.frames}
    assert len(ids) == 1 and 0 not in ids, ids
    return rs, ids.pop(), got


async def change(conn: Connection, session_id: int, epoch: int, add: dict[int, tuple[int, int]],
                 forget: tuple[int, ...] = ()) -> Frame:
    """An incremental FETCH: ``add`` is stream -> (offset, request_index)."""
    req = FetchRequest(session_id=session_id, session_epoch=epoch, forgotten=forget,
                       items=tuple(FetchItem(stream_id=sid, request_index=ri, fetch_offset=off)
                                   for sid, (off, ri) in add.items()))
    frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)
    assert len(frames) == 1 and frames[0].is_end
    resp = FetchResponse.decode(frames[0].header)
    assert resp.status.ok and resp.session_id == session_id and not resp.items
    return frames[0]


def bases(got: Received, sid: int) -> list[int]:
    return [read_header(b).base_offset for s, b in got.batches if s == sid]


async def test_streams_are_added_and_dropped_on_the_live_subscription(
        pm: LocalCluster, node: DataNodeServer) -> None:
    a, b, c = [await create_stream(pm) for _ in range(3)]

    async def run(conn: Connection) -> None:
        await append_ok(conn, a, [batch(5, tag="a0")])
        await append_ok(conn, b, [batch(5, tag="b0")])
        rs, session, got = await open_session(conn, {a: 0})
        await receive_until(rs, got, lambda: bases(got, a) == [0])
        sub = subs(node).by_session[session]
        assert stats(node).streams == 1
        # add b from offset 0: its records come on the same subscription, no new one
        await change(conn, session, 1, {b: (0, 1)})
        await receive_until(rs, got, lambda: bases(got, b) == [0])
        assert [r.request_index for r in got.results if r.stream_id == b][-1] == 1
        assert stats(node).subscriptions == 1 and stats(node).streams == 2
        # drop a, add c: a's new records are not sent any more, c's are
        await change(conn, session, 2, {c: (0, 2)}, forget=(a,))
        assert set(sub.live) == {b, c} and stats(node).streams == 2
        await append_ok(conn, a, [batch(5, tag="a1")])
        await append_ok(conn, c, [batch(5, tag="c0")])
        await append_ok(conn, b, [batch(5, tag="b1")])
        await receive_until(rs, got, lambda: bases(got, c) == [0] and bases(got, b) == [0, 5])
        assert bases(got, a) == [0], "a forgotten stream was still pushed"
        # a stream named again continues where the update says, under its new request_index
        await change(conn, session, 3, {b: (0, 7)})
        await receive_until(rs, got, lambda: bases(got, b) == [0, 5, 0, 5])
        assert {r.request_index for r in got.results[-2:]} == {7}
        # every frame of the subscription carries the session id
        assert {FetchResponse.decode(f.header).session_id for f in got.frames} == {session}
        assert (await ack(conn, rs, got.payload_bytes)).status.ok
        assert (await ack(conn, rs, 0, cancel=True)).status.ok
        async with asyncio.timeout(TIMEOUT_S):
            async for f in rs:
                got.take(f)
        await eventually_async(lambda: stats(node).subscriptions == 0,
                               what="the subscription to end")
        # the session ended with its subscription
        assert session not in subs(node).by_session
        assert subs(node).sessions.sessions.get(session) is None
        with pytest.raises(FetchSessionIdNotFoundError):
            await conn.request(Opcode.FETCH, FetchRequest(
                session_id=session, session_epoch=4).encode(), timeout_s=TIMEOUT_S)

    conn = await Connection.open(node.address)
    try:
        await run(conn)
    finally:
        await conn.aclose()
    assert stats(node).streams == 0


async def test_epoch_errors_change_nothing_and_close_ends_it(
        pm: LocalCluster, node: DataNodeServer) -> None:
    a, b = [await create_stream(pm) for _ in range(2)]
    conn = await Connection.open(node.address)
    other = await Connection.open(node.address)
    try:
        await append_ok(conn, b, [batch(3, tag="b")])
        rs, session, got = await open_session(conn, {a: 0})
        sub = subs(node).by_session[session]
        for bad in (2, 0x7FFF_FFFF):  # skipped ahead, and far off
            with pytest.raises(InvalidFetchSessionEpochError):
                await conn.request(Opcode.FETCH, FetchRequest(
                    session_id=session, session_epoch=bad,
                    items=(FetchItem(stream_id=b, fetch_offset=0),)).encode(),
                    timeout_s=TIMEOUT_S)
        # another connection does not find it (a session belongs to its connection)
        with pytest.raises(FetchSessionIdNotFoundError):
            await other.request(Opcode.FETCH, FetchRequest(
                session_id=session, session_epoch=1,
                items=(FetchItem(stream_id=b, fetch_offset=0),)).encode(), timeout_s=TIMEOUT_S)
        assert set(sub.live) == {a}, "a refused update changed the subscription"
        # the right epoch still works, and is then used up (a replay is refused)
        await change(conn, session, 1, {b: (0, 1)})
        await receive_until(rs, got, lambda: bases(got, b) == [0])
        with pytest.raises(InvalidFetchSessionEpochError):
            await conn.request(Opcode.FETCH, FetchRequest(
                session_id=session, session_epoch=1).encode(), timeout_s=TIMEOUT_S)
        # epoch -1 closes the session, which ends its subscription with an END frame
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            session_id=session, session_epoch=-1).encode(), timeout_s=TIMEOUT_S)
        assert frames[-1].is_end
        async with asyncio.timeout(TIMEOUT_S):
            async for f in rs:
                got.take(f)
        assert got.frames[-1].is_end
        assert FetchResponse.decode(got.frames[-1].header).status.ok
        await eventually_async(lambda: stats(node).subscriptions == 0,
                               what="the subscription to end")
    finally:
        await conn.aclose()
        await other.aclose()


async def test_updates_are_bounded_and_a_refused_one_changes_nothing(
        pm: LocalCluster, node: DataNodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscribe_mod, "MAX_SUBSCRIPTION_STREAMS", 3)
    sids = [await create_stream(pm) for _ in range(5)]
    conn = await Connection.open(node.address)
    try:
        rs, session, _ = await open_session(conn, {sids[0]: 0, sids[1]: 0})
        sub = subs(node).by_session[session]
        with pytest.raises(LimitExceededError, match="at most 3"):
            await change(conn, session, 1, {sids[2]: (0, 2), sids[3]: (0, 3)})
        assert set(sub.live) == {sids[0], sids[1]} and stats(node).streams == 2
        # the epoch was not used up; dropping one makes room for two
        await change(conn, session, 1, {sids[2]: (0, 2), sids[3]: (0, 3)}, forget=(sids[0],))
        assert set(sub.live) == set(sids[1:4]) and stats(node).streams == 3
        assert subs(node).sessions.sessions[session].size == 3
        # a long-poll session cannot be turned into a subscription by an incremental FETCH
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            session_id=0, session_epoch=0, max_wait_ms=0,
            items=(FetchItem(stream_id=sids[4], fetch_offset=0),)).encode(), timeout_s=TIMEOUT_S)
        pull = FetchResponse.decode(frames[-1].header).session_id
        assert pull and pull != session
        with pytest.raises(SbpError) as e:
            await anext(await conn.stream(Opcode.FETCH, FetchRequest(
                window_bytes=WINDOW, session_id=pull, session_epoch=1).encode(),
                timeout_s=TIMEOUT_S))
        assert e.value.code == ErrorCode.INVALID_REQUEST
        await rs.aclose()
    finally:
        await conn.aclose()
    await eventually_async(lambda: stats(node).subscriptions == 0, what="the subscription to end")
