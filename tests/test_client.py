"""The SDK against a real local cluster (PM + data nodes as processes on free ports), and the
producer's flow table on its own (pure)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from sbpstream.client import (
    AsyncClient,
    Client,
    ConsumedRecord,
    Record,
    _sync_support,
    iter_columns,
)
from sbpstream.client import routing as routing_mod
from sbpstream.client.flow import TRANSITIONS, Flow, FlowEvent, FlowMachine, ProducerFlowError
from sbpstream.client.producer import Offsets
from sbpstream.cluster import LocalCluster
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol.errors import (
    ErrorCode,
    NoPmReachableError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    ProducerClosedError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.messages import Status, SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import RecordTooLargeError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d: Path = tmp_path_factory.mktemp("cluster")
    with LocalCluster(d, datanodes=3, heartbeat_interval_ms=500, node_timeout_ms=6000) as c:
        yield c


@pytest.fixture
async def client(cluster: LocalCluster) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=30_000) as c:
        yield c


async def _read_all(c: AsyncClient, sid: int, start: int | str = "earliest") -> list[
        ConsumedRecord]:
    end = await c.end_offset(sid)
    return [r async for r in c.consumer(sid, start, end=end)]


async def test_produce_consume_100k_one_stream(client: AsyncClient) -> None:
    sid = await client.create_stream()
    async with client.producer(linger_ms=2) as p:
        futs = [await p.send(sid, b"value-%d" % i, key=b"k" if i % 2 else None)
                for i in range(100_000)]
        await p.flush()
        offsets = [f.result() for f in futs]
    assert offsets == list(range(100_000))
    got = await _read_all(client, sid)
    assert len(got) == 100_000
    for i, r in enumerate(got):
        assert r.offset == i and r.value == b"value-%d" % i
        assert r.key == (b"k" if i % 2 else None) and r.stream_id == sid
    # start inside a batch: records before the offset are skipped
    tail = await _read_all(client, sid, 99_990)
    assert [r.offset for r in tail] == list(range(99_990, 100_000))


async def test_produce_consume_several_streams_with_compression(client: AsyncClient) -> None:
    sids = await client.create_streams(4)
    assert len(set(sids)) == 4
    n = 25_000
    async with client.producer(linger_ms=2, compression="zstd") as p:
        futs = {s: [] for s in sids}  # type: dict[int, list[asyncio.Future[int]]]
        for i in range(n):
            for s in sids:
                futs[s].append(await p.send(s, b"%d:%d" % (s, i), headers=[("h", b"x")]))
        await p.flush()
    for s in sids:
        assert [f.result() for f in futs[s]] == list(range(n))
        got = await _read_all(client, s)
        assert [r.value for r in got] == [b"%d:%d" % (s, i) for i in range(n)]
        assert got[0].headers == (("h", b"x"),)


async def test_columns_and_latest(client: AsyncClient) -> None:
    sid = await client.create_stream()
    async with client.producer() as p:
        await p.send_many(sid, [b"a", Record(b"b", key=b"kb"), b"c"])
    cons = client.consumer(sid, 1, end=3)
    batch = await cons.poll_columns()
    assert batch.columns.values == [b"b", b"c"] and batch.columns.keys == [b"kb", None]
    assert (batch.start_offset, batch.next_offset) == (1, 3)
    assert [r.offset for r in iter_columns(batch)] == [1, 2]
    # "latest" sees only what comes after it starts
    latest = client.consumer(sid, "latest", max_wait_ms=100)
    assert await latest.poll(timeout_ms=50) == []
    assert latest.caught_up and latest.position == 3
    async with client.producer() as p:
        fut = await p.send(sid, b"d")
    assert await fut == 3
    got = await latest.poll(timeout_ms=2000)
    assert [r.value for r in got] == [b"d"]


async def test_admin(client: AsyncClient) -> None:
    a, b = await client.create_streams(2, retention_ms=3_600_000)
    (sa,) = await client.describe_streams([a])
    assert sa.stream_id == a and sa.retention_period_ms == 3_600_000
    assert {a, b} <= {s.stream_id for s in await client.list_streams()}
    up = await client.update_stream(a, retention_ms=7_200_000)
    assert up.retention_period_ms == 7_200_000
    ranges = await client.list_ranges(a)
    assert ranges and ranges[-1].end_offset == -1
    assert (await client.describe_range(a, 0)).range_index == 0
    async with client.producer() as p:
        await p.send_many(a, [b"x%d" % i for i in range(10)])
    assert await client.end_offset(a) == 10
    await client.trim_stream(a, 5)
    assert await client.start_offset(a) == 5
    with pytest.raises(OffsetTrimmedError):
        await client.consumer(a, 2, end=10).poll()
    got = [r async for r in client.consumer(a, 2, end=10, auto_reset="earliest")]
    assert [r.offset for r in got] == [5, 6, 7, 8, 9]
    with pytest.raises(OffsetOutOfRangeError):
        await client.consumer(a, 50, max_wait_ms=10).poll()
    await client.delete_streams([b])
    with pytest.raises((StreamNotFoundError, StreamDeletedError)):
        await client.describe_stream(b)
    with pytest.raises(StreamNotFoundError):
        await client.list_ranges(987_654)


async def test_send_batch_offsets(client: AsyncClient) -> None:
    """One future per call; offsets derived per record across many batches and buffer waits."""
    sid = await client.create_stream()
    values = [b"v%d" % i for i in range(3000)]
    async with client.producer(batch_max_bytes=4096, buffer_max_bytes=8192) as p:
        solo = await p.send(sid, b"solo")
        fut = await p.send_batch(sid, values, key=b"k")
        mixed = await p.send_batch(sid, [b"a", Record(b"b", key=b"kb"), None])
        empty = await p.send_batch(sid, [])
    offs = await fut
    assert await solo == 0
    assert offs.done and offs.error is None and offs.failed == 0 and len(offs) == 3000
    assert list(offs) == list(range(1, 3001)) and offs[-1] == 3000 and offs[10:12] == [11, 12]
    assert list(await mixed) == [3001, 3002, 3003]
    assert len(await empty) == 0
    got = await _read_all(client, sid)
    assert [r.value for r in got] == [b"solo", *values, b"a", b"b", None]
    assert {r.key for r in got[1:3001]} == {b"k"} and got[3002].key == b"kb"


async def test_send_batch_failure_is_in_the_offsets(client: AsyncClient) -> None:
    async with client.producer() as p:
        fut = await p.send_batch(987_654, [b"x", b"y"])
        offs = await asyncio.wait_for(fut, 60)
    assert offs.failed == 2 and isinstance(offs.error, StreamNotFoundError)
    with pytest.raises(StreamNotFoundError):
        offs[1]


def test_offsets_out_of_order_runs_and_errors() -> None:
    offs = Offsets(6)
    offs.record_acked(3, 100, 2)  # a later piece settles first
    assert not offs.done
    offs.record_acked(0, 40, 3)
    offs.record_failed(5, 1, StreamNotFoundError("gone"))
    assert offs.done and offs.failed == 1 and list(offs[:5]) == [40, 41, 42, 100, 101]
    with pytest.raises(StreamNotFoundError):
        offs[5]
    with pytest.raises(IndexError):
        offs[6]


def test_sync_send_batch(cluster: LocalCluster) -> None:
    with Client(cluster.pm_address) as c:
        sid = c.create_stream()
        with c.producer() as p:
            futs = [p.send_batch(sid, [b"%d" % (i * 100 + j) for j in range(100)])
                    for i in range(50)]
        offs = [f.result() for f in futs]
        assert [o for batch in offs for o in batch] == list(range(5000))
        assert c.end_offset(sid) == 5000


def test_sync_send_is_queued_in_order(cluster: LocalCluster,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync send hands records over in chunks: order per stream holds across send, send_batch
    and send_many; a small queue bound makes send wait for the hand-over; errors reach the
    record's future."""
    monkeypatch.setattr(_sync_support, "SYNC_QUEUE_MAX_BYTES", 4096)
    with Client(cluster.pm_address) as c:
        a, b = c.create_streams(2)
        done: list[int] = []
        with c.producer(batch_max_bytes=2048) as p:
            fa = [p.send(a, b"a%d" % i) for i in range(500)]
            fb = [p.send(b, b"b%d" % i, key=b"k", timestamp_ms=1234) for i in range(300)]
            mid = p.send_batch(a, [b"batch"])
            fa.append(p.send(a, b"after"))
            fa[0].add_done_callback(lambda f: done.append(f.result()))
            p.send_many(b, [b"many"])
            lost = p.send(987_654, b"nowhere")
            with pytest.raises(RecordTooLargeError):
                p.send(a, b"x" * 4096)
        assert [f.result() for f in fa[:500]] == list(range(500))
        assert mid.result()[0] == 500 and fa[500].result() == 501
        assert [f.result() for f in fb] == list(range(300)) and fb[0].exception() is None
        assert done == [0] and fa[0].done() and not fa[0].cancelled()
        assert isinstance(lost.exception(timeout=60), StreamNotFoundError)
        with pytest.raises(StreamNotFoundError):
            lost.result()
        got = list(c.consumer(b, end=301))
        assert got[0].key == b"k" and got[0].timestamp_ms == 1234 and got[-1].value == b"many"


