"""Server side of the one connection layer: accept, read, dispatch, respond, drain, close.

Each connection has one reader (the protocol's ``data_received``) and one task per request, so
requests run concurrently and responses go out as they complete, several frames per response
where a handler streams. The layer itself answers PING (same header and payload, flags 0x03),
honours GOAWAY, answers a known opcode with no handler with UNSUPPORTED_OPERATION, turns a CRC
mismatch or bad header format into a system error frame, discards and counts bad magic and
unknown opcodes, and on a framing error sends GOAWAY and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sbpstream.net.base import FrameProtocol
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.frame import (
    FLAG_END,
    FLAG_RESPONSE,
    FLAGS_RESPONSE_END,
    FLAGS_SYSTEM_ERROR,
    Buffer,
    Event,
    Frame,
    FrameCorrupt,
    FrameDiscarded,
    FramingError,
)
from sbpstream.protocol.limits import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_FRAME_LENGTH,
    MAX_IN_FLIGHT_REQUESTS,
)
from sbpstream.protocol.messages import GoAway, Status, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.server")


@dataclass(slots=True)
class ServerStats:
    connections_accepted: int = 0
    connections_open: int = 0
    connections_rejected: int = 0
    requests: int = 0
    requests_failed: int = 0
    frames_discarded_bad_magic: int = 0
    frames_discarded_unknown_opcode: int = 0
    frames_corrupt: int = 0
    framing_errors: int = 0
    requests_by_opcode: dict[int, int] = field(default_factory=dict)


class Responder:
    """Sends the response frames of one request. The last frame carries END."""

    __slots__ = ("_conn", "finished", "frames_sent", "opcode", "request_id")

    def __init__(self, conn: ServerConnection, opcode: int, request_id: int) -> None:
        self._conn = conn
        self.opcode = opcode
        self.request_id = request_id
        self.finished = False
        self.frames_sent = 0

    @property
    def closed(self) -> bool:
        return self._conn.closed

    async def send(
        self, header: Buffer = b"", payload: Buffer | Sequence[Buffer] = b"", *, end: bool = True
    ) -> None:
        """Send one response frame; ``end=False`` for all but the last frame of a stream."""
        if self.finished:
            raise RuntimeError("response already ended")
        flags = FLAGS_RESPONSE_END if end else FLAG_RESPONSE
        size = len(header) + (
            len(payload)
            if isinstance(payload, bytes | bytearray | memoryview)
            else sum(len(p) for p in payload)
        )
        await self._conn.window.acquire(size)
        await self._conn.write_frame(self.opcode, self.request_id, flags, header, payload)
        self.frames_sent += 1
        if end:
            self.finished = True
        else:
            # Writing does not suspend while the peer keeps up, so a handler streaming many
            # frames (a node's whole LIST_RANGES, a big FETCH) would hold the event loop for its
            # whole answer; yield once per frame so heartbeats and other requests go on.
            await asyncio.sleep(0)

    async def send_error(self, code: int, message: str, detail: bytes = b"") -> None:
        """A system error frame (flags 0x07): ends the response."""
        if self.finished:
            raise RuntimeError("response already ended")
        self.finished = True
        self._conn.send_system_error(self.opcode, self.request_id, code, message, detail)
        await self._conn.drain()


@dataclass(slots=True)
class Request:
    opcode: int
    request_id: int
    flags: int
    header: Buffer
    payload: Buffer
    conn: ServerConnection
    received_at: float


Handler = Callable[[Request, Responder], Awaitable[None]]


class ServerConnection(FrameProtocol):
    def __init__(self, server: Server) -> None:
        super().__init__(server.max_frame_length)
        self.server = server
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.draining = False
        self.last_activity = time.monotonic()
        self.highest_request_id = 0
        self.attributes: dict[str, object] = {}  # per-connection state for handlers (e.g. role)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        s = self.server
        s.stats.connections_accepted += 1
        if len(s.connections) >= s.max_connections or s.closing:
            s.stats.connections_rejected += 1
            self.send_goaway(
                ErrorCode.LIMIT_EXCEEDED,
                "too many connections" if not s.closing else "server shutting down",
            )
            self.close()
            return
        s.connections.add(self)
        s.stats.connections_open = len(s.connections)

    def on_close(self, exc: BaseException) -> None:
        for t in list(self.tasks.values()):
            t.cancel()
        self.server.connections.discard(self)
        self.server.stats.connections_open = len(self.server.connections)

    def on_framing_error(self, exc: FramingError) -> None:
        self.server.stats.framing_errors += 1
        log.warning("event=framing_error peer=%s error=%r", self.peer, str(exc))
        with contextlib.suppress(Exception):
            self.send_goaway(ErrorCode.INVALID_REQUEST, f"framing error: {exc}")
        self.closed = True  # stop processing anything else from this peer
        self.close()

    def send_goaway(self, code: int, message: str) -> None:
        hdr = GoAway(code=code, message=message, last_stream_id=self.highest_request_id).encode()
        with contextlib.suppress(ConnectionError):
            self.write_frame_nowait(Opcode.GOAWAY, 0, 0, hdr)

    def send_system_error(
        self, opcode: int, request_id: int, code: int, message: str, detail: bytes = b""
    ) -> None:
        hdr = SystemErrorResponse(status=Status(code=code, message=message, detail=detail)).encode()
        with contextlib.suppress(ConnectionError):
            self.write_frame_nowait(opcode, request_id, FLAGS_SYSTEM_ERROR, hdr)

    def on_event(self, ev: Event) -> None:
        self.last_activity = time.monotonic()
        stats = self.server.stats
        if isinstance(ev, FrameDiscarded):
            if ev.reason == "bad_magic":
                stats.frames_discarded_bad_magic += 1
            else:
                stats.frames_discarded_unknown_opcode += 1
            log.debug(
                "event=frame_discarded peer=%s reason=%s opcode=0x%04x",
                self.peer,
                ev.reason,
                ev.opcode,
            )
            return
        if isinstance(ev, FrameCorrupt):
            stats.frames_corrupt += 1
            if not ev.flags & FLAG_RESPONSE:
                code = (
                    ErrorCode.CHECKSUM_MISMATCH
                    if ev.reason == "crc_mismatch"
                    else (ErrorCode.BAD_HEADER)
                )
                self.send_system_error(ev.opcode, ev.request_id, code, ev.detail)
            return
        self._on_frame(ev)

    def _on_frame(self, frame: Frame) -> None:
        op = frame.opcode
        if frame.is_response:
            # servers send no requests except PING; a stray response is ignored
            return
        if op == Opcode.PING:
            with contextlib.suppress(ConnectionError):
                self.write_frame_nowait(
                    op, frame.request_id, FLAGS_RESPONSE_END, frame.header, frame.payload
                )
            return
        if op == Opcode.GOAWAY:
            self.draining = True
            self._maybe_finish_drain()
            return
        if self.draining:
            self.send_system_error(
                op, frame.request_id, ErrorCode.SHUTTING_DOWN, "connection is draining after GOAWAY"
            )
            return
        handler = self.server.handlers.get(op)
        if handler is None:
            self.send_system_error(
                op,
                frame.request_id,
                ErrorCode.UNSUPPORTED_OPERATION,
                f"{self.server.name} does not serve {Opcode(op).name}",
            )
            return
        if frame.request_id in self.tasks:
            self.send_system_error(
                op,
                frame.request_id,
                ErrorCode.INVALID_REQUEST,
                f"request id {frame.request_id} already has a request in flight",
            )
            return
        self.highest_request_id = max(self.highest_request_id, frame.request_id)
        stats = self.server.stats
        stats.requests += 1
        stats.requests_by_opcode[op] = stats.requests_by_opcode.get(op, 0) + 1
        req = Request(
            op, frame.request_id, frame.flags, frame.header, frame.payload, self, time.monotonic()
        )
        task = asyncio.get_running_loop().create_task(self._run(handler, req))
        self.tasks[frame.request_id] = task
        if len(self.tasks) >= self.server.max_in_flight:
            self.pause_reading("in_flight")

    async def _run(self, handler: Handler, req: Request) -> None:
        resp = Responder(self, req.opcode, req.request_id)
        try:
            await handler(req, resp)
            if not resp.finished and not self.closed:
                raise RuntimeError(f"handler for {Opcode(req.opcode).name} sent no final frame")
        except asyncio.CancelledError:
            if not resp.finished and not self.closed:
                self.send_system_error(
                    req.opcode, req.request_id, ErrorCode.SHUTTING_DOWN, "request cancelled"
                )
            raise
        except SbpError as exc:
            self.server.stats.requests_failed += 1
            if not resp.finished and not self.closed:
                self.send_system_error(
                    req.opcode, req.request_id, exc.code, exc.message, exc.detail
                )
        except ConnectionError:
            pass
        except Exception as exc:
            self.server.stats.requests_failed += 1
            log.exception(
                "event=handler_error opcode=%s peer=%s", Opcode(req.opcode).name, self.peer
            )
            if not resp.finished and not self.closed:
                self.send_system_error(
                    req.opcode,
                    req.request_id,
                    ErrorCode.INTERNAL_ERROR,
                    f"{type(exc).__name__}: {exc}",
                )
        finally:
            self.tasks.pop(req.request_id, None)
            self.last_activity = time.monotonic()
            if len(self.tasks) < self.server.max_in_flight and self.reading_paused:
                self.process_events()  # frames held back while at the cap
                if len(self.tasks) < self.server.max_in_flight:
                    self.resume_reading("in_flight")
            self._maybe_finish_drain()

    def can_accept_event(self) -> bool:
        return len(self.tasks) < self.server.max_in_flight

    def _maybe_finish_drain(self) -> None:
        if self.draining and not self.tasks and not self.closed:
            self.close()

    def goaway_and_drain(self, code: int, message: str) -> None:
        """Send GOAWAY, accept no new requests, close once in-flight requests finish."""
        if self.closed:
            return
        self.send_goaway(code, message)
        self.draining = True
        self._maybe_finish_drain()


class Server:
    """An SBP server: ``handlers`` maps each served opcode to ``async handler(req, resp)``."""

    def __init__(
        self,
        handlers: Mapping[int, Handler],
        *,
        name: str = "sbpstream",
        max_frame_length: int = MAX_FRAME_LENGTH,
        max_in_flight: int = MAX_IN_FLIGHT_REQUESTS,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.handlers = dict(handlers)
        self.name = name
        self.max_frame_length = max_frame_length
        self.max_in_flight = max_in_flight
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[ServerConnection] = set()
        self.stats = ServerStats()
        self.closing = False
        self._server: asyncio.Server | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ServerConnection(self), host, port, reuse_address=True, backlog=1024
        )
        sock = self._server.sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self._idle_task = loop.create_task(self._idle_loop())
        log.info("event=listening server=%s host=%s port=%d", self.name, self.host, self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _idle_loop(self) -> None:
        interval = max(0.05, min(self.idle_timeout_s / 4, 5.0))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for c in list(self.connections):
                if not c.tasks and now - c.last_activity > self.idle_timeout_s:
                    log.info("event=idle_close peer=%s", c.peer)
                    c.goaway_and_drain(ErrorCode.TIMEOUT, "idle timeout")

    async def close(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """GOAWAY every connection, let in-flight requests finish (bounded), then close."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
        conns = list(self.connections)
        for c in conns:
            c.goaway_and_drain(ErrorCode.SHUTTING_DOWN, "server shutting down")
        if conns:
            waits = [asyncio.ensure_future(c.closed_event.wait()) for c in conns]
            _, pending = await asyncio.wait(waits, timeout=drain_timeout_s)
            for w in pending:
                w.cancel()
            for c in conns:
                if not c.closed:
                    c.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


__all__ = ["FLAG_END", "Handler", "Request", "Responder", "Server", "ServerConnection"]
