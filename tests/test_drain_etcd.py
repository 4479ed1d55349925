"""A drain survives a leader change: two PM processes on one real etcd and two data nodes; a
node marked draining at one leader is still draining (and its ranges moved) at the next one."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Final

import pytest
from etcd_fixture import EtcdServer, require_etcd
from waiting import eventually_async

from sbpstream.client.aclient import AsyncClient
from sbpstream.cluster import Node
from sbpstream.net.ports import free_port
from sbpstream.protocol.errors import InvalidRequestError, SbpError

LEASE_TTL_S: Final = 2
"""Short lease: the follower takes over about two seconds after the leader stops."""
BOUND_S: Final = 30.0
"""Bound on a failover plus a drain pass, on a loaded 2-core box."""
_prefixes = itertools.count(1)


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    require_etcd()
    with EtcdServer() as server:
        yield server


@pytest.fixture
async def nodes(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[list[Node]]:
    url = etcd_server.url(f"/drain{next(_prefixes)}") + f"?lease_ttl_s={LEASE_TTL_S}"
    pms = []
    for i in range(2):
        port = free_port()
        pms.append(Node("pm", f"pm{i}", port,
                        ["--port", str(port), "--metadata", url, "--heartbeat-interval-ms",
                         "200", "--node-timeout-ms", "3000"], tmp_path / f"pm{i}.log"))
    dns = []
    for i in range(3):
        port = free_port()
        dns.append(Node("datanode", f"dn{i}", port,
                        ["--dir", str(tmp_path / f"dn{i}"), "--port", str(port),
                         "--pm", ",".join(p.address for p in pms),
                         "--heartbeat-interval-ms", "200", "--fsync", "none"],
                        tmp_path / f"dn{i}.log"))
    started = []
    try:
        for n in [*pms, *dns]:
            n.start()
            started.append(n)
        for n in started:
            await asyncio.to_thread(n.wait_ready)
        yield [*pms, *dns]
    finally:
        for n in started:
            n.stop()


async def test_drain_mark_survives_a_leader_change(nodes: list[Node]) -> None:
    pms = nodes[:2]
    addresses = ",".join(p.address for p in pms)
    async with AsyncClient(addresses, retry_deadline_ms=int(BOUND_S * 1000)) as client:
        sid = await eventually_async(lambda: client.create_stream(replica_nums=2),
                                     timeout=BOUND_S, interval=0.2, retry_on=(SbpError,),
                                     what="a stream created")
        (r0,) = await client.list_ranges(sid)
        victim = r0.replica_nodes[0].data_node.node_id
        assert (await client.admin.drain_node(victim)).draining
        leader = client.pm_leader
        next(p for p in pms if p.address == leader).stop()  # the follower takes over

        async def drained_elsewhere() -> bool:
            (st,) = await client.admin.drain_status(victim)
            return client.pm_leader != leader and st.complete

        await eventually_async(drained_elsewhere, timeout=BOUND_S, interval=0.2,
                               retry_on=(SbpError,), what="drained at the new leader")
        assert [s.node_id for s in await client.admin.drain_status()] == [victim]
        with pytest.raises(InvalidRequestError, match="already draining"):
            await client.admin.drain_node(victim)
        assert all(victim not in {rn.data_node.node_id for rn in r.replica_nodes}
                   for r in await client.list_ranges(sid))
        assert not (await client.admin.cancel_drain(victim)).draining
