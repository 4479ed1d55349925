"""SQLite-only metadata behaviour, the staging layer the rules run on, and placement: no network.

The rules themselves run on both backends in test_pm_etcd_conformance.py."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from metadata_backends import created

from sbpstream.pm.metadata import (
    CreatedStream,
    NewStream,
    NodeMetrics,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    StreamMeta,
)
from sbpstream.pm.placement import (
    DISK_FREE_MIN_BYTES,
    NodeLoad,
    NodeRegistry,
    Placer,
    choose_nodes,
)
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.pm.sqlite_schema import SCHEMA_VERSION
from sbpstream.pm.staging import ALL_RANGES, Layer, StagedTxn
from sbpstream.protocol.errors import MetadataError, NotEnoughDataNodesError

R1 = (ReplicaMeta(1, True),)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteMetadataStore]:
    s = SqliteMetadataStore(tmp_path / "pm.sqlite")
    await s.open()
    yield s
    await s.close()


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


async def test_rows_on_disk_keep_their_format(store: SqliteMetadataStore,
                                              tmp_path: Path) -> None:
    """The rows of schema version 4, as every earlier writer left them: a file written by
    any earlier sbpstream of this version must still open and read the same (version 1 files
    are migrated: tests/test_names.py; version 2: tests/test_groups_offsets.py; version 3:
    tests/test_drain.py)."""
    nid = await store.allocate_node_id("host-a", 1000)
    await store.record_metrics(nid, NodeMetrics(memory_used=5), 1500)
    reps = (ReplicaMeta(3, False), ReplicaMeta(2, True))
    created(await store.create_streams([NewStream(2, 60_000, reps)], 2000))
    await store.seal_and_new(1, 0, 42, (ReplicaMeta(5, False), ReplicaMeta(4, True)),
                             [ProducerStateMeta(7, 1, 11, 30)])
    await store.trim_streams([(1, 3)], 3000)
    await store.close()
    c = sqlite3.connect(tmp_path / "pm.sqlite")
    try:
        def rows(sql: str) -> list[tuple[object, ...]]:
            return c.execute(sql).fetchall()

        assert rows("SELECT key, value FROM meta ORDER BY key") == [
            ("next_node_id", 2), ("next_stream_id", 2), ("schema_version", 4)]
        assert rows("SELECT * FROM streams") == [(1, 2, 60_000, 3, 0, 2000, 3000, "")]
        assert rows("SELECT * FROM ranges ORDER BY range_index") == [
            (1, 0, 3, 42, 42), (1, 1, 42, -1, 42)]
        assert rows("SELECT * FROM range_replicas ORDER BY range_index, node_id") == [
            (1, 0, 2, 1), (1, 0, 3, 0), (1, 1, 4, 1), (1, 1, 5, 0)]
        assert rows("SELECT * FROM seal_producers") == [(1, 0, 7, 1, 11, 30)]
        metrics = json.dumps(NodeMetrics(memory_used=5).to_dict(), separators=(",", ":"))
        assert rows("SELECT * FROM data_nodes") == [
            (1, "host-a", "", 1000, 0, metrics, 1500, 0)]
    finally:
        c.close()


# ---------------------------------------------------------------------------- staging
class _Empty:
    """A BaseReader with nothing committed but one stream and its two ranges."""

    s1 = StreamMeta(1, 1, 0, 0)
    r0 = RangeMeta(1, 0, 0, 10, 10, R1)
    r1 = RangeMeta(1, 1, 10, -1, 10, R1)

    def stream(self, sid: int) -> StreamMeta | None:
        return self.s1 if sid == 1 else None

    def ranges(self, sid: int) -> list[RangeMeta]:
        return [self.r0, self.r1] if sid == 1 else []

    def range(self, sid: int, idx: int) -> RangeMeta | None:
        return next((r for r in self.ranges(sid) if r.range_index == idx), None)

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        return (ProducerStateMeta(1, 0, 5),) if (sid, idx) == (1, 0) else ()

    def node(self, nid: int) -> None:
        return None

    def counter(self, name: str) -> int:
        return 7


def test_staged_reads_see_earlier_items_and_drops() -> None:
    base, chunk = _Empty(), Layer()
    first = Layer()
    tx = StagedTxn(base, chunk, first)
    tx.drop_ranges_below(1, 1)
    assert tx.ranges(1) == [base.r1] and tx.range(1, 0) is None and tx.producers(1, 0) == ()
    r2 = RangeMeta(1, 2, 20, -1, 20, R1)
    tx.put_range(r2)
    assert tx.next_id("c", 3) == 7 and tx.counter("c") == 10
    chunk.merge(first)
    second = StagedTxn(base, chunk, Layer())
    assert second.ranges(1) == [base.r1, r2] and second.counter("c") == 10
    second.drop_ranges_below(1, ALL_RANGES)  # a later drop takes the earlier put with it
    chunk.merge(second.top)
    assert chunk.ranges == {1: {}} and chunk.dropped == {1: ALL_RANGES}
    assert StagedTxn(base, chunk, Layer()).ranges(1) == []
    with pytest.raises(MetadataError, match="twice"):
        tx.put_range(RangeMeta(1, 3, 0, -1, 0, (ReplicaMeta(4, True), ReplicaMeta(4, False))))



def test_journaled_layer_undoes_a_failed_item() -> None:
    base, chunk = _Empty(), Layer(journaled=True)
    tx = StagedTxn(base, Layer(), chunk)
    tx.put_stream(StreamMeta(2, 1, 0, 0))
    chunk.keep()
    before = (dict(chunk.streams), {k: dict(v) for k, v in chunk.ranges.items()},
              dict(chunk.dropped), dict(chunk.counters))
    tx.put_stream(StreamMeta(2, 1, 5, 9))
    tx.put_range(RangeMeta(3, 0, 0, -1, 0, R1))
    tx.drop_ranges_below(1, 5)
    tx.next_id("c")
    chunk.undo()
    after = (chunk.streams, chunk.ranges, chunk.dropped, chunk.counters)
    assert after == before
    assert tx.ranges(1) == [base.r0, base.r1] and tx.counter("c") == 7


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
