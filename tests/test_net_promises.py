"""The connection layer's promises, held with raw bytes over real sockets.

- Every request gets an answer: a request id with the top bit set gets a system error frame
  (INVALID_REQUEST) without being dispatched; whatever a handler raises becomes an error response
  on its request id; the server keeps serving and the event loop sees no stray task exception.
- The GOAWAY promise holds on every path: after a framing error the server sends GOAWAY with the
  highest request id it accepted, answers those, accepts nothing more, then closes (bounded); a
  client honours a server's GOAWAY; a client that meets a framing error fails its pending
  requests, tells the server and closes.
- A fuzz test throws random and mutated frames at a server: every well-formed request gets exactly
  one final answer and the server survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import PmProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_peer import RawPeer, raw_frame, system_error_code

from sbpstream.net import client as client_module
from sbpstream.net.client import Connection
from sbpstream.net.loop import new_event_loop
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol.errors import (
    ConnectionClosedError,
    ErrorCode,
    RangeSealedError,
    SbpError,
    ShuttingDownError,
)
from sbpstream.protocol.frame import (
    FLAG_END,
    FLAG_RESPONSE,
    FLAGS_RESPONSE_END,
    MAGIC,
    Frame,
    FrameCorrupt,
    FrameDecoder,
    FramingError,
    encode_frame,
)
from sbpstream.protocol.limits import MAX_REQUEST_ID
from sbpstream.protocol.messages import GoAway, SystemErrorResponse
from sbpstream.protocol.opcodes import KNOWN_OPCODES, Opcode

WAIT_S = 10.0  # bound of every wait on the peer
TOP_BIT = 1 << 31


def finals(frames: list[Frame]) -> dict[int, Frame]:
    out: dict[int, Frame] = {}
    for f in frames:
        if f.is_response and f.is_end:
            assert f.request_id not in out, f"two final answers on request id {f.request_id}"
            out[f.request_id] = f
    return out


async def echo(req: Request, resp: Responder) -> None:
    await resp.send(b"", req.payload)


# ---- every request gets an answer


async def test_top_bit_request_id_gets_invalid_request_not_dispatched() -> None:
    errors = _watch_loop_errors()
    calls: list[int] = []

    async def counting(req: Request, resp: Responder) -> None:
        calls.append(req.request_id)
        await resp.send(b"ok")

    s = Server({Opcode.APPEND: counting})
    await s.start("127.0.0.1", 0)
    ids = [TOP_BIT | 1, TOP_BIT | 2, 0xFFFFFFFF]
    data = (
        raw_frame(Opcode.APPEND, ids[0])
        + raw_frame(Opcode.PING, ids[1], payload=b"p")
        + raw_frame(Opcode.FETCH, ids[2])  # served by nobody here: still INVALID_REQUEST
        + raw_frame(Opcode.APPEND, 7)
    )

    def exchange() -> list[Frame]:
        peer = RawPeer(s.address)
        try:
            peer.send(data)
            peer.half_close()
            return peer.read_to_eof()
        finally:
            peer.close()

    frames = await asyncio.to_thread(exchange)
    answers = finals(frames)
    assert set(answers) == {*ids, 7}
    for rid in ids:
        assert system_error_code(answers[rid]) == ErrorCode.INVALID_REQUEST
        assert "top bit" in SystemErrorResponse.decode(answers[rid].header).status.message
    assert bytes(answers[7].header) == b"ok"
    assert calls == [7]  # the top-bit APPEND was never dispatched
    assert s.stats.requests_bad_id == 3
    c = await Connection.open(s.address)  # still serving
    await c.ping()
    await c.aclose()
    await s.close(drain_timeout_s=1)
    assert errors == []


def _watch_loop_errors() -> list[dict[str, Any]]:
    """What the loop's exception handler sees ("Task exception was never retrieved", ...)."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    return seen


class OddServerError(RangeSealedError):
    """A request error whose detail cannot fit any frame: the answer itself cannot encode."""


