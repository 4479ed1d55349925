"""The draining mark and node removal in both metadata stores (pm/drain.py keeps its state
there): durable across a reopen, refused twice, forgotten by remove_node; an SQLite file of
schema version 3 (before drains) gains the column."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from metadata_backends import Backend, backend, etcd_server

from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.pm.sqlite_schema import SCHEMA_VERSION
from sbpstream.protocol.errors import DataNodeNotFoundError, InvalidRequestError

__all__ = ["backend", "etcd_server"]  # pytest fixtures


async def test_draining_mark_survives_reopen_and_refuses_twice(backend: Backend) -> None:
    s = backend.store
    a = await s.allocate_node_id("host-a", 1)
    b = await s.allocate_node_id("host-b", 1)
    got = await s.set_node_draining(a, True)
    assert got.draining and got.node_id == a
    with pytest.raises(InvalidRequestError, match="already draining"):
        await s.set_node_draining(a, True)
    with pytest.raises(InvalidRequestError, match="is not draining"):
        await s.set_node_draining(b, False)
    with pytest.raises(DataNodeNotFoundError, match="unknown"):
        await s.set_node_draining(99, True)
    s = await backend.reopen()
    nodes = {n.node_id: n for n in await s.list_nodes()}
    assert nodes[a].draining and not nodes[b].draining
    await s.set_node_draining(a, False)
    s = await backend.reopen()
    assert not any(n.draining for n in await s.list_nodes())


async def test_remove_node_forgets_it_for_good(backend: Backend) -> None:
    s = backend.store
    a = await s.allocate_node_id("host-a", 1)
    b = await s.allocate_node_id("host-b", 1)
    assert await s.remove_node(a)
    s = await backend.reopen()
    assert [n.node_id for n in await s.list_nodes()] == [b]
    assert await s.get_node(a) is None
    c = await s.allocate_node_id("host-a", 2)
    assert c not in (a, b)  # an id is never handed out again


async def test_schema_3_file_gains_the_draining_column(tmp_path: Path) -> None:
    path = tmp_path / "pm.sqlite"
    store = SqliteMetadataStore(path)
    await store.open()
    nid = await store.allocate_node_id("host-a", 1000)
    await store.close()
    db = sqlite3.connect(path)  # as schema 3 wrote it: no draining column
    db.execute("ALTER TABLE data_nodes DROP COLUMN draining")
    db.execute("UPDATE meta SET value = 3 WHERE key = 'schema_version'")
    db.commit()
    db.close()
    store = SqliteMetadataStore(path)
    await store.open()
    try:
        (n,) = await store.list_nodes()
        assert n.node_id == nid and n.host == "host-a" and not n.draining
        assert (await store.set_node_draining(nid, True)).draining
    finally:
        await store.close()
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            SCHEMA_VERSION,)
        assert db.execute("SELECT draining FROM data_nodes").fetchall() == [(1,)]
    finally:
        db.close()
