"""The connection layer over real loopback sockets."""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import pytest
from waiting import eventually_async

from sbpstream.net.client import Connection, ConnectionPool
from sbpstream.net.ports import free_port
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol.errors import (
    ConnectionClosedError,
    InvalidRequestError,
    SbpError,
    ShuttingDownError,
    UnsupportedOperationError,
)
from sbpstream.protocol.frame import Frame, FrameDecoder, encode_frame
from sbpstream.protocol.limits import WRITE_BUFFER_HIGH_WATER
from sbpstream.protocol.messages import GoAway, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode


async def echo_handler(req: Request, resp: Responder) -> None:
    # header says how many frames and how long to sleep between them
    n, delay_ms = struct.unpack(">HH", bytes(req.header)) if len(req.header) == 4 else (1, 0)
    for i in range(n):
        await asyncio.sleep(delay_ms / 1000)
        await resp.send(struct.pack(">H", i), req.payload, end=i == n - 1)


async def failing_handler(req: Request, resp: Responder) -> None:
    raise InvalidRequestError("nope")


async def crashing_handler(req: Request, resp: Responder) -> None:
    raise ZeroDivisionError("boom")


@pytest.fixture
async def server() -> asyncio.AsyncIterator[Server]:  # type: ignore[name-defined]
    s = Server(
        {
            Opcode.APPEND: echo_handler,
            Opcode.FETCH: echo_handler,
            Opcode.TRIM_STREAMS: failing_handler,
            Opcode.DELETE_STREAMS: crashing_handler,
        },
        name="test",
    )
    await s.start("127.0.0.1", 0)
    yield s
    await s.close(drain_timeout_s=1)


async def test_ping_and_pong(server: Server) -> None:
    c = await Connection.open(server.address)
    f = await c.ping(b"hello")
    assert f.flags == 0x03 and bytes(f.payload) == b"hello"
    await c.aclose()


async def test_many_concurrent_out_of_order_multi_frame(server: Server) -> None:
    c = await Connection.open(server.address)
    rnd = random.Random(7)

    async def one(i: int) -> None:
        n = rnd.randint(1, 5)
        delay = rnd.randint(0, 20)
        frames = await c.request(Opcode.FETCH, struct.pack(">HH", n, delay), f"req{i}".encode())
        assert len(frames) == n
        assert [struct.unpack(">H", bytes(f.header))[0] for f in frames] == list(range(n))
        assert all(bytes(f.payload) == f"req{i}".encode() for f in frames)
        assert frames[-1].is_end and not any(f.is_end for f in frames[:-1])

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), 30)
    await c.aclose()


async def test_errors_become_system_error_frames(server: Server) -> None:
    c = await Connection.open(server.address)
    with pytest.raises(InvalidRequestError):
        await c.request(Opcode.TRIM_STREAMS)
    with pytest.raises(SbpError) as ei:
        await c.request(Opcode.DELETE_STREAMS)
    assert "boom" in str(ei.value)
    with pytest.raises(UnsupportedOperationError):
        await c.request(Opcode.CREATE_STREAMS)
    # the connection is still fine
    assert len(await c.request(Opcode.APPEND, b"", b"x")) == 1
    await c.aclose()


def raw_exchange(
    address: str, data: bytes, expect_frames: int, timeout: float = 5.0
) -> list[Frame]:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        d = FrameDecoder()
        out: list[Frame] = []
        while len(out) < expect_frames:
            chunk = s.recv(65536)
            if not chunk:
                break
            d.feed(chunk)
            out.extend(e for e in d.events() if isinstance(e, Frame))
        return out


async def test_raw_rules_over_socket(server: Server) -> None:
    bad_magic = bytearray(encode_frame(Opcode.APPEND, 1, 0, b"", b"x"))
    bad_magic[4] = 1
    unknown = encode_frame(0x0999, 2, 0)
    bad_crc = bytearray(encode_frame(Opcode.APPEND, 3, 0, b"", b"abc"))
    bad_crc[-1] ^= 1
    bad_fmt = bytearray(encode_frame(Opcode.APPEND, 4, 0, b"", b"abc"))
    bad_fmt[12] = 9
    ping = encode_frame(Opcode.PING, 5, 0, b"", b"p")
    data = bytes(bad_magic) + unknown + bytes(bad_crc) + bytes(bad_fmt) + ping
    frames = await asyncio.to_thread(raw_exchange, server.address, data, 3)
    by_id = {f.request_id: f for f in frames}
    assert set(by_id) == {3, 4, 5}
    assert by_id[3].is_system_error and SystemErrorResponse.decode(by_id[3].header).status.code == 7
    assert (
        by_id[4].is_system_error and SystemErrorResponse.decode(by_id[4].header).status.code == 10
    )
    assert by_id[5].flags == 0x03 and bytes(by_id[5].payload) == b"p"
    assert server.stats.frames_discarded_bad_magic == 1
    assert server.stats.frames_discarded_unknown_opcode == 1


async def test_framing_error_gets_goaway_and_close(server: Server) -> None:
    frames = await asyncio.to_thread(
        raw_exchange, server.address, b"\xff\xff\xff\xff" + b"x" * 20, 1
    )
    assert frames and frames[0].opcode == Opcode.GOAWAY
    assert GoAway.decode(frames[0].header).code != 0
    # the server is still alive for others
    c = await Connection.open(server.address)
    await c.ping()
    await c.aclose()


