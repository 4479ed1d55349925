"""A pulling SDK consumer's fetch session through a seal of one of its streams and the failover
of another stream's primary (processes, R=2 on 3 data nodes).

Streams A and B share a primary, so one session holds both; C's primary is another node (not a
replica of B). A is sealed: the session of A and B goes on with B (A moves to its next range in
a session of its own). Then B goes idle and C's primary is killed: B's session is still the same
one, many rounds later (C moved to its replica), and every acknowledged record of the three
arrives exactly once, in order, including the last ones written after the kill (a consumer
moved to a secondary by an error learns the last commit from the idle primary's commit round).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import node_at
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.client.types import ConsumedRecord
from sbpstream.cluster import LocalCluster

PROGRESS_TIMEOUT_S = 60.0  # generous: failure detection + seal + new range on a loaded machine


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path, datanodes=3, heartbeat_interval_ms=200,
                      node_timeout_ms=2000) as c:
        yield c


async def primary(client: AsyncClient, sid: int) -> str:
    cur = (await client.list_ranges(sid))[-1]
    return next(rn.data_node.advertise_addr for rn in cur.replica_nodes if rn.is_primary)


def _pick(placed: list[tuple[int, str, set[str]]]) -> tuple[int, int, int] | None:
    """A and B with one primary P, B not replicated on C's primary K (its failover leaves B's
    range alone), K != P."""
    for a, pa, _ in placed:
        for b, pb, rb in placed:
            for c, pc, _ in placed:
                if len({a, b, c}) == 3 and pa == pb and pc != pa and pc not in rb:
                    return a, b, c
    return None


async def test_session_survives_a_seal_and_a_failover(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as client, \
            AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as reader:
        placed: list[tuple[int, str, set[str]]] = []  # (stream, primary, replicas)
        pick: tuple[int, int, int] | None = None
        for _ in range(24):
            sid = await client.create_stream(replica_nums=2)
            cur = (await client.list_ranges(sid))[-1]
            nodes = {rn.data_node.advertise_addr for rn in cur.replica_nodes}
            placed.append((sid, await primary(client, sid), nodes))
            pick = _pick(placed)
            if pick is not None:
                break
        assert pick is not None, f"no placement to test with: {placed}"
        a, b, c = pick
        shared, other = await primary(client, a), await primary(client, c)
        streams = (a, b, c)
        acked: dict[tuple[int, int], bytes] = {}
        got: list[ConsumedRecord] = []
        stop = asyncio.Event()
        active = set(streams)  # written to

        async def load() -> None:
            async with client.producer(linger_ms=2) as p:
                i = 0
                while not stop.is_set():
                    for sid in sorted(active):
                        value = f"{sid}-{i:07d}".encode()
                        f = await p.send(sid, value)
                        f.add_done_callback(
                            lambda f, v=value, s=sid: None if f.exception() else
                            acked.__setitem__((s, f.result()), v))
                    i += 1
                    if i % 50 == 0:
                        await asyncio.sleep(0.01)

        cons = reader.consumer(list(streams), "earliest", subscribe=False, max_wait_ms=100)

        async def consume() -> None:
            async for rec in cons:
                got.append(rec)

        producer = asyncio.ensure_future(load())
        consumer = asyncio.ensure_future(consume())

        def state() -> str:
            return f"acked {len(acked)}, received {len(got)}"

        def session_of(sid: int) -> tuple[str, int, int] | None:
            sub = cons.reader._sub  # a StreamReader here
            for f in [] if sub is None else sub.feeds:
                if sid in f.ranges:
                    return f.addr, f.session_id, f.epoch
            return None

        try:
            await eventually_async(lambda: len(got) >= 600,
                                   what=lambda: f"the consumer: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            before = session_of(b)
            assert before is not None and before[0] == shared and before[1] > 0
            assert session_of(a) is not None and session_of(a)[:2] == before[:2]  # type: ignore[index]
            (r0,) = await client.list_ranges(a)
            await client.routing.seal(a, r0.range_index)
            n = len(got)
            await eventually_async(lambda: len(got) >= n + 600,
                                   what=lambda: f"reads after the seal: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            mid = session_of(b)
            assert mid is not None and mid[:2] == before[:2] and mid[2] > before[2]
            assert session_of(a) != mid  # A left it for its next range
            # B goes idle (its writes would stall behind the kill and seal its range: a
            # failover of B itself); its session must outlive C's failover
            active.discard(b)
            await eventually_async(lambda: {k for k in acked if k[0] == b} <= {
                (r.stream_id, r.offset) for r in got if r.stream_id == b}, what=state,
                timeout=PROGRESS_TIMEOUT_S)
            before = session_of(b)  # type: ignore[assignment]
            assert before is not None and before[:2] == mid[:2]
            node_at(cluster, other).kill()
            c_at = sum(1 for r in got if r.stream_id == c)
            # C goes on at its replica, and B's session is still the same one
            await eventually_async(lambda: sum(1 for r in got if r.stream_id == c) >= c_at + 300,
                                   what=lambda: f"C read after the kill: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
            after = session_of(b)
            assert after is not None and after[:2] == before[:2], (before, after)
            assert after[2] > before[2]  # the same session, many incremental rounds later
            stop.set()
            await asyncio.wait_for(producer, PROGRESS_TIMEOUT_S)
            await eventually_async(lambda: set(acked) <= {(r.stream_id, r.offset) for r in got},
                                   what=lambda: f"every acknowledged record: {state()}",
                                   timeout=PROGRESS_TIMEOUT_S)
        finally:
            stop.set()
            consumer.cancel()
            producer.cancel()
            await asyncio.gather(consumer, producer, return_exceptions=True)
            await cons.close()
        for sid in streams:
            offsets = [r.offset for r in got if r.stream_id == sid]
            assert offsets == list(range(len(offsets))), f"a gap, duplicate or reorder in {sid}"
        received = {(r.stream_id, r.offset): r.value for r in got}
        assert all(received[k] == acked[k] for k in received if k in acked)
        missing = [k for k in acked if received.get(k) != acked[k]]
        assert not missing, f"{len(missing)} acknowledged records not received: {missing[:5]}"
        assert len(await client.list_ranges(a)) >= 2
