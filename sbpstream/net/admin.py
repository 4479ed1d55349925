"""The admin HTTP port of the servers: Prometheus ``/metrics``, and whatever routes the owner adds
(the ``/v1/...`` JSON of :mod:`sbpstream.introspect` and, on the PM, the web console).

A small HTTP/1.1 server on the event loop itself (one request per connection, ``GET``/``HEAD``
only, request head bounded by :data:`MAX_REQUEST_HEAD_BYTES` and :data:`REQUEST_TIMEOUT_S`): the
figures live in event-loop objects that only the loop may touch, so serving from the loop needs
no snapshot, lock or thread, and a route may await (the PM asks its data nodes for their STATS).
A scrape or route that fails answers 500 and never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sbpstream.auth.config import TlsConfig
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.admin")

MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024
"""Request line plus headers: an admin GET needs a few hundred bytes; more is not a client of
ours, and an unbounded head would let one connection hold any amount of memory."""
REQUEST_TIMEOUT_S: Final = 10.0
"""Reading the head and answering one request: a stuck or slow client is dropped after this."""

_REASONS: Final = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                   413: "Payload Too Large", 500: "Internal Server Error", 502: "Bad Gateway"}


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

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> HttpResponse:
        return cls(status, "application/json", json.dumps(obj, separators=(",", ":")).encode())


Route = Callable[[str, dict[str, list[str]]], Awaitable[HttpResponse | None]]
"""``route(path, query)``: the answer, or None when the path is not this route's (404)."""


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
                 routes: list[Route] | None = None, tls: TlsConfig | None = None) -> None:
        self.tls = tls  # HTTPS when it has a certificate; client certificates per its CA
        self.host = host
        self._want_port = port
        self.port = 0
        self.routes = list(routes or [])
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(collect))
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        from sbpstream.auth.tls import server_context

        ctx = server_context(self.tls) if self.tls is not None else None
        self._server = await asyncio.start_server(self._serve, self.host, self._want_port,
                                                  reuse_address=True, ssl=ctx)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("event=admin_listening host=%s port=%d paths=/metrics,/v1 tls=%s", self.host,
                 self.port, ctx is not None)

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await self._read_head(reader)
                method, _, rest = head.partition(" ")
                target = rest.partition(" ")[0]
                if not target.startswith("/"):
                    resp = HttpResponse.json({"error": "bad request"}, 400)
                elif method not in ("GET", "HEAD"):
                    resp = HttpResponse.json({"error": "only GET and HEAD"}, 405)
                else:
                    resp = await self._answer(target)
                writer.write(self._encode(resp, with_body=method != "HEAD"))
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> str:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return ""
        if len(raw) > MAX_REQUEST_HEAD_BYTES:
            return ""
        return raw.split(b"\r\n", 1)[0].decode("latin-1")

    async def _answer(self, target: str) -> HttpResponse:
        url = urlsplit(target)
        try:
            if url.path == "/metrics":
                return HttpResponse(200, CONTENT_TYPE_LATEST, generate_latest(self._registry))
            query = parse_qs(url.query)
            for route in self.routes:
                got = await route(url.path, query)
                if got is not None:
                    return got
            return HttpResponse.json({"error": f"no such path: {url.path}"}, 404)
        except Exception as exc:  # a broken figure must not stop the server or the others
            log.exception("event=admin_request_failed path=%s", url.path)
            return HttpResponse.json({"error": f"{type(exc).__name__}: {exc}"}, 500)

    @staticmethod
    def _encode(resp: HttpResponse, *, with_body: bool) -> bytes:
        head = (f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Error')}\r\n"
                f"Content-Type: {resp.content_type}\r\n"
                f"Content-Length: {len(resp.body)}\r\n"
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