async def test_peer_dies_mid_response_fails_pending_at_once() -> None:
    started = asyncio.Event()

    async def hang(req: Request, resp: Responder) -> None:
        await resp.send(b"first", end=False)
        started.set()
        await asyncio.sleep(60)

    s = Server({Opcode.FETCH: hang})
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    rs = [await c.stream(Opcode.FETCH) for _ in range(10)]
    first = await rs[0].__anext__()
    assert bytes(first.header) == b"first"
    await started.wait()
    for conn in list(s.connections):
        conn.abort()
    # the handler never ends on its own: only the dead connection can end these responses
    for r in rs:
        with pytest.raises(ConnectionClosedError):
            async for _ in r:
                pass
    await s.close(drain_timeout_s=0.5)


async def test_slow_reader_server_stops_buffering_at_cap() -> None:
    sent = 0
    blocked = asyncio.Event()

    async def firehose(req: Request, resp: Responder) -> None:
        nonlocal sent
        chunk = b"z" * 65536
        for _ in range(2000):  # up to 128 MiB if nothing pushed back
            task = asyncio.ensure_future(resp.send(b"", chunk, end=False))
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done:
                blocked.set()
                await task
            sent += len(chunk)
        await resp.send(b"", b"", end=True)

    s = Server({Opcode.FETCH: firehose})
    await s.start("127.0.0.1", 0)
    host, port = s.address.split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(encode_frame(Opcode.FETCH, 1, 0))
    await asyncio.wait_for(blocked.wait(), 20)
    # the peer read nothing: what the server pushed is bounded by kernel buffers + its cap
    assert sent < WRITE_BUFFER_HIGH_WATER + 32 * 1024 * 1024
    conn = next(iter(s.connections))
    assert conn.transport is not None
    assert conn.transport.get_write_buffer_size() <= WRITE_BUFFER_HIGH_WATER + 2 * 65536 + 64
    writer.close()
    await s.close(drain_timeout_s=0.5)


async def test_goaway_from_server_drains_in_flight() -> None:
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(req: Request, resp: Responder) -> None:
        arrived.set()
        await release.wait()
        await resp.send(b"done")

    s = Server({Opcode.APPEND: slow})
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    pending = asyncio.ensure_future(c.request_one(Opcode.APPEND))
    await asyncio.wait_for(arrived.wait(), 5)
    closing = asyncio.ensure_future(s.close(drain_timeout_s=10))
    await eventually_async(lambda: c.goaway is not None, timeout=5, what="GOAWAY at the client")
    with pytest.raises(ShuttingDownError):
        await c.request_one(Opcode.APPEND)
    release.set()
    f = await asyncio.wait_for(pending, 5)
    assert bytes(f.header) == b"done"
    await asyncio.wait_for(closing, 10)
    await asyncio.wait_for(c.closed_event.wait(), 5)


async def test_goaway_from_client_drains_then_server_closes() -> None:
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(req: Request, resp: Responder) -> None:
        arrived.set()
        await release.wait()
        await resp.send(b"ok")

    s = Server({Opcode.APPEND: slow})
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    pending = asyncio.ensure_future(c.request_one(Opcode.APPEND))
    await asyncio.wait_for(arrived.wait(), 5)
    await c.send_goaway(0, "bye")
    await eventually_async(lambda: all(conn.draining for conn in s.connections), timeout=5,
                           what="the server draining after the client's GOAWAY")
    release.set()
    assert bytes((await asyncio.wait_for(pending, 5)).header) == b"ok"
    await asyncio.wait_for(c.closed_event.wait(), 5)
    await s.close(drain_timeout_s=1)


async def test_pool_reconnects_on_demand(server: Server) -> None:
    pool = ConnectionPool()
    c1 = await pool.get(server.address)
    await c1.ping()
    c1.abort()
    await asyncio.wait_for(c1.closed_event.wait(), 5)
    c2 = await pool.get(server.address)
    assert c2 is not c1
    await c2.ping()
    await pool.close()


async def test_connect_refused_is_clear() -> None:
    with pytest.raises(ConnectionClosedError, match="cannot connect"):
        await Connection.open(f"127.0.0.1:{free_port()}")


async def test_idle_timeout_closes() -> None:
    s = Server({}, idle_timeout_s=0.2)
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    await asyncio.wait_for(c.closed_event.wait(), 5)
    await s.close()


async def test_in_flight_cap_pauses_reading() -> None:
    release = asyncio.Event()

    async def slow(req: Request, resp: Responder) -> None:
        await release.wait()
        await resp.send(b"")

    s = Server({Opcode.APPEND: slow}, max_in_flight=4)
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    futs = [asyncio.ensure_future(c.request_one(Opcode.APPEND)) for _ in range(10)]
    conn = await eventually_async(lambda: next(iter(s.connections), None), timeout=5)
    await eventually_async(lambda: conn.reading_paused, timeout=5, what="reading paused")
    assert len(conn.tasks) == 4
    release.set()
    await asyncio.wait_for(asyncio.gather(*futs), 10)
    await c.aclose()
    await s.close()


async def test_streaming_handler_yields_between_frames() -> None:
    """A long streamed answer must not starve other requests on the server's loop."""
    ticks: list[int] = []
    sent = 0

    async def many(req: Request, resp: Responder) -> None:
        nonlocal sent
        for i in range(200):
            await resp.send(b"", b"x" * 100, end=i == 199)
            sent += 1

    async def ticker() -> None:
        while sent < 200:
            ticks.append(sent)
            await asyncio.sleep(0)

    s = Server({Opcode.FETCH: many})
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    t = asyncio.ensure_future(ticker())
    frames = await c.request(Opcode.FETCH)
    await t
    assert len(frames) == 200
    # the ticker ran while the handler was half-way through its frames
    assert any(0 < n < 199 for n in ticks)
    await c.aclose()
    await s.close()
