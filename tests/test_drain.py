"""Draining a data node with real processes (issue 33): a PM and 4 data nodes.

A producer writes to an R=2 and an R=3 stream while one node that holds ranges of both is
drained: the drain seals its writable ranges (the producer moves on to the successors), copies
its sealed ones elsewhere, and completes with no range listing the node. Every acknowledged
record is then read back exactly once at its offset; the node is stopped and ``check`` finds no
problem (no under-replicated or unreachable replica); the stopped node is removed. Refusals,
the mark across PM restarts, and the admin permission with security on are checked too.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import dev_certs, node_at, secure_client, secure_cluster
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.client.types import DrainStatus
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port
from sbpstream.protocol.errors import (
    AuthorizationFailedError,
    DataNodeNotFoundError,
    InvalidRequestError,
)
from sbpstream.tools.check import check_cluster

DRAIN_TIMEOUT_S = 40.0
"""Bound on a drain of a few ranges on a loaded machine (it takes a few sweeps of 200 ms)."""
DEADLINE_MS = 30_000
"""Client retry deadline: long enough to ride out seals and node restarts."""
BEFORE = 150
"""Records per stream written (and sealed into range 0) before the drain starts."""


@pytest.fixture
def admin_port() -> int:
    """The PM's admin HTTP port (/v1/nodes)."""
    return free_port()


@pytest.fixture
def cluster(tmp_path: Path, admin_port: int) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path, datanodes=4, heartbeat_interval_ms=200, node_timeout_ms=1500,
                     extra_pm_args=["--metrics-port", str(admin_port)])
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _ids(rng: object) -> set[int]:
    return {rn.data_node.node_id for rn in rng.replica_nodes}  # type: ignore[attr-defined]


async def _drained(client: AsyncClient, node: int) -> DrainStatus | None:
    (st,) = await client.admin.drain_status(node)
    return st if st.complete else None


async def test_drain_moves_every_range_while_a_producer_writes(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=DEADLINE_MS) as client:
        s2 = await client.create_stream(replica_nums=2)
        s3 = await client.create_stream(replica_nums=3)
        acked: dict[tuple[int, int], bytes] = {}
        producer = client.producer(linger_ms=2)
        for sid in (s2, s3):
            futs = [(await producer.send(sid, f"{sid}-pre-{i}".encode()), i)
                    for i in range(BEFORE)]
            await producer.flush()
            for f, i in futs:
                acked[(sid, await f)] = f"{sid}-pre-{i}".encode()
            await client.routing.seal(sid, 0)  # a sealed range with data: it is copied
        r2 = await client.list_ranges(s2)
        r3 = await client.list_ranges(s3)
        # a node holding ranges of both streams, the R=3 one's writable range among them (it
        # is on 3 of the 4 nodes, so it meets the 2 or more holding the R=2 stream's ranges)
        both = (_ids(r2[0]) | _ids(r2[-1])) & _ids(r3[-1])
        victim = min(both)
        victim_addr = next(rn.data_node.advertise_addr for r in [*r2, *r3]
                           for rn in r.replica_nodes if rn.data_node.node_id == victim)

        stop = asyncio.Event()
        sent = [0]

        async def write() -> None:
            n = 0
            while not stop.is_set():
                batch = []
                for sid in (s2, s3):
                    value = f"{sid}-live-{n}".encode()
                    batch.append((sid, value, await producer.send(sid, value)))
                n += 1
                if n % 20 == 0:
                    await producer.flush()
                    for sid, value, f in batch:
                        acked[(sid, await f)] = value
                    await asyncio.sleep(0.01)
                else:
                    for sid, value, f in batch:
                        acked[(sid, await f)] = value
                sent[0] = n

        writer = asyncio.create_task(write())
        await eventually_async(lambda: sent[0] >= 40, timeout=DRAIN_TIMEOUT_S,
                               what="the producer writing")
        started = await client.admin.drain_node(victim)
        assert started.draining and started.node_id == victim and started.ranges_left >= 2
        assert started.address == victim_addr
        done = await eventually_async(lambda: _drained(client, victim), timeout=DRAIN_TIMEOUT_S,
                                      interval=0.2, what=f"data node {victim} drained")
        assert done.ranges_left == 0 and done.writable_left == 0
        at_drain = sent[0]
        await eventually_async(lambda: sent[0] >= at_drain + 40, timeout=DRAIN_TIMEOUT_S,
                               what="the producer writing after the drain")
        stop.set()
        await writer
        await producer.flush()
        await producer.close()

        # the metadata: no range of any stream lists the node, and new ranges avoid it
        for sid in (s2, s3):
            ranges = await client.list_ranges(sid)
            assert all(victim not in _ids(r) for r in ranges), ranges
        assert len(await client.list_ranges(s3)) >= 3  # the drain sealed its writable range
        # every acknowledged record exactly once, at its offset
        for sid in (s2, s3):
            end = await client.end_offset(sid)
            got = {r.offset: r.value async for r in client.consumer(sid, "earliest", end=end)}
            mine = {off: v for (s, off), v in acked.items() if s == sid}
            assert len(mine) > BEFORE + 40
            for off, value in mine.items():
                assert got.get(off) == value, (sid, off)
            values = list(got.values())
            assert len(values) == len(set(values)), "a record was written twice"
            assert len(got) == end  # every offset below the end holds one record

        node_at(cluster, victim_addr).stop()
        report = await check_cluster(client)
        assert report.ok, [str(p) for p in report.problems]

        async def stopped() -> bool:
            (st,) = await client.admin.drain_status(victim)
            return not st.live

        await eventually_async(stopped, timeout=DRAIN_TIMEOUT_S, what="the node no longer live")
        await client.admin.remove_node(victim)
        with pytest.raises(DataNodeNotFoundError):
            await client.admin.drain_status(victim)
        assert (await check_cluster(client)).ok


