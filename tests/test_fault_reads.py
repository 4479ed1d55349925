"""Reads go on during a fault wherever a replica is reachable (issue 33), in the network test bed.

Found by the scenario ``dn-cut-from-pm``: a consumer tailing a writable range reads from its
primary. When that primary is cut from the PM (clients and peers still reach it), the PM declares
it dead, seals the range on the other replicas and opens a successor on live nodes; producers
move there at once (their next append fails replication and asks the PM). The cut primary never
hears of the seal, so it keeps answering the consumer "nothing new" at the range's end, and a
reader that trusted it waited there for good, after the heal too. A reader must learn from the
PM that its range ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from faultbed import DEADLINE_MS, FaultCluster
from netbed import require_root
from waiting import eventually_async

from sbpstream.client import AsyncClient

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(300)]

READ_ON_TIMEOUT_S = 60.0
"""Bound on the reader moving to the successor range: the node timeout (1.5 s) for the PM to
seal, plus the reader's recheck of an idle range, on a loaded 2-core box."""


@pytest.mark.parametrize("subscribe", [True, False], ids=["push", "pull"])
def test_a_reader_moves_past_a_range_sealed_behind_its_replicas_back(
        subscribe: bool, tmp_path: Path) -> None:
    require_root()
    with FaultCluster(tmp_path, metadata="sqlite") as c:
        asyncio.run(_tail_through_a_cut(c, subscribe))


async def _tail_through_a_cut(c: FaultCluster, subscribe: bool) -> None:
    async with AsyncClient(c.pm_arg, retry_deadline_ms=DEADLINE_MS) as client:
        sid = await client.admin.create_stream(replica_nums=2)
        async with client.producer() as p:
            for i in range(10):
                await p.send(sid, b"a%d" % i)
        got: list[bytes] = []
        consumer = client.consumer(sid, subscribe=subscribe)

        async def read() -> None:
            async for rec in consumer:
                got.append(bytes(rec.value or b""))

        task = asyncio.create_task(read())
        try:
            await eventually_async(lambda: len(got) == 10, timeout=READ_ON_TIMEOUT_S,
                                   what="the first ten records read")
            (first,) = await client.list_ranges(sid)
            primary = next(rn.data_node.advertise_addr for rn in first.replica_nodes
                           if rn.is_primary)
            host = c.dn_host(primary)
            c.bed.split([host], c.pm_hosts)
            try:
                async def sealed() -> bool:  # the PM found the primary dead and sealed range 0
                    return (await client.list_ranges(sid))[0].sealed

                await eventually_async(sealed, timeout=READ_ON_TIMEOUT_S,
                                       what="the PM seals the cut primary's range")
                async with client.producer() as p:
                    for i in range(10):
                        await p.send(sid, b"b%d" % i)
                await eventually_async(
                    lambda: len(got) == 20, timeout=READ_ON_TIMEOUT_S,
                    what=lambda: f"the reader moved to the successor range while {host} is cut "
                                 f"from the PM (read {len(got)} of 20)")
            finally:
                c.bed.heal()
            assert got == [b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await consumer.close()
