"""A primary cut off from the PM cannot keep accepting writes after the seal.

Every data node sits behind two proxies the test controls: one for its traffic to the PM, one
for traffic to it (its advertised address). A writer holds a direct connection to the primary's
real port, so it keeps talking to the primary after the partition. The test cuts only the
primary's proxies: the PM stops hearing from it, declares it dead, seals range 0 on the
secondaries it can reach and opens range 1 elsewhere. The old primary's next write must be
refused; nothing it acknowledged before is lost.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tcp_proxy import TcpProxy
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.messages import AppendItem, AppendRequest, AppendResponse, Range
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import build_batch
from sbpstream.records.builder import Record

SEAL_TIMEOUT_S = 60.0  # generous: node timeout + sweep + seal on a loaded machine


async def test_partitioned_primary_refuses_writes_after_seal(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, datanodes=0, heartbeat_interval_ms=200,
                           node_timeout_ms=1500)
    proxies: list[tuple[TcpProxy, TcpProxy]] = []
    try:
        cluster.pm.start()
        cluster.pm.wait_ready()
        # Bind every proxy first, then pick the data nodes' ports: a port picked before a proxy
        # binds could be handed to that proxy (free_port only probes).
        for _ in range(4):
            to_pm = await TcpProxy(cluster.pm_address).start()
            to_dn = await TcpProxy("127.0.0.1:1").start()  # target set below
            proxies.append((to_pm, to_dn))
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        for port, (to_pm, to_dn) in zip(sorted(ports), proxies, strict=True):
            to_dn.target = ("127.0.0.1", port)
            node = cluster.add_datanode(port, pm_address=to_pm.address, advertise=to_dn.address)
            node.start()
        for node in cluster.datanodes:
            await asyncio.to_thread(node.wait_ready)

        async with AsyncClient(cluster.pm_address, retry_deadline_ms=60_000) as client:
            sid = await client.create_stream(replica_nums=3)
            (r0,) = await client.list_ranges(sid)
            primary_adv = next(rn for rn in r0.replica_nodes if rn.is_primary)
            idx = next(i for i, (_, to_dn) in enumerate(proxies)
                       if to_dn.address == primary_adv.data_node.advertise_addr)
            writer = await Connection.open(cluster.datanodes[idx].address)  # the real port

            async def append(n: int) -> AppendResponse:
                batch = build_batch([Record(value=f"v{n}".encode(), timestamp_ms=1)])
                req = AppendRequest(timeout_ms=10_000, items=(AppendItem(
                    stream_id=sid, request_index=0, batch_length=len(batch), range_index=0),))
                f = await writer.request_one(Opcode.APPEND, req.encode(), batch, timeout_s=30)
                return AppendResponse.decode(f.header)

            for n in range(5):
                ok = await append(n)
                assert ok.items[0].status.ok and ok.items[0].base_offset == n

            to_pm, to_dn = proxies[idx]
            to_pm.cut()  # the primary no longer reaches the PM ...
            to_dn.cut()  # ... and neither the PM nor anyone else reaches it

            async def sealed() -> list[Range] | None:
                ranges = await client.list_ranges(sid)
                return ranges if len(ranges) >= 2 and ranges[0].sealed else None

            ranges = await eventually_async(sealed, timeout=SEAL_TIMEOUT_S, interval=0.2,
                                            what="the PM sealing the cut-off range")
            assert ranges[0].end_offset == 5, "acknowledged records were cut off by the seal"

            refused = await append(99)
            code = refused.items[0].status.code
            assert code in (ErrorCode.RANGE_SEALED, ErrorCode.REPLICA_UNAVAILABLE), code
            assert refused.items[0].base_offset == -1

            # writers that follow the PM carry on in range 1 on reachable nodes
            p = client.producer(linger_ms=1)
            fut = await p.send(sid, b"after")
            await p.flush()
            assert await asyncio.wait_for(fut, 30) == 5
            await p.close()
            await writer.aclose()
    finally:
        for a, b in proxies:
            await a.close()
            await b.close()
        cluster.stop()
