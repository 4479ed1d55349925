"""Committed offsets survive a PM failover on etcd (three PMs, kill -9 of the leader), and a
group member carries on after it: it rejoins the new leader on UNKNOWN_MEMBER."""

from __future__ import annotations

from test_pm_etcd_cluster import (
    FAILOVER_BOUND_S,
    PmCluster,
    cluster,
    create_until_ok,
    etcd_server,
    wait_for_leader,
)
from waiting import eventually_async

from sbpstream.client.aclient import AsyncClient
from sbpstream.protocol.errors import SbpError

__all__ = ["cluster", "etcd_server"]  # pytest fixtures, re-exported


async def test_commits_survive_leader_failover(cluster: PmCluster) -> None:
    leader = await wait_for_leader(cluster.addresses)
    async with AsyncClient(cluster.addresses, request_timeout_ms=3000,
                           retry_deadline_ms=int(FAILOVER_BOUND_S * 1000)) as client:
        sids = await create_until_ok(client, 3, FAILOVER_BOUND_S)
        await client.commit_offsets("outside", {sids[0]: 7, sids[1]: 9})
        member = client.consumer(sids, group="inside", heartbeat_interval_ms=200,
                                 session_timeout_ms=5000, max_wait_ms=100)
        await member.fill(100)  # joins, gets every stream
        assert member.assignment == tuple(sorted(sids))
        await member.commit({sids[2]: 4})
        cluster.by_address(leader).kill()  # SIGKILL: the lease expires, another PM leads
        survivors = [a for a in cluster.addresses if a != leader]
        await wait_for_leader(survivors)
        got = await eventually_async(lambda: client.committed_offsets("outside"),
                                     timeout=FAILOVER_BOUND_S, retry_on=(SbpError,),
                                     what="offsets from the new leader")
        assert got == {sids[0]: 7, sids[1]: 9}
        assert await client.committed_offsets("inside") == {sids[2]: 4}
        # the member's next commit finds a leader that never heard of it: it rejoins, keeps
        # its streams (it reports them) and commits
        await member.commit({sids[2]: 6, sids[0]: 1})
        assert await client.committed_offsets("inside") == {sids[0]: 1, sids[2]: 6}
        assert member.assignment == tuple(sorted(sids))
        await member.close()
        assert sorted(await client.list_groups()) == ["inside", "outside"]
