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
why. Connections are counted in at accept (:mod:`sbpstream.net.admission`: global, per source,
unauthenticated); before it authenticates a connection gets small frames, small output, one
request at a time and a deadline; a TLS listener peeks at the first byte
(:mod:`sbpstream.net.tls_port`) to answer a plaintext SBP frame that TLS is required. Every
connection stops reading while its unsent output is past the high-water mark
(docs/security.md, "Pre-authentication limits").
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

from sbpstream.net.admission import Admission
from sbpstream.net.base import FrameProtocol
from sbpstream.net.tls_port import TlsAccept
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.frame import (
    FIXED_SIZE,
    FIXED_STRUCT,
    FLAG_END,
    FLAG_RESPONSE,
    FLAGS_RESPONSE_END,
    FLAGS_SYSTEM_ERROR,
    MAGIC,
    Buffer,
    Event,
    Frame,
    FrameCorrupt,
    FrameDiscarded,
    FramingError,
)
from sbpstream.protocol.limits import (
    DEFAULT_AUTH_DEADLINE_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_SOURCE,
    MAX_FRAME_LENGTH,
    MAX_IN_FLIGHT_REQUESTS,
    MAX_REQUEST_ID,
    MAX_UNAUTHENTICATED_CONNECTIONS,
    PREAUTH_MAX_FRAME_LENGTH,
    PREAUTH_WRITE_BUFFER_HIGH_WATER,
    PREAUTH_WRITE_BUFFER_LOW_WATER,
    WRITE_BUFFER_HIGH_WATER,
    WRITE_BUFFER_LOW_WATER,
)
from sbpstream.protocol.messages import GoAway, Status, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.server")

# Bytes of a frame beyond its extended header and payload: length prefix, fixed header, CRC.
_FRAME_OVERHEAD = 24

AUTHENTICATED_ATTRIBUTE: Final = "auth.claims"
"""The key of a connection's ``attributes`` that the gate sets once the connection has
authenticated (``sbpstream.auth.gate.CONN_CLAIMS``): the layer then lifts its pre-authentication
limits (docs/security.md, "Pre-authentication limits")."""

