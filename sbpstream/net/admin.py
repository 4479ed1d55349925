"""Prometheus metrics over HTTP for the servers (design.md section 7, introspection: first part).

``MetricsExporter`` serves ``GET /metrics`` in the Prometheus text format from a
``prometheus_client`` HTTP server thread. The figures live in event-loop objects (counters,
stores) that only the loop thread may touch safely, so the loop takes a **snapshot** every
``refresh_s`` (a plain list of samples) and the HTTP thread only ever reads the latest snapshot:
no locks, no cross-thread access to live state. A scrape is therefore at most ``refresh_s`` old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sbpstream.auth.config import TlsConfig
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.net.admin")

# How often the event loop refreshes the snapshot scrapes read (seconds): fresh enough for a
# 15 s scrape interval, cheap enough to never show up in a profile.
DEFAULT_REFRESH_S: Final = 1.0


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


class _SnapshotCollector:
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def collect(self) -> Iterator[Any]:
        samples = self.samples  # one reference read: the loop replaces the list, never mutates
        families: dict[str, Any] = {}
        for s in samples:
            fam = families.get(s.name)
            if fam is None:
                keys = sorted(s.labels)
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                fam = families[s.name] = cls(s.name, s.help, labels=keys)
            fam.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        yield from families.values()


class MetricsExporter:
    """``GET http://HOST:PORT/metrics``; ``port`` 0 picks a free port (see :attr:`port`)."""

    def __init__(self, collect: Collect, host: str = "127.0.0.1", port: int = 0,
                 refresh_s: float = DEFAULT_REFRESH_S, tls: TlsConfig | None = None) -> None:
        self._collect = collect
        self.tls = tls  # HTTPS when it has a certificate; client certificates per its CA
        self.host = host
        self._want_port = port
        self.port = 0
        self.refresh_s = refresh_s
        self._collector = _SnapshotCollector()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    def refresh(self) -> None:
        try:
            self._collector.samples = list(self._collect())
        except Exception:  # a broken figure must not stop the server or the other figures
            log.exception("event=metrics_collect_failed")

    async def start(self) -> None:
        self.refresh()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        tls = self.tls if self.tls is not None and self.tls.server_enabled else None
        self._server, self._thread = start_http_server(
            self._want_port, self.host, registry=registry,
            certfile=tls.cert if tls else None, keyfile=tls.key if tls else None,
            client_cafile=(tls.ca or None) if tls else None,
            client_auth_required=bool(tls and tls.require_client_cert))
        self.port = int(self._server.server_port)
        self._task = asyncio.get_running_loop().create_task(self._loop())
        log.info("event=metrics_listening host=%s port=%d path=/metrics", self.host, self.port)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(server.shutdown)
            server.server_close()


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
    for op, n in sorted(st.requests_by_opcode.items()):
        out.append(Sample(f"{prefix}_requests", "counter", "requests received, by opcode", n,
                          {"opcode": Opcode(op).name}))
    return out
