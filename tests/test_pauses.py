"""Pauses and stale authority (docs/pm.md, docs/datanode.md: "Clocks, pauses and stale
authority").

A data node refuses SEAL_RANGES from a PM epoch below the highest it has seen, across its own
restart (sbpstream/datanode/pmfence.py): a PM leader paused past its lease, resumed while a
successor has sealed the range, cannot end the range on a replica at a stale end.

The PM's side (the epoch is the election's fencing token) is exercised by the etcd leader
tests and the network test bed; here the data node is driven directly with hand-made seals.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
from raw_sbp import REQUEST_TIMEOUT_S, append_ok, create_streams
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.datanode.pmfence import PM_EPOCH_FILE, PmEpochFence
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import ErrorCode, FencedLeaderError
from sbpstream.protocol.messages import (
    SealItem,
    SealRangesRequest,
    SealRangesResponse,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import build_batch
from sbpstream.records.builder import Record


async def _seal(addr: str, sid: int, end: int, epoch: int) -> SealRangesResponse:
    conn = await Connection.open(addr)
    try:
        f = await conn.request_one(Opcode.SEAL_RANGES, SealRangesRequest(
            timeout_ms=5000, items=(SealItem(sid, 0, end),), pm_epoch=epoch).encode(),
            timeout_s=REQUEST_TIMEOUT_S)
        return SealRangesResponse.decode(f.header)
    finally:
        await conn.aclose()


async def test_a_seal_from_a_lower_epoch_is_refused_and_changes_nothing(
        tmp_path: Path) -> None:
    with LocalCluster(tmp_path, datanodes=1) as c:
        (sid,) = await create_streams(c.pm_address)
        addr = c.datanodes[0].address  # the only replica
        conn = await Connection.open(addr)
        try:
            await append_ok(conn, sid, [build_batch([Record(value=b"v%d" % i)]) for i in range(4)])
        finally:
            await conn.aclose()
        # a successor PM (epoch 7) stops the range here
        stop = await _seal(addr, sid, -1, 7)
        assert stop.items[0].status.ok, stop.items[0].status
        # the deposed leader (epoch 5) resumes and sends its final seal at a stale end
        stale = await _seal(addr, sid, 1, 5)
        assert stale.items[0].status.code == ErrorCode.FENCED_LEADER, stale.items[0].status
        assert "epoch 5" in stale.items[0].status.message
        # the node restarts: the epoch it saw is on disk, the stale seal is still refused
        dn = c.datanodes[0]
        dn.stop()
        dn.start()
        dn.wait_ready()
        assert json.loads((tmp_path / "dn0" / PM_EPOCH_FILE).read_text())["epoch"] == 7
        stale = await _seal(addr, sid, 1, 5)
        assert stale.items[0].status.code == ErrorCode.FENCED_LEADER
        # the current leader seals at the end it chose: all four records stay
        final = await _seal(addr, sid, 4, 7)
        assert final.items[0].status.ok, final.items[0].status
        assert final.items[0].ranges[0].end_offset == 4


def test_the_epoch_file_is_versioned_and_a_newer_format_is_refused(tmp_path: Path) -> None:
    fence = PmEpochFence(tmp_path)
    assert fence.highest == 0
    fence.admit(0)
    assert not (tmp_path / PM_EPOCH_FILE).exists()  # epoch 0 (no election) writes nothing
    fence.admit(3)
    assert PmEpochFence(tmp_path).highest == 3
    with pytest.raises(FencedLeaderError):
        fence.admit(2)
    (tmp_path / PM_EPOCH_FILE).write_text(json.dumps({"format": 99, "epoch": 4}))
    with pytest.raises(RuntimeError, match="format 99, this build reads format 1"):
        PmEpochFence(tmp_path)
    (tmp_path / PM_EPOCH_FILE).write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        PmEpochFence(tmp_path)


async def test_a_pm_paused_past_the_node_timeout_seals_nothing_when_it_resumes(
        tmp_path: Path) -> None:
    """A lone (SQLite) PM stopped for three node timeouts: the heartbeats sent meanwhile wait
    unread in its sockets, so its first sweep after SIGCONT would find every node silent. The
    sweep notices its own stall and does not count it against the nodes."""
    with LocalCluster(tmp_path, datanodes=2, heartbeat_interval_ms=100,
                      node_timeout_ms=600) as c:
        async with AsyncClient(c.pm_address) as client:
            sid = await client.create_stream(replica_nums=2)
            async with client.producer() as p:
                await p.send(sid, b"before")
            assert c.pm.proc is not None
            c.pm.proc.send_signal(signal.SIGSTOP)
            try:
                # three node timeouts of wall time, waited on the data nodes' side: each has
                # sent heartbeats the stopped PM cannot read
                await asyncio.sleep(3 * 0.6)
            finally:
                c.pm.proc.send_signal(signal.SIGCONT)
            await eventually_async(lambda: "event=pm_stall_excused" in c.pm.log_tail(200),
                                   timeout=20, what="the PM's sweep notices its stall")
            async with client.producer() as p:
                await p.send(sid, b"after")
            ranges = await client.list_ranges(sid)
            assert [r.range_index for r in ranges] == [0], ranges
            assert "dead_node_ranges_renewed" not in c.pm.log_tail(500)