async def test_every_handler_failure_becomes_an_error_response() -> None:
    errors = _watch_loop_errors()
    max_frame = 4096

    async def sbp_error(req: Request, resp: Responder) -> None:
        raise RangeSealedError("sealed", b"7")

    async def client_side_error(req: Request, resp: Responder) -> None:
        raise ConnectionClosedError("the replica went away")  # a client-side code, passed on

    async def crash(req: Request, resp: Responder) -> None:
        raise KeyError("boom")

    async def own_connection_error(req: Request, resp: Responder) -> None:
        raise ConnectionResetError("a socket of the handler's own")  # ours is still open

    async def unencodable_answer(req: Request, resp: Responder) -> None:
        await resp.send(b"", b"x" * (2 * max_frame))

    async def unencodable_error(req: Request, resp: Responder) -> None:
        raise OddServerError("detail too big", b"d" * (2 * max_frame))

    async def silent(req: Request, resp: Responder) -> None:
        return None

    async def half_stream(req: Request, resp: Responder) -> None:
        await resp.send(b"part", end=False)
        raise ValueError("gave up mid-stream")

    handlers = {
        Opcode.APPEND: sbp_error,
        Opcode.FETCH: client_side_error,
        Opcode.TRIM_STREAMS: crash,
        Opcode.DELETE_STREAMS: own_connection_error,
        Opcode.CREATE_STREAMS: unencodable_answer,
        Opcode.SEAL_RANGES: unencodable_error,
        Opcode.SYNC_RANGES: silent,
        Opcode.LIST_RANGES: half_stream,
        Opcode.DESCRIBE_RANGES: echo,
    }
    expected = {
        Opcode.APPEND: ErrorCode.RANGE_SEALED,
        Opcode.FETCH: int(ConnectionClosedError.code),
        Opcode.TRIM_STREAMS: ErrorCode.INTERNAL_ERROR,
        Opcode.DELETE_STREAMS: ErrorCode.INTERNAL_ERROR,
        Opcode.CREATE_STREAMS: ErrorCode.INTERNAL_ERROR,
        Opcode.SEAL_RANGES: ErrorCode.INTERNAL_ERROR,
        Opcode.SYNC_RANGES: ErrorCode.INTERNAL_ERROR,
        Opcode.LIST_RANGES: ErrorCode.INTERNAL_ERROR,
    }
    s = Server(handlers, max_frame_length=max_frame)
    await s.start("127.0.0.1", 0)
    c = await Connection.open(s.address)
    for _round in range(2):  # the server keeps serving after each failure
        for op, code in expected.items():
            with pytest.raises(SbpError) as ei:
                await c.request(op, timeout_s=WAIT_S)
            assert int(ei.value.code) == code, (Opcode(op).name, ei.value)
        frame = await c.request_one(Opcode.DESCRIBE_RANGES, b"", b"still here", timeout_s=WAIT_S)
        assert bytes(frame.payload) == b"still here"
    assert s.stats.requests_failed == 2 * len(expected)
    await c.aclose()
    await s.close(drain_timeout_s=1)
    assert errors == []


# ---- the GOAWAY promise


async def test_framing_error_mid_pipeline_answers_accepted_then_goaway_then_close() -> None:
    errors = _watch_loop_errors()
    release = asyncio.Event()
    dispatched: list[int] = []

    async def slow(req: Request, resp: Responder) -> None:
        dispatched.append(req.request_id)
        await release.wait()
        await resp.send(b"", req.payload)

    s = Server({Opcode.APPEND: slow})
    await s.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    data = (
        raw_frame(Opcode.APPEND, 1, payload=b"one")
        + raw_frame(Opcode.APPEND, 2, payload=b"two")
        + raw_frame(Opcode.PING, 3, payload=b"p")
        + b"\xff\xff\xff\xff"  # frame length past the limit: nothing after it can be trusted
        + raw_frame(Opcode.APPEND, 9, payload=b"never")
    )

    def exchange() -> tuple[list[Frame], list[Frame], bool]:
        peer = RawPeer(s.address)
        try:
            peer.send(data)
            before = peer.read_until(lambda fs: any(f.opcode == Opcode.GOAWAY for f in fs))
            loop.call_soon_threadsafe(release.set)  # only now may the held requests finish
            after = peer.read_to_eof()
            return before, after, peer.eof
        finally:
            peer.close()

    before, after, eof = await asyncio.to_thread(exchange)
    assert eof
    # PONG (answered at once), then GOAWAY naming the highest accepted request id
    assert [f.request_id for f in before] == [3, 0]
    goaway = GoAway.decode(before[1].header)
    assert goaway.last_stream_id == 2 and goaway.code == ErrorCode.INVALID_REQUEST
    # the accepted requests were answered after the GOAWAY, nothing after the bad bytes was
    answers = finals(after)
    assert set(answers) == {1, 2}
    assert bytes(answers[1].payload) == b"one" and bytes(answers[2].payload) == b"two"
    assert sorted(dispatched) == [1, 2]
    assert s.stats.framing_errors == 1
    await s.close(drain_timeout_s=1)
    assert errors == []


