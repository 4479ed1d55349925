"""The admin HTTP port of the servers: Prometheus ``/metrics``, and whatever routes the owner adds
(the ``/v1/...`` JSON of :mod:`sbpstream.introspect` and, on the PM, the web console).

A small HTTP/1.1 server on the event loop itself (one request per connection, ``GET``/``HEAD``,
and ``POST`` with a body of at most :data:`MAX_REQUEST_BODY_BYTES` for the console's login; the
head bounded by :data:`MAX_REQUEST_HEAD_BYTES`, the whole exchange by :data:`REQUEST_TIMEOUT_S`):
the figures live in event-loop objects that only the loop may touch, so serving from the loop
needs no snapshot, lock or thread, and a route may await (the PM asks its data nodes for their
STATS). A scrape or route that fails answers 500 and never stops the server.

Who may ask is decided before any route runs: in protected mode (auth off, listening beyond
loopback: docs/security.md) a peer beyond loopback is refused with 403; then the ``gate`` (with
auth on: :mod:`sbpstream.auth.http`) authenticates the request, sets :attr:`HttpRequest.caller`
for the routes, or answers 401/403 itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sbpstream.net.server import PROTECTED_MODE_MESSAGE
from sbpstream.net.tls import TlsConfig
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.admin")

MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024
"""Request line plus headers: an admin GET needs a few hundred bytes; more is not a client of
ours, and an unbounded head would let one connection hold any amount of memory."""
REQUEST_TIMEOUT_S: Final = 10.0
"""Reading the head and answering one request: a stuck or slow client is dropped after this."""
MAX_REQUEST_BODY_BYTES: Final = 4096
"""A POST body (the console's login: a user name and a password as JSON, under 300 bytes):
bounded so that a request cannot make the server hold more than this."""

_REASONS: Final = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
                   404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
                   413: "Payload Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
                   503: "Service Unavailable"}
_METHODS: Final = ("GET", "HEAD", "POST")


@dataclass(frozen=True, slots=True)
class Sample:
    """One metric value. ``kind`` is ``"counter"`` (monotonic, name without ``_total``) or
    ``"gauge"``."""

    name: str
    kind: str
    help: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


Collect = Callable[[], list[Sample]]


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, obj: Any, status: int = 200,
             headers: tuple[tuple[str, str], ...] = ()) -> HttpResponse:
        return cls(status, "application/json", json.dumps(obj, separators=(",", ":")).encode(),
                   headers)


@dataclass(slots=True)
class HttpRequest:
    """One request: header names lower-cased; ``peer`` the client's address; ``tls`` whether it
    came over TLS; ``caller`` whoever the gate authenticated (None with auth off)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""
    peer: str = ""
    tls: bool = False
    caller: Any = None


Route = Callable[[HttpRequest], Awaitable[HttpResponse | None]]
"""``route(request)``: the answer, or None when the path is not this route's (404)."""
Gate = Callable[[HttpRequest], Awaitable[HttpResponse | None]]
"""Runs before every route (``/metrics`` too): a refusal (401, 403), or None to go on, having
set ``request.caller``."""


class BadRequest(ValueError):
    """A request this server does not take; ``status`` is the answer's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback_peer(peername: object) -> bool:
    """A peer only this machine can be: a loopback address, or a Unix socket (not a tuple)."""
    if not isinstance(peername, tuple):
        return True
    try:
        return ipaddress.ip_address(str(peername[0]).split("%")[0]).is_loopback
    except ValueError:
        return False


def protected_refusal(protected: bool, peername: object) -> HttpResponse | None:
    """Protected mode's answer to a peer beyond loopback (403 naming the flag), else None."""
    if not protected or is_loopback_peer(peername):
        return None
    return HttpResponse.json({"error": "forbidden", "reason": PROTECTED_MODE_MESSAGE}, 403)


class _Collector:
    def __init__(self, collect: Collect) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for s in self._collect():
            fam = families.get(s.name)
            if fam is None:
                keys = sorted(s.labels)
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                fam = families[s.name] = cls(s.name, s.help, labels=keys)
            fam.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        yield from families.values()


class MetricsExporter:
    """``GET http://HOST:PORT/metrics`` and the ``routes``; ``port`` 0 picks a free port (see
    :attr:`port`)."""

    def __init__(self, collect: Collect, host: str = "127.0.0.1", port: int = 0,
                 routes: list[Route] | None = None, tls: TlsConfig | None = None, *,
                 gate: Gate | None = None, protected: bool = False) -> None:
        self.tls = tls  # HTTPS when it has a certificate; client certificates per its CA
        self.gate = gate  # authentication and authorization (auth on); None: open
        self.protected = protected  # auth off beyond loopback: loopback peers only
        self.host = host
        self._want_port = port
        self.port = 0
        self.routes = list(routes or [])
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(collect))
        self._server: asyncio.Server | None = None
        self._tls_on = False

    async def start(self) -> None:
        from sbpstream.net.tls import server_context

        ctx = server_context(self.tls) if self.tls is not None else None
        self._server = await asyncio.start_server(self._serve, self.host, self._want_port,
                                                  reuse_address=True, ssl=ctx)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._tls_on = ctx is not None
        log.info("event=admin_listening host=%s port=%d paths=/metrics,/v1 tls=%s auth=%s "
                 "protected=%s", self.host, self.port, self._tls_on, self.gate is not None,
                 self.protected)

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                method = "GET"
                refused = protected_refusal(self.protected, peername)
                if refused is not None:
                    log.warning("event=admin_protected_mode_refused peer=%s", peername)
                    resp = refused
                else:
                    try:
                        req = await self._read_request(reader, peername)
                        method = req.method
                        resp = await self._answer(req)
                    except BadRequest as exc:
                        resp = HttpResponse.json({"error": str(exc)}, exc.status)
                writer.write(self._encode(resp, with_body=method != "HEAD"))
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader,
                            peername: object) -> HttpRequest:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise BadRequest(400, "request head too large") from None
        if len(raw) > MAX_REQUEST_HEAD_BYTES:
            raise BadRequest(400, "request head too large")
        lines = raw.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.partition(" ")[0]
        if not target.startswith("/"):
            raise BadRequest(400, "bad request")
        if method not in _METHODS:
            raise BadRequest(405, "only GET, HEAD and POST")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            name = name.strip().lower()
            if not sep or not name:
                raise BadRequest(400, f"bad header line {line[:40]!r}")
            if name in headers and name in ("authorization", "content-length"):
                raise BadRequest(400, f"{name} given twice")
            headers[name] = value.strip()
        body = b""
        if method == "POST":
            if "transfer-encoding" in headers:
                raise BadRequest(411, "send the body with a Content-Length")
            try:
                length = int(headers.get("content-length", ""))
            except ValueError:
                raise BadRequest(411, "POST needs a Content-Length") from None
            if not 0 <= length <= MAX_REQUEST_BODY_BYTES:
                raise BadRequest(413, f"a POST body is at most {MAX_REQUEST_BODY_BYTES} bytes")
            body = await reader.readexactly(length)
        url = urlsplit(target)
        host = str(peername[0]) if isinstance(peername, tuple) else "local"
        return HttpRequest(method, url.path, parse_qs(url.query), headers, body, host,
                           self._tls_on)

    async def _answer(self, req: HttpRequest) -> HttpResponse:
        try:
            if self.gate is not None:
                refused = await self.gate(req)
                if refused is not None:
                    return refused
            if req.path == "/metrics":
                if req.method == "POST":
                    return HttpResponse.json({"error": "POST /metrics: use GET"}, 405)
                return HttpResponse(200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
            for route in self.routes:
                got = await route(req)
                if got is not None:
                    return got
            return HttpResponse.json({"error": f"no such path: {req.path}"}, 404)
        except Exception as exc:  # a broken figure must not stop the server or the others
            log.exception("event=admin_request_failed path=%s", req.path)
            return HttpResponse.json({"error": f"{type(exc).__name__}: {exc}"}, 500)

    @staticmethod
    def _encode(resp: HttpResponse, *, with_body: bool) -> bytes:
        head = (f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Error')}\r\n"
                f"Content-Type: {resp.content_type}\r\n"
                f"Content-Length: {len(resp.body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in resp.headers) +
                "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                "Connection: close\r\n\r\n")
        return head.encode("latin-1") + (resp.body if with_body else b"")


def server_samples(prefix: str, server: Any) -> list[Sample]:
    """Connection-layer figures of a :class:`sbpstream.net.server.Server`."""
    st = server.stats
    out = [
        Sample(f"{prefix}_connections_open", "gauge", "open client connections",
               st.connections_open),
        Sample(f"{prefix}_connections_accepted", "counter", "connections accepted",
               st.connections_accepted),
        Sample(f"{prefix}_connections_rejected", "counter",
               "connections refused (limit or shutting down)", st.connections_rejected),
        Sample(f"{prefix}_requests_failed", "counter",
               "requests answered with a system error", st.requests_failed),
        Sample(f"{prefix}_frames_discarded", "counter", "frames dropped by the framing rules",
               st.frames_discarded_bad_magic, {"reason": "bad_magic"}),
        Sample(f"{prefix}_frames_discarded", "counter", "frames dropped by the framing rules",
               st.frames_discarded_unknown_opcode, {"reason": "unknown_opcode"}),
        Sample(f"{prefix}_frames_corrupt", "counter",
               "frames answered with a system error (CRC, header format)", st.frames_corrupt),
        Sample(f"{prefix}_framing_errors", "counter",
               "connections closed for a framing error", st.framing_errors),
    ]
    # only opcodes with a handler are counted, so every key is a known Opcode
    for op, c in sorted(st.by_opcode.items()):
        out.append(Sample(f"{prefix}_requests", "counter", "requests received, by opcode",
                          c.requests, {"opcode": Opcode(op).name}))
    return out
