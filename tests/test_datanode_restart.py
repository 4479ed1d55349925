"""A data node that reconciles in the background after a restart (many ranges) stays correct.

In-process PM and data node. While the node is down, the PM seals one of its streams' range (as
its dead-node sweep would) and deletes another. The node restarts with its whole-node listing
held back: appends must already see the PM's decisions (they look the stream up first), and
reads of a stream not yet confirmed wait instead of serving what the PM may have cut off.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from raw_sbp import append_one, fetch
from waiting import eventually_async

from sbpstream.datanode import node as node_mod
from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.node import DataNodeServer
from sbpstream.net.client import Connection
from sbpstream.pm import metadata as md
from sbpstream.pm.config import PmConfig
from sbpstream.pm.server import PmServer
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import ErrorCode
from sbpstream.records import Record, build_batch

TIMEOUT_S = 10.0


def batch(n: int) -> bytes:
    return build_batch([Record(value=b"v%d" % i) for i in range(n)])


async def call(conn: Connection, req: m.Message, cls: type[m.Message]) -> m.Message:
    f = await conn.request_one(req.OPCODE, req.encode(), timeout_s=TIMEOUT_S)
    return cls.decode(f.header)


async def test_background_reconcile_applies_the_pms_decisions_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_mod, "RECONCILE_IN_BACKGROUND_RANGES", 0)
    pm = PmServer(PmConfig(port=0, metadata=f"sqlite:{tmp_path / 'pm.sqlite'}",
                           heartbeat_interval_ms=200, node_timeout_ms=60_000))
    await pm.start()
    cfg = DataNodeConfig(directory=tmp_path / "dn", pm=(pm.address,), heartbeat_interval_ms=200)
    dn = DataNodeServer(cfg)
    await dn.start()
    conn = await Connection.open(pm.address)
    try:
        r = await call(conn, m.CreateStreamsRequest(items=tuple(
            m.CreateStreamItem(1, 0) for _ in range(3))), m.CreateStreamsResponse)
        assert isinstance(r, m.CreateStreamsResponse)
        sealed, deleted, kept = (it.stream.stream_id for it in r.items if it.stream)
        node = await Connection.open(dn.address)
        for sid in (sealed, deleted, kept):
            assert (await append_one(node, sid, batch(2))).status.ok
        await node.aclose()
        await dn.close()

        # while the node is away: the PM seals `sealed` at 2 (a new range 1 on the same node)
        # and deletes `deleted`
        await pm.service.meta.seal_and_new(sealed, 0, 2, (md.ReplicaMeta(dn.node_id, True),),
                                           ())
        d = await call(conn, m.DeleteStreamsRequest(items=(m.Stream(stream_id=deleted),)),
                       m.DeleteStreamsResponse)
        assert isinstance(d, m.DeleteStreamsResponse) and d.items[0].status.ok

        release = asyncio.Event()
        reconcile = DataNodeServer._reconcile

        async def held(self: DataNodeServer, yield_every: int = 0) -> None:
            await release.wait()
            await reconcile(self, yield_every)

        monkeypatch.setattr(DataNodeServer, "_reconcile", held)
        dn = DataNodeServer(cfg)
        await asyncio.wait_for(dn.start(), TIMEOUT_S)  # listens before the listing
        assert not dn.reconciled.is_set()
        node = await Connection.open(dn.address)
        try:
            res = await append_one(node, sealed, batch(1), range_index=0)
            assert res.status.code == ErrorCode.RANGE_SEALED
            res = await append_one(node, sealed, batch(1))  # the last range: the PM's new one
            assert res.status.ok and res.base_offset == 2
            res = await append_one(node, deleted, batch(1))
            assert res.status.code == ErrorCode.STREAM_DELETED
            _, (got, *_), batches = await fetch(node, kept)  # not confirmed yet: nothing readable
            assert got.status.ok and not batches and got.high_watermark == -1
            release.set()
            await asyncio.wait_for(dn.reconciled.wait(), TIMEOUT_S)

            async def readable() -> bool:
                return len((await fetch(node, kept))[2]) == 1

            await eventually_async(readable, timeout=TIMEOUT_S, what="kept readable")
            res = await append_one(node, kept, batch(1))
            assert res.status.ok and res.base_offset == 2
            _, (got, *_), batches = await fetch(node, sealed)  # range 0 up to the PM's end, range 1
            assert got.status.ok and len(batches) == 2
        finally:
            await node.aclose()
    finally:
        await conn.aclose()
        await dn.close()
        await pm.close()
