"""Named streams (issue 20): the name rules, the wire fields, the name index on both metadata
backends (uniqueness within a call, across calls, concurrently and across PM failover), the
SQLite migration of old files, and the SDK's name resolution against a real cluster."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from aetcd import rpc
from etcd_fixture import EtcdServer
from metadata_backends import R1, Backend, backend, etcd_server

from sbpstream.client.aclient import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.pm.etcd import EtcdMetadataStore
from sbpstream.pm.leader import LeaderElection
from sbpstream.pm.metadata import CreatedStream, NewStream
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.pm.sqlite_schema import SCHEMA_VERSION
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    FencedLeaderError,
    InvalidRequestError,
    InvalidStreamConfigError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import MAX_STREAM_NAME_LEN, name_problem, parse_stream_ref

__all__ = ["backend", "etcd_server"]  # pytest fixtures, shared with other backend tests

WAIT_S = 15.0


def named(name: str) -> NewStream:
    return NewStream(1, 0, R1, name)


# ------------------------------------------------------------------------------- rules, wire
@pytest.mark.parametrize("name", ["a", "orders", "Orders.EU-1_x", "x" * MAX_STREAM_NAME_LEN,
                                  "...", "1a", "-"])
def test_valid_names(name: str) -> None:
    assert name_problem(name) is None
    assert parse_stream_ref(name) == name


@pytest.mark.parametrize(("name", "why"), [
    ("", "empty"), (".", "reserved"), ("..", "reserved"), ("a b", "invalid characters ' '"),
    ("ü", "invalid characters"), ("a/b", "invalid characters '/'"), ("123", "all digits"),
    ("x" * (MAX_STREAM_NAME_LEN + 1), "at most 249"),
])
def test_invalid_names_say_why_in_one_line(name: str, why: str) -> None:
    problem = name_problem(name)
    assert problem is not None and why in problem and "\n" not in problem


def test_stream_refs() -> None:
    assert parse_stream_ref("42") == 42
    assert parse_stream_ref(" 7 ") == 7
    with pytest.raises(InvalidStreamConfigError, match="invalid characters"):
        parse_stream_ref("a,b")


# Bytes of three messages as encoded before the name fields existed (tests/data's golden
# lines of that commit): an old peer's frames still decode, as unnamed streams.
OLD_STREAM = ("14000000000000000c0024001c001b000c0004000c000000e803000000000000005c2605000000"
              "0000000000000000032a00000000000000")
OLD_CREATE = ("0c00000008000c00080004000800000008000000e803000002000000280000000c00000008001000"
              "0f00040008000000010000000000000000000001080014001300040008000000005c26050000000000"
              "00000000000003")
OLD_DESCRIBE = ("14000000000000000c001800140010000c0004000c00000029000000000000006400000008000000"
                "e8030000030000002a000000000000002b000000000000000000000000000400")


def test_frames_from_before_names_still_decode() -> None:
    assert m.Stream.decode(bytes.fromhex(OLD_STREAM)) == m.Stream(42, 3, 86_400_000, 1_000)
    assert m.CreateStreamsRequest.decode(bytes.fromhex(OLD_CREATE)) == m.CreateStreamsRequest(
        1_000, (m.CreateStreamItem(3, 86_400_000), m.CreateStreamItem(1, 1)))
    assert m.DescribeStreamsRequest.decode(bytes.fromhex(OLD_DESCRIBE)) == (
        m.DescribeStreamsRequest(1_000, (42, 43, 1 << 50), 100, 41))
    # and an unnamed stream still encodes to exactly the old bytes
    assert m.Stream(42, 3, 86_400_000, 1_000).encode().hex() == OLD_STREAM


# ------------------------------------------------------------------------------- both backends
def outcome_types(outs: list[CreatedStream | SbpError]) -> list[str]:
    return [type(o).__name__ for o in outs]


async def test_names_are_stored_unique_and_survive_reopen(backend: Backend) -> None:
    store = backend.store
    outs = await store.create_streams(
        [named("orders"), NewStream(1, 0, R1), named("orders"), named("orders.eu")], 1)
    assert outcome_types(outs) == ["CreatedStream", "CreatedStream", "InvalidStreamConfigError",
                                   "CreatedStream"]
    assert isinstance(outs[2], InvalidStreamConfigError)
    assert "'orders' is taken by stream 1" in outs[2].message
    again = await store.create_streams([named("orders")], 2)
    assert outcome_types(again) == ["InvalidStreamConfigError"]
    s2 = await backend.reopen()
    got = await s2.get_stream_by_name("orders")
    assert got is not None and (got.stream_id, got.name) == (1, "orders")
    assert (await s2.get_streams([2]))[0] is not None
    assert (await s2.get_streams([2]))[0].name == ""  # type: ignore[union-attr]
    assert await s2.get_stream_by_name("nope") is None


async def test_prefix_listing_pages_by_id(backend: Backend) -> None:
    store = backend.store
    names = ["a.1", "b.1", "a.2", "a", "ab", "a.3"]
    await store.create_streams([named(n) for n in names] + [NewStream(1, 0, R1)], 1)
    assert [s.name for s in await store.list_streams_by_prefix("a.", 0, 10)] == [
        "a.1", "a.2", "a.3"]
    assert [s.name for s in await store.list_streams_by_prefix("a", 0, 10)] == [
        "a.1", "a.2", "a", "ab", "a.3"]
    first = await store.list_streams_by_prefix("a", 0, 2)
    rest = await store.list_streams_by_prefix("a", first[-1].stream_id, 10)
    assert [s.name for s in first + rest] == ["a.1", "a.2", "a", "ab", "a.3"]
    assert len(await store.list_streams_by_prefix("", 0, 100)) == 6  # every named stream


async def test_delete_releases_the_name(backend: Backend) -> None:
    store = backend.store
    (c,) = await store.create_streams([named("tmp")], 1)
    assert isinstance(c, CreatedStream)
    await store.delete_streams([c.stream.stream_id], 2)
    assert await store.get_stream_by_name("tmp") is None
    assert await store.list_streams_by_prefix("tmp", 0, 10) == []
    (d,) = await store.create_streams([named("tmp")], 3)
    assert isinstance(d, CreatedStream) and d.stream.stream_id != c.stream.stream_id
    s2 = await backend.reopen()
    got = await s2.get_stream_by_name("tmp")
    assert got is not None and got.stream_id == d.stream.stream_id
    old = (await s2.get_streams([c.stream.stream_id]))[0]
    assert old is not None and old.deleted and old.name == "tmp"  # kept for history


async def test_concurrent_creates_of_one_name(backend: Backend) -> None:
    store = backend.store
    outs = await asyncio.gather(*(store.create_streams([named("race")], 1) for _ in range(6)))
    kinds = sorted(type(o[0]).__name__ for o in outs)
    assert kinds == ["CreatedStream"] + ["InvalidStreamConfigError"] * 5


async def test_bad_name_item_leaves_no_trace(backend: Backend) -> None:
    store = backend.store
    outs = await store.create_streams([named("ok"), named("bad name")], 1)
    assert outcome_types(outs) == ["CreatedStream", "InvalidStreamConfigError"]
    assert len(await store.list_streams_by_prefix("", 0, 10)) == 1


# ------------------------------------------------------------------------------- failover
async def test_names_stay_unique_across_failover(etcd_server: EtcdServer) -> None:
    url = etcd_server.url("/names-fo") + "?lease_ttl_s=2"
    a, b = EtcdMetadataStore(url), EtcdMetadataStore(url)
    ea, eb = LeaderElection(a, "127.0.0.1:1"), LeaderElection(b, "127.0.0.1:2")
    await a.open()
    await b.open()
    try:
        ea.start()
        assert await ea.wait_leader(WAIT_S)
        assert isinstance((await a.create_streams([named("x")], 1))[0], CreatedStream)
        # A stops renewing without noticing (a paused process): it still holds its token.
        task = ea._task
        assert task is not None
        task.cancel()
        ea._task = None
        eb.start()
        assert await eb.wait_leader(WAIT_S)
        with pytest.raises(FencedLeaderError):
            await a.create_streams([named("y")], 2)
        taken = await b.create_streams([named("x"), named("y")], 3)
        assert outcome_types(taken) == ["InvalidStreamConfigError", "CreatedStream"]
        # A name key written behind the leader's back is never overwritten: either the rule
        # sees it in the cache or the transaction's compare (the key must be absent) fails.
        ch = rpc.insecure_channel(etcd_server.endpoint)
        try:
            await rpc.KVStub(ch).Put(rpc.PutRequest(key=b.keys.name("z"), value=b"999"),
                                     timeout=5)
        finally:
            await ch.close()
        (z,) = await b.create_streams([named("z")], 4)
        assert not isinstance(z, CreatedStream)
        await b.sync()
        assert b._cache.names["z"][0] == 999
    finally:
        await eb.stop()
        await b.close()
        await a.close()


# ------------------------------------------------------------------------------- migration
V1_STREAMS = """CREATE TABLE streams (
    stream_id INTEGER PRIMARY KEY, replica_nums INTEGER NOT NULL,
    retention_period_ms INTEGER NOT NULL, start_offset INTEGER NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0, created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL)"""


async def test_old_sqlite_file_is_migrated(tmp_path: Path) -> None:
    """A file of schema 1 (before names): opened, migrated, its streams intact and nameable."""
    path = tmp_path / "old.sqlite"
    store = SqliteMetadataStore(path)
    await store.open()
    await store.create_streams([NewStream(1, 0, R1)], 1)
    await store.close()
    # Rebuild it as schema 1 wrote it: no name column, no name table.
    c = sqlite3.connect(path)
    rows = c.execute("SELECT stream_id, replica_nums, retention_period_ms, start_offset, deleted,"
                     " created_ms, updated_ms FROM streams").fetchall()
    c.executescript("DROP TABLE streams; DROP TABLE stream_names;" + V1_STREAMS + ";")
    c.executemany("INSERT INTO streams VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    c.execute("UPDATE meta SET value = 1 WHERE key = 'schema_version'")
    c.commit()
    c.close()
    store = SqliteMetadataStore(path)
    await store.open()
    try:
        (old,) = await store.get_streams([1])
        assert old is not None and old.name == "" and not old.deleted
        (new,) = await store.create_streams([named("after")], 2)
        assert isinstance(new, CreatedStream) and new.stream.stream_id == 2
    finally:
        await store.close()
    c = sqlite3.connect(path)
    assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        SCHEMA_VERSION,)
    c.close()


# ------------------------------------------------------------------------------- SDK, wire
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("names"), datanodes=1) as c:
        yield c


async def test_sdk_takes_names_wherever_it_takes_a_stream(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address) as c:
        sid = await c.create_stream("clicks.web")
        (sid2, sid3) = await c.create_streams(names=["clicks.app", "views"])
        assert await c.resolve_stream("clicks.web") == sid
        assert await c.resolve_stream(str(sid)) == sid
        assert (await c.describe_stream("clicks.web")).name == "clicks.web"
        assert [s.stream_id for s in await c.find_streams("clicks.")] == [sid, sid2]
        assert [s.name for s in await c.find_streams(pattern=r"clicks\.a.*|views")] == [
            "clicks.app", "views"]
        with pytest.raises(InvalidStreamConfigError, match="taken by stream"):
            await c.create_stream("views")
        with pytest.raises(InvalidStreamConfigError, match="all digits"):
            await c.create_stream("12")
        with pytest.raises(InvalidRequestError, match="bad stream pattern"):
            await c.find_streams(pattern="(")
        async with c.producer(linger_ms=1) as p:
            await p.send(await c.resolve_stream("views"), b"v")
        assert await c.end_offset("views") == 1
        s = await c.update_stream("views", retention_ms=5_000)
        assert (s.stream_id, s.retention_period_ms) == (sid3, 5_000)
        await c.delete_stream("views")
        with pytest.raises(StreamNotFoundError, match="no stream is named 'views'"):
            await c.describe_stream("views")
        assert await c.create_stream("views") not in (sid3,)
