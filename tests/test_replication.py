"""Replication and failover with real processes: a PM and 5 data nodes, replica_nums 3.

Under a steady append load a secondary is killed with SIGKILL, later the primary; afterwards every
acknowledged record is readable exactly once, in order, from every live replica of every range,
and writes have resumed. Bounds are generous (a loaded 2-core machine); the real failover time is
measured in the benchmarks.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from cluster_helpers import node_at, read_range
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import RangeSealedError, SbpError
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
    SealItem,
    SealRangesRequest,
    SealRangesResponse,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import build_batch
from sbpstream.records.builder import Record

PROGRESS_TIMEOUT_S = 60.0  # generous: detection + seal + new range on a loaded machine
MAX_RECORDS = 200_000  # the load loop's bound in count...
LOAD_SECONDS_MAX = 120.0  # ...and in time
REPLICA_BOUND_DEADLINE_MS = 2_000
"""The SDK's retry deadline when asking for more replicas than there are nodes: the answer is a
retriable NOT_ENOUGH_DATA_NODES, asked again until this deadline (the default 30 s is waited out
in full otherwise)."""


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:  # type: ignore[misc]
    c = LocalCluster(tmp_path, datanodes=5, heartbeat_interval_ms=200, node_timeout_ms=2000)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def wait_progress(acked: list[int], target: int, what: str) -> None:
    await eventually_async(lambda: len(acked) >= target, timeout=PROGRESS_TIMEOUT_S,
                           what=f"{target} acknowledged writes after {what}")


async def test_kill_secondary_then_primary_loses_nothing(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as client:
        sid = await client.create_stream(replica_nums=3)
        (r0,) = await client.list_ranges(sid)
        assert len(r0.replica_nodes) == 3
        assert len({rn.data_node.node_id for rn in r0.replica_nodes}) == 3

        acked: list[int] = []
        failed: list[BaseException] = []
        stop = asyncio.Event()

        async def load() -> None:
            producer = client.producer(linger_ms=2)
            t_end = time.monotonic() + LOAD_SECONDS_MAX
            pending: set[asyncio.Future[int]] = set()

            def done(i: int, f: asyncio.Future[int]) -> None:
                pending.discard(f)
                if f.exception() is not None:
                    failed.append(f.exception())  # type: ignore[arg-type]
                else:
                    acked.append(i)

            for i in range(MAX_RECORDS):
                if stop.is_set() or time.monotonic() > t_end:
                    break
                f = await producer.send(sid, f"r{i:07d}".encode())
                pending.add(f)
                f.add_done_callback(lambda f, i=i: done(i, f))
                if i % 200 == 199:
                    await asyncio.sleep(0.01)  # a steady load, not a flood
            await producer.flush()
            await producer.close()

        task = asyncio.ensure_future(load())
        await wait_progress(acked, 2000, "start")

        primary = next(rn for rn in r0.replica_nodes if rn.is_primary)
        secondary = next(rn for rn in r0.replica_nodes if not rn.is_primary)
        node_at(cluster, secondary.data_node.advertise_addr).kill()
        await wait_progress(acked, len(acked) + 3000, "killing a secondary")

        ranges = await client.list_ranges(sid)
        cur = ranges[-1]
        assert len(ranges) >= 2, "the range with a dead secondary was not sealed"
        cur_primary = next(rn for rn in cur.replica_nodes if rn.is_primary)
        assert cur_primary.data_node.advertise_addr != secondary.data_node.advertise_addr
        node_at(cluster, cur_primary.data_node.advertise_addr).kill()
        await wait_progress(acked, len(acked) + 3000, "killing the primary")
        stop.set()
        await asyncio.wait_for(task, PROGRESS_TIMEOUT_S)
        assert not failed, f"{len(failed)} records failed, first: {failed[0]!r}"
        del primary

        # seal the last range too, so every range has a final end on every replica
        ranges = await client.list_ranges(sid)
        assert len(ranges) >= 3, "the range with a dead primary was not sealed"
        await client.routing.seal(sid, ranges[-1].range_index)
        ranges = [r for r in await client.list_ranges(sid) if r.sealed]
        dead = {dn.address for dn in cluster.datanodes if not dn.running}
        stream: list[bytes] = []
        for rng in ranges:
            copies = []
            for rn in rng.replica_nodes:
                if rn.data_node.advertise_addr in dead:
                    continue
                copies.append(await read_range(rn.data_node.advertise_addr, rng))
            assert copies, f"range {rng.range_index} has no live replica"
            assert all(c == copies[0] for c in copies), f"replicas of {rng.range_index} differ"
            stream.extend(copies[0])
        expected = [f"r{i:07d}".encode() for i in sorted(acked)]
        assert len(stream) == len(set(stream)), "a record is stored twice"
        assert stream == expected, "acknowledged records lost or reordered"
        assert len(expected) >= 8000
        print(f"acked={len(expected)} ranges={len(ranges)}")


async def test_old_primary_refuses_writes_after_seal(cluster: LocalCluster) -> None:
    """A primary that did not hear of its seal from a writer still refuses once sealed."""
    async with AsyncClient(cluster.pm_address) as client:
        sid = await client.create_stream(replica_nums=3)
        (r0,) = await client.list_ranges(sid)
        primary = next(rn for rn in r0.replica_nodes if rn.is_primary).data_node.advertise_addr
        conn = await Connection.open(primary)
        batch = build_batch([Record(value=b"x", timestamp_ms=1)])

        async def append() -> AppendResponse:
            req = AppendRequest(timeout_ms=5000, items=(AppendItem(
                stream_id=sid, request_index=0, batch_length=len(batch), range_index=0),))
            f = await conn.request_one(Opcode.APPEND, req.encode(), batch, timeout_s=10)
            return AppendResponse.decode(f.header)

        first = await append()
        assert first.items[0].status.ok and first.items[0].base_offset == 0
        await client.routing.seal(sid, 0)  # another writer failed over: the PM sealed range 0
        again = await append()
        assert again.items[0].status.code == RangeSealedError.code
        await conn.aclose()


async def test_replica_count_bounds(tmp_path: Path) -> None:
    # more replicas than data nodes (one node, two replicas: no need to start five for six).
    # NOT_ENOUGH_DATA_NODES is retriable (nodes may be coming back): the SDK asks again until
    # its retry deadline, then raises that error; a short deadline keeps the wait short
    with LocalCluster(tmp_path, datanodes=1, heartbeat_interval_ms=200) as cluster:
        async with AsyncClient(cluster.pm_address,
                               retry_deadline_ms=REPLICA_BOUND_DEADLINE_MS) as client:
            with pytest.raises(SbpError, match=r"NOT_ENOUGH_DATA_NODES|INVALID_STREAM_CONFIG"):
                await client.create_stream(replica_nums=2)
            assert await client.create_stream(replica_nums=1) > 0  # as many as there are: fine


async def test_one_round_replicates_many_ranges_with_their_own_commits(tmp_path: Path) -> None:
    """Two ranges with the same primary and secondaries go out in shared rounds (one APPEND per
    secondary carrying both): each secondary gets each range's batches in order and learns each
    range's own committed offset, never the other's."""
    with LocalCluster(tmp_path, datanodes=3, heartbeat_interval_ms=200,
                      node_timeout_ms=20_000) as c:
        async with AsyncClient(c.pm_address) as client:
            by_primary: dict[str, list[int]] = {}
            while not any(len(v) >= 2 for v in by_primary.values()):
                sid = await client.create_stream(replica_nums=3)
                (r,) = await client.list_ranges(sid)
                addr = next(rn.data_node.advertise_addr for rn in r.replica_nodes
                            if rn.is_primary)
                by_primary.setdefault(addr, []).append(sid)
            addr, (a, b) = next((k, v[:2]) for k, v in by_primary.items() if len(v) >= 2)
            (ra,) = await client.list_ranges(a)
            secondaries = [rn.data_node.advertise_addr for rn in ra.replica_nodes
                           if not rn.is_primary]
        conn = await Connection.open(addr)

        async def append(counts: dict[int, int], tag: str) -> None:
            batches = {sid: build_batch([Record(value=f"{tag}{sid}-{i}".encode())
                                         for i in range(n)]) for sid, n in counts.items()}
            req = AppendRequest(timeout_ms=10_000, items=tuple(
                AppendItem(stream_id=sid, request_index=i, batch_length=len(batches[sid]))
                for i, sid in enumerate(counts)))
            frames = await conn.request(Opcode.APPEND, req.encode(), list(batches.values()),
                                        timeout_s=30)
            res = [r for f in frames for r in AppendResponse.decode(f.header).items]
            assert len(res) == len(counts) and all(r.status.ok for r in res), res

        async def high_watermark(sec: str, sid: int) -> int:
            s = await Connection.open(sec)
            try:
                req = FetchRequest(max_wait_ms=0, items=(FetchItem(
                    stream_id=sid, request_index=0, fetch_offset=0, batch_max_bytes=1 << 20),))
                frames = await s.request(Opcode.FETCH, req.encode(), timeout_s=10)
                items = [it for f in frames for it in FetchResponse.decode(f.header).items]
                return items[-1].high_watermark
            finally:
                await s.aclose()

        async def high_watermark_is(sec: str, sid: int, want: int) -> bool:
            return await high_watermark(sec, sid) == want

        try:
            await append({a: 3, b: 5}, "x")
            await append({a: 1, b: 1}, "y")  # carries the commits of the first append
            for sec in secondaries:
                for sid, want in ((a, 3), (b, 5)):
                    # the first append's commit, or already the second's (an idle commit round)
                    assert want <= await high_watermark(sec, sid) <= want + 1, (sec, sid)
            # no more writes: the idle primary still tells its secondaries the last commit,
            # so a reader of a secondary gets every acknowledged record
            for sec in secondaries:
                for sid, want in ((a, 4), (b, 6)):
                    await eventually_async(
                        lambda sec=sec, sid=sid, want=want: high_watermark_is(sec, sid, want),
                        timeout=30, what=f"high watermark {want} of {sid} on {sec}")
            pm = await Connection.open(c.pm_address)
            try:
                f = await pm.request_one(Opcode.SEAL_RANGES, SealRangesRequest(items=(
                    SealItem(a, 0), SealItem(b, 0))).encode(), timeout_s=30)
                results = SealRangesResponse.decode(f.header).items
            finally:
                await pm.aclose()
            for (sid, n), res in zip(((a, 4), (b, 6)), results, strict=True):
                assert res.status.ok, res.status
                sealed = res.ranges[0]  # every replica holds the same records, in order
                assert sealed.end_offset == n
                want = [f"x{sid}-{i}".encode() for i in range(n - 1)] + [f"y{sid}-0".encode()]
                for rep in sealed.replica_nodes:
                    assert await read_range(rep.data_node.advertise_addr, sealed) == want
        finally:
            await conn.aclose()
