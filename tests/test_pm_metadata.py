"""PM metadata (SQLite backend) and placement: no network."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sbpstream.pm.metadata import (
    CreatedStream,
    DeleteOutcome,
    NewStream,
    NodeMetrics,
    ProducerStateMeta,
    ReplicaMeta,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.placement import (
    DISK_FREE_MIN_BYTES,
    NodeLoad,
    NodeRegistry,
    Placer,
    choose_nodes,
)
from sbpstream.pm.sqlite_meta import SCHEMA_VERSION, SqliteMetadataStore
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    MetadataError,
    NotEnoughDataNodesError,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

R1 = (ReplicaMeta(1, True),)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteMetadataStore]:
    s = SqliteMetadataStore(tmp_path / "pm.sqlite")
    await s.open()
    yield s
    await s.close()


async def reopen(s: SqliteMetadataStore) -> SqliteMetadataStore:
    await s.close()
    s2 = SqliteMetadataStore(s.path)
    await s2.open()
    return s2


async def trim1(s: SqliteMetadataStore, sid: int, off: int) -> TrimOutcome:
    (out,) = await s.trim_streams([(sid, off)], 1)
    if isinstance(out, SbpError):
        raise out
    return out


async def delete1(s: SqliteMetadataStore, sid: int) -> DeleteOutcome:
    (out,) = await s.delete_streams([sid], 1)
    if isinstance(out, SbpError):
        raise out
    return out


async def update1(s: SqliteMetadataStore, sid: int, rn: int, ret: int) -> StreamMeta:
    (out,) = await s.update_streams([StreamUpdate(sid, rn, ret)], 1)
    if isinstance(out, SbpError):
        raise out
    return out


def created(outcomes: list[CreatedStream | SbpError]) -> list[CreatedStream]:
    out = []
    for o in outcomes:
        assert isinstance(o, CreatedStream), o
        out.append(o)
    return out


async def test_create_and_restart_keeps_everything(store: SqliteMetadataStore) -> None:
    n1 = await store.allocate_node_id("host-a", 1000)
    n2 = await store.allocate_node_id("host-b", 1001)
    assert (n1, n2) == (1, 2)
    await store.update_node_address(n1, "127.0.0.1:9001")
    await store.record_heartbeat(n1, 5000)
    await store.record_metrics(n1, NodeMetrics(disk_free_space=10**9, range_active_cnt=3), 5000)
    items = [NewStream(1, 60_000 * i, (ReplicaMeta(n1, True),)) for i in range(5)]
    res = created(await store.create_streams(items, 2000))
    ids = [c.stream.stream_id for c in res]
    assert ids == [1, 2, 3, 4, 5]
    assert all(c.first_range.range_index == 0 and c.first_range.writable for c in res)
    sealed = await store.seal_and_new(1, 0, 42, (ReplicaMeta(n2, True),),
                                      [ProducerStateMeta(7, 0, 11, 30)])
    await store.trim_streams([(2, 0)], 3000)
    await store.delete_streams([3], 3000)

    s2 = await reopen(store)
    try:
        streams = await s2.get_streams([1, 2, 3, 4, 5, 99])
        assert [s.retention_period_ms if s else None for s in streams] == [
            0, 60_000, 120_000, 180_000, 240_000, None]
        assert streams[2] is not None and streams[2].deleted
        ranges = (await s2.list_ranges([1]))[0]
        assert ranges == [sealed.sealed, sealed.new]
        assert ranges[0].end_offset == 42 and ranges[1].start_offset == 42
        assert ranges[1].replicas == (ReplicaMeta(n2, True),)
        assert await s2.get_seal_producers(1, 0) == (ProducerStateMeta(7, 0, 11, 30),)
        node = await s2.get_node(n1)
        assert node is not None and node.advertise_addr == "127.0.0.1:9001"
        assert node.last_heartbeat_ms == 5000
        assert node.metrics is not None and node.metrics.range_active_cnt == 3
        # Counters continue, never reuse an id.
        assert await s2.allocate_node_id("host-c", 1) == 3
        more = created(await s2.create_streams([NewStream(1, 0, R1)], 1))
        assert more[0].stream.stream_id == 6
        assert [s.stream_id for s in await s2.list_streams(0, 100)] == [1, 2, 4, 5, 6]
    finally:
        await s2.close()


async def test_schema_versioned(store: SqliteMetadataStore, tmp_path: Path) -> None:
    await store.close()
    c = sqlite3.connect(tmp_path / "pm.sqlite")
    assert c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == (
        SCHEMA_VERSION)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c.execute("UPDATE meta SET value = 999 WHERE key='schema_version'")
    c.commit()
    c.close()
    s = SqliteMetadataStore(tmp_path / "pm.sqlite")
    with pytest.raises(MetadataError, match="newer"):
        await s.open()


async def test_second_opener_is_refused(store: SqliteMetadataStore) -> None:
    await store.create_streams([NewStream(1, 0, R1)], 1)
    other = SqliteMetadataStore(store.path)
    with pytest.raises(MetadataError, match="in use"):
        await other.open()


async def test_batch_create_is_per_item(store: SqliteMetadataStore, tmp_path: Path) -> None:
    # Force one item's range row to collide: pre-insert a range for the id item 2 will get.
    await store.close()
    c = sqlite3.connect(tmp_path / "pm.sqlite")
    c.execute("INSERT INTO ranges VALUES (2, 0, 0, -1, 0)")
    c.commit()
    c.close()
    s = SqliteMetadataStore(tmp_path / "pm.sqlite")
    await s.open()
    try:
        out = await s.create_streams([NewStream(1, 0, R1)] * 3, 1)
        assert isinstance(out[0], CreatedStream) and isinstance(out[2], CreatedStream)
        assert isinstance(out[1], MetadataError)
        got = await s.get_streams([1, 2, 3])
        # Item 2 is all-or-nothing: its stream row did not survive its failed range.
        assert got[0] is not None and got[1] is None and got[2] is not None
        assert len((await s.list_ranges([3]))[0]) == 1
    finally:
        await s.close()


async def test_large_batch_one_call(store: SqliteMetadataStore) -> None:
    items = [NewStream(1, 1000, (ReplicaMeta(1 + i % 3, True),)) for i in range(1000)]
    res = created(await store.create_streams(items, 1))
    assert len({c.stream.stream_id for c in res}) == 1000
    counts = await store.writable_range_counts()
    assert counts == {1: 334, 2: 333, 3: 333}
    node2 = await store.list_node_ranges(2)
    assert len(node2) == 333 and all(r.node_ids == (2,) for r in node2)


async def test_seal_and_new_idempotent(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1)], 1))
    first = await store.seal_and_new(1, 0, 10, (ReplicaMeta(2, True),), [])
    assert first.created
    again = await store.seal_and_new(1, 0, 999, (ReplicaMeta(3, True),), [])
    assert not again.created
    assert (again.sealed, again.new) == (first.sealed, first.new)
    assert len((await store.list_ranges([1]))[0]) == 2
    second = await store.seal_and_new(1, 1, 25, (ReplicaMeta(1, True),), [])
    assert second.sealed.range_index == 1 and second.new.range_index == 2
    assert second.new.start_offset == 25
    # Index 0 is an older sealed range: still answered, idempotently, with its own pair.
    old = await store.seal_and_new(1, 0, 10, R1, [])
    assert not old.created and (old.sealed, old.new) == (first.sealed, second.sealed)
    with pytest.raises(RangeNotFoundError):
        await store.seal_and_new(1, 7, 10, R1, [])
    with pytest.raises(InvalidRequestError):
        await store.seal_and_new(1, 2, 3, R1, [])  # end below start 25
    with pytest.raises(StreamNotFoundError):
        await store.seal_and_new(42, 0, 0, R1, [])


async def test_trim(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1)], 1))
    await store.seal_and_new(1, 0, 10, R1, [])
    await store.seal_and_new(1, 1, 20, R1, [])
    # Ranges: [0,10) [10,20) [20,-1)
    t = await trim1(store, 1, 5)
    assert t.dropped == () and t.first_range is not None
    assert (t.first_range.range_index, t.first_range.start_offset) == (0, 5)
    assert t.stream.start_offset == 5
    t = await trim1(store, 1, 10)  # range 0 ends exactly at 10: wholly below
    assert [r.range_index for r in t.dropped] == [0]
    assert t.first_range is not None and t.first_range.range_index == 1
    assert t.first_range.start_offset == 10
    t = await trim1(store, 1, 3)  # never lowers
    assert t.stream.start_offset == 10 and t.dropped == ()
    t = await trim1(store, 1, 27)  # into the writable range
    assert t.first_range is not None and t.first_range.range_index == 2
    assert t.first_range.start_offset == 27 and t.first_range.writable
    assert t.first_range.next_offset == 27
    assert [r.range_index for r in (await store.list_ranges([1]))[0]] == [2]
    with pytest.raises(InvalidRequestError):
        await trim1(store, 1, -1)
    with pytest.raises(StreamNotFoundError):
        await trim1(store, 9, 1)


async def test_delete_and_update(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1), NewStream(1, 5, R1)], 1))
    u = await update1(store, 2, 1, 777)
    assert u.retention_period_ms == 777
    d = await delete1(store, 1)
    assert d.stream.deleted and [r.range_index for r in d.removed] == [0]
    assert (await store.list_ranges([1]))[0] == []
    with pytest.raises(StreamDeletedError):
        await delete1(store, 1)
    with pytest.raises(StreamDeletedError):
        await update1(store, 1, 1, 1)
    with pytest.raises(StreamNotFoundError):
        await delete1(store, 77)
    assert [s.stream_id for s in await store.list_streams(0, 10)] == [2]
    with pytest.raises(DataNodeNotFoundError):
        await store.update_node_address(55, "x:1")


async def test_next_offsets_never_lower(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1)], 1))
    await store.record_next_offsets([(1, 0, 50)])
    await store.record_next_offsets([(1, 0, 20)])
    r = await store.get_range(1, 0)
    assert r is not None and r.next_offset == 50


async def test_list_streams_pages(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1)] * 25, 1))
    seen: list[int] = []
    after = 0
    while True:
        page = await store.list_streams(after, 10)
        if not page:
            break
        seen += [s.stream_id for s in page]
        after = page[-1].stream_id
    assert seen == list(range(1, 26))


# ---------------------------------------------------------------------------- placement
def test_choose_nodes_by_load() -> None:
    loads = [
        NodeLoad(1, writable_ranges=10, append_rate=0, disk_free_space=10**12),
        NodeLoad(2, writable_ranges=0, append_rate=0, disk_free_space=10**12),
        NodeLoad(3, writable_ranges=0, append_rate=100, disk_free_space=10**12),
        NodeLoad(4, writable_ranges=0, append_rate=0, disk_free_space=DISK_FREE_MIN_BYTES - 1),
    ]
    assert choose_nodes(loads, 1) == [2]
    assert choose_nodes(loads, 3) == [2, 3, 1]
    with pytest.raises(NotEnoughDataNodesError):
        choose_nodes(loads, 4)  # node 4's disk is nearly full


def test_choose_nodes_tie_break_deterministic() -> None:
    loads = [NodeLoad(n, 0, 0, None) for n in (9, 3, 5)]
    assert choose_nodes(loads, 2) == [3, 5]
    assert choose_nodes(list(reversed(loads)), 2) == [3, 5]


def test_choose_prefers_free_disk() -> None:
    loads = [NodeLoad(1, 0, 0, 10**9), NodeLoad(2, 0, 0, 10**12)]
    assert choose_nodes(loads, 1) == [2]


def test_placer_avoids_dead_and_spreads() -> None:
    reg = NodeRegistry(node_timeout_ms=1000, started_at=0.0)
    for n in (1, 2, 3):
        reg.add(n, f"h{n}", f"127.0.0.1:{9000 + n}")
    reg.heartbeat(1, "", 10.0)
    reg.heartbeat(2, "", 10.0)
    reg.heartbeat(3, "", 8.0)  # stale by t=10: 2 s > 1 s timeout
    placer = Placer(reg)
    picks = [placer.place(1, 10.0)[0].node_id for _ in range(10)]
    assert set(picks) == {1, 2}
    assert picks.count(1) == 5 and picks.count(2) == 5
    two = placer.place(2, 10.0)
    assert two[0].is_primary and not two[1].is_primary
    assert {r.node_id for r in two} == {1, 2}
    with pytest.raises(NotEnoughDataNodesError):
        placer.place(3, 10.0)
    assert reg.is_dead(3, 10.0) and not reg.is_dead(1, 10.0)


def test_registry_grace_after_restart() -> None:
    reg = NodeRegistry(node_timeout_ms=5000, started_at=100.0)
    reg.add(1, "h", "127.0.0.1:1")
    assert not reg.is_live(1, 101.0)  # not heard yet: not placed on
    assert not reg.is_dead(1, 104.0)  # but not dead within the grace period
    assert reg.is_dead(1, 105.5)
    assert reg.heartbeat(1, "127.0.0.1:2", 106.0)  # address change reported
    assert reg.is_live(1, 106.0)


async def test_mixed_batches_per_item(store: SqliteMetadataStore) -> None:
    created(await store.create_streams([NewStream(1, 0, R1)] * 3, 1))
    await delete1(store, 2)
    out = await store.trim_streams([(1, 5), (2, 5), (3, -4), (99, 1), (3, 2)], 2)
    assert isinstance(out[0], TrimOutcome) and out[0].stream.start_offset == 5
    assert isinstance(out[1], StreamDeletedError)
    assert isinstance(out[2], InvalidRequestError)
    assert isinstance(out[3], StreamNotFoundError)
    assert isinstance(out[4], TrimOutcome) and out[4].stream.start_offset == 2
    dels = await store.delete_streams([1, 1, 42], 3)
    assert isinstance(dels[0], DeleteOutcome)
    assert isinstance(dels[1], StreamDeletedError)
    assert isinstance(dels[2], StreamNotFoundError)
    ups = await store.update_streams([StreamUpdate(3, 1, 9), StreamUpdate(1, 1, 9)], 4)
    assert isinstance(ups[0], StreamMeta) and ups[0].retention_period_ms == 9
    assert isinstance(ups[1], StreamDeletedError)
