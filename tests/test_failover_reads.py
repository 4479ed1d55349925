"""Reads during a primary's failover, with real processes: a PM and exactly 3 data nodes.

SIGKILL of the primary of a replicated stream: a reader started right after the kill gets every
acknowledged record (from the surviving replicas), ``end_offset`` never reports less than it did
before, and the PM seals the dead range whether or not it can place a new one. With R=3 on 3
nodes no new range fits, so new writes get NOT_ENOUGH_DATA_NODES (docs/pm.md: no write is
acknowledged on fewer than replica_nums replicas); with R=2 on 3 nodes writes go on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cluster_helpers import node_at
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import NotEnoughDataNodesError

RECORDS = 300
SEAL_TIMEOUT_S = 60.0  # generous: detection (2 s) + seal on a loaded 2-core machine
READ_DEADLINE_MS = 60_000


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:  # type: ignore[misc]
    c = LocalCluster(tmp_path, datanodes=3, heartbeat_interval_ms=200, node_timeout_ms=2000)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _produce(client: AsyncClient, sid: int, first: int, n: int) -> list[int]:
    producer = client.producer(linger_ms=1)
    futs = [await producer.send(sid, f"r{i:05d}".encode()) for i in range(first, first + n)]
    await producer.flush()
    offsets = [await f for f in futs]
    await producer.close()
    return offsets


async def _read_all(pm: str, sid: int) -> tuple[int, list[bytes]]:
    """What ``sbpstream consume --from earliest`` does: a fresh client, the end, then read."""
    async with AsyncClient(pm, retry_deadline_ms=READ_DEADLINE_MS) as c:
        end = await c.end_offset(sid)
        values = [r.value or b"" async for r in c.consumer(sid, "earliest", end=end)]
    return end, values


@pytest.mark.parametrize("replicas", [3, 2])
async def test_reader_gets_every_acked_record_when_the_primary_dies(
    cluster: LocalCluster, replicas: int
) -> None:
    pm = cluster.pm_address
    async with AsyncClient(pm, retry_deadline_ms=READ_DEADLINE_MS) as client:
        sid = await client.create_stream(replica_nums=replicas)
        offsets = await _produce(client, sid, 0, RECORDS)
        assert offsets == list(range(RECORDS))
        end_before = await client.end_offset(sid)
        assert end_before == RECORDS
        (r0,) = await client.list_ranges(sid)
        primary = next(rn for rn in r0.replica_nodes if rn.is_primary)

        node_at(cluster, primary.data_node.advertise_addr).kill()

        # Right after the kill (before the PM noticed), and while it seals: every acked record.
        end, values = await _read_all(pm, sid)
        assert end >= end_before
        assert values == [f"r{i:05d}".encode() for i in range(RECORDS)]

        # describe (a fresh client each time: what the servers say) never goes backwards, and
        # the PM seals the dead range although it may not be able to place a new one.
        seen: list[int] = []

        async def sealed() -> bool:
            async with AsyncClient(pm, retry_deadline_ms=READ_DEADLINE_MS) as c:
                seen.append(await c.end_offset(sid))
                ranges = await c.list_ranges(sid)
            return ranges[0].sealed

        await eventually_async(sealed, timeout=SEAL_TIMEOUT_S, what="the dead range sealed")
        assert all(e >= end_before for e in seen), seen
        ranges = await client.list_ranges(sid)
        assert ranges[0].end_offset == RECORDS

        if replicas == 3:
            # 2 live nodes cannot hold a range of 3 replicas: no new range, a clear error.
            assert len(ranges) == 1
            async with AsyncClient(pm, retry_deadline_ms=1500) as c:
                with pytest.raises(NotEnoughDataNodesError):
                    await c.create_stream(replica_nums=3)
        else:
            more = await _produce(client, sid, RECORDS, 50)
            assert more == list(range(RECORDS, RECORDS + 50))
            assert await client.end_offset(sid) == RECORDS + 50

        end, values = await _read_all(pm, sid)
        assert values == [f"r{i:05d}".encode() for i in range(end)]
        assert end >= end_before


async def test_create_is_retried_through_not_enough_data_nodes(cluster: LocalCluster) -> None:
    """R=3 while one of 3 nodes is down: the create waits (retrying) until it is back."""
    pm = cluster.pm_address
    victim = cluster.datanodes[0]
    victim.kill()
    async with AsyncClient(pm, retry_deadline_ms=1500) as c:
        async def refused() -> bool:
            try:
                sid = await c.create_stream(replica_nums=3)
            except NotEnoughDataNodesError:
                return True
            await c.delete_stream(sid)  # created before the PM noticed the kill
            return False

        await eventually_async(refused, timeout=SEAL_TIMEOUT_S, what="the node counted dead")
    async with AsyncClient(pm, retry_deadline_ms=READ_DEADLINE_MS) as c:
        create = asyncio.ensure_future(c.create_stream(replica_nums=3))
        await asyncio.sleep(0)  # the create is under way (and being refused) ...
        victim.start()  # ... when the node comes back
        await asyncio.to_thread(victim.wait_ready)
        sid = await create
        (r0,) = await c.list_ranges(sid)
        assert len(r0.replica_nodes) == 3
