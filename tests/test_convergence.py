"""Convergence of sealed ranges, and ``sbpstream check``, with real processes.

A replica that comes back without the data of a sealed range it is listed for (its store was
lost while it was down) seals the range at the PM's end and copies it from the other replica in
the background; ``check`` reports the replica while it is down and is clean once it converged,
and the copy holds exactly the records of the sealed range.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import node_at, read_range
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.tools.check import check_cluster

pytestmark = pytest.mark.adversity

CONVERGE_TIMEOUT_S = 60.0  # hang guard: a restart, a reconcile and a copy on a loaded machine
RECORDS = 3000


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:  # type: ignore[misc]
    # a long node timeout: the PM must not re-replicate elsewhere; the node converges by itself
    c = LocalCluster(tmp_path, datanodes=3, heartbeat_interval_ms=200, node_timeout_ms=60_000)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _cli_check(pm: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sbpstream.cli", "check", "--pm", pm,
                           "--timeout-ms", "5000"],
                          capture_output=True, text=True, timeout=120)


async def test_replica_without_a_sealed_range_copies_it_back(cluster: LocalCluster,
                                                              tmp_path: Path) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=60_000) as client:
        sid = await client.create_stream(replica_nums=2)
        async with client.producer(linger_ms=1) as producer:
            futs = [await producer.send(sid, f"v{i}".encode()) for i in range(RECORDS)]
            await producer.flush()
        assert [f.result() for f in futs] == list(range(RECORDS))
        await client.routing.seal(sid, 0)
        (sealed, *_) = await client.list_ranges(sid)
        assert sealed.end_offset == RECORDS
        assert (await check_cluster(client)).ok

        victim = node_at(cluster, sealed.replica_nodes[-1].data_node.advertise_addr)
        other = sealed.replica_nodes[0].data_node.advertise_addr
        victim.kill()
        down = _cli_check(cluster.pm_address)
        assert down.returncode == 1, down.stdout + down.stderr
        assert "unreachable" in down.stdout and victim.address in down.stdout

        shutil.rmtree(tmp_path / victim.name / "store")  # the store is lost, the node id kept
        victim.start()
        victim.wait_ready()

        async def clean() -> bool:
            return (await check_cluster(client)).ok

        await eventually_async(clean, timeout=CONVERGE_TIMEOUT_S, interval=0.2,
                               what="the replica converged")
        want = [f"v{i}".encode() for i in range(RECORDS)]
        assert await read_range(victim.address, sealed) == want
        assert await read_range(other, sealed) == want
    up = _cli_check(cluster.pm_address)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "0 problem(s)" in up.stdout
