"""Committed offsets in the PM's metadata: the same behaviour on SQLite and etcd (the
conformance suite's ``backend`` fixture), durable across a reopen."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from metadata_backends import R1, Backend, backend, created, etcd_server
from test_pm_etcd_conformance import delete1

from sbpstream.pm.metadata import NewStream, OffsetMeta
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol.errors import (
    InvalidRequestError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

__all__ = ["backend", "etcd_server"]  # pytest fixtures, re-exported


async def test_commit_fetch_forget_and_reopen(backend: Backend) -> None:
    store = backend.store
    sids = [c.stream.stream_id for c in created(
        await store.create_streams([NewStream(1, 0, R1) for _ in range(3)], 1))]
    outs = await store.commit_offsets(
        [OffsetMeta("g1", sids[0], 10, "m"), OffsetMeta("g1", sids[1], 0),
         OffsetMeta("g1", 999, 5), OffsetMeta("g1", sids[2], -7),
         OffsetMeta("bad/name", sids[0], 1), OffsetMeta("g2", sids[2], 3)], 1234)
    assert isinstance(outs[0], OffsetMeta) and outs[0].commit_ms == 1234
    assert isinstance(outs[1], OffsetMeta)
    assert isinstance(outs[2], StreamNotFoundError)
    assert isinstance(outs[3], InvalidRequestError)
    assert isinstance(outs[4], InvalidRequestError)
    assert isinstance(outs[5], OffsetMeta)
    got = await store.fetch_offsets("g1", [])
    assert [(o.stream_id, o.offset, o.metadata) for o in got] == [
        (sids[0], 10, "m"), (sids[1], 0, "")]
    assert [o.stream_id for o in await store.fetch_offsets("g1", [sids[1], sids[2]])] == [
        sids[1]]
    assert await store.offset_groups() == {"g1": 2, "g2": 1}
    # later commits overwrite (also backwards), -1 forgets
    await store.commit_offsets([OffsetMeta("g1", sids[0], 4), OffsetMeta("g1", sids[1], -1)],
                               2000)
    store = await backend.reopen()
    got = await store.fetch_offsets("g1", [])
    assert [(o.stream_id, o.offset, o.commit_ms) for o in got] == [(sids[0], 4, 2000)]
    assert await store.delete_offsets("g2") == 1
    assert await store.offset_groups() == {"g1": 1}
    # a deleted stream refuses commits, but its offset can still be forgotten
    await delete1(store, sids[0])
    (err,) = await store.commit_offsets([OffsetMeta("g1", sids[0], 9)], 3000)
    assert isinstance(err, StreamDeletedError)
    (ok,) = await store.commit_offsets([OffsetMeta("g1", sids[0], -1)], 3000)
    assert not isinstance(ok, SbpError)
    assert await store.fetch_offsets("g1", []) == []


async def test_schema_2_file_is_migrated(tmp_path: Path) -> None:
    """A file from before committed offsets (schema version 2) opens and takes commits."""
    path = tmp_path / "pm.sqlite"
    store = SqliteMetadataStore(path)
    await store.open()
    (c,) = created(await store.create_streams([NewStream(1, 0, R1)], 1))
    await store.close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE consumer_offsets")
    db.execute("UPDATE meta SET value = 2 WHERE key = 'schema_version'")
    db.commit()
    db.close()
    store = SqliteMetadataStore(path)
    await store.open()
    try:
        (o,) = await store.commit_offsets([OffsetMeta("g", c.stream.stream_id, 3)], 5)
        assert isinstance(o, OffsetMeta)
        assert [x.offset for x in await store.fetch_offsets("g", [])] == [3]
    finally:
        await store.close()