async def test_drain_after_framing_error_is_bounded() -> None:
    async def never(req: Request, resp: Responder) -> None:
        await asyncio.Event().wait()

    s = Server({Opcode.APPEND: never}, drain_timeout_s=0.2)
    await s.start("127.0.0.1", 0)

    def exchange() -> tuple[list[Frame], bool]:
        peer = RawPeer(s.address)
        try:
            peer.send(raw_frame(Opcode.APPEND, 5) + b"\x00\x00\x00\x01")  # length below 16
            return peer.read_to_eof(), peer.eof
        finally:
            peer.close()

    frames, eof = await asyncio.to_thread(exchange)
    assert eof and [f.opcode for f in frames] == [Opcode.GOAWAY]
    assert GoAway.decode(frames[0].header).last_stream_id == 5
    assert s.stats.drains_expired == 1
    await s.close(drain_timeout_s=1)


async def test_half_close_answers_everything_sent_then_closes() -> None:
    async def slow_echo(req: Request, resp: Responder) -> None:
        await asyncio.sleep(0.05)
        await resp.send(b"", req.payload)

    s = Server({Opcode.APPEND: slow_echo}, max_in_flight=2)  # some are held at the cap
    await s.start("127.0.0.1", 0)
    data = b"".join(raw_frame(Opcode.APPEND, i, payload=b"%d" % i) for i in range(1, 9))

    def exchange() -> tuple[list[Frame], bool]:
        peer = RawPeer(s.address)
        try:
            peer.send(data)
            peer.half_close()
            return peer.read_to_eof(), peer.eof
        finally:
            peer.close()

    frames, eof = await asyncio.to_thread(exchange)
    assert eof
    answers = finals(frames)
    assert set(answers) == set(range(1, 9))
    assert all(bytes(answers[i].payload) == b"%d" % i for i in answers)
    await s.close(drain_timeout_s=1)


@dataclass
class FakeServer:
    """A raw asyncio server the test scripts frame by frame, to drive a client Connection."""

    requests: asyncio.Queue[Frame]
    received_after: list[Frame]
    writer: asyncio.StreamWriter | None = None
    server: asyncio.Server | None = None
    address: str = ""
    got_eof: asyncio.Event | None = None


@contextlib.asynccontextmanager
async def fake_server() -> AsyncIterator[FakeServer]:
    fs = FakeServer(asyncio.Queue(), [], got_eof=asyncio.Event())
    connected = asyncio.Event()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fs.writer = writer
        connected.set()
        dec = FrameDecoder()
        while chunk := await reader.read(65536):
            dec.feed(chunk)
            for ev in dec.events():
                assert isinstance(ev, Frame)
                await fs.requests.put(ev)
        assert fs.got_eof is not None
        fs.got_eof.set()

    fs.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    host, port = fs.server.sockets[0].getsockname()[:2]
    fs.address = f"{host}:{port}"
    try:
        yield fs
    finally:
        if fs.writer is not None:
            fs.writer.close()
        fs.server.close()


