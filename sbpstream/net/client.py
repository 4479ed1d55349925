"""Client side of the one connection layer: multiplexed requests over one TCP connection.

Requests are keyed by the frame's request id; the reader delivers each response frame to its
request, so responses may interleave and arrive out of order. A request's response may be one frame
(:meth:`Connection.request`) or many (:meth:`Connection.stream`). When the connection dies every
pending request fails at once with :class:`~sbpstream.protocol.errors.ConnectionClosedError`.
A GOAWAY from the server fails the pending requests above its ``last_stream_id`` at once with
:class:`~sbpstream.protocol.errors.ShuttingDownError` (retriable: the server never saw them); those
at or below it still get their answers, bounded by ``DEFAULT_DRAIN_TIMEOUT_S``, then the
connection closes. A framing error from the server fails every pending request (nothing more can be
read), sends GOAWAY and closes.
Frames not yet consumed count against ``MAX_BUFFERED_RESPONSE_BYTES``; past it the client stops
reading the socket. :class:`ConnectionPool` keeps one connection per address and reconnects on
demand. A connection may run over TLS (the server verified against a CA) and be authenticated by
an :class:`Authenticator` when opened; the pool has it authenticate again once due (token
renewal, docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from sbpstream.net.base import FrameProtocol
from sbpstream.net.retry import clip_timeout
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    AuthenticationRequiredError,
    BadHeaderError,
    ClientTimeoutError,
    ConnectionClosedError,
    ErrorCode,
    LimitExceededError,
    SbpError,
    ShuttingDownError,
    error_for,
)
from sbpstream.protocol.frame import (
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
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    MAX_BUFFERED_RESPONSE_BYTES,
    MAX_FRAME_LENGTH,
    MAX_IN_FLIGHT_REQUESTS,
    MAX_REQUEST_ID,
)
from sbpstream.protocol.messages import GoAway, Status, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.client")


def parse_address(addr: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) to a tuple; raises ValueError with a clear message."""
    addr = addr.strip()
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"bad address {addr!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


NOT_TLS_REASONS: Final = frozenset({
    "WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
    "HTTP_REQUEST", "UNEXPECTED_RECORD", "RECORD_TOO_LARGE", "TLSV1_ALERT_PROTOCOL_VERSION",
})
"""OpenSSL's reasons for a handshake that got bytes which are not TLS (an SBP frame, a GOAWAY
from a plaintext port): the port is not a TLS port, and retrying cannot help."""

CLOSE_WAIT_S: Final = 2.0
"""How long closing a connection waits for the socket to close (its buffered bytes sent); then
the socket is aborted: a stopped peer that takes nothing must not hold a client's close. The
pool closes its connections together, so a client's close waits this long at most."""

CREDENTIALS_HINT: Final = (
    "set SBPSTREAM_USER and SBPSTREAM_PASSWORD (or --user/--password, or SBPSTREAM_TOKEN_FILE)"
)
"""The fix named when a server with auth on answers a client that has no credentials."""


