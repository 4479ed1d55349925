"""Backend conformance: the same metadata behaviours against SQLite and etcd.

Every test takes a ``backend`` fixture, parametrised over both stores; etcd runs for real (one
server per module, one key prefix per test). Backend-specific behaviour (SQLite's file lock,
etcd's transaction limits and fencing) is tested in test_pm_etcd.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from metadata_backends import R1, Backend, SqliteBackend, backend, created, etcd_server

from sbpstream.pm.backends import open_metadata
from sbpstream.pm.etcd import EtcdMetadataStore
from sbpstream.pm.metadata import (
    CreatedStream,
    DeleteOutcome,
    MetadataStore,
    NewStream,
    NodeMetrics,
    ProducerStateMeta,
    ReplicaMeta,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    InvalidRequestError,
    MetadataError,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

__all__ = ["backend", "etcd_server"]  # pytest fixtures, shared with other backend tests


async def trim1(s: MetadataStore, sid: int, off: int) -> TrimOutcome:
    (out,) = await s.trim_streams([(sid, off)], 1)
    if isinstance(out, SbpError):
        raise out
    return out


async def delete1(s: MetadataStore, sid: int) -> DeleteOutcome:
    (out,) = await s.delete_streams([sid], 1)
    if isinstance(out, SbpError):
        raise out
    return out


async def update1(s: MetadataStore, sid: int, rn: int, ret: int) -> StreamMeta:
    (out,) = await s.update_streams([StreamUpdate(sid, rn, ret)], 1)
    if isinstance(out, SbpError):
        raise out
    return out


async def test_create_and_reopen_keeps_everything(backend: Backend) -> None:
    store = backend.store
    n1 = await store.allocate_node_id("host-a", 1000)
    n2 = await store.allocate_node_id("host-b", 1001)
    assert (n1, n2) == (1, 2)
    await store.update_node_address(n1, "127.0.0.1:9001")
    await store.record_heartbeat(n1, 5000)
    await store.record_metrics(n1, NodeMetrics(disk_free_space=10**9, range_active_cnt=3), 5000)
    items = [NewStream(1, 60_000 * i, (ReplicaMeta(n1, True),)) for i in range(5)]
    res = created(await store.create_streams(items, 2000))
    assert [c.stream.stream_id for c in res] == [1, 2, 3, 4, 5]
    assert all(c.first_range.range_index == 0 and c.first_range.writable for c in res)
    assert res[0].stream == StreamMeta(1, 1, 0, 0, False, 2000, 2000)
    sealed = await store.seal_and_new(1, 0, 42, (ReplicaMeta(n2, True),),
                                      [ProducerStateMeta(7, 0, 11, 30)])
    await store.trim_streams([(2, 0)], 3000)
    await store.delete_streams([3], 3000)

    s2 = await backend.reopen()
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
    assert [n.node_id for n in await s2.list_nodes()] == [1, 2]
    # Counters continue, never reuse an id.
    assert await s2.allocate_node_id("host-c", 1) == 3
    more = created(await s2.create_streams([NewStream(1, 0, R1)], 1))
    assert more[0].stream.stream_id == 6
    assert [s.stream_id for s in await s2.list_streams(0, 100)] == [1, 2, 4, 5, 6]


async def test_large_batch_one_call(backend: Backend) -> None:
    items = [NewStream(1, 1000, (ReplicaMeta(1 + i % 3, True),)) for i in range(1000)]
    res = created(await backend.store.create_streams(items, 1))
    assert [c.stream.stream_id for c in res] == list(range(1, 1001))
    assert await backend.store.writable_range_counts() == {1: 334, 2: 333, 3: 333}
    node2 = await backend.store.list_node_ranges(2)
    assert len(node2) == 333 and all(r.node_ids == (2,) for r in node2)
    assert [r.stream_id for r in node2] == sorted(r.stream_id for r in node2)
    got = await backend.store.get_streams([1, 500, 1000, 1001])
    assert [s.stream_id if s else None for s in got] == [1, 500, 1000, None]


async def test_multi_replica_ranges(backend: Backend) -> None:
    reps = (ReplicaMeta(3, False), ReplicaMeta(2, True), ReplicaMeta(1, False))
    created(await backend.store.create_streams([NewStream(3, 0, reps)], 1))
    r = await backend.store.get_range(1, 0)
    assert r is not None and r.primary_node_id == 2 and r.node_ids == (2, 1, 3)
    s = await backend.store.seal_and_new(1, 0, 5, reps, [])
    assert s.new.node_ids == (2, 1, 3)
    assert [x.range_index for x in await backend.store.list_node_ranges(3)] == [0, 1]
    assert [x.range_index for x in await backend.store.list_node_ranges(3, True)] == [1]
    assert await backend.store.writable_range_counts() == {1: 1, 2: 1, 3: 1}
    # A node listed twice in one range is refused, and nothing is written.
    with pytest.raises(MetadataError):
        await backend.store.seal_and_new(1, 1, 9, (ReplicaMeta(1, True), ReplicaMeta(1, False)),
                                         [])
    assert len((await backend.store.list_ranges([1]))[0]) == 2


async def test_seal_and_new_idempotent(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1)], 1))
    first = await store.seal_and_new(1, 0, 10, (ReplicaMeta(2, True),), [])
    assert first.created
    again = await store.seal_and_new(1, 0, 999, (ReplicaMeta(3, True),), [])
    assert not again.created
    assert (again.sealed, again.new) == (first.sealed, first.new)
    assert len((await store.list_ranges([1]))[0]) == 2
    second = await store.seal_and_new(1, 1, 25, (ReplicaMeta(1, True),),
                                      [ProducerStateMeta(4, 1, 9, 20),
                                       ProducerStateMeta(2, 0, 3, 11)])
    assert second.sealed.range_index == 1 and second.new.range_index == 2
    assert second.new.start_offset == 25
    assert second.producers == (ProducerStateMeta(2, 0, 3, 11), ProducerStateMeta(4, 1, 9, 20))
    assert (await store.seal_and_new(1, 1, 0, (), ())).producers == second.producers
    old = await store.seal_and_new(1, 0, 10, R1, [])  # an older sealed range: its own pair
    assert not old.created and (old.sealed, old.new) == (first.sealed, second.sealed)
    with pytest.raises(RangeNotFoundError):
        await store.seal_and_new(1, 7, 10, R1, [])
    with pytest.raises(InvalidRequestError):
        await store.seal_and_new(1, 2, 3, R1, [])  # end below start 25
    alone = await store.seal_and_new(1, 2, 30, (), [])  # no replicas: sealed alone
    assert alone.created and alone.new is None and alone.sealed.end_offset == 30
    again2 = await store.seal_and_new(1, 2, 0, (), [])
    assert not again2.created and again2.new is None and again2.sealed == alone.sealed
    opened = await store.seal_and_new(1, 2, 0, R1, [])  # its successor, once placed
    assert opened.created and opened.new is not None and opened.new.start_offset == 30
    assert opened.sealed == alone.sealed and len((await store.list_ranges([1]))[0]) == 4
    with pytest.raises(StreamNotFoundError):
        await store.seal_and_new(42, 0, 0, R1, [])
    await delete1(store, 1)
    with pytest.raises(StreamDeletedError):
        await store.seal_and_new(1, 2, 30, R1, [])


async def test_trim(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1)], 1))
    await store.seal_and_new(1, 0, 10, R1, [ProducerStateMeta(1, 0, 1, 0)])
    await store.seal_and_new(1, 1, 20, R1, [ProducerStateMeta(1, 0, 2, 10)])
    # Ranges: [0,10) [10,20) [20,-1)
    t = await trim1(store, 1, 5)
    assert t.dropped == () and t.first_range is not None
    assert (t.first_range.range_index, t.first_range.start_offset) == (0, 5)
    assert t.stream.start_offset == 5
    t = await trim1(store, 1, 10)  # range 0 ends exactly at 10: wholly below
    assert [r.range_index for r in t.dropped] == [0]
    assert t.first_range is not None and t.first_range.range_index == 1
    assert t.first_range.start_offset == 10
    assert await store.get_seal_producers(1, 0) == ()
    assert await store.get_seal_producers(1, 1) == (ProducerStateMeta(1, 0, 2, 10),)
    t = await trim1(store, 1, 3)  # never lowers
    assert t.stream.start_offset == 10 and t.dropped == ()
    t = await trim1(store, 1, 27)  # into the writable range
    assert t.first_range is not None and t.first_range.range_index == 2
    assert t.first_range.start_offset == 27 and t.first_range.writable
    assert t.first_range.next_offset == 27
    assert [r.range_index for r in (await store.list_ranges([1]))[0]] == [2]
    assert (await store.get_streams([1]))[0] == t.stream
    with pytest.raises(InvalidRequestError):
        await trim1(store, 1, -1)
    with pytest.raises(StreamNotFoundError):
        await trim1(store, 9, 1)


async def test_delete_and_update(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1), NewStream(1, 5, R1)], 1))
    await store.seal_and_new(1, 0, 4, R1, [ProducerStateMeta(1, 0, 1, 0)])
    u = await update1(store, 2, 1, 777)
    assert u.retention_period_ms == 777 and u.updated_ms == 1
    d = await delete1(store, 1)
    assert d.stream.deleted and [r.range_index for r in d.removed] == [0, 1]
    assert (await store.list_ranges([1]))[0] == []
    assert await store.get_seal_producers(1, 0) == ()
    assert await store.list_node_ranges(1) == [(await store.get_range(2, 0))]
    with pytest.raises(StreamDeletedError):
        await delete1(store, 1)
    with pytest.raises(StreamDeletedError):
        await update1(store, 1, 1, 1)
    with pytest.raises(StreamNotFoundError):
        await delete1(store, 77)
    assert [s.stream_id for s in await store.list_streams(0, 10)] == [2]
    with pytest.raises(DataNodeNotFoundError):
        await store.update_node_address(55, "x:1")


async def test_next_offsets_never_lower(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1)] * 2, 1))
    await store.record_next_offsets([(1, 0, 50), (2, 0, 7), (9, 0, 1)])
    await store.record_next_offsets([(1, 0, 20)])
    r = await store.get_range(1, 0)
    assert r is not None and r.next_offset == 50
    r2 = await store.get_range(2, 0)
    assert r2 is not None and r2.next_offset == 7
    await store.seal_and_new(2, 0, 7, R1, [])
    await store.record_next_offsets([(2, 0, 100)])  # sealed: unchanged
    r2 = await store.get_range(2, 0)
    assert r2 is not None and r2.next_offset == 7


async def test_list_streams_pages(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1)] * 25, 1))
    await delete1(store, 13)
    seen: list[int] = []
    after = 0
    while True:
        page = await store.list_streams(after, 10)
        if not page:
            break
        seen += [s.stream_id for s in page]
        after = page[-1].stream_id
    assert seen == [i for i in range(1, 26) if i != 13]
    assert await store.list_streams(0, 0) == []


async def test_mixed_batches_per_item(backend: Backend) -> None:
    store = backend.store
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


async def test_items_of_one_call_see_each_other(backend: Backend) -> None:
    store = backend.store
    created(await store.create_streams([NewStream(1, 0, R1)] * 2, 1))
    ups = await store.update_streams(
        [StreamUpdate(1, 1, 10), StreamUpdate(1, 1, 20), StreamUpdate(2, 1, 30)], 5)
    assert [u.retention_period_ms for u in ups if isinstance(u, StreamMeta)] == [10, 20, 30]
    assert [s.retention_period_ms for s in await store.get_streams([1, 2]) if s] == [20, 30]
    out = await store.trim_streams([(1, 3), (1, 1), (1, 8)], 6)
    assert [o.stream.start_offset for o in out if isinstance(o, TrimOutcome)] == [3, 3, 8]


async def test_replace_replica(backend: Backend) -> None:
    store = backend.store
    reps = (ReplicaMeta(1, True), ReplicaMeta(2, False))
    created(await store.create_streams([NewStream(2, 0, reps)], 1))
    with pytest.raises(InvalidRequestError):  # writable: not re-replicated
        await store.replace_replica(1, 0, 2, 3)
    await store.seal_and_new(1, 0, 5, reps, [])
    moved = await store.replace_replica(1, 0, 1, 9)
    assert moved.replicas == (ReplicaMeta(9, True), ReplicaMeta(2, False))
    assert await store.get_range(1, 0) == moved
    assert await store.replace_replica(1, 0, 1, 9) == moved  # done already: idempotent
    assert [r.range_index for r in await store.list_node_ranges(9)] == [0]
    assert [r.range_index for r in await store.list_node_ranges(1)] == [1]
    with pytest.raises(InvalidRequestError):
        await store.replace_replica(1, 0, 7, 8)  # neither node
    with pytest.raises(InvalidRequestError):
        await store.replace_replica(1, 0, 2, 9)  # 9 already holds it
    with pytest.raises(RangeNotFoundError):
        await store.replace_replica(1, 4, 1, 9)
    await delete1(store, 1)
    with pytest.raises(StreamDeletedError):
        await store.replace_replica(1, 0, 9, 1)


async def test_soft_state_reads_before_it_is_persisted(backend: Backend) -> None:
    store = backend.store
    nid = await store.allocate_node_id("h", 1)
    await store.record_heartbeat(nid, 700)
    await store.record_metrics(nid, NodeMetrics(memory_used=5), 800)
    await store.record_heartbeat(99, 700)  # an unknown node: ignored, never created
    node = await store.get_node(nid)
    assert node is not None and node.last_heartbeat_ms == 700 and node.metrics_ms == 800
    assert node.metrics == NodeMetrics(memory_used=5)
    # A durable write keeps it; so does the address update of that very node.
    moved = await store.update_node_address(nid, "h:1")
    assert moved.last_heartbeat_ms == 700 and moved.advertise_addr == "h:1"
    s2 = await backend.reopen()
    again = await s2.get_node(nid)
    assert again == moved
    assert await s2.get_node(99) is None


async def test_failed_item_leaves_no_trace(backend: Backend) -> None:
    store = backend.store
    twice = (ReplicaMeta(4, True), ReplicaMeta(4, False))
    out = await store.create_streams([NewStream(1, 0, R1), NewStream(2, 0, twice),
                                      NewStream(1, 0, R1)], 1)
    assert isinstance(out[0], CreatedStream) and isinstance(out[2], CreatedStream)
    assert isinstance(out[1], MetadataError)
    assert await store.get_streams([2]) == [None]  # its id is burned, never half-written
    assert await store.list_node_ranges(4) == []
    assert created(await store.create_streams([NewStream(1, 0, R1)], 1))[0].stream.stream_id == 4
    # Items of one call see each other: the second delete finds the first's work.
    dels = await store.delete_streams([1, 1], 2)
    assert isinstance(dels[0], DeleteOutcome) and isinstance(dels[1], StreamDeletedError)
    trims = await store.trim_streams([(3, 4), (1, 2)], 3)
    assert isinstance(trims[0], TrimOutcome) and isinstance(trims[1], StreamDeletedError)
    assert [r.start_offset for r in (await store.list_ranges([3]))[0]] == [4]


def test_open_metadata_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_metadata(f"sqlite:{tmp_path / 'x.sqlite3'}"), SqliteMetadataStore)
    assert isinstance(open_metadata("etcd://127.0.0.1:2379/p"), EtcdMetadataStore)
    with pytest.raises(ValueError):
        open_metadata("mysql://db")


async def test_quotas_set_replace_delete_persist(backend: Backend) -> None:
    """Quotas (issue 22): the same rules on both stores, surviving a reopen."""
    from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec

    s = backend.store
    a = QuotaSpec(QuotaKind.CLIENT, "app-1", 1000, UNLIMITED, 50)
    d = QuotaSpec(QuotaKind.DEFAULT, "", 10_000)
    bad = QuotaSpec(QuotaKind.STREAM, "7", 0)
    outs = await s.set_quotas([a, d, bad, QuotaSpec(QuotaKind.STREAM, "07", 5, 6, 7)])
    assert outs[:2] == [a, d]
    assert isinstance(outs[2], InvalidRequestError) and "= 0" in outs[2].message
    assert outs[3] == QuotaSpec(QuotaKind.STREAM, "7", 5, 6, 7)
    a2 = QuotaSpec(QuotaKind.CLIENT, "app-1", 2000)
    assert await s.set_quotas([a2]) == [a2]  # replaces, whole
    # per principal: a user's quota, and the same client id's quota for that user alone
    u = QuotaSpec(QuotaKind.USER, "", 3000, user="alice")
    uc = QuotaSpec(QuotaKind.CLIENT, "app-1", UNLIMITED, 4000, user="alice")
    outs = await s.set_quotas([u, uc, QuotaSpec(QuotaKind.STREAM, "7", 5, user="alice")])
    assert outs[:2] == [u, uc]
    assert isinstance(outs[2], InvalidRequestError) and "takes no user" in outs[2].message
    s = await backend.reopen()
    assert {q.key: q for q in await s.list_quotas()} == {
        "client/app-1": a2, "default": d, "stream/7": QuotaSpec(QuotaKind.STREAM, "7", 5, 6, 7),
        "user/alice": u, "user/alice,client/app-1": uc}
    outs = await s.delete_quotas([(int(QuotaKind.DEFAULT), "", ""),
                                  (int(QuotaKind.CLIENT), "nope", ""),
                                  (int(QuotaKind.CLIENT), "app-1", "alice")])
    assert outs[0] == d
    assert isinstance(outs[1], InvalidRequestError)
    assert "no quota for client/nope" in outs[1].message
    assert outs[2] == uc
    s = await backend.reopen()
    assert sorted(q.key for q in await s.list_quotas()) == ["client/app-1", "stream/7",
                                                             "user/alice"]


async def test_sqlite_quotas_table_from_before_principals_gains_the_column(tmp_path: Path) -> None:
    """A quotas table written before user quotas existed: opened, its rows read as they were,
    and user quotas stored alongside."""
    import sqlite3

    from sbpstream.quota.model import QuotaKind, QuotaSpec

    path = tmp_path / "old.sqlite"
    b = SqliteBackend(path)
    await b.open()
    await b.close()
    c = sqlite3.connect(path)
    c.execute("DROP TABLE quotas")
    c.execute("CREATE TABLE quotas (key TEXT PRIMARY KEY, kind INTEGER NOT NULL, name TEXT NOT "
              "NULL, produce_bytes_per_s INTEGER NOT NULL, fetch_bytes_per_s INTEGER NOT NULL, "
              "requests_per_s INTEGER NOT NULL) WITHOUT ROWID")
    c.execute("INSERT INTO quotas VALUES ('client/old', 1, 'old', 100, -1, -1)")
    c.commit()
    c.close()
    s = await b.reopen()
    assert await s.list_quotas() == [QuotaSpec(QuotaKind.CLIENT, "old", 100)]
    u = QuotaSpec(QuotaKind.USER, "", 5, user="bob")
    assert await s.set_quotas([u]) == [u]
    s = await b.reopen()
    assert [q.key for q in await s.list_quotas()] == ["client/old", "user/bob"]
    await b.close()


# ---- auth records (issue 23): users and ACL rules, both backends


async def test_auth_records_users_and_acls_survive_reopen(backend: Backend) -> None:
    from sbpstream.auth.acl import Op
    from sbpstream.auth.records import AuthRecords
    from sbpstream.auth.scram import ScramLogin

    recs = AuthRecords(backend.store)
    await recs.add_user("alice", "pw-a")
    await recs.add_user("bob", "pw-b")
    with pytest.raises(InvalidRequestError):
        await recs.add_rule("carol", "fetch", "*")  # no such user
    await recs.add_rule("alice", "append", "stream:7")
    await recs.add_rule("alice", "fetch", "stream:7")  # merged into one rule
    await recs.add_rule("bob", "describe", "prefix:1")
    raw = await backend.store.auth_get("user", "alice")
    assert raw is not None and "pw-a" not in raw  # salted and hashed, never the password

    store = await backend.reopen()
    recs = AuthRecords(store)
    assert await recs.list_users() == ["alice", "bob"]
    rules = await recs.rules()
    assert [(r.principal, r.ops, r.resource) for r in rules] == [
        ("alice", frozenset({Op.APPEND, Op.FETCH}), "stream:7"),
        ("bob", frozenset({Op.DESCRIBE}), "prefix:1"),
    ]
    cred = await recs.credential("alice")
    assert cred is not None and ScramLogin("alice", cred).known

    await recs.delete_rule("alice", "append", "stream:7")
    assert [r.ops for r in await recs.rules("alice")] == [frozenset({Op.FETCH})]
    await recs.delete_user("bob")  # its rules go with it
    assert await recs.list_users() == ["alice"]
    assert [r.principal for r in await recs.rules()] == ["alice"]
    with pytest.raises(InvalidRequestError):
        await recs.delete_user("bob")
    assert await store.auth_delete("user", "nobody") is False
