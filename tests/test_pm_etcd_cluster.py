"""Several PM processes on one real etcd: one leader, redirects, kill -9 failover, fencing.

Each test starts its own three ``python -m sbpstream.pm --metadata etcd://...`` processes (own
key prefix) and one data node that knows all three; every loop is bounded and every process is
stopped at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
from etcd_fixture import EtcdServer, require_etcd
from waiting import eventually_async

from sbpstream.client.aclient import AsyncClient
from sbpstream.cluster import Node
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import PmNotLeaderError, SbpError

LEASE_TTL_S = 2
"""Short lease so failovers in the tests take about two seconds."""

FAILOVER_BOUND_S = 20.0
"""Generous bound on "a new leader serves": lease TTL + election + one data node heartbeat,
on a loaded 2-core box."""

LOAD_CREATES_MAX = 400
"""Upper bound on CREATE_STREAMS calls of the load loop (it normally stops far earlier)."""

_prefixes = itertools.count(1)


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    require_etcd()
    with EtcdServer() as server:
        yield server


@dataclass
class PmCluster:
    pms: list[Node]
    dn: Node

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.pms]

    def by_address(self, address: str) -> Node:
        return next(p for p in self.pms if p.address == address)


@pytest.fixture
async def cluster(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[PmCluster]:
    url = etcd_server.url(f"/cluster{next(_prefixes)}") + f"?lease_ttl_s={LEASE_TTL_S}"
    ports = [free_port() for _ in range(3)]
    # pm0 and pm1 run `python -m sbpstream.pm`, pm2 the CLI (`sbpstream pm`): both entry points.
    pms = [
        Node("pm" if i < 2 else "cli", f"pm{i}", port,
             [*([] if i < 2 else ["pm"]), "--port", str(port), "--metadata", url,
              "--heartbeat-interval-ms", "200", "--node-timeout-ms", "5000"],
             tmp_path / f"pm{i}.log")
        for i, port in enumerate(ports)
    ]
    dn_port = free_port()
    dn = Node("datanode", "dn0", dn_port,
              ["--dir", str(tmp_path / "dn0"), "--port", str(dn_port),
               "--pm", ",".join(p.address for p in pms), "--heartbeat-interval-ms", "200",
               "--fsync", "none"],
              tmp_path / "dn0.log")
    nodes = [*pms, dn]
    try:
        for n in pms:
            n.start()
        for n in pms:
            await asyncio.to_thread(n.wait_ready)
        dn.start()
        await asyncio.to_thread(dn.wait_ready)
        yield PmCluster(pms, dn)
    finally:
        for n in nodes:
            n.resume()
            n.stop()


async def probe(address: str) -> str | None:
    """None if the PM at ``address`` serves as leader; else the leader it names ('' unknown).
    Raises on connection failures."""
    conn = await Connection.open(address, connect_timeout_s=2.0)
    try:
        req = m.DescribeStreamsRequest(timeout_ms=2000, limit=1)
        await conn.request_one(req.OPCODE, req.encode(), timeout_s=5.0)
        return None
    except PmNotLeaderError as e:
        return e.detail.decode()
    finally:
        await conn.aclose()


async def wait_for_leader(addresses: list[str], timeout_s: float = FAILOVER_BOUND_S) -> str:
    """The one PM serving as leader, once every other named one points at it."""

    async def single_leader() -> str | None:
        last: dict[str, str | Exception | None] = {}
        for a in addresses:
            try:
                last[a] = await probe(a)
            except (SbpError, OSError) as e:
                last[a] = e
        leaders = [a for a, v in last.items() if v is None]
        if len(leaders) == 1 and all(last[a] == leaders[0] for a in addresses if a != leaders[0]):
            return leaders[0]
        return None

    return await eventually_async(single_leader, timeout=timeout_s, interval=0.1,
                                  what=f"a single leader among {addresses}")


async def create_until_ok(client: AsyncClient, count: int, timeout_s: float) -> list[int]:
    """Create streams, retrying while the data node is not yet live at a new leader."""
    return await eventually_async(lambda: client.create_streams(count), timeout=timeout_s,
                                  interval=0.1, retry_on=(SbpError,), what="CREATE_STREAMS")


async def test_one_leader_followers_redirect(cluster: PmCluster) -> None:
    leader = await wait_for_leader(cluster.addresses)
    followers = [a for a in cluster.addresses if a != leader]
    for f in followers:
        conn = await Connection.open(f)
        try:
            req = m.CreateStreamsRequest(timeout_ms=2000, items=(m.CreateStreamItem(1, 0),))
            with pytest.raises(PmNotLeaderError) as ei:
                await conn.request_one(req.OPCODE, req.encode(), timeout_s=5.0)
            assert ei.value.detail.decode() == leader
            hb = m.HeartbeatRequest(client_id="t", client_role=m.ClientRole.CLIENT)
            with pytest.raises(PmNotLeaderError):
                await conn.request_one(hb.OPCODE, hb.encode(), timeout_s=5.0)
        finally:
            await conn.aclose()
    # The SDK given only a follower follows the redirect to the leader.
    async with AsyncClient(followers[0], retry_deadline_ms=15_000) as client:
        ids = await create_until_ok(client, 3, FAILOVER_BOUND_S)
        assert len(set(ids)) == 3
        assert [s.stream_id for s in await client.describe_streams(ids)] == ids


async def test_kill_leader_under_load_loses_nothing(cluster: PmCluster) -> None:
    leader = await wait_for_leader(cluster.addresses)
    acked: list[int] = []
    failures = 0
    killed = False
    ok_after_kill = False
    async with AsyncClient(cluster.addresses, request_timeout_ms=3000,
                           retry_deadline_ms=int(FAILOVER_BOUND_S * 1000)) as client:
        await create_until_ok(client, 1, FAILOVER_BOUND_S)
        for _ in range(LOAD_CREATES_MAX):
            if not killed and len(acked) >= 100:
                cluster.by_address(leader).kill()  # SIGKILL: no resignation, the lease expires
                killed = True
            try:
                ids = await client.create_streams(5)
            except SbpError:
                failures += 1
                await asyncio.sleep(0.05)
                continue
            acked.extend(ids)
            ok_after_kill = ok_after_kill or killed
            if ok_after_kill and len(acked) >= 200:
                break
        # served again after the kill (the failover time is bench.bench_pm_etcd's figure)
        assert killed and ok_after_kill
        survivors = [a for a in cluster.addresses if a != leader]
        new_leader = await wait_for_leader(survivors)
        assert new_leader != leader
        # Every acknowledged stream is describable at the new leader, and no id was reused.
        assert len(set(acked)) == len(acked)
        described = await client.describe_streams(acked)
        assert [s.stream_id for s in described] == acked
    print(f"acked={len(acked)} failed_calls={failures}")


async def test_paused_leader_is_fenced(cluster: PmCluster) -> None:
    """SIGSTOP the leader past its lease, let another take over and write, resume the old one:
    it must not act as leader (no write of its own lands) and redirects to the new leader."""
    old = await wait_for_leader(cluster.addresses)
    async with AsyncClient(cluster.addresses, request_timeout_ms=3000,
                           retry_deadline_ms=int(FAILOVER_BOUND_S * 1000)) as client:
        before = await create_until_ok(client, 2, FAILOVER_BOUND_S)
        old_node = cluster.by_address(old)
        old_node.pause()
        try:
            survivors = [a for a in cluster.addresses if a != old]
            new = await wait_for_leader(survivors)
            during = await create_until_ok(client, 3, FAILOVER_BOUND_S)
        finally:
            old_node.resume()
        # Resumed: its lease is gone; it answers as a follower at once, naming the new leader.
        conn = await Connection.open(old)
        try:
            req = m.CreateStreamsRequest(timeout_ms=2000, items=(m.CreateStreamItem(1, 0),) * 4)
            with pytest.raises(PmNotLeaderError) as ei:
                await conn.request_one(req.OPCODE, req.encode(), timeout_s=5.0)
            assert ei.value.detail.decode() in ("", new)
        finally:
            await conn.aclose()
        assert await wait_for_leader(cluster.addresses) == new
        after = await create_until_ok(client, 1, FAILOVER_BOUND_S)
        listed = [s.stream_id for s in await client.list_streams()]
        # Exactly the acknowledged streams exist: the old leader wrote nothing after its pause.
        assert listed == sorted(before + during + after)
        assert len(set(listed)) == len(listed)
    assert "event=leader_lost" in old_node.log_tail(200)


async def node_rows(address: str) -> list[dict[str, object]]:
    """The ``nodes`` of the PM's INFO (the overview ``sbpstream nodes`` shows)."""
    conn = await Connection.open(address, connect_timeout_s=2.0)
    try:
        frame = await conn.request_one(m.InfoRequest.OPCODE, m.InfoRequest().encode(),
                                       timeout_s=5.0)
        rows: list[dict[str, object]] = json.loads(bytes(frame.payload))["nodes"]
        return rows
    finally:
        await conn.aclose()