def test_offsets_first_and_on_done() -> None:
    seen: list[Offsets] = []
    offs = Offsets(5, None, seen.append)
    assert offs.first is None  # not settled yet
    offs.record_acked(3, 13, 2)  # a later piece first, consecutive with the earlier one
    offs.record_acked(0, 10, 3)
    assert offs.first == 10 and seen == [offs] and list(offs) == [10, 11, 12, 13, 14]
    gap = Offsets(2)
    gap.record_acked(0, 10, 1)
    gap.record_acked(1, 20, 1)  # another producer's batch between the two
    assert gap.done and gap.first is None and list(gap) == [10, 20]
    bad = Offsets(2)
    bad.record_acked(0, 10, 1)
    bad.record_failed(1, 1, StreamNotFoundError("gone"))
    assert bad.first is None
    empty: list[Offsets] = []
    assert Offsets(0, None, empty.append).done and len(empty) == 1


def test_record_future_views_its_chunk() -> None:
    """A RecordFuture reads its chunk's outcome: waits (with a timeout) until settled, gives the
    record's offset or its own error, and runs callbacks once, before or after settling."""
    chunk = _sync_support._Chunk(7)
    f0, f1 = _sync_support.RecordFuture(chunk, 0), _sync_support.RecordFuture(chunk, 1)
    with pytest.raises(TimeoutError):
        f1.result(timeout=0.01)
    calls: list[int] = []
    f1.add_done_callback(lambda f: calls.append(f.result()))
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(f0.result(timeout=60)))
    waiter.start()
    offs = Offsets(2, None, chunk.settle)
    offs.record_acked(0, 40, 1)
    assert not f0.done() and not calls
    offs.record_failed(1, 1, StreamNotFoundError("gone"))
    waiter.join(60)
    assert got == [40] and f0.done() and f0.exception() is None and not f0.cancel()
    assert isinstance(f1.exception(), StreamNotFoundError) and calls == []  # it raised
    with pytest.raises(StreamNotFoundError):
        f1.result()
    late: list[BaseException | None] = []
    f1.add_done_callback(lambda f: late.append(f.exception()))  # already done: runs at once
    assert len(late) == 1 and isinstance(late[0], StreamNotFoundError)

    whole = _sync_support._Chunk(8)  # the hand-over itself failed: every record's error
    whole.settle(None, ProducerClosedError("stopped"))
    whole.settle(Offsets(1), None)  # the first outcome stays
    with pytest.raises(ProducerClosedError):
        _sync_support.RecordFuture(whole, 0).result()


