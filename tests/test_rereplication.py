"""Re-replication with real processes: a PM and 4 data nodes, replica_nums 3.

Range 0 is filled, sealed (SEAL_AND_NEW), then one of its replicas is killed with SIGKILL. The PM
notices the node is dead for good, picks the fourth node, which copies the sealed range from a
survivor; the PM then lists range 0 on 3 live nodes again, and the new copy holds exactly the
records of the sealed range.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_helpers import node_at, read_range
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.pm.metadata import NewStream, ReplicaMeta
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol.errors import InvalidRequestError, RangeNotFoundError
from sbpstream.protocol.messages import Range

REPAIR_TIMEOUT_S = 60.0  # generous: dead-for-good detection + a repair pass on a loaded machine
RECORDS = 2000


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:  # type: ignore[misc]
    c = LocalCluster(tmp_path, datanodes=4, heartbeat_interval_ms=200, node_timeout_ms=1500)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def test_sealed_range_is_rereplicated_after_replica_dies(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=60_000) as client:
        sid = await client.create_stream(replica_nums=3)
        producer = client.producer(linger_ms=2)
        futs = [await producer.send(sid, f"v{i:06d}".encode()) for i in range(RECORDS)]
        await producer.flush()
        await producer.close()
        offsets = [await f for f in futs]
        assert sorted(offsets) == list(range(RECORDS))

        await client.routing.seal(sid, 0)
        r0 = (await client.list_ranges(sid))[0]
        assert r0.sealed and r0.end_offset == RECORDS
        before = {rn.data_node.node_id for rn in r0.replica_nodes}
        assert len(before) == 3
        victim = next(rn for rn in r0.replica_nodes if not rn.is_primary).data_node
        node_at(cluster, victim.advertise_addr).kill()

        async def repaired_range() -> Range | None:
            rng = (await client.list_ranges(sid))[0]
            ids = {rn.data_node.node_id for rn in rng.replica_nodes}
            return rng if len(ids) == 3 and victim.node_id not in ids else None

        repaired = await eventually_async(repaired_range, timeout=REPAIR_TIMEOUT_S,
                                          interval=0.2, what="range 0 re-replicated")
        assert repaired.end_offset == RECORDS

        dead = {dn.address for dn in cluster.datanodes if not dn.running}
        addrs = [rn.data_node.advertise_addr for rn in repaired.replica_nodes]
        assert not dead & set(addrs), "a dead node is still listed"
        (new_id,) = {rn.data_node.node_id for rn in repaired.replica_nodes} - before
        new_addr = next(rn.data_node.advertise_addr for rn in repaired.replica_nodes
                        if rn.data_node.node_id == new_id)
        survivor = next(a for a in addrs if a != new_addr)
        copied = await read_range(new_addr, repaired)
        original = await read_range(survivor, repaired)
        assert copied == original
        assert copied == [f"v{i:06d}".encode() for i in range(RECORDS)]


async def test_sqlite_replace_replica(tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "pm.sqlite")
    await store.open()
    try:
        reps = (ReplicaMeta(1, True), ReplicaMeta(2, False), ReplicaMeta(3, False))
        await store.create_streams([NewStream(2, 0, reps)], 1)
        with pytest.raises(InvalidRequestError):  # writable ranges are not re-replicated
            await store.replace_replica(1, 0, 2, 4)
        await store.seal_and_new(1, 0, 10, reps, [])
        got = await store.replace_replica(1, 0, 2, 4)
        assert got.node_ids == (1, 3, 4) and got.end_offset == 10
        again = await store.replace_replica(1, 0, 2, 4)  # idempotent
        assert again == got
        assert [r.range_index for r in await store.list_node_ranges(2)] == [1]
        assert [r.range_index for r in await store.list_node_ranges(4)] == [0]
        with pytest.raises(InvalidRequestError):
            await store.replace_replica(1, 0, 3, 1)  # node 1 already holds it
        with pytest.raises(RangeNotFoundError):
            await store.replace_replica(1, 7, 2, 4)
    finally:
        await store.close()
