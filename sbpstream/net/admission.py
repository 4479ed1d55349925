"""Which accepted connections a server keeps: the global cap, the cap per peer address, and the
cap on connections that have not authenticated (docs/security.md, "Pre-authentication limits").

A connection is counted in when accepted (before any TLS handshake, so a peer cannot hold
uncounted handshakes) and out when it closes. Unauthenticated connections (auth on) are kept
oldest first: when every unauthenticated slot (or every slot) is taken, a new connection evicts
the oldest unauthenticated one instead of being refused, so an attacker holding idle
connections cannot keep a legitimate client from logging in; authenticated connections are never
evicted, and ``MAX_UNAUTHENTICATED_CONNECTIONS`` < ``MAX_CONNECTIONS`` leaves them room.
"""

from __future__ import annotations

import logging
import time
from typing import Generic, Protocol, TypeVar

from sbpstream.protocol.errors import ErrorCode

log = logging.getLogger("sbpstream.net.server")

EVICTED_MESSAGE = (
    "too many unauthenticated connections: the oldest is closed; authenticate right after "
    "connecting"
)


class AdmittedConnection(Protocol):
    """What admission needs of a connection (``net.server.AdmittedConnection`` is one)."""

    source: str

    @property
    def authenticated(self) -> bool: ...

    @property
    def peer(self) -> str: ...

    @property
    def connected_mono(self) -> float: ...

    @property
    def speaks_sbp(self) -> bool: ...

    def send_goaway(self, code: int, message: str) -> None: ...

    def abort(self, exc: BaseException) -> None: ...


class AdmissionStats(Protocol):
    """The counters admission keeps (``net.server.ServerStats`` has them)."""

    connections_open: int
    connections_evicted: int


C = TypeVar("C", bound=AdmittedConnection)


class Admission(Generic[C]):
    """The open connections of one server, counted per source and before authentication."""

    def __init__(self, stats: AdmissionStats, max_connections: int, max_per_source: int,
                 max_unauthenticated: int) -> None:
        self.stats = stats
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self.max_unauthenticated = min(max_unauthenticated, max_connections)
        self.connections: set[C] = set()
        # not yet authenticated (auth on), oldest first: the first is evicted to make room
        self.unauthenticated: dict[C, None] = {}
        self.per_source: dict[str, int] = {}  # open connections by peer IP address

    def admit(self, conn: C, peer: object) -> str:
        """Count a newly accepted connection in, or say why not ("" when admitted)."""
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.per_source.get(source, 0) >= self.max_per_source:
            return f"too many connections from {source} (at most {self.max_per_source} each)"
        unauth = not conn.authenticated
        while len(self.connections) >= self.max_connections or (
                unauth and len(self.unauthenticated) >= self.max_unauthenticated):
            if not self.unauthenticated:
                return f"too many connections (at most {self.max_connections})"
            self._evict(next(iter(self.unauthenticated)))
        conn.source = source
        self.per_source[source] = self.per_source.get(source, 0) + 1
        self.connections.add(conn)
        if unauth:
            self.unauthenticated[conn] = None
        self.stats.connections_open = len(self.connections)
        return ""

    def authenticated(self, conn: C) -> None:
        self.unauthenticated.pop(conn, None)

    def _evict(self, conn: C) -> None:
        self.stats.connections_evicted += 1
        log.info("event=unauthenticated_evicted peer=%s age_s=%.1f", conn.peer,
                 time.monotonic() - conn.connected_mono)
        if conn.speaks_sbp:  # not while a TLS handshake is under way: it could not read it
            conn.send_goaway(ErrorCode.AUTHENTICATION_REQUIRED, EVICTED_MESSAGE)
        self.release(conn)
        conn.abort(ConnectionAbortedError(EVICTED_MESSAGE))

    def release(self, conn: C) -> None:
        """Count a closing connection out (idempotent)."""
        self.unauthenticated.pop(conn, None)
        if conn in self.connections:
            self.connections.discard(conn)
            n = self.per_source.get(conn.source, 0) - 1
            if n > 0:
                self.per_source[conn.source] = n
            else:
                self.per_source.pop(conn.source, None)
        self.stats.connections_open = len(self.connections)