def test_sync_send_across_streams_keeps_call_order(cluster: LocalCluster) -> None:
    """Interleaved sends to several streams, with send_batch calls between them: each stream
    gets its records in call order, and each future gives the record's own offset."""
    with Client(cluster.pm_address) as c:
        sids = c.create_streams(3)
        sent: dict[int, list[bytes]] = {s: [] for s in sids}
        futs: dict[int, list[Any]] = {s: [] for s in sids}
        batches = []
        with c.producer(batch_max_bytes=1024) as p:
            for i in range(6000):
                s = sids[i % 3] if i % 7 else sids[(i // 7) % 3]
                sent[s].append(b"%d" % i)
                futs[s].append(p.send(s, sent[s][-1]))
                if i % 1000 == 999:
                    batch = [b"batch-%d-%d" % (i, j) for j in range(3)]
                    batches.append((s, len(sent[s]), p.send_batch(s, batch)))
                    sent[s] += batch
                    futs[s] += [None] * 3
        for s in sids:
            offsets = [f.result(timeout=60) for f in futs[s] if f is not None]
            assert offsets == [i for i, f in enumerate(futs[s]) if f is not None]
            assert [r.value for r in c.consumer(s, end=len(sent[s]))] == sent[s]
        for _s, at, b in batches:
            assert list(b.result()) == [at, at + 1, at + 2]


def test_sync_send_queue_is_bounded(cluster: LocalCluster,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """send blocks while SYNC_QUEUE_MAX_BYTES wait for the hand-over: the bytes queued on the
    caller's side never exceed the bound (one record over an empty queue at most)."""
    bound = 2048
    monkeypatch.setattr(_sync_support, "SYNC_QUEUE_MAX_BYTES", bound)
    value = b"v" * 100
    with Client(cluster.pm_address) as c:
        sids = c.create_streams(4)
        most = 0
        with c.producer() as p:
            futs = []
            for i in range(4000):
                futs.append(p.send(sids[i % 4], value))
                most = max(most, p._queued_bytes)
        assert 0 < most <= bound
        assert sorted(f.result(timeout=60) for f in futs[::4]) == list(range(1000))


def test_sync_send_from_two_threads(cluster: LocalCluster) -> None:
    with Client(cluster.pm_address) as c:
        sids = c.create_streams(2)
        with c.producer() as p:
            futs: dict[int, list[Any]] = {}

            def worker(sid: int) -> None:
                futs[sid] = [p.send(sid, b"%d" % i) for i in range(3000)]

            threads = [threading.Thread(target=worker, args=(s,)) for s in sids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        for s in sids:
            assert [f.result(timeout=60) for f in futs[s]] == list(range(3000))


def test_sync_and_async_agree(cluster: LocalCluster) -> None:
    with Client(cluster.pm_address) as c:
        sid = c.create_stream()
        with c.producer() as p:
            futs = p.send_many(sid, [b"s%d" % i for i in range(20_000)])
            one = p.send(sid, b"last", key=b"k")
        assert [f.result() for f in futs] == list(range(20_000))
        assert one.result() == 20_000
        end = c.end_offset(sid)
        sync_got = list(c.consumer(sid, end=end))
        cols = c.consumer(sid, 0, end=end).poll_columns()
        it = c.consumer(sid, 5, end=end)
        assert next(it).offset == 5 and it.position == 6 and it.buffered > 0

    async def read() -> list[ConsumedRecord]:
        async with AsyncClient(cluster.pm_address) as ac:
            return await _read_all(ac, sid)

    async_got = asyncio.run(read())
    assert sync_got == async_got and len(sync_got) == 20_001
    assert sync_got[-1].key == b"k" and cols.columns.offsets[0] == 0


async def test_pm_not_leader_is_followed(cluster: LocalCluster) -> None:
    async def not_leader(req: Request, resp: Responder) -> None:
        st = Status(ErrorCode.PM_NOT_LEADER, "follower", cluster.pm_address.encode())
        await resp.send(SystemErrorResponse(status=st).encode(), end=True)  # as a plain answer

    async def not_leader_err(req: Request, resp: Responder) -> None:
        await resp.send_error(ErrorCode.PM_NOT_LEADER, "follower", cluster.pm_address.encode())

    follower = Server({Opcode.CREATE_STREAMS: not_leader_err, Opcode.LIST_RANGES: not_leader},
                      name="follower")
    await follower.start("127.0.0.1", 0)
    try:
        async with AsyncClient(follower.address) as c:
            sid = await c.create_stream()
            assert (await c.list_ranges(sid))[0].stream_id == sid
    finally:
        await follower.close(drain_timeout_s=1)


async def test_unreachable_pm_is_one_clear_error() -> None:
    async with AsyncClient("127.0.0.1:1", retry_deadline_ms=300) as c:
        with pytest.raises(NoPmReachableError, match="no placement manager reachable"):
            await c.create_stream()


async def test_restarted_data_node_is_ridden_through(cluster: LocalCluster,
                                                     client: AsyncClient) -> None:
    sid = await client.create_stream()
    sent: list[bytes] = []
    futs: list[asyncio.Future[int]] = []
    async with client.producer(linger_ms=1) as p:
        for i in range(3000):
            sent.append(b"before-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
        await futs[0]
        (rng,) = await client.list_ranges(sid)
        primary = next(r.data_node.advertise_addr for r in rng.replica_nodes if r.is_primary)
        node = next(dn for dn in cluster.datanodes if dn.address == primary)
        for i in range(2000):  # kill -9 with appends in flight
            sent.append(b"during-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
        node.kill()

        async def restart() -> None:
            await asyncio.sleep(0.5)
            node.start()
            await asyncio.to_thread(node.wait_ready)

        restarting = asyncio.create_task(restart())
        for i in range(3000):
            sent.append(b"after-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
            if i % 100 == 0:
                await asyncio.sleep(0.01)
        await p.flush()
        await restarting
    offsets = [f.result() for f in futs]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    got = await _read_all(client, sid)
    by_offset = {r.offset: r.value for r in got}
    assert len(got) == len(by_offset)  # each record once
    assert [by_offset[o] for o in offsets] == sent  # every acknowledged record, in order
    assert [r.value for r in got] == sent  # and nothing else


async def test_sealed_range_failover_neither_loses_nor_duplicates(cluster: LocalCluster,
                                                                  client: AsyncClient) -> None:
    """The PM seals the writable range under a busy producer, three times: RANGE_SEALED makes
    the producer seal (idempotently), learn from the producer states what the sealed range
    holds, and resend exactly the rest to the new range."""
    sid = await client.create_stream()
    sent: list[bytes] = []
    futs: list[asyncio.Future[int]] = []
    async with AsyncClient(cluster.pm_address) as admin, client.producer(linger_ms=1) as p:
        for round_ in range(4):
            for i in range(2000):
                sent.append(b"%d-%d" % (round_, i))
                futs.append(await p.send(sid, sent[-1]))
                if i == 1000 and round_ < 3:
                    ranges = await admin.list_ranges(sid)
                    await admin.routing.seal(sid, ranges[-1].range_index)
            await asyncio.sleep(0.01)
        await p.flush()
    assert [f.result() for f in futs] == list(range(len(sent)))
    assert [r.value for r in await _read_all(client, sid)] == sent
    ranges = await client.list_ranges(sid)
    assert len(ranges) == 4 and all(r.sealed for r in ranges[:-1])


async def test_range_lookups_are_coalesced(cluster: LocalCluster) -> None:
    """Lookups asked for in one loop turn go to the PM together: LIST_RANGES requests of
    MAX_RANGE_LOOKUPS_PER_REQUEST streams each, in the order asked (the first answer comes after
    the PM's work on its own streams, not on all of them)."""
    async with AsyncClient(cluster.pm_address) as c:
        ids = await c.create_streams(300)
        missing = 987_654_321
        calls: list[int] = []
        real = c.routing._pm_call

        async def counting(req: Any, resp_cls: Any) -> Any:
            calls.append(len(getattr(req, "items", ())))
            return await real(req, resp_cls)

        c.routing._pm_call = counting
        results = await asyncio.gather(*(c.list_ranges(s) for s in ids),
                                       c.list_ranges(missing), return_exceptions=True)
        per = routing_mod.MAX_RANGE_LOOKUPS_PER_REQUEST
        assert calls == [per, 301 - per]
        assert c.routing.range_lookup_requests == 2
        assert all(isinstance(r, list) and r[0].range_index == 0 for r in results[:-1])
        assert isinstance(results[-1], SbpError) and "does not exist" in str(results[-1])
        # cached now: no more PM calls
        await asyncio.gather(*(c.routing.ranges(s) for s in ids))
        assert calls == [per, 301 - per]


async def test_a_lookup_under_way_is_shared_but_not_by_a_refresh(cluster: LocalCluster) -> None:
    """A stream asked for while its LIST_RANGES is out waits for that answer (no second
    request); a refresh asked for then gets a request of its own (the answer under way may
    predate what made the caller refresh)."""
    async with AsyncClient(cluster.pm_address) as c:
        (sid,) = await c.create_streams(1)
        calls: list[int] = []
        sent = asyncio.Event()
        release = asyncio.Event()
        real = c.routing._pm_call

        async def slow(req: Any, resp_cls: Any) -> Any:
            calls.append(len(getattr(req, "items", ())))
            sent.set()
            await release.wait()
            return await real(req, resp_cls)

        c.routing._pm_call = slow

        async def under_way(refresh: bool) -> list[Any]:
            sent.clear()
            release.clear()
            first = asyncio.ensure_future(c.routing.ranges(sid, refresh=True))
            async with asyncio.timeout(10):
                await sent.wait()  # its LIST_RANGES is out
            second = asyncio.ensure_future(c.routing.ranges(sid, refresh=refresh))
            await asyncio.sleep(0)
            release.set()
            async with asyncio.timeout(10):
                return list(await asyncio.gather(first, second))

        got = await under_way(refresh=False)
        assert calls == [1]  # the second waited for the answer under way
        got += await under_way(refresh=True)
        assert calls == [1, 1, 1]  # a refresh sent its own
        assert all(r[0].range_index == 0 for r in got)


def test_streamed_pm_answer_items_are_merged() -> None:
    from sbpstream.net.pmcaller import merge_responses
    from sbpstream.protocol.messages import ListRangesResponse, ListRangesResult

    parts = [ListRangesResponse(items=(ListRangesResult(stream_id=i),)) for i in (1, 2, 3)]
    frames = [ListRangesResponse.decode(p.encode()) for p in parts]
    merged = merge_responses(frames)
    assert [it.stream_id for it in merged.items] == [1, 2, 3]


async def test_producer_finds_its_stored_batches_in_a_sealed_range(cluster: LocalCluster) -> None:
    """The failover path that reads a sealed range back to learn where this producer's
    unacknowledged-but-stored batches landed (several batches in flight at a seal)."""
    from sbpstream.client.batches import Batch, locate
    from sbpstream.client.retry import Attempts

    async with AsyncClient(cluster.pm_address) as c:
        sid = await c.create_stream()
        other = c.producer(linger_ms=0)
        p = c.producer(linger_ms=0, max_in_flight_per_stream=4)
        offsets = []
        for i in range(3):  # three batches of 2 records, each interleaved with another writer
            f1 = await p.send(sid, b"a%d" % i)
            f2 = await p.send(sid, b"b%d" % i)
            await p.flush()
            offsets.append(await f1)
            assert await f2 == offsets[-1] + 1
            await (await other.send(sid, b"x"))
        res = await c.routing.seal(sid, 0)
        sealed = res.ranges[0]
        st = p._streams[sid]
        st.acked_next = -1  # as if nothing had been acknowledged
        batches = [Batch(sid, b"", 2 * i, 2, [], 0) for i in range(3)]
        found = await locate(c.routing, p.producer_id, st, sealed, batches, Attempts(c.retry))
        assert found == {2 * i: offsets[i] for i in range(3)}
        await p.close()
        await other.close()


# ----------------------------------------------------------------- the producer's flow table
# Pure: no cluster. Every (state, event) pair either moves as TRANSITIONS says or breaks the
# stream's flow for good with a ProducerFlowError.

ALL_PAIRS = [(s, e) for s in Flow for e in FlowEvent]


@given(hst.sampled_from(ALL_PAIRS))
@settings(max_examples=4 * len(ALL_PAIRS), deadline=None)
def test_flow_every_state_event_pair(pair: tuple[Flow, FlowEvent]) -> None:
    state, event = pair
    m = FlowMachine()
    m.state = state
    expected = TRANSITIONS.get(pair)
    if expected is not None:
        assert m.process(event) is expected
        assert m.error is None
    else:
        with pytest.raises(ProducerFlowError, match=f"{event.name} is not allowed in state "
                                                    f"{state.name}"):
            m.process(event)
        assert m.state is Flow.BROKEN and m.error is not None
        for again in FlowEvent:  # terminal: nothing leaves BROKEN, the first error is kept
            first = m.error
            with pytest.raises(ProducerFlowError):
                m.process(again)
            assert m.state is Flow.BROKEN and m.error is first


def test_flow_walk_covers_every_pair() -> None:
    """The property above is exhaustive over the pairs, not a sample of them."""
    assert len(ALL_PAIRS) == len(Flow) * len(FlowEvent)
    for state, event in ALL_PAIRS:
        m = FlowMachine()
        m.state = state
        try:
            got = m.process(event)
        except ProducerFlowError:
            got = Flow.BROKEN
        assert got is TRANSITIONS.get((state, event), Flow.BROKEN)


@given(hst.lists(hst.sampled_from(list(FlowEvent)), max_size=40))
@settings(max_examples=300, deadline=None)
def test_flow_event_sequences_follow_the_table(events: list[FlowEvent]) -> None:
    m = FlowMachine()
    state = Flow.SENDING
    for ev in events:
        state = TRANSITIONS.get((state, ev), Flow.BROKEN)
        try:
            m.process(ev)
        except ProducerFlowError:
            assert state is Flow.BROKEN
        assert m.state is state
        assert (m.error is None) == (state is not Flow.BROKEN)


def test_flow_table_shape() -> None:
    """Only BROKEN is terminal; every other state is reachable from SENDING and gets back."""
    assert not any(s is Flow.BROKEN for s, _ in TRANSITIONS)
    assert Flow.BROKEN not in TRANSITIONS.values()
    reach = {Flow.SENDING}
    while True:
        more = {new for (s, _), new in TRANSITIONS.items() if s in reach} - reach
        if not more:
            break
        reach |= more
    assert reach == set(Flow) - {Flow.BROKEN}
    for s in reach - {Flow.SENDING}:
        back, seen = {s}, set()
        while back - seen:
            seen |= back
            back |= {new for (x, _), new in TRANSITIONS.items() if x in seen}
        assert Flow.SENDING in back, s


async def test_a_broken_flow_fails_the_streams_records_instead_of_hanging() -> None:
    """A flow bug (an unexpected event) fails the stream's records with a clear error; the
    producer's flush returns. No cluster: nothing is sent."""
    async with AsyncClient("127.0.0.1:1") as c:
        p = c.producer(linger_ms=60_000)
        fut = await p.send(7, b"x")
        with pytest.raises(ProducerFlowError):
            p._streams[7].flow.process(FlowEvent.RECOVERY_DONE)  # not allowed in SENDING
        async with asyncio.timeout(30):
            await p.flush()
        with pytest.raises(SbpError, match="RECOVERY_DONE is not allowed in state SENDING"):
            await fut
        fut2 = await p.send(7, b"y")  # BROKEN is terminal for the stream
        async with asyncio.timeout(30):
            await p.flush()
        with pytest.raises(SbpError, match="RECOVERY_DONE"):
            await fut2
        await p.close()


async def _delay_first_connection_lookup(c: AsyncClient, started: asyncio.Event,
                                         delay_s: float) -> list[str]:
    """Make the routing's first data-node connection lookup wait ``delay_s`` (as a throttle
    wait, or a write waiting for the socket to drain, does); later ones pass at once. Returns
    the order in which the lookups passed."""
    routing = c.routing
    inner = routing._node_conn
    passed: list[str] = []
    calls = 0

    async def node_conn(addr: str) -> Any:
        nonlocal calls
        calls += 1
        me = calls
        if me == 1:
            started.set()
            await asyncio.sleep(delay_s)
        conn = await inner(addr)
        passed.append(f"request {me}")
        return conn

    routing._node_conn = node_conn  # type: ignore[method-assign]
    return passed


@pytest.mark.parametrize("acknowledged_first", [False, True])
async def test_a_delayed_request_is_not_overtaken_by_a_later_batch_of_its_stream(
        cluster: LocalCluster, acknowledged_first: bool) -> None:
    """Regression (OUT_OF_ORDER_SEQUENCE: sequence 0 after N): a stream's batch whose request
    waited before reaching the wire (a throttle wait, a paused socket) was overtaken by the
    stream's next batch, sent in a later request. On a range that had no batch of the producer
    yet, the data node took the later batch as the producer's first, refused every resend of
    the earlier one as out of order, and the send failed at the deadline. On a range that knows
    the producer, the data node refused the gap and the producer had to back off and resend."""
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=4_000) as c:
        sid = await c.create_stream(replica_nums=1)
        p = c.producer(linger_ms=0, max_in_flight_per_stream=4)
        if acknowledged_first:  # the range knows the producer already
            assert await (await p.send(sid, b"first")) == 0
        started = asyncio.Event()
        passed = await _delay_first_connection_lookup(c, started, 0.5)
        f0 = await p.send(sid, b"r0")
        async with asyncio.timeout(30):
            await started.wait()  # r0's batch is dispatched and its request waits
        f1 = await p.send(sid, b"r1")  # the next batch of the stream, in a later request
        f2 = await p.send(sid, b"r2")
        async with asyncio.timeout(60):
            await p.flush()
        base = 1 if acknowledged_first else 0
        assert [await f0, await f1, await f2] == [base, base + 1, base + 2]
        assert passed[0] == "request 1", passed  # nothing overtook the delayed request
        await p.close()
