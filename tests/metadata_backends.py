"""The PM's two metadata stores behind one face, for tests that run the same checks on both:
SQLite in a file, and etcd (a real ``etcd`` process, one key prefix per test) holding the PM
leadership of its prefix. One copy for every test module."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final, Protocol

import pytest
from etcd_fixture import EtcdServer, require_etcd

from sbpstream.pm.etcd import EtcdMetadataStore
from sbpstream.pm.leader import LeaderElection
from sbpstream.pm.metadata import CreatedStream, MetadataStore, ReplicaMeta
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol.errors import SbpError

R1 = (ReplicaMeta(1, True),)
"""One replica, the primary, on node 1."""
LEADER_WAIT_S: Final = 15.0
"""Bound on winning the election of a fresh prefix (immediate on an idle etcd)."""
_prefixes = itertools.count(1)


class Backend(Protocol):
    store: MetadataStore

    async def reopen(self) -> MetadataStore: ...

    async def close(self) -> None: ...


class SqliteBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.store: MetadataStore = SqliteMetadataStore(path)

    async def open(self) -> None:
        await self.store.open()

    async def reopen(self) -> MetadataStore:
        await self.store.close()
        self.store = SqliteMetadataStore(self.path)
        await self.store.open()
        return self.store

    async def close(self) -> None:
        await self.store.close()


class EtcdBackend:
    """An etcd store that has won the election for its own prefix."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.etcd: EtcdMetadataStore = EtcdMetadataStore(url)
        self.store: MetadataStore = self.etcd
        self.election: LeaderElection | None = None

    async def open(self) -> None:
        await self.etcd.open()
        self.election = LeaderElection(self.etcd, "127.0.0.1:1")
        self.election.start()
        assert await self.election.wait_leader(LEADER_WAIT_S), "no leadership on a fresh prefix"

    async def reopen(self) -> MetadataStore:
        await self.close()
        self.etcd = EtcdMetadataStore(self.url)
        self.store = self.etcd
        await self.open()
        return self.store

    async def close(self) -> None:
        await self.etcd.flush_soft_state()
        if self.election is not None:
            await self.election.stop()
        await self.etcd.close()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    require_etcd()
    with EtcdServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "etcd"])
async def backend(request: Any, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each test that takes it runs twice: on SQLite, then on etcd (a fresh prefix)."""
    b: SqliteBackend | EtcdBackend
    if request.param == "sqlite":
        b = SqliteBackend(tmp_path / "pm.sqlite")
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        b = EtcdBackend(server.url(f"/backend{next(_prefixes)}"))
    await b.open()
    yield b
    await b.close()


def created(outcomes: list[CreatedStream | SbpError]) -> list[CreatedStream]:
    """The outcomes of ``create_streams``, each asserted a success."""
    out = []
    for o in outcomes:
        assert isinstance(o, CreatedStream), o
        out.append(o)
    return out