async def test_refusals_and_the_mark_across_pm_restarts(cluster: LocalCluster,
                                                        admin_port: int) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=DEADLINE_MS) as client:
        sid = await client.create_stream(replica_nums=3)
        (r0,) = await client.list_ranges(sid)
        first, second = sorted(_ids(r0))[:2]
        with pytest.raises(DataNodeNotFoundError, match="data node 99 is unknown"):
            await client.admin.drain_node(99)
        with pytest.raises(DataNodeNotFoundError, match="no data node has the address"):
            await client.admin.drain_node("nowhere.invalid:1")
        with pytest.raises(InvalidRequestError, match="is not draining"):
            await client.admin.cancel_drain(first)
        with pytest.raises(InvalidRequestError, match="still holds 1 range"):
            await client.admin.remove_node(first)
        addr = next(rn.data_node.advertise_addr for rn in r0.replica_nodes
                    if rn.data_node.node_id == first)
        assert (await client.admin.drain_node(addr)).node_id == first  # by address
        with pytest.raises(InvalidRequestError, match=f"data node {first} is already draining"):
            await client.admin.drain_node(first)
        with pytest.raises(InvalidRequestError,
                           match=rf"would leave 2 live data node\(s\), but stream {sid} has 3 "
                                 rf"replicas.*--replicas 2"):
            await client.admin.drain_node(second)

        cluster.pm.stop()  # the mark is in the metadata: a new PM goes on draining
        cluster.pm.start()
        cluster.pm.wait_ready()
        assert [s.node_id for s in await client.admin.drain_status()] == [first]
        with pytest.raises(InvalidRequestError, match="already draining"):
            await client.admin.drain_node(first)
        await eventually_async(lambda: _drained(client, first), timeout=DRAIN_TIMEOUT_S,
                               interval=0.2, what=f"data node {first} drained after a restart")
        cancelled = await client.admin.cancel_drain(first)
        assert not cancelled.draining and cancelled.ranges_left == 0
        cluster.pm.stop()
        cluster.pm.start()
        cluster.pm.wait_ready()
        assert await client.admin.drain_status() == []
        (st,) = await client.admin.drain_status(first)
        assert not st.draining

        # the command line: drain with --wait (progress until drained), status, list, cancel
        pm = cluster.pm_address
        r = await asyncio.to_thread(_sbp, "node", "drain", str(second), "--wait", "--pm", pm)
        assert r.returncode == 0, r.stderr
        out = r.stdout.decode()
        assert f"data node {second} (" in out and "range(s) left" in out, out
        assert out.strip().splitlines()[-1].endswith(f"`sbpstream node remove {second}`"), out
        r = await asyncio.to_thread(_sbp, "node", "status", "--pm", pm)
        assert r.returncode == 0 and "drained" in r.stdout.decode(), r
        r = await asyncio.to_thread(_sbp, "node", "list", "--json", "--pm", pm)
        listed = {n["node_id"]: n for n in json.loads(r.stdout)["nodes"]}
        assert listed[second]["draining"] and listed[second]["ranges_left"] == 0
        assert not listed[first]["draining"] and listed[first]["ranges_left"] is None
        body = await asyncio.to_thread(_http_json, f"http://127.0.0.1:{admin_port}/v1/nodes")
        assert {n["node_id"]: (n["draining"], n["ranges_left"]) for n in body["nodes"]}[
            second] == (True, 0)
        r = await asyncio.to_thread(_sbp, "node", "drain", str(second), "--cancel", "--pm", pm)
        assert r.returncode == 0 and "drain cancelled" in r.stdout.decode(), r
        r = await asyncio.to_thread(_sbp, "node", "drain", "99", "--pm", pm)
        err = r.stderr.decode()
        assert r.returncode == 1 and len(err.strip().splitlines()) == 1, err
        assert "data node 99 is unknown" in err, err


def _http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _sbp(*args: str) -> subprocess.CompletedProcess[bytes]:
    exe = str(Path(sys.executable).with_name("sbpstream"))
    return subprocess.run([exe, *args], capture_output=True, timeout=60, check=False)


@pytest.fixture
def secure(tmp_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    certs = dev_certs(tmp_path_factory)
    with secure_cluster(tmp_path / "c", certs, datanodes=2, heartbeat_interval_ms=200,
                        node_timeout_ms=1500) as cluster:
        yield cluster, certs


async def test_secure_drain_needs_admin(secure: tuple[LocalCluster, Path]) -> None:
    cluster, certs = secure
    async with secure_client(cluster, certs) as admin:
        await admin.admin.add_user("bob", "bob-pw")
        await admin.admin.add_acl("bob", "create,delete,update,trim,describe,append,fetch",
                                  "*")  # everything but admin
        async with secure_client(cluster, certs, user="bob", password="bob-pw") as bob:
            with pytest.raises(AuthorizationFailedError, match="bob may not admin"):
                await bob.admin.drain_node(1)
            with pytest.raises(AuthorizationFailedError, match="bob may not admin"):
                await bob.admin.drain_status()
        st = await admin.admin.drain_node(1)
        assert st.draining and st.node_id == 1
        assert [s.node_id for s in await admin.admin.drain_status()] == [1]
        assert not (await admin.admin.cancel_drain(1)).draining
