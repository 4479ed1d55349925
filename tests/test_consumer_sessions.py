"""The SDK consumer changes its streams on a live subscription (a fetch session in push mode,
issue 17): ``set_streams`` and a group rebalance add and drop streams without starting over, and
a refused change (a session error, a limit) is recovered by a full subscription of the streams
it would have added, from the consumer's own positions: nothing skipped, nothing read twice.

The data node runs in the test's loop (fixtures of test_subscribe.py), so the tests read its own
state (subscriptions, sessions, updates) instead of guessing from timings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import test_subscribe
from test_subscribe import subs
from waiting import eventually_async

from sbpstream.client import AsyncClient, AsyncConsumer
from sbpstream.client import pull as pull_mod
from sbpstream.client import push as push_mod
from sbpstream.client.types import ConsumedRecord
from sbpstream.cluster import LocalCluster
from sbpstream.datanode import subscribe as subscribe_mod
from sbpstream.datanode.node import DataNodeServer

pm = test_subscribe.pm  # the fixtures: a PM process, and a data node in the test's loop
node = test_subscribe.node

TIMEOUT_S = 30.0


async def produce(client: AsyncClient, counts: dict[int, int], tag: str) -> None:
    async with client.producer(linger_ms=1) as p:
        for sid, n in counts.items():
            for i in range(n):
                await p.send(sid, f"{tag}-{sid}-{i}".encode())
        await p.flush()


class Reader:
    """Iterates a consumer in the background, keeping what it got per stream."""

    def __init__(self, cons: AsyncConsumer) -> None:
        self.cons = cons
        self.got: dict[int, list[ConsumedRecord]] = {}
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for rec in self.cons:
            self.got.setdefault(rec.stream_id, []).append(rec)

    def values(self, sid: int) -> list[bytes]:
        return [r.value for r in self.got.get(sid, [])]

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        """Wait for ``cond``; a consumer that ended (or failed) first fails at once."""

        def ready() -> bool:
            if self.task.done():
                self.task.result()
                raise AssertionError(f"the consumer ended before {what}")
            return cond()

        await eventually_async(ready, timeout=TIMEOUT_S, interval=0.01,
                               what=lambda: f"{what} (got {self.got})")

    async def close(self) -> None:
        await self.cons.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def want(sid: int, tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{sid}-{i}".encode() for i in range(n)]


def in_order(r: Reader) -> None:
    for sid, recs in r.got.items():
        offs = [x.offset for x in recs]
        assert offs == sorted(set(offs)), f"stream {sid}: a duplicate or a reorder"


async def test_set_streams_adds_and_drops_on_the_live_subscription(
        pm: LocalCluster, node: DataNodeServer) -> None:
    async with AsyncClient(pm.pm_address) as client:
        a, b, c = [await client.create_stream(replica_nums=1) for _ in range(3)]
        await produce(client, {a: 5, b: 5, c: 5}, "x")
        r = Reader(client.consumer([a, b], "earliest"))
        try:
            await r.until(lambda: len(r.values(a)) == 5 and len(r.values(b)) == 5, "a and b")
            s = subs(node)
            assert s.stats().subscriptions == 1 and s.updates == 0
            (session,) = s.by_session
            await r.cons.set_streams([a, b, c])
            await r.until(lambda: len(r.values(c)) == 5, "c, added")
            assert s.stats().subscriptions == 1 and s.updates == 1
            assert set(s.by_session) == {session}, "the subscription was started over"
            # drop a: its new records are not delivered; b and c go on where they were
            await r.cons.set_streams([b, c])
            await r.until(lambda: s.updates == 2, "the node to forget a")
            await produce(client, {a: 3, b: 3, c: 3}, "y")
            await r.until(lambda: len(r.values(b)) == 8 and len(r.values(c)) == 8, "b and c")
            assert r.values(a) == want(a, "x", 5)
            for sid in (b, c):
                assert r.values(sid) == want(sid, "x", 5) + want(sid, "y", 3)
            assert s.stats().subscriptions == 1 and set(s.by_session) == {session}
            assert s.stats().streams == 2
            in_order(r)
            # a stream added again starts from the consumer's start (earliest), once
            await r.cons.set_streams([a, b, c])
            await r.until(lambda: len(r.values(a)) == 13, "a, added again")
            assert r.values(a) == 2 * want(a, "x", 5) + want(a, "y", 3)
        finally:
            await r.close()


async def test_a_session_error_restarts_the_added_streams_in_full(
        pm: LocalCluster, node: DataNodeServer) -> None:
    async with AsyncClient(pm.pm_address) as client:
        a, b = [await client.create_stream(replica_nums=1) for _ in range(2)]
        await produce(client, {a: 4, b: 4}, "x")
        r = Reader(client.consumer([a], "earliest"))
        try:
            await r.until(lambda: len(r.values(a)) == 4, "a")
            s = subs(node)
            (session,) = s.by_session
            # the node's session moves on without the client (a lost answer, a replay)
            s.sessions.sessions[session].epoch += 1
            bad = s.sessions.bad_epoch
            await r.cons.set_streams([a, b])
            await r.until(lambda: len(r.values(b)) == 4, "b, after the refused change")
            assert s.sessions.bad_epoch == bad + 1
            assert s.stats().subscriptions == 2  # b in a full subscription of its own
            await produce(client, {a: 2, b: 2}, "y")
            await r.until(lambda: len(r.values(a)) == 6 and len(r.values(b)) == 6, "more")
            for sid in (a, b):
                assert r.values(sid) == want(sid, "x", 4) + want(sid, "y", 2)
            in_order(r)
        finally:
            await r.close()


async def test_a_change_past_the_limits_is_refused_and_recovered(
        pm: LocalCluster, node: DataNodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscribe_mod, "MAX_SUBSCRIPTION_STREAMS", 2)
    async with AsyncClient(pm.pm_address) as client:
        sids = [await client.create_stream(replica_nums=1) for _ in range(3)]
        await produce(client, dict.fromkeys(sids, 3), "x")
        r = Reader(client.consumer(sids[:2], "earliest"))
        try:
            await r.until(lambda: all(len(r.values(s)) == 3 for s in sids[:2]), "two streams")
            await r.cons.set_streams(sids)
            await r.until(lambda: len(r.values(sids[2])) == 3, "the third stream")
            s = subs(node)
            assert s.stats().subscriptions == 2 and s.updates == 0
            assert all(r.values(sid) == want(sid, "x", 3) for sid in sids)
        finally:
            await r.close()


async def test_starts_resolved_while_reading_join_the_one_subscription(
        pm: LocalCluster, node: DataNodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A many-stream consumer subscribes once the first FIRST_STARTS streams' starts are known
    and resolves the rest while it reads; each later chunk joins the node's one subscription
    (an incremental FETCH), and a stream dropped before its chunk is resolved is never read."""
    monkeypatch.setattr(pull_mod, "FIRST_STARTS", 2)  # the consumer's first chunk
    monkeypatch.setattr(push_mod, "FIRST_STARTS", 2)  # the subscriber's later ones
    monkeypatch.setattr(push_mod, "STARTS_GROWTH", 2)  # chunks of 2, 4, 8
    async with AsyncClient(pm.pm_address) as client:
        ids = await client.create_streams(10)
        await produce(client, dict.fromkeys(ids, 3), "x")
        cons = client.consumer(ids, "earliest")
        reader = cons.reader  # the subscriber's host: a plain reader, without a group
        assert isinstance(reader, pull_mod.StreamReader)
        gate = asyncio.Event()
        resolve = reader.resolve_starts
        chunks: list[list[int]] = []

        async def gated(sids: list[int]) -> list[int]:
            chunks.append(list(sids))
            if len(chunks) > 1:
                await gate.wait()  # the later chunks wait until the first streams were read
            return await resolve(sids)

        monkeypatch.setattr(reader, "resolve_starts", gated)
        r = Reader(cons)
        try:
            await r.until(lambda: all(len(r.values(sid)) == 3 for sid in ids[:2]), "the first")
            s = subs(node)
            assert s.stats().subscriptions == 1 and s.stats().streams == 2
            assert not any(r.values(sid) for sid in ids[2:])
            (session,) = s.by_session
            dropped = ids[-1]  # in the last chunk, not resolved yet
            await cons.set_streams([sid for sid in ids if sid != dropped])
            gate.set()
            kept = ids[:-1]
            await r.until(lambda: all(len(r.values(sid)) == 3 for sid in kept), "every stream")
            assert chunks == [ids[:2], ids[2:6], ids[6:]]
            assert s.stats().subscriptions == 1 and set(s.by_session) == {session}
            assert s.stats().streams == len(kept)
            for sid in kept:
                assert r.values(sid) == want(sid, "x", 3)
            assert r.values(dropped) == []
            in_order(r)
        finally:
            await r.close()