TLS_REQUIRED_MESSAGE: Final = (
    "this port requires TLS: set SBPSTREAM_TLS_CA / --tls-ca to the cluster's CA certificate"
)
"""The plaintext system error answering an SBP frame sent in plaintext to a TLS port."""

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
    connections_evicted: int = 0  # unauthenticated ones, for a newer one (all slots taken)
    auth_deadlines_expired: int = 0  # closed for not authenticating in time
    preauth_frames_refused: int = 0  # frames over PREAUTH_MAX_FRAME_LENGTH before auth
    plaintext_on_tls: int = 0  # SBP frames sent in plaintext to a TLS port (answered, closed)
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
        # Before authentication (auth on): smaller frames and output, a deadline, a cap
        self.source = ""  # the peer's IP address: per-source connection caps
        self.authenticated = server.gate is None
        if not self.authenticated:
            self.decoder.max_frame_length = min(PREAUTH_MAX_FRAME_LENGTH, self.max_frame_length)
        self._auth_timer: asyncio.TimerHandle | None = None
        self.admitted = False  # counted in by the server's Admission
        # A TLS listener peeks at the first byte before the handshake (tls_port): until the
        # connection has its transport, closing it cancels that; a plaintext SBP peer is
        # answered that TLS is required
        self.cancel_setup: Callable[[BaseException | None], None] | None = None
        self.plaintext_on_tls_port = False
        self._plain_head = b""

    def admit(self, peer: object) -> str:
        """Count this connection in (its peer's address), arming the authentication deadline;
        or say why it is refused."""
        s = self.server
        if not self.peer and isinstance(peer, tuple):  # before its transport (a TLS listener)
            self.peer = f"{peer[0]}:{peer[1]}"
        refusal = s.admission.admit(self, peer)
        if refusal:
            return refusal
        self.admitted = True
        if s.gate is not None or s.ssl_context is not None:
            # an unauthenticated connection (and a TLS handshake) has this long, then it goes
            self._auth_timer = asyncio.get_running_loop().call_later(
                s.auth_deadline_s, self._auth_deadline)
        return ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        s = self.server
        if not self.admitted:  # a plain listener (a TLS listener's TlsAccept admitted it)
            s.stats.connections_accepted += 1
            refusal = "server shutting down" if s.closing else \
                self.admit(transport.get_extra_info("peername"))
            if refusal:
                s.stats.connections_rejected += 1
                log.info("event=connection_refused peer=%s reason=%r", self.peer, refusal)
                self.send_goaway(ErrorCode.LIMIT_EXCEEDED, refusal)
                self.close()
                return
        self._set_water_marks()
        if self.authenticated and self._auth_timer is not None:  # TLS is up, auth is off
            self._auth_timer.cancel()
            self._auth_timer = None
        if not self.plaintext_on_tls_port:
            self._after_admission()

    def _after_admission(self) -> None:
        """The connection is admitted (and over TLS on a TLS listener): protected mode."""
        s = self.server
        if self.transport is not None and s.protected and not _is_loopback_peer(self.transport):
            s.stats.connections_rejected += 1
            log.warning("event=protected_mode_refused peer=%s", self.peer)
            self.send_goaway(ErrorCode.AUTHENTICATION_REQUIRED, PROTECTED_MODE_MESSAGE)
            self.close()

    @property
    def speaks_sbp(self) -> bool:
        """Frames written now reach the peer readable (not before or during a TLS handshake)."""
        return self.transport is not None and not self.plaintext_on_tls_port

    def _set_water_marks(self) -> None:
        if self.transport is None:
            return
        if self.authenticated:
            self.transport.set_write_buffer_limits(WRITE_BUFFER_HIGH_WATER,
                                                   WRITE_BUFFER_LOW_WATER)
        else:
            self.transport.set_write_buffer_limits(PREAUTH_WRITE_BUFFER_HIGH_WATER,
                                                   PREAUTH_WRITE_BUFFER_LOW_WATER)

    # ---- authentication (auth on): the gate's handler marks the connection, the layer notices
    def note_authenticated(self) -> None:
        """Lift the pre-authentication limits once the gate set the connection's claims."""
        if self.authenticated or AUTHENTICATED_ATTRIBUTE not in self.attributes:
            return
        self.authenticated = True
        self.server.admission.authenticated(self)
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        self.decoder.max_frame_length = self.max_frame_length
        self._set_water_marks()

    def _auth_deadline(self) -> None:
        self._auth_timer = None
        if self.closed:
            return
        if self.transport is None or self.plaintext_on_tls_port:
            log.info("event=tls_setup_expired peer=%s after_s=%.1f", self.peer,
                     self.server.auth_deadline_s)
            self.abort(TimeoutError("no TLS handshake within the authentication deadline"))
            return
        if self.authenticated or self.server.gate is None:
            return
        self.server.stats.auth_deadlines_expired += 1
        log.info("event=auth_deadline_expired peer=%s after_s=%.1f", self.peer,
                 self.server.auth_deadline_s)
        self.goaway_and_drain(
            ErrorCode.AUTHENTICATION_REQUIRED,
            f"not authenticated within {self.server.auth_deadline_s:g}s of connecting: send "
            "AUTHENTICATE first (SBPSTREAM_USER and SBPSTREAM_PASSWORD, or a token)")

    # ---- a TLS listener (tls_port.TlsAccept): before the connection has its transport
    def setup_failed(self, exc: BaseException) -> None:
        """The TLS handshake failed or was given up: the connection ends without a transport."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = exc
        self.closed_event.set()
        self.on_close(exc)

    def close(self) -> None:
        if self.transport is None and self.cancel_setup is not None:
            self.cancel_setup(None)
            return
        super().close()

    def abort(self, exc: BaseException | None = None) -> None:
        if self.transport is None and self.cancel_setup is not None:
            self.cancel_setup(exc)
            return
        super().abort(exc)

    def _plaintext_on_tls_port(self, data: bytes) -> None:
        """The first bytes on a TLS port were not a TLS record: answer an SBP frame's header
        with a plaintext system error saying TLS is required, then close."""
        self._plain_head += data
        head = self._plain_head
        if len(head) < FIXED_SIZE and (len(head) <= 4 or head[4] == MAGIC):
            return  # wait for the fixed header (bounded by the authentication deadline)
        self.input_broken = True
        assert self.transport is not None
        self.transport.pause_reading()
        if len(head) >= FIXED_SIZE and head[4] == MAGIC:
            _, _, opcode, _, request_id, _, _ = FIXED_STRUCT.unpack_from(head, 0)
            self.server.stats.plaintext_on_tls += 1
            log.info("event=plaintext_on_tls_port peer=%s", self.peer)
            self.send_system_error(opcode, request_id & MAX_REQUEST_ID,
                                   ErrorCode.INVALID_REQUEST, TLS_REQUIRED_MESSAGE)
        else:
            log.info("event=not_tls_on_tls_port peer=%s first_bytes=%r", self.peer, head[:8])
        self.close()

    def data_received(self, data: bytes) -> None:
        if self.plaintext_on_tls_port:
            self.bytes_in += len(data)
            if not self.input_broken:
                self._plaintext_on_tls_port(data)
            return
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.pause_reading("write_buffer")  # read nothing more while the peer does not read

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._read_pause_reasons:
            self.resume_reading("write_buffer")
            asyncio.get_running_loop().call_soon(self.process_events)  # frames held back

    def on_close(self, exc: BaseException) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        self.server.admission.release(self)
        self._close_handlers()

    def _close_handlers(self) -> None:
        if self._mute_timer is not None:
            self._mute_timer.cancel()
            self._mute_timer = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        for t in list(self.tasks.values()):
            t.cancel()

    def on_framing_error(self, exc: FramingError) -> None:
        # Nothing after the bad bytes can be trusted, but everything before them was: the
        # requests already dispatched are answered (GOAWAY's promise), then the connection closes.
        self.server.stats.framing_errors += 1
        self.pause_reading("broken")  # nothing after it is read: a refused body stays unread
        if not self.authenticated and str(exc).startswith("frame length "):  # frame.py's
            self.server.stats.preauth_frames_refused += 1
            log.info("event=preauth_frame_refused peer=%s error=%r", self.peer, str(exc))
            self.goaway_and_drain(
                ErrorCode.AUTHENTICATION_REQUIRED,
                f"{exc}: before authentication a frame may carry at most "
                f"{self.decoder.max_frame_length} bytes; send AUTHENTICATE first")
            return
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
        if not self.speaks_sbp:  # before or during a TLS handshake: nothing it could read
            return
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
            if not self.authenticated:
                self.note_authenticated()
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
        if self._write_paused:  # the peer does not read its answers: read nothing more
            return False
        if not self.authenticated and self.tasks:
            # one request at a time before auth (an AUTHENTICATE in flight): what follows it
            # is held to the limits that apply once it is answered
            return False
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
        auth_deadline_s: float = DEFAULT_AUTH_DEADLINE_S,
        max_connections_per_source: int = MAX_CONNECTIONS_PER_SOURCE,
        max_unauthenticated: int = MAX_UNAUTHENTICATED_CONNECTIONS,
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
        self.stats = ServerStats()
        self.auth_deadline_s = auth_deadline_s  # to authenticate (and finish a TLS handshake)
        # every open connection; caps per source and before authentication
        self.admission: Admission[ServerConnection] = Admission(
            self.stats, max_connections, max_connections_per_source, max_unauthenticated)
        self.connections = self.admission.connections
        self.connection_ids: int = 0  # the last connection id handed out
        self.started_mono = time.monotonic()
        self.closing = False
        self._server: asyncio.Server | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        # A TLS listener accepts plain TCP: each connection peeks at its first byte, then goes
        # on over TLS, or answers a plaintext SBP frame saying TLS is required (tls_port).
        factory: Callable[[], asyncio.Protocol] = (
            (lambda: ServerConnection(self)) if self.ssl_context is None
            else (lambda: TlsAccept(self, lambda: ServerConnection(self))))
        self._server = await loop.create_server(
            factory, host, port, reuse_address=True, backlog=1024)
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