def _expire(waiter: asyncio.Future[None]) -> None:
    """A response waiter's timer: the wait is over (raised as TimeoutError in the waiter)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def system_error_from(frame: Frame) -> SbpError:
    try:
        st = SystemErrorResponse.decode(frame.header).status
    except SbpError:
        return error_for(ErrorCode.UNKNOWN, "undecodable system error frame")
    return error_for(st.code, st.message, st.detail)


class Authenticator(Protocol):
    """Authenticates a freshly opened connection, and again before its token expires
    (:mod:`sbpstream.auth.client`). The net layer only calls it."""

    async def authenticate(self, conn: Connection) -> None: ...

    def due(self, conn: Connection) -> bool:
        """True when ``conn`` must authenticate again before its next request."""


@dataclass(slots=True)
class _Pending:
    queue: deque[Frame]
    waiter: asyncio.Future[None] | None
    error: BaseException | None
    done: bool
    buffered: int


class ResponseStream:
    """Async iterator over the frames of one response; stops after the END frame.

    A system error frame raises the matching :class:`SbpError`. Leaving the iteration early
    (``aclose`` or ``async with``) forgets the request; later frames for it are dropped.
    """

    def __init__(self, conn: Connection, request_id: int, timeout_s: float | None) -> None:
        self._conn = conn
        self.request_id = request_id
        self._timeout_s = timeout_s
        self._finished = False

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> Frame:
        if self._finished:
            raise StopAsyncIteration
        frame = await self._conn._next_frame(self.request_id, self._timeout_s)
        if frame.is_end:
            self._finished = True
            self._conn._forget(self.request_id)
        if frame.is_system_error:
            self._finished = True
            raise self._conn.system_error(frame)
        return frame

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._conn._forget(self.request_id)

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Connection(FrameProtocol):
    """One multiplexed client connection. Create with :meth:`open`."""

    def __init__(
        self,
        address: str,
        max_frame_length: int = MAX_FRAME_LENGTH,
        max_in_flight: int = MAX_IN_FLIGHT_REQUESTS,
    ) -> None:
        super().__init__(max_frame_length)
        self.address = address
        self.max_in_flight = max_in_flight
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._buffered = 0
        self.goaway: GoAway | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self.auth_renew_at_ms = 0  # when this connection must authenticate again (0: never)
        self.has_credentials = False  # opened with an authenticator

    @classmethod
    async def open(
        cls,
        address: str,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_frame_length: int = MAX_FRAME_LENGTH,
        ssl_context: ssl.SSLContext | None = None,
        authenticator: Authenticator | None = None,
    ) -> Connection:
        """Connect (over TLS when ``ssl_context`` is given: the server's certificate is verified
        against its CA and its name), then authenticate when ``authenticator`` is given."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: cls(address, max_frame_length), host, port, ssl=ssl_context,
                    server_hostname=host if ssl_context is not None else None,
                ),
                connect_timeout_s,
            )
        except ssl.SSLCertVerificationError as exc:
            # not retriable: the server is not who the CA vouches for (or the CA is wrong)
            raise AuthenticationFailedError(
                f"TLS: {address} failed certificate verification: {exc.verify_message}"
            ) from exc
        except ssl.SSLError as exc:
            if exc.reason not in NOT_TLS_REASONS:
                raise ConnectionClosedError(f"TLS handshake with {address} failed: {exc}") from exc
            # not retriable: the server answered in plaintext, so it is not a TLS port
            raise AuthenticationFailedError(
                f"TLS: {address} does not speak TLS (its answer is not TLS: {exc.reason}): "
                "connect without SBPSTREAM_TLS_CA / --tls-ca, or turn TLS on at the server"
            ) from exc
        except (OSError, TimeoutError) as exc:
            raise ConnectionClosedError(f"cannot connect to {address}: {exc}") from exc
        if authenticator is not None:
            proto.has_credentials = True
            try:
                await authenticator.authenticate(proto)
            except BaseException:
                proto.abort()
                raise
        return proto

    def system_error(self, frame: Frame) -> SbpError:
        """The error a system error frame on this connection raises: AUTHENTICATION_REQUIRED
        on a connection without credentials names them."""
        err = system_error_from(frame)
        if err.code == ErrorCode.AUTHENTICATION_REQUIRED and not self.has_credentials:
            return AuthenticationRequiredError(
                f"{self.address} requires authentication ({err.message}): {CREDENTIALS_HINT}")
        return err

    def _goaway_error(self) -> SbpError:
        """What a request fails with once the server sent GOAWAY and will not see it."""
        g = self.goaway
        message = g.message if g is not None else ""
        if g is not None and g.code == ErrorCode.AUTHENTICATION_REQUIRED:
            # not retriable: a new connection gets the same answer (protected mode, no login)
            if not self.has_credentials and CREDENTIALS_HINT not in message and \
                    "protected mode" not in message:
                message = f"{message}: {CREDENTIALS_HINT}"
            return AuthenticationRequiredError(f"{self.address} sent GOAWAY: {message}")
        return ShuttingDownError(f"{self.address} sent GOAWAY: {message}")

    @property
    def usable(self) -> bool:
        return not self.closed and self.goaway is None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # ---- reading
    def on_event(self, ev: Event) -> None:
        if isinstance(ev, FrameDiscarded):
            log.debug("event=frame_discarded peer=%s reason=%s", self.peer, ev.reason)
            return
        if isinstance(ev, FrameCorrupt):
            # a corrupt response frame: its request cannot be completed correctly
            p = self._pending.get(ev.request_id)
            if p is not None and ev.flags & 0x01:
                self._fail(ev.request_id, BadHeaderError(f"corrupt response frame: {ev.detail}"))
            elif not ev.flags & 0x01:
                self._send_system_error(
                    ev.opcode, ev.request_id, ErrorCode.CHECKSUM_MISMATCH, ev.detail
                )
            return
        if not ev.is_response:
            self._on_request(ev)
            return
        p = self._pending.get(ev.request_id)
        if p is None or p.done:
            return  # a response to a forgotten request
        size = len(ev.header) + len(ev.payload)
        p.queue.append(ev)
        p.buffered += size
        self._buffered += size
        if ev.is_end:
            p.done = True
        if self._buffered > MAX_BUFFERED_RESPONSE_BYTES:
            self.pause_reading("buffered")
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(None)

    def _on_request(self, frame: Frame) -> None:
        if frame.request_id > MAX_REQUEST_ID and frame.opcode != Opcode.GOAWAY:
            self._send_system_error(
                frame.opcode,
                frame.request_id,
                ErrorCode.INVALID_REQUEST,
                f"request id 0x{frame.request_id:08x} has the top bit set",
            )
        elif frame.opcode == Opcode.PING:
            with contextlib.suppress(ConnectionError):
                self.write_frame_nowait(
                    Opcode.PING, frame.request_id, FLAGS_RESPONSE_END, frame.header, frame.payload
                )
        elif frame.opcode == Opcode.GOAWAY:
            try:
                self.goaway = GoAway.decode(frame.header)
            except SbpError:
                self.goaway = GoAway()
            log.info(
                "event=goaway_received peer=%s code=%d message=%r",
                self.peer,
                self.goaway.code,
                self.goaway.message,
            )
            last = self.goaway.last_stream_id
            for rid in [r for r in self._pending if r > last]:
                # the server never saw it: safe to retry, even an APPEND
                self._fail(rid, self._goaway_error())
            if not self._pending:
                self.close()
            elif self._drain_timer is None:
                self._drain_timer = asyncio.get_running_loop().call_later(
                    DEFAULT_DRAIN_TIMEOUT_S, self._drain_expired
                )
        else:
            self._send_system_error(
                frame.opcode,
                frame.request_id,
                ErrorCode.UNSUPPORTED_OPERATION,
                "clients serve only PING",
            )

    def _send_system_error(self, opcode: int, request_id: int, code: int, message: str) -> None:
        hdr = SystemErrorResponse(status=Status(code=code, message=message)).encode()
        with contextlib.suppress(ConnectionError, ValueError):
            self.write_frame_nowait(opcode, request_id, FLAGS_SYSTEM_ERROR, hdr)

    def _drain_expired(self) -> None:
        self._drain_timer = None
        if not self.closed:
            log.warning("event=drain_expired peer=%s unanswered=%d", self.peer, len(self._pending))
            self.abort(TimeoutError(f"no answer within {DEFAULT_DRAIN_TIMEOUT_S}s of GOAWAY"))

    def on_framing_error(self, exc: FramingError) -> None:
        # No response can be read any more: every pending request fails (the server may have
        # served it: ConnectionClosedError, as for any lost connection). The server is told, and
        # the connection closes once the GOAWAY is written.
        log.warning("event=framing_error peer=%s error=%r", self.peer, str(exc))
        self.close_reason = exc
        err = ConnectionClosedError(f"framing error from {self.address}: {exc}")
        for rid in list(self._pending):
            self._fail(rid, err)
        hdr = GoAway(
            code=ErrorCode.INVALID_REQUEST, message=f"framing error: {exc}", last_stream_id=0
        ).encode()
        with contextlib.suppress(ConnectionError):
            self.write_frame_nowait(Opcode.GOAWAY, 0, 0, hdr)
        self.close()

    def on_close(self, exc: BaseException) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        err = ConnectionClosedError(f"connection to {self.address} closed: {exc}")
        for rid in list(self._pending):
            self._fail(rid, err)

    def _fail(self, request_id: int, exc: BaseException) -> None:
        p = self._pending.get(request_id)
        if p is None:
            return
        if p.error is None and not p.done:
            p.error = exc
            p.done = True
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(None)

    def _forget(self, request_id: int) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        self._release(p.buffered)
        p.buffered = 0
        self._slots.release()
        if self.goaway is not None and not self._pending:
            self.close()

    def _release(self, nbytes: int) -> None:
        self._buffered -= nbytes
        if self._buffered <= MAX_BUFFERED_RESPONSE_BYTES // 2:
            self.resume_reading("buffered")

    async def _next_frame(self, request_id: int, timeout_s: float | None) -> Frame:
        p = self._pending.get(request_id)
        if p is None:
            raise ConnectionClosedError("request is no longer pending")
        while not p.queue:
            if p.error is not None:
                self._forget(request_id)
                raise p.error
            if p.done:
                self._forget(request_id)
                raise ConnectionClosedError("response ended without an END frame")
            loop = asyncio.get_running_loop()
            p.waiter = waiter = loop.create_future()
            wait_s = clip_timeout(timeout_s)  # the call's deadline bounds every wait (issue 33)
            # one timer that fails the waiter itself, not wait_for's second future and
            # callback hop (a response is one loop pass sooner; issue 34)
            timer = None if wait_s is None else loop.call_later(wait_s, _expire, waiter)
            try:
                await waiter
            except TimeoutError:
                self._forget(request_id)
                raise ClientTimeoutError(
                    f"no response from {self.address} within {wait_s:.3f}s"
                ) from None
            except asyncio.CancelledError:
                self._forget(request_id)
                raise
            finally:
                p.waiter = None
                if timer is not None:
                    timer.cancel()
        frame = p.queue.popleft()
        size = len(frame.header) + len(frame.payload)
        p.buffered -= size
        self._release(size)
        return frame

    # ---- writing
    def _next_request_id(self) -> int:
        for _ in range(MAX_IN_FLIGHT_REQUESTS + 2):
            rid = next(self._ids)
            if rid > MAX_REQUEST_ID:
                self._ids = itertools.count(1)
                rid = next(self._ids)
            if rid not in self._pending:
                return rid
        raise LimitExceededError("no free request id")

    async def _start(self, opcode: int, header: Buffer, payload: Buffer | Sequence[Buffer]) -> int:
        if self.closed:
            raise ConnectionClosedError(f"connection to {self.address} is closed")
        if self.goaway is not None:
            raise self._goaway_error()
        # the call's deadline (issue 33) bounds the wait for a request slot and for the peer to
        # take what was written before (a stopped peer's full socket)
        # (no timer when nothing is waited for: a free slot, a socket taking data; issue 34)
        if self._slots.locked():
            try:
                async with asyncio.timeout(clip_timeout(None)):
                    await self._slots.acquire()
            except TimeoutError:
                raise ClientTimeoutError(
                    f"no request slot on the connection to {self.address} by the call's "
                    "deadline") from None
        else:
            await self._slots.acquire()  # free: returns at once
        rid = self._next_request_id()
        self._pending[rid] = _Pending(deque(), None, None, False, 0)
        try:
            if self._write_paused:
                async with asyncio.timeout(clip_timeout(None)):
                    await self.write_frame(opcode, rid, 0, header, payload)
            else:
                self.write_frame_nowait(opcode, rid, 0, header, payload)
        except TimeoutError:
            self._forget(rid)
            raise ClientTimeoutError(
                f"{self.address} took no data by the call's deadline") from None
        except (ConnectionError, ValueError) as exc:
            self._forget(rid)
            if isinstance(exc, ValueError):
                raise LimitExceededError(str(exc)) from exc
            raise ConnectionClosedError(f"connection to {self.address} closed: {exc}") from exc
        except BaseException:
            self._forget(rid)
            raise
        return rid

    async def stream(
        self,
        opcode: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
        *,
        timeout_s: float | None = None,
    ) -> ResponseStream:
        """Send a request; iterate its response frames. ``timeout_s`` bounds each frame's wait."""
        rid = await self._start(opcode, header, payload)
        return ResponseStream(self, rid, timeout_s)

    async def request(
        self,
        opcode: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
        *,
        timeout_s: float | None = None,
    ) -> list[Frame]:
        """Send a request and collect every frame of its response (the last one has END)."""
        rs = await self.stream(opcode, header, payload, timeout_s=timeout_s)
        return [f async for f in rs]

    async def request_one(
        self,
        opcode: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
        *,
        timeout_s: float | None = None,
    ) -> Frame:
        """A request whose response is one frame: returns it."""
        frames = await self.request(opcode, header, payload, timeout_s=timeout_s)
        return frames[-1]

    async def ping(self, payload: bytes = b"", timeout_s: float | None = 5.0) -> Frame:
        return await self.request_one(Opcode.PING, b"", payload, timeout_s=timeout_s)

    async def send_goaway(self, code: int = 0, message: str = "") -> None:
        """Tell the server we send nothing more; pending requests still complete."""
        hdr = GoAway(code=code, message=message, last_stream_id=0).encode()
        await self.write_frame(Opcode.GOAWAY, 0, 0, hdr)

    async def aclose(self) -> None:
        self.close()
        try:
            await asyncio.wait_for(self.closed_event.wait(), CLOSE_WAIT_S)
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()  # the peer takes nothing: drop what is buffered
        except Exception:  # closing: nothing left to report to
            pass