async def test_client_honours_goaway_below_answered_above_retriable() -> None:
    async with fake_server() as fs:
        c = await Connection.open(fs.address)
        futs = [
            asyncio.ensure_future(c.request_one(Opcode.APPEND, b"", b"%d" % i, timeout_s=WAIT_S))
            for i in range(3)
        ]
        reqs = [await asyncio.wait_for(fs.requests.get(), WAIT_S) for _ in range(3)]
        ids = sorted(r.request_id for r in reqs)
        assert fs.writer is not None
        last = ids[1]
        fs.writer.write(encode_frame(Opcode.GOAWAY, 0, 0, GoAway(0, "bye", last).encode()))
        # above last_stream_id: fails at once, retriable; a new request is refused the same way
        above = next(f for f, r in zip(futs, reqs, strict=True) if r.request_id == ids[2])
        with pytest.raises(ShuttingDownError) as ei:
            await asyncio.wait_for(above, WAIT_S)
        assert ei.value.retriable
        with pytest.raises(ShuttingDownError):
            await c.request_one(Opcode.APPEND)
        # at or below it: still answered
        for r in reqs:
            if r.request_id <= last:
                fs.writer.write(encode_frame(r.opcode, r.request_id, FLAGS_RESPONSE_END, b"ok"))
        for f, r in zip(futs, reqs, strict=True):
            if r.request_id <= last:
                assert bytes((await asyncio.wait_for(f, WAIT_S)).header) == b"ok"
        # nothing left pending: the client closes
        await asyncio.wait_for(c.closed_event.wait(), WAIT_S)
        assert fs.got_eof is not None
        await asyncio.wait_for(fs.got_eof.wait(), WAIT_S)


async def test_client_drain_after_goaway_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DEFAULT_DRAIN_TIMEOUT_S", 0.2)
    async with fake_server() as fs:
        c = await Connection.open(fs.address)
        fut = asyncio.ensure_future(c.request_one(Opcode.APPEND))  # no timeout of its own
        r = await asyncio.wait_for(fs.requests.get(), WAIT_S)
        assert fs.writer is not None
        fs.writer.write(encode_frame(Opcode.GOAWAY, 0, 0, GoAway(0, "", r.request_id).encode()))
        # promised an answer that never comes: the client gives up after the drain bound
        with pytest.raises(ConnectionClosedError):
            await asyncio.wait_for(fut, WAIT_S)
        await asyncio.wait_for(c.closed_event.wait(), WAIT_S)


async def test_client_framing_error_fails_pending_sends_goaway_and_closes() -> None:
    async with fake_server() as fs:
        c = await Connection.open(fs.address)
        first = asyncio.ensure_future(c.request_one(Opcode.APPEND, timeout_s=WAIT_S))
        r1 = await asyncio.wait_for(fs.requests.get(), WAIT_S)
        second = asyncio.ensure_future(c.request_one(Opcode.APPEND, timeout_s=WAIT_S))
        await asyncio.wait_for(fs.requests.get(), WAIT_S)
        assert fs.writer is not None
        fs.writer.write(encode_frame(r1.opcode, r1.request_id, FLAGS_RESPONSE_END, b"ok"))
        fs.writer.write(b"\xff\xff\xff\xff garbage")
        assert bytes((await asyncio.wait_for(first, WAIT_S)).header) == b"ok"
        with pytest.raises(ConnectionClosedError, match="framing error"):
            await asyncio.wait_for(second, WAIT_S)
        goaway = await asyncio.wait_for(fs.requests.get(), WAIT_S)
        assert goaway.opcode == Opcode.GOAWAY
        assert GoAway.decode(goaway.header).code == ErrorCode.INVALID_REQUEST
        assert fs.got_eof is not None
        await asyncio.wait_for(fs.got_eof.wait(), WAIT_S)
        await asyncio.wait_for(c.closed_event.wait(), WAIT_S)


async def test_client_answers_top_bit_ping_with_invalid_request() -> None:
    async with fake_server() as fs:
        c = await Connection.open(fs.address)
        for _ in range(int(WAIT_S * 100)):
            if fs.writer is not None:
                break
            await asyncio.sleep(0.01)
        assert fs.writer is not None
        fs.writer.write(raw_frame(Opcode.PING, TOP_BIT | 4) + raw_frame(Opcode.PING, 4))
        got = [await asyncio.wait_for(fs.requests.get(), WAIT_S) for _ in range(2)]
        by_id = {f.request_id: f for f in got}
        assert system_error_code(by_id[TOP_BIT | 4]) == ErrorCode.INVALID_REQUEST
        assert by_id[4].flags == FLAGS_RESPONSE_END
        await c.aclose()


# ---- a real PM process


