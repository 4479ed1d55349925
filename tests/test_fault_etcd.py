"""The PMs keep a leader while one etcd member is cut off (issue 33, in the network test bed).

Found by the scenario ``etcd-member-isolated``: every PM's etcd client starts on the first
endpoint that answers, the same member for all of them. Cut off silently, that member answered
nothing: requests timed out (DEADLINE_EXCEEDED, which did not move the client to another
endpoint) and the watch stream stayed open with nothing on it, so no PM could keep or win the
leadership although two of three etcd members were healthy. A PM must move to another member.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from faultbed import DEADLINE_MS, ETCD_HOSTS, FaultCluster
from netbed import require_root
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.protocol.errors import SbpError

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(300)]

LEADER_BACK_TIMEOUT_S = 60.0
"""Bound on a PM leading again with the first etcd member cut off: the request timeout (5 s)
to give up on that member, the gRPC keepalive (5 s + 2 s) to break its watch, a lease (2 s) and
an election, on a loaded 2-core box."""


def test_the_pms_lead_on_while_the_first_etcd_member_is_cut_off(tmp_path: Path) -> None:
    require_root()
    with FaultCluster(tmp_path, metadata="etcd") as c:
        first = ETCD_HOSTS[0]  # every PM's client started there
        c.bed.link_down(first)
        try:
            asyncio.run(_create_while_cut(c))
        finally:
            c.bed.heal()


async def _create_while_cut(c: FaultCluster) -> None:
    async with AsyncClient(c.pm_arg, retry_deadline_ms=DEADLINE_MS) as client:
        async def created() -> bool:
            try:
                await client.admin.create_stream()
            except SbpError:
                return False
            return True

        await eventually_async(created, timeout=LEADER_BACK_TIMEOUT_S,
                               what="a PM leads and creates a stream with etcd member e1 cut off")
