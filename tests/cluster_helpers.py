"""Helpers shared by the multi-process tests (no test module imports another)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import pytest
from waiting import eventually

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster, Node
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.net.tls import TlsConfig, client_context
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse, Range
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import iter_all_records

SECURE_ADMIN: Final = ("admin", "admin-pw")
"""The administrator :func:`secure_cluster` bootstraps (user, password)."""
CLIENT_RETRY_DEADLINE_MS: Final = 20_000
"""How long a secure test client retries (a loaded machine: slow TLS handshakes, elections)."""


def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Development certificates (CA, server, client, token secret) in a fresh directory."""
    d: Path = tmp_path_factory.mktemp("certs")
    init_dev_certs(d)
    return d


@contextmanager
def secure_cluster(directory: Path, certs: Path, **kwargs: Any) -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` with TLS and authentication from ``certs``, its administrator
    (:data:`SECURE_ADMIN`) bootstrapped; stopped on exit."""
    with LocalCluster(directory, secure=certs, **kwargs) as c:
        asyncio.run(bootstrap_admin(c.pm_address, certs, *SECURE_ADMIN))
        yield c


def secure_client(cluster: LocalCluster, certs: Path, user: str = SECURE_ADMIN[0],
                  password: str = SECURE_ADMIN[1], **kwargs: Any) -> AsyncClient:
    """An SDK client of a secure cluster, logging in as ``user`` (the administrator unless
    told); ``kwargs`` go to :class:`AsyncClient`."""
    kwargs.setdefault("retry_deadline_ms", CLIENT_RETRY_DEADLINE_MS)
    return AsyncClient(cluster.pm_address, user=user, password=password,
                       tls_ca=str(certs / CA_FILE), **kwargs)


async def tls_connection(address: str, certs: Path) -> Connection:
    """A TLS connection to ``address`` that has not authenticated."""
    return await Connection.open(address, ssl_context=client_context(TlsConfig(
        ca=str(certs / CA_FILE))))


def node_at(cluster: LocalCluster, address: str) -> Node:
    return next(dn for dn in cluster.datanodes if dn.address == address)


async def read_range(address: str, rng: Range) -> list[bytes]:
    """Every record value of a sealed range, read straight from one replica."""
    conn = await Connection.open(address)
    out: list[bytes] = []
    offset = rng.start_offset
    try:
        while offset < rng.end_offset:
            req = FetchRequest(max_wait_ms=0, min_bytes=1, items=(FetchItem(
                stream_id=rng.stream_id, request_index=0, fetch_offset=offset,
                batch_max_bytes=1 << 20, range_index=rng.range_index),))
            frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=10)
            got = 0
            for f in frames:
                for item in FetchResponse.decode(f.header).items:
                    if item.status.code:
                        raise item.status.error()
                for r in iter_all_records(bytes(f.payload), start_offset=offset):
                    if r.offset >= rng.end_offset:
                        break
                    assert r.offset == offset, f"gap or reorder at {offset} on {address}"
                    out.append(bytes(r.value or b""))
                    offset += 1
                    got += 1
            assert got, f"replica {address} returned nothing at {offset} < {rng.end_offset}"
    finally:
        await conn.aclose()
    return out


class PmProcess:
    """A PM in its own process on a SQLite file under ``tmp``, its log in ``tmp/pm.log``."""

    def __init__(self, tmp: Path, heartbeat_ms: int = 100, node_timeout_ms: int = 600,
                 start_timeout_s: float = 20.0) -> None:
        self.heartbeat_ms = heartbeat_ms
        self.node_timeout_ms = node_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.db = tmp / "meta" / "pm.sqlite"
        self.log = tmp / "pm.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        started_before = self._log_text().count("event=pm_started")
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sbpstream.pm", "--port", str(self.port),
                 "--metadata", f"sqlite:{self.db}",
                 "--heartbeat-interval-ms", str(self.heartbeat_ms),
                 "--node-timeout-ms", str(self.node_timeout_ms)],
                stdout=subprocess.DEVNULL, stderr=logf,
            )
        proc = self.proc

        def started() -> bool:
            assert proc.poll() is None, f"PM exited:\n{self._log_text()}"
            return self._log_text().count("event=pm_started") > started_before

        eventually(started, timeout=self.start_timeout_s, interval=0.02, what="the PM started")

    def _log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
