"""A send that fails with its outcome unknown never lends its sequence to a later record (issue
33, in the network test bed).

Found by the soak of ``pm-cut-from-dns``: a batch failed at its deadline although its range held
it (the acknowledgement was what got lost). The producer then restarted the stream's sequence at
the failed batch's, so the next record carried the same producer sequence; the data node took
it for a retry of the stored batch and acknowledged it at that batch's offset. The new record
was never stored: an acknowledged record lost. Here the acknowledgement is lost on purpose: the
data node's packets to the client are dropped (one way) and the PM is cut from the data node,
so the single-replica range cannot be sealed and the send fails at its deadline.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from faultbed import FaultCluster
from netbed import TEST_PROCESS, require_root

from sbpstream.client import AsyncClient
from sbpstream.protocol.errors import SbpError

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(300)]

DEADLINE_MS = 3_000
"""The failing send's deadline: short, so the test does not wait long for it to fail."""

REQUEST_TIMEOUT_MS = 1_000


def test_a_record_after_a_failed_but_stored_send_is_stored_too(tmp_path: Path) -> None:
    require_root()
    with FaultCluster(tmp_path, metadata="sqlite") as c:
        asyncio.run(_lose_an_ack(c))


async def _lose_an_ack(c: FaultCluster) -> None:
    async with AsyncClient(c.pm_arg, retry_deadline_ms=DEADLINE_MS,
                           request_timeout_ms=REQUEST_TIMEOUT_MS) as client:
        sid = await client.admin.create_stream(replica_nums=1)
        async with client.producer(linger_ms=0) as p:
            a = await (await p.send(sid, b"a"))  # the connection to the primary is open
            (rng,) = await client.list_ranges(sid)
            host = c.dn_host(rng.replica_nodes[0].data_node.advertise_addr)
            c.bed.cut(host, TEST_PROCESS, one_way=True)  # its answers to us are dropped
            c.bed.split([host], c.pm_hosts)  # and the PM cannot seal its range
            try:
                fut_b = await p.send(sid, b"b")
                with pytest.raises(SbpError):
                    await fut_b  # stored on the node, but its acknowledgement never came
            finally:
                c.bed.heal()
            c_offset = await (await p.send(sid, b"c"))
        got = [(r.offset, bytes(r.value or b"")) async for r in client.consumer(
            sid, end=await client.end_offset(sid))]
        values = [v for _, v in got]
        assert values.count(b"c") == 1, got  # acknowledged: stored, once
        assert dict(got)[c_offset] == b"c", (c_offset, got)  # at the offset acknowledged
        assert dict(got)[a] == b"a"
        assert values.count(b"b") <= 1, got  # failed: stored at most once
