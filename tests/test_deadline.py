"""A request's ``timeout_ms`` bounds the replication done on its behalf (issue 15).

An R=2 stream whose secondary is stopped (SIGSTOP): an APPEND with a short ``timeout_ms`` is
answered TIMEOUT instead of waiting for a replication bound of its own; its round is abandoned
(the range breaks), and its retry, a duplicate of a batch the primary holds but no secondary
confirmed, is not acknowledged. Through the SDK, a producer with a short request timeout loses
nothing it was told was acknowledged while a secondary is stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster_helpers import node_at, read_range
from raw_sbp import append_one
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster, Node
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.messages import AppendResult
from sbpstream.records import build_batch
from sbpstream.records.builder import Record

BOUND_S = 60.0  # generous: a loaded 2-core machine
SHORT_TIMEOUT_MS = 300
PRODUCER_ID = 4242


@contextmanager
def stopped(node: Node) -> Iterator[None]:
    """SIGSTOP ``node`` for the block (SIGCONT after, whatever happens)."""
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)


def cluster_of(tmp_path: Path, datanodes: int) -> LocalCluster:
    return LocalCluster(tmp_path, datanodes=datanodes, heartbeat_interval_ms=200,
                        node_timeout_ms=2000)


async def append(conn: Connection, sid: int, batch: bytes, timeout_ms: int) -> AppendResult:
    return await append_one(conn, sid, batch, timeout_ms=timeout_ms, range_index=0,
                            timeout_s=BOUND_S)


async def test_short_timeout_append_times_out_and_its_retry_is_not_acknowledged(
        tmp_path: Path) -> None:
    cluster = cluster_of(tmp_path, 2)
    cluster.start()
    try:
        async with AsyncClient(cluster.pm_address) as client:
            sid = await client.create_stream(replica_nums=2)
            (r0,) = await client.list_ranges(sid)
            primary = next(rn for rn in r0.replica_nodes if rn.is_primary)
            secondary = next(rn for rn in r0.replica_nodes if not rn.is_primary)
            conn = await Connection.open(primary.data_node.advertise_addr)
            try:
                a = build_batch([Record(value=b"acked", timestamp_ms=1)],
                                producer_id=PRODUCER_ID, producer_epoch=0, base_sequence=0)
                first = await append(conn, sid, a, 10_000)
                assert first.status.ok, first.status
                b = build_batch([Record(value=b"timed-out", timestamp_ms=2)],
                                producer_id=PRODUCER_ID, producer_epoch=0, base_sequence=1)
                with stopped(node_at(cluster, secondary.data_node.advertise_addr)):
                    late = await append(conn, sid, b, SHORT_TIMEOUT_MS)
                    assert late.status.code == ErrorCode.TIMEOUT, late.status
                    # retried until the answer is not TIMEOUT: the primary holds the batch,
                    # no secondary does, so the duplicate must not be acknowledged; once the
                    # abandoned round broke the range it is REPLICA_UNAVAILABLE
                    retried: list[AppendResult] = []

                    async def settled() -> bool:
                        retried.append(await append(conn, sid, b, SHORT_TIMEOUT_MS))
                        return retried[-1].status.code != ErrorCode.TIMEOUT

                    await eventually_async(settled, timeout=BOUND_S,
                                           what="the retried APPEND to settle")
                    assert retried[-1].status.code == ErrorCode.REPLICA_UNAVAILABLE, retried
            finally:
                await conn.aclose()
            # the writer's move: seal; every replica holds exactly the sealed range
            await client.routing.seal(sid, 0)
            sealed = next(r for r in await client.list_ranges(sid) if r.range_index == 0)
            assert sealed.sealed
            copies = [await read_range(rn.data_node.advertise_addr, sealed)
                      for rn in sealed.replica_nodes]
            assert all(c == copies[0] for c in copies), copies
            assert copies[0] == [b"acked"], "acknowledged record lost or unacked one kept"
    finally:
        cluster.stop()


async def test_producer_with_short_timeout_loses_nothing_while_a_secondary_is_stopped(
        tmp_path: Path) -> None:
    cluster = cluster_of(tmp_path, 3)
    cluster.start()
    try:
        async with AsyncClient(cluster.pm_address, request_timeout_ms=1000,
                               retry_deadline_ms=int(BOUND_S * 1000)) as client:
            sid = await client.create_stream(replica_nums=2)
            (r0,) = await client.list_ranges(sid)
            secondary = next(rn for rn in r0.replica_nodes if not rn.is_primary)
            acked: dict[int, bytes] = {}
            failed: list[BaseException] = []
            stop = asyncio.Event()

            async def load() -> None:
                producer = client.producer(linger_ms=2)
                pending: set[asyncio.Future[int]] = set()

                def done(value: bytes, f: asyncio.Future[int]) -> None:
                    pending.discard(f)
                    exc = f.exception()
                    if exc is not None:
                        failed.append(exc)
                    else:
                        acked[f.result()] = value

                async with producer:
                    i = 0
                    t_end = time.monotonic() + 2 * BOUND_S
                    while not stop.is_set() and time.monotonic() < t_end:
                        value = f"v{i:07d}".encode()
                        f = await producer.send(sid, value)
                        pending.add(f)
                        f.add_done_callback(lambda f, v=value: done(v, f))
                        i += 1
                        if i % 100 == 0:
                            await asyncio.sleep(0.01)
                    await producer.flush()
                if pending:
                    await asyncio.wait(pending)

            task = asyncio.ensure_future(load())
            await eventually_async(lambda: len(acked) >= 500, timeout=BOUND_S,
                                   what="500 acknowledged records")
            with stopped(node_at(cluster, secondary.data_node.advertise_addr)):
                before = len(acked)
                await eventually_async(lambda: len(acked) >= before + 1000, timeout=BOUND_S,
                                       what="writes resumed with the secondary stopped")
            stop.set()
            await asyncio.wait_for(task, BOUND_S)
            assert not failed, f"{len(failed)} sends failed, first: {failed[0]!r}"
            end = await client.end_offset(sid)
            seen: dict[int, bytes] = {}
            consumer = client.consumer(sid, "earliest", end=end)
            async for rec in consumer:
                seen[rec.offset] = rec.value or b""
            await consumer.close()
            assert len(set(seen.values())) == len(seen), "a record is stored twice"
            lost = [off for off, v in acked.items() if seen.get(off) != v]
            assert not lost, f"{len(lost)} acknowledged records lost, first at {lost[0]}"
    finally:
        cluster.stop()