async def test_many_streams_from_an_offset_are_looked_up_together(
        pm: LocalCluster, node: DataNodeServer) -> None:
    """A consumer of many streams from an explicit offset (no "earliest" lookup fills the routing
    cache first) looks their ranges up together: a few LIST_RANGES, not one per stream (it was
    one PM round trip per stream, 150 ms before the first record at 1,000 streams)."""
    async with AsyncClient(pm.pm_address) as client:
        ids = await client.create_streams(60)
        await produce(client, dict.fromkeys(ids, 2), "o")
    async with AsyncClient(pm.pm_address) as client:  # a fresh client: an empty routing cache
        r = Reader(client.consumer(ids, 0))
        try:
            await r.until(lambda: all(len(r.values(sid)) == 2 for sid in ids), "every stream")
            for sid in ids:
                assert r.values(sid) == want(sid, "o", 2)
            assert client.routing.range_lookup_requests <= 3
        finally:
            await r.close()


async def test_partial_polls_ack_what_they_take_and_the_window_keeps_moving(
        pm: LocalCluster, node: DataNodeServer) -> None:
    """poll(max_records=k) takes k records at a time (one step, not k); the acks must count
    exactly those, or a window far smaller than the data stalls the subscription."""
    async with AsyncClient(pm.pm_address) as client:
        a, b = [await client.create_stream(replica_nums=1) for _ in range(2)]
        await produce(client, {a: 300, b: 300}, "p")  # ~6 KiB per stream
        cons = client.consumer([a, b], "earliest", window_bytes=1024)
        got: dict[int, list[bytes]] = {a: [], b: []}
        sizes: set[int] = set()
        try:
            async def took_all() -> bool:
                recs = await cons.poll(max_records=7, timeout_ms=200)
                assert len(recs) <= 7
                sizes.add(len(recs))
                for rec in recs:
                    got[rec.stream_id].append(rec.value)
                return len(got[a]) + len(got[b]) >= 600

            await eventually_async(took_all, timeout=TIMEOUT_S, interval=0, what=lambda: (
                f"all 600 records (stalled at {len(got[a])}, {len(got[b])})"))
            assert got[a] == want(a, "p", 300) and got[b] == want(b, "p", 300)
            assert 7 in sizes  # more than 7 were buffered at times: the partial take ran
            assert await cons.poll(timeout_ms=100) == []
        finally:
            await cons.close()