class ConnectionPool:
    """One connection per address, opened on first use and reopened when it dies or GOAWAYs."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_frame_length: int = MAX_FRAME_LENGTH,
        ssl_context: ssl.SSLContext | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self._conns: dict[str, Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_length = max_frame_length
        self.ssl_context = ssl_context
        self.authenticator = authenticator
        self._closed = False

    async def get(self, address: str) -> Connection:
        if self._closed:
            raise ConnectionClosedError("connection pool is closed")
        c = self._conns.get(address)
        auth = self.authenticator
        if c is not None and c.usable and (auth is None or not auth.due(c)):
            return c
        lock = self._locks.setdefault(address, asyncio.Lock())
        # the call's deadline (issue 33) bounds the wait for another caller's connect, the
        # connect itself, the TLS handshake and the authentication
        try:
            async with asyncio.timeout(clip_timeout(None)):
                await lock.acquire()
        except TimeoutError:
            raise ClientTimeoutError(
                f"no connection to {address} by the call's deadline") from None
        try:
            c = self._conns.get(address)
            if c is not None and c.usable:
                if auth is None or not auth.due(c):
                    return c
                await auth.authenticate(c)  # renew on the same connection, before expiry
                return c
            connect_s = clip_timeout(self.connect_timeout_s)
            assert connect_s is not None
            c = await Connection.open(
                address,
                connect_timeout_s=connect_s,
                max_frame_length=self.max_frame_length,
                ssl_context=self.ssl_context,
                authenticator=auth,
            )
            self._conns[address] = c
            return c
        finally:
            lock.release()

    def discard(self, address: str) -> None:
        c = self._conns.pop(address, None)
        if c is not None:
            c.close()

    async def close(self) -> None:
        self._closed = True
        conns = list(self._conns.values())
        self._conns.clear()
        await asyncio.gather(*(c.aclose() for c in conns))  # CLOSE_WAIT_S at most in all


__all__ = [
    "Authenticator", "Connection", "ConnectionPool", "ResponseStream", "parse_address",
    "system_error_from",
]
