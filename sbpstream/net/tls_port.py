"""Accepting on a TLS listener: look at the first byte before the handshake.

A TLS client starts with a handshake record (first byte 0x16); an SBP client that was not told
to use TLS starts with a frame (first byte 0, the high byte of its length). The listener accepts
plain TCP; :class:`TlsAccept` counts the connection in (admission), waits without reading for
its first byte (a peek), then hands the socket to the event loop over TLS, as a TLS listener
would (``connect_accepted_socket`` with the server's context), or, for anything else, in
plaintext, so that the connection can answer an SBP frame with a system error saying TLS is
required (``ServerConnection``'s plaintext state) and close.

The socket is taken from the accepting transport (a duplicate of its descriptor) before that
transport reads anything, so nothing the peer sent is lost; the peek and the hand-over cost one
``dup`` and one ``recv(MSG_PEEK)`` per connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import Final, Protocol, cast

log = logging.getLogger("sbpstream.net.server")

TLS_HANDSHAKE_RECORD: Final = 0x16
"""The first byte of a TLS handshake record (a ClientHello)."""


class PendingConnection(Protocol):
    """What the hand-over needs of the connection it sets up (``net.server.ServerConnection``);
    it is the asyncio protocol the TLS (or plaintext) transport is given."""

    plaintext_on_tls_port: bool
    cancel_setup: Callable[[BaseException | None], None] | None

    @property
    def peer(self) -> str: ...

    def admit(self, peer: object) -> str: ...

    def setup_failed(self, exc: BaseException) -> None: ...


class ListenerStats(Protocol):
    connections_accepted: int
    connections_rejected: int


class TlsListener(Protocol):
    """What the hand-over needs of its server (``net.server.Server``)."""

    @property
    def stats(self) -> ListenerStats: ...

    @property
    def closing(self) -> bool: ...

    @property
    def ssl_context(self) -> ssl.SSLContext | None: ...

    @property
    def auth_deadline_s(self) -> float: ...


class TlsAccept(asyncio.Protocol):
    """The protocol of a TLS listener's accepted TCP transport: takes its socket over at once.
    ``new_connection`` makes the server's connection object for it."""

    def __init__(self, server: TlsListener,
                 new_connection: Callable[[], PendingConnection]) -> None:
        self.server = server
        self.new_connection = new_connection
        self.conn: PendingConnection | None = None
        self.sock: socket.socket | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's does not subclass it
        s = self.server
        s.stats.connections_accepted += 1
        conn = self.new_connection()
        peer = transport.get_extra_info("peername")
        refusal = "server shutting down" if s.closing else conn.admit(peer)
        if refusal:
            # a TLS client could not read a plaintext GOAWAY, and a handshake is what a full
            # server cannot afford: the peer sees the connection reset
            s.stats.connections_rejected += 1
            log.info("event=connection_refused peer=%s reason=%r", peer, refusal)
            transport.abort()
            return
        fd = transport.get_extra_info("socket").fileno()
        self.sock = socket.socket(fileno=os.dup(fd))  # the same connection, its own descriptor
        self.sock.setblocking(False)
        transport.abort()  # closes its descriptor only, before it read anything
        self.conn = conn
        conn.cancel_setup = self.cancel
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._peek)

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # the accepting transport: its socket lives on in ``self.sock``

    def _stop_peeking(self) -> socket.socket | None:
        sock, self.sock = self.sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
        return sock

    def _peek(self) -> None:
        assert self.sock is not None and self.conn is not None
        try:
            first = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.cancel(exc)
            return
        if not first:
            self.cancel(ConnectionResetError("closed before sending anything"))
            return
        sock = self._stop_peeking()
        assert sock is not None
        tls = first[0] == TLS_HANDSHAKE_RECORD
        self.task = asyncio.get_running_loop().create_task(self._hand_over(sock, tls))

    async def _hand_over(self, sock: socket.socket, tls: bool) -> None:
        conn = self.conn
        assert conn is not None
        conn.plaintext_on_tls_port = not tls
        ctx = self.server.ssl_context if tls else None
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: cast(asyncio.BaseProtocol, conn), sock, ssl=ctx,
                ssl_handshake_timeout=self.server.auth_deadline_s if tls else None)
        except (OSError, asyncio.CancelledError, TimeoutError) as exc:
            # a failed handshake, or cancelled (deadline, eviction, shutdown): the socket is the
            # loop's transport's from the call on, and that transport closes it
            log.info("event=tls_handshake_failed peer=%s error=%r", conn.peer, str(exc))
            conn.setup_failed(exc if isinstance(exc, Exception) else TimeoutError(str(exc)))

    def cancel(self, exc: BaseException | None = None) -> None:
        """Give up before the connection has its transport (deadline, eviction, shutdown)."""
        sock = self._stop_peeking()
        if sock is not None:
            sock.close()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the handshake: ``_hand_over`` reports it
            return
        if self.conn is not None:
            self.conn.setup_failed(exc or ConnectionAbortedError("closed before TLS was set up"))