async def test_real_pm_process_keeps_the_promises(tmp_path: Path) -> None:
    pm = PmProcess(tmp_path)
    await asyncio.to_thread(pm.start)
    try:

        def exchange() -> tuple[list[Frame], bool]:
            peer = RawPeer(pm.address)
            try:
                peer.send(
                    raw_frame(Opcode.DESCRIBE_STREAMS, TOP_BIT | 1)
                    + raw_frame(Opcode.DESCRIBE_STREAMS, 2)
                    + raw_frame(Opcode.DESCRIBE_STREAMS, 3, header=b"\x01\x02\x03")  # undecodable
                    + b"\x00\x00\x00\x02"  # framing error
                )
                return peer.read_to_eof(), peer.eof
            finally:
                peer.close()

        frames, eof = await asyncio.to_thread(exchange)
        assert eof
        answers = finals(frames)
        assert set(answers) == {TOP_BIT | 1, 2, 3}
        assert system_error_code(answers[TOP_BIT | 1]) == ErrorCode.INVALID_REQUEST
        assert not answers[2].is_system_error
        assert system_error_code(answers[3]) == ErrorCode.BAD_HEADER
        goaways = [f for f in frames if f.opcode == Opcode.GOAWAY]
        assert len(goaways) == 1 and GoAway.decode(goaways[0].header).last_stream_id == 3
        # and it still serves
        c = await Connection.open(pm.address)
        await c.ping()
        await c.aclose()
    finally:
        await asyncio.to_thread(pm.stop)


# ---- fuzz


