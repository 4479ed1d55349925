"""A subscribing SDK consumer at R=3, through a seal and a SIGKILL of the primary (processes).

The producer and the subscriber run side by side; the subscriber must get every acknowledged
record exactly once, in order, and follow the stream to the ranges created after each event.

It used to fail under load (issue 16): the primary acknowledged and committed a replication round
answered after the seal had stopped the range, so the subscriber read records the seal then cut
(tests/test_replication_seal_race.py has the race on its own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import node_at
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.client.types import ConsumedRecord
from sbpstream.cluster import LocalCluster

PROGRESS_TIMEOUT_S = 60.0  # generous: failure detection + seal + new range on a loaded machine


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path, datanodes=4, heartbeat_interval_ms=200,
                      node_timeout_ms=2000) as c:
        yield c


async def test_subscriber_across_seal_and_primary_kill(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as client, \
            AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as reader:
        sid = await client.create_stream(replica_nums=3)
        acked: dict[int, bytes] = {}  # offset -> value, acknowledged to the producer
        got: list[ConsumedRecord] = []
        stop = asyncio.Event()

        async def load() -> None:
            async with client.producer(linger_ms=2) as p:
                i = 0
                while not stop.is_set():
                    value = f"r{i:07d}".encode()
                    f = await p.send(sid, value)
                    f.add_done_callback(
                        lambda f, v=value: None if f.exception() else acked.__setitem__(
                            f.result(), v))
                    i += 1
                    if i % 100 == 0:
                        await asyncio.sleep(0.01)

        async def consume() -> None:
            cons = reader.consumer(sid, "earliest", window_bytes=64 * 1024)
            try:
                async for rec in cons:
                    got.append(rec)
            finally:
                await cons.close()

        producer = asyncio.ensure_future(load())
        consumer = asyncio.ensure_future(consume())

        def state() -> str:
            why = ""
            if consumer.done() and not consumer.cancelled() and consumer.exception():
                why = f"; the consumer ended with {consumer.exception()!r}"
            return f"acked {len(acked)}, received {len(got)}{why}"

        try:
            await eventually_async(lambda: len(got) >= 1000,
                                   what=lambda: f"the subscriber: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            (r0,) = await client.list_ranges(sid)
            await client.routing.seal(sid, r0.range_index)
            n = len(acked)
            await eventually_async(lambda: len(acked) >= n + 1000 and len(got) >= n + 500,
                                   what=lambda: f"writes and reads after the seal: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            cur = (await client.list_ranges(sid))[-1]
            prim = next(rn for rn in cur.replica_nodes if rn.is_primary)
            node_at(cluster, prim.data_node.advertise_addr).kill()
            n = len(acked)
            await eventually_async(lambda: len(acked) >= n + 1000,
                                   what=lambda: f"writes after killing the primary: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            stop.set()
            await asyncio.wait_for(producer, PROGRESS_TIMEOUT_S)
            last = max(acked)
            await eventually_async(
                lambda: (bool(got) and got[-1].offset >= last) or consumer.done(),
                what=lambda: f"every acknowledged record: {state()}", timeout=PROGRESS_TIMEOUT_S)
        finally:
            stop.set()
            consumer.cancel()
            producer.cancel()
            await asyncio.gather(consumer, producer, return_exceptions=True)
        offsets = [r.offset for r in got]
        assert offsets == list(range(len(offsets))), "a gap, a duplicate or a reorder"
        by_offset = {r.offset: r.value for r in got}
        missing = [o for o in acked if by_offset.get(o) != acked[o]]
        assert not missing, f"{len(missing)} acknowledged records not received, e.g. {missing[:5]}"
        assert len(await client.list_ranges(sid)) >= 3