STORED_LIVENESS_BOUND_S: Final = 5.0 + 5.0 + 0.2 + 10.0
"""A stopped node stops being live at a follower within the node timeout (5 s) plus the
soft-state flush lag (5 s + one 0.2 s heartbeat interval: pm/liveness.py), plus slack for a
loaded box."""


async def test_followers_report_a_live_node_live(cluster: PmCluster) -> None:
    """Heartbeats reach the leader only; a follower's overview reads the heartbeat times the
    leader persisted in etcd, so it shows the running data node live, not silent, and shows it
    no longer live once it stops."""
    leader = await wait_for_leader(cluster.addresses)
    followers = [a for a in cluster.addresses if a != leader]

    async def live_everywhere() -> bool | None:
        for a in cluster.addresses:
            rows = await node_rows(a)
            if len(rows) != 1 or rows[0]["live"] is not True:
                return None
        return True

    await eventually_async(live_everywhere, timeout=FAILOVER_BOUND_S, interval=0.2,
                           what="the data node live at the leader and at both followers")
    for f in followers:
        (row,) = await node_rows(f)
        assert row["address"] == cluster.dn.address and row["dead"] is False
        assert isinstance(row["last_heartbeat_s"], float)

    await asyncio.to_thread(cluster.dn.stop)

    async def gone_at_followers() -> bool | None:
        rows = [await node_rows(f) for f in followers]
        return True if all(r[0]["live"] is False for r in rows) else None

    await eventually_async(gone_at_followers, timeout=STORED_LIVENESS_BOUND_S, interval=0.2,
                           what="the stopped data node no longer live at the followers")