class ServerThread:
    """A real Server on its own uvloop in a thread, so sync hypothesis tests can talk to it."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(WAIT_S)

    async def _start(self) -> Server:
        async def echo_some(req: Request, resp: Responder) -> None:
            n = 1 + len(req.payload) % 3
            for i in range(n):
                await asyncio.sleep(0.001 * (len(req.header) % 3))
                await resp.send(b"", req.payload, end=i == n - 1)

        async def sbp_error(req: Request, resp: Responder) -> None:
            raise RangeSealedError("sealed")

        async def crash(req: Request, resp: Responder) -> None:
            raise ZeroDivisionError("boom")

        async def silent(req: Request, resp: Responder) -> None:
            await asyncio.sleep(0)

        async def client_side(req: Request, resp: Responder) -> None:
            raise ConnectionClosedError("peer went away")

        async def too_big(req: Request, resp: Responder) -> None:
            await resp.send(b"", b"z" * FUZZ_MAX_FRAME)

        s = Server(
            {
                Opcode.APPEND: echo_some,
                Opcode.FETCH: sbp_error,
                Opcode.TRIM_STREAMS: crash,
                Opcode.DELETE_STREAMS: silent,
                Opcode.SEAL_RANGES: client_side,
                Opcode.CREATE_STREAMS: too_big,
            },
            max_frame_length=FUZZ_MAX_FRAME,
            max_in_flight=4,
            drain_timeout_s=WAIT_S,
        )
        await s.start("127.0.0.1", 0)
        return s

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(1), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


FUZZ_MAX_FRAME = 4096
FUZZ_HANDLED = {
    Opcode.APPEND,
    Opcode.FETCH,
    Opcode.TRIM_STREAMS,
    Opcode.DELETE_STREAMS,
    Opcode.SEAL_RANGES,
    Opcode.CREATE_STREAMS,
}


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerThread]:
    st_ = ServerThread()
    yield st_
    st_.stop()


_opcodes = st.sampled_from(
    [*sorted(int(o) for o in KNOWN_OPCODES if o != Opcode.GOAWAY), 0x0999, 0xFFFF]
)


@st.composite
def fuzz_frame(draw: st.DrawFn, request_id: int) -> bytes:
    header = draw(st.binary(max_size=24))
    payload = draw(st.binary(max_size=24))
    mutation = draw(
        st.sampled_from(["none"] * 6 + ["magic", "flags", "crc", "format", "hlen", "opcode"])
    )
    kw: dict[str, Any] = {}
    opcode = draw(st.sampled_from([*sorted(FUZZ_HANDLED), int(Opcode.PING)]))
    flags = 0
    if mutation == "magic":
        kw["magic"] = draw(st.integers(0, 255).filter(lambda m: m != MAGIC))
    elif mutation == "flags":
        flags = draw(st.integers(0, 255))
    elif mutation == "crc":
        kw["crc_ok"] = False
        payload = payload or b"x"
    elif mutation == "format":
        kw["header_format"] = draw(st.integers(0, 255))
    elif mutation == "hlen":
        kw["header_length"] = draw(st.integers(0, len(header) + len(payload) + 8))
    elif mutation == "opcode":
        opcode = draw(_opcodes)
    return raw_frame(opcode, request_id, header, payload, flags=flags, **kw)


@st.composite
def fuzz_stream(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 24))
    ids = draw(
        st.lists(
            st.one_of(st.integers(0, 1000), st.integers(MAX_REQUEST_ID - 2, 0xFFFFFFFF)),
            min_size=n,
            max_size=n,
            unique=True,
        )
    )
    data = b"".join(draw(fuzz_frame(rid)) for rid in ids)
    tail = draw(
        st.sampled_from(["none", "random", "bad_length", "truncated"]),
    )
    if tail == "random":
        data += draw(st.binary(min_size=1, max_size=64))
    elif tail == "bad_length":
        data += struct.pack(">I", draw(st.sampled_from([0, 15, FUZZ_MAX_FRAME + 1, 0xFFFFFFFF])))
    elif tail == "truncated":
        data += raw_frame(Opcode.APPEND, 4242, payload=b"cut")[:-3]
    return data


@dataclass
class Expectation:
    answers: Counter[int]  # request id -> how many final answers it must get
    maybe: set[int]  # ids after a peer's GOAWAY: at most one answer each
    goaway_last: int | None  # the server's GOAWAY after a framing error, with this last id
    goaway_known: bool = True  # False after a peer's GOAWAY: the server may close before


def expected(data: bytes) -> Expectation:
    """The oracle: the same decoder the server runs, over the same bytes."""
    dec = FrameDecoder(FUZZ_MAX_FRAME)
    dec.feed(data)
    answers: Counter[int] = Counter()
    maybe: set[int] = set()
    dispatched = [0]
    peer_goaway = False
    while True:
        try:
            ev = dec.next_event()
        except FramingError:
            return Expectation(answers, maybe, max(dispatched), not peer_goaway)
        if ev is None:
            return Expectation(answers, maybe, None)
        if not isinstance(ev, Frame | FrameCorrupt) or ev.flags & FLAG_RESPONSE:
            continue  # discarded, or a stray response: never answered
        if isinstance(ev, Frame) and ev.opcode == Opcode.GOAWAY:
            peer_goaway = True  # (random tail bytes can make one) the server may close after it
            continue
        if peer_goaway:
            maybe.add(ev.request_id)
            continue
        answers[ev.request_id] += 1
        if (
            isinstance(ev, Frame)
            and ev.opcode in FUZZ_HANDLED
            and ev.request_id <= MAX_REQUEST_ID
        ):
            dispatched.append(ev.request_id)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=fuzz_stream())
def test_fuzz_every_well_formed_request_gets_exactly_one_answer(
    fuzz_server: ServerThread, data: bytes
) -> None:
    exp = expected(data)
    peer = RawPeer(fuzz_server.server.address)
    try:
        with contextlib.suppress(ConnectionError):
            peer.send(data)
            peer.half_close()
        frames = peer.read_to_eof()
    finally:
        peer.close()
    assert peer.eof, "the server did not close after the peer's half-close"
    got: Counter[int] = Counter(
        f.request_id for f in frames if f.flags & FLAG_RESPONSE and f.flags & FLAG_END
    )
    for rid, n in exp.answers.items():
        assert got[rid] == n, f"request id {rid}: {got[rid]} final answers, expected {n}"
    for rid in set(got) - set(exp.answers):
        assert rid in exp.maybe and got[rid] <= 1, f"unexpected answer on request id {rid}"
    goaways = [f for f in frames if f.opcode == Opcode.GOAWAY and not f.is_response]
    if not exp.goaway_known:
        assert len(goaways) <= 1
    elif exp.goaway_last is not None:
        assert len(goaways) == 1
        assert GoAway.decode(goaways[0].header).last_stream_id == exp.goaway_last
    else:
        assert goaways == []
    # the server survives: a fresh connection is served
    ping = RawPeer(fuzz_server.server.address)
    try:
        ping.send(encode_frame(Opcode.PING, 1, 0, b"", b"alive"))
        pong = ping.read_until(lambda fs: len(fs) == 1)
    finally:
        ping.close()
    assert pong and pong[0].flags == FLAGS_RESPONSE_END and bytes(pong[0].payload) == b"alive"
    assert fuzz_server.loop_errors == []
