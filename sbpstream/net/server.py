"""Server side of the one connection layer: accept, read, dispatch, respond, drain, close.

Each connection has one reader (the protocol's ``data_received``) and one task per request, so
requests run concurrently and responses go out as they complete, several frames per response
where a handler streams. The layer itself answers PING (same header and payload, flags 0x03),
honours GOAWAY, answers a known opcode with no handler with UNSUPPORTED_OPERATION, turns a CRC
mismatch or bad header format into a system error frame, discards and counts bad magic and
unknown opcodes.

Every request frame gets exactly one final answer while the connection lives: a request id with
the top bit set gets INVALID_REQUEST without being dispatched, and whatever a handler raises
(an :class:`SbpError` of any code, an answer that does not encode, any other exception) becomes a
system error frame on its request id. A connection drains the same way on every path (a framing
error, a GOAWAY either way, the idle timeout, server shutdown): GOAWAY with ``last_stream_id`` =
the highest request id it accepted, no new requests, the accepted ones answered, then close,
bounded by ``drain_timeout_s`` (``DEFAULT_DRAIN_TIMEOUT_S``). A peer's half-close (EOF) drains
too: what it sent before is answered (over TLS, which has no half-close, the connection closes).

Security (docs/security.md): a listener serves TLS when given an SSL context; a
:class:`ConnectionGate` (auth on) is asked about every request frame before dispatch and may
answer it with an error instead; protected mode refuses non-loopback peers with a GOAWAY saying
why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

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
    MAX_REQUEST_ID,
)
from sbpstream.protocol.messages import GoAway, Status, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.server")

# Bytes of a frame beyond its extended header and payload: length prefix, fixed header, CRC.
_FRAME_OVERHEAD = 24

# An error response that does not encode is replaced by INTERNAL_ERROR quoting this much of it.
_FALLBACK_MESSAGE_CHARS = 1000


@dataclass(slots=True)
class OpcodeCounters:
    """Totals of one opcode, kept on the request path as plain integer adds (INFO reads them)."""

    requests: int = 0
    bytes_in: int = 0  # request frames, whole (length prefix and CRC included)
    bytes_out: int = 0  # response frames, system error frames included
    errors: int = 0  # requests answered with a system error frame


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
    requests_bad_id: int = 0
    drains_expired: int = 0
    requests_refused: int = 0  # by the gate (auth): answered, never dispatched
    by_opcode: dict[int, OpcodeCounters] = field(default_factory=dict)
    """Only opcodes with a handler are counted, so every key is a known Opcode."""

    def opcode(self, op: int) -> OpcodeCounters:
        c = self.by_opcode.get(op)
        if c is None:
            c = self.by_opcode[op] = OpcodeCounters()
        return c


class Responder:
    """Sends the response frames of one request. The last frame carries END."""

    __slots__ = ("_conn", "counters", "finished", "frames_sent", "opcode", "request_id")

    def __init__(self, conn: ServerConnection, opcode: int, request_id: int,
                 counters: OpcodeCounters | None = None) -> None:
        self._conn = conn
        self.opcode = opcode
        self.request_id = request_id
        self.finished = False
        self.frames_sent = 0
        self.counters = counters if counters is not None else OpcodeCounters()

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
        self.counters.bytes_out += await self._conn.write_frame(
            self.opcode, self.request_id, flags, header, payload)
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
        self.counters.errors += 1
        self.counters.bytes_out += self._conn.send_system_error(
            self.opcode, self.request_id, code, message, detail)
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


class ConnectionGate(Protocol):
    """Who may send what on a connection (:mod:`sbpstream.auth.gate`): asked for every request
    frame the layer does not answer itself (PING, GOAWAY), before its handler runs."""

    def refuse(self, conn: ServerConnection, opcode: int) -> SbpError | None:
        """The error to answer with (nothing runs, nothing changes), or None to go on."""


PROTECTED_MODE_MESSAGE: Final = (
    "protected mode: this server listens beyond loopback with authentication off, so it "
    "serves loopback clients only; turn auth on (--auth), or allow remote clients without it "
    "(--allow-remote-unauthenticated)"
)


def _is_loopback_peer(transport: asyncio.BaseTransport) -> bool:
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple):
        return True  # a Unix socket: local by construction
    try:
        return ipaddress.ip_address(str(peer[0]).split("%")[0]).is_loopback
    except ValueError:
        return False


class ServerConnection(FrameProtocol):
    def __init__(self, server: Server) -> None:
        super().__init__(server.max_frame_length)
        self.server = server
        server.connection_ids += 1
        self.connection_id = server.connection_ids  # CONNECTIONS / WHOAMI: unique per server
        self.connected_at_ms = int(time.time() * 1000)
        self.connected_mono = time.monotonic()
        self.requests = 0  # requests dispatched on this connection
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.draining = False
        self.last_activity = time.monotonic()
        self.highest_request_id = 0  # highest request id dispatched: GOAWAY's last_stream_id
        self.input_ended = False  # the peer half-closed: answer what it sent, then close
        self._drain_timer: asyncio.TimerHandle | None = None
        self.attributes: dict[str, object] = {}  # per-connection state for handlers (e.g. role)
        # Quotas (issue 22): the client id the peer declared (HEARTBEAT), and the KIP-219 mute.
        self.client_id = ""
        self._mute_timer: asyncio.TimerHandle | None = None
        self._muted_until = 0.0
        # set when draining starts (GOAWAY either way, half-close): requests that would otherwise
        # run until the peer cancels them (subscriptions) end then, so the drain can finish
        self.drain_events: set[asyncio.Event] = set()

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
        if s.protected and not _is_loopback_peer(transport):
            s.stats.connections_rejected += 1
            log.warning("event=protected_mode_refused peer=%s", self.peer)
            self.send_goaway(ErrorCode.AUTHENTICATION_REQUIRED, PROTECTED_MODE_MESSAGE)
            self.close()
            return
        s.connections.add(self)
        s.stats.connections_open = len(s.connections)

    def on_close(self, exc: BaseException) -> None:
        if self._mute_timer is not None:
            self._mute_timer.cancel()
            self._mute_timer = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        for t in list(self.tasks.values()):
            t.cancel()
        self.server.connections.discard(self)
        self.server.stats.connections_open = len(self.server.connections)

    def on_framing_error(self, exc: FramingError) -> None:
        # Nothing after the bad bytes can be trusted, but everything before them was: the
        # requests already dispatched are answered (GOAWAY's promise), then the connection closes.
        self.server.stats.framing_errors += 1
        log.warning(
            "event=framing_error peer=%s error=%r in_flight=%d last_request_id=%d",
            self.peer,
            str(exc),
            len(self.tasks),
            self.highest_request_id,
        )
        self.goaway_and_drain(ErrorCode.INVALID_REQUEST, f"framing error: {exc}")

    def eof_received(self) -> bool:
        # A half-close: the peer sends nothing more but may still read. Answer what it sent
        # (frames held back at the in-flight cap included), then close.
        self.input_ended = True
        self._arm_drain_timer()
        self._maybe_finish_drain()
        # keep the transport open for writing; TLS has no half-close (asyncio closes it)
        return self.server.ssl_context is None

    def send_goaway(self, code: int, message: str) -> None:
        hdr = GoAway(code=code, message=message, last_stream_id=self.highest_request_id).encode()
        with contextlib.suppress(ConnectionError):
            self.write_frame_nowait(Opcode.GOAWAY, 0, 0, hdr)

    def send_system_error(
        self, opcode: int, request_id: int, code: int, message: str, detail: bytes = b""
    ) -> int:
        """Answer ``request_id`` with a system error frame; returns the bytes written. Never
        raises: an error that does not encode (a code outside int16, a frame past the length
        limit) is answered as INTERNAL_ERROR instead, and a closed connection has nobody left
        to answer (0 bytes)."""
        try:
            hdr = SystemErrorResponse(
                status=Status(code=code, message=message, detail=detail)
            ).encode()
            return self.write_frame_nowait(opcode, request_id, FLAGS_SYSTEM_ERROR, hdr)
        except ConnectionError:
            return 0
        except Exception as exc:
            log.warning(
                "event=error_response_unencodable peer=%s request_id=%d code=%d error=%r",
                self.peer,
                request_id,
                code,
                str(exc),
            )
        fallback = f"error {code} did not encode: {message[:_FALLBACK_MESSAGE_CHARS]}"
        hdr = SystemErrorResponse(
            status=Status(code=ErrorCode.INTERNAL_ERROR, message=fallback)
        ).encode()
        try:
            return self.write_frame_nowait(opcode, request_id, FLAGS_SYSTEM_ERROR, hdr)
        except ConnectionError:
            return 0

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
        if frame.request_id > MAX_REQUEST_ID and op != Opcode.GOAWAY:
            # not dispatched: its answer would echo an id no request may carry
            self.server.stats.requests_bad_id += 1
            self.send_system_error(
                op,
                frame.request_id,
                ErrorCode.INVALID_REQUEST,
                f"request id 0x{frame.request_id:08x} has the top bit set",
            )
            return
        if op == Opcode.PING:
            with contextlib.suppress(ConnectionError):
                self.write_frame_nowait(
                    op, frame.request_id, FLAGS_RESPONSE_END, frame.header, frame.payload
                )
            return
        if op == Opcode.GOAWAY:
            # the peer sends nothing more: answer what it sent, then close
            self.draining = True
            self._arm_drain_timer()
            self._maybe_finish_drain()
            return
        if self.draining:
            self.send_system_error(
                op, frame.request_id, ErrorCode.SHUTTING_DOWN, "connection is draining after GOAWAY"
            )
            return
        gate = self.server.gate
        if gate is not None:
            refusal = gate.refuse(self, op)
            if refusal is not None:
                self.server.stats.requests_refused += 1
                self.send_system_error(op, frame.request_id, refusal.code, refusal.message)
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
        self.requests += 1
        counters = stats.opcode(op)
        counters.requests += 1
        # the whole frame: length prefix, fixed and extended headers, payload, CRC
        counters.bytes_in += _FRAME_OVERHEAD + len(frame.header) + len(frame.payload)
        req = Request(
            op, frame.request_id, frame.flags, frame.header, frame.payload, self, time.monotonic()
        )
        task = asyncio.get_running_loop().create_task(self._run(handler, req, counters))
        self.tasks[frame.request_id] = task
        if len(self.tasks) >= self.server.max_in_flight:
            self.pause_reading("in_flight")

    async def _run(self, handler: Handler, req: Request, counters: OpcodeCounters) -> None:
        resp = Responder(self, req.opcode, req.request_id, counters)
        try:
            await handler(req, resp)
            if not resp.finished and not self.closed:
                raise RuntimeError(f"handler for {Opcode(req.opcode).name} sent no final frame")
        except asyncio.CancelledError:
            self._answer_failure(resp, ErrorCode.SHUTTING_DOWN, "request cancelled")
            raise
        except SbpError as exc:
            # any code, client-side ones included: a handler's own call to another node failed
            # that way, and the caller is told so (errors.py)
            self.server.stats.requests_failed += 1
            self._answer_failure(resp, exc.code, exc.message, exc.detail)
        except Exception as exc:
            if not (self.closed and isinstance(exc, ConnectionError)):  # else nobody to answer
                self.server.stats.requests_failed += 1
                log.exception(
                    "event=handler_error opcode=%s request_id=%d peer=%s",
                    Opcode(req.opcode).name,
                    req.request_id,
                    self.peer,
                )
                self._answer_failure(resp, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(req.request_id, None)
            self.last_activity = time.monotonic()
            if len(self.tasks) < self.server.max_in_flight and self.reading_paused:
                self.process_events()  # frames held back while at the cap
                if len(self.tasks) < self.server.max_in_flight:
                    self.resume_reading("in_flight")
            self._maybe_finish_drain()

    def _answer_failure(
        self, resp: Responder, code: int, message: str, detail: bytes = b""
    ) -> None:
        """End a failed request's response with a system error, unless it already ended."""
        if resp.finished or self.closed:
            return
        resp.finished = True
        resp.counters.errors += 1
        resp.counters.bytes_out += self.send_system_error(
            resp.opcode, resp.request_id, code, message, detail)

    def can_accept_event(self) -> bool:
        return len(self.tasks) < self.server.max_in_flight and self._mute_timer is None

    # ---- quotas: KIP-219 muting
    def mute(self, duration_ms: int) -> None:
        """Read nothing more from this connection for ``duration_ms`` (a client over its quota:
        its response went or goes out at once). Frames already buffered wait too; a longer mute
        extends a shorter one."""
        if duration_ms <= 0 or self.closed:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + duration_ms / 1000.0
        if until <= self._muted_until:
            return
        self._muted_until = until
        if self._mute_timer is not None:
            self._mute_timer.cancel()
        self._mute_timer = loop.call_at(until, self._unmute)
        self.pause_reading("throttle")

    @property
    def muted(self) -> bool:
        return self._mute_timer is not None

    def _unmute(self) -> None:
        self._mute_timer = None
        self._muted_until = 0.0
        if self.closed:
            return
        self.resume_reading("throttle")
        self.process_events()  # frames held back while muted (this re-pauses at the cap)

    def _maybe_finish_drain(self) -> None:
        # frames held back at the in-flight cap are dispatched as tasks finish (``_run``), so no
        # tasks left means nothing accepted is unanswered
        if (self.draining or self.input_ended) and not self.tasks and not self.closed:
            self.close()

    def _arm_drain_timer(self) -> None:
        for ev in self.drain_events:
            ev.set()
        if self._drain_timer is None and not self.closed:
            loop = asyncio.get_running_loop()
            self._drain_timer = loop.call_later(self.server.drain_timeout_s, self._drain_expired)

    def _drain_expired(self) -> None:
        self._drain_timer = None
        if self.closed:
            return
        self.server.stats.drains_expired += 1
        log.warning(
            "event=drain_expired peer=%s unanswered=%d after_s=%.1f",
            self.peer,
            len(self.tasks),
            self.server.drain_timeout_s,
        )
        self.abort(TimeoutError(f"drain not done within {self.server.drain_timeout_s}s"))

    def goaway_and_drain(self, code: int, message: str) -> None:
        """Send GOAWAY, accept no new requests, close once in-flight requests finish (bounded)."""
        if self.closed:
            return
        self.send_goaway(code, message)
        self.draining = True
        self._arm_drain_timer()
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
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
        gate: ConnectionGate | None = None,
        protected: bool = False,
    ) -> None:
        self.handlers = dict(handlers)
        self.ssl_context = ssl_context  # TLS on the listener when set
        self.gate = gate  # authentication and authorization when set
        self.protected = protected  # refuse non-loopback peers (protected mode)
        self.name = name
        self.max_frame_length = max_frame_length
        self.max_in_flight = max_in_flight
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.drain_timeout_s = drain_timeout_s  # bound of every connection's drain
        self.connections: set[ServerConnection] = set()
        self.connection_ids = 0  # the last connection id handed out
        self.stats = ServerStats()
        self.started_mono = time.monotonic()
        self.closing = False
        self._server: asyncio.Server | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ServerConnection(self), host, port, reuse_address=True, backlog=1024,
            ssl=self.ssl_context,
        )
        sock = self._server.sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self._idle_task = loop.create_task(self._idle_loop())
        log.info("event=listening server=%s host=%s port=%d tls=%s auth=%s protected=%s",
                 self.name, self.host, self.port, self.ssl_context is not None,
                 self.gate is not None, self.protected)

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

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """GOAWAY every connection, let in-flight requests finish (bounded), then close."""
        if drain_timeout_s is None:
            drain_timeout_s = self.drain_timeout_s
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


__all__ = [
    "FLAG_END", "ConnectionGate", "Handler", "OpcodeCounters", "Request", "Responder", "Server",
    "ServerConnection", "ServerStats",
]
