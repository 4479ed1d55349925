"""Data node against a real PM and real data node processes (LocalCluster), over SBP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from raw_sbp import append, create_streams, decode_fetch, fetch, primary, values
from waiting import eventually_async

from sbpstream.cluster import LocalCluster
from sbpstream.datanode.metrics import Metrics
from sbpstream.datanode.pmclient import PmClient
from sbpstream.net.client import Connection, ConnectionPool, ResponseStream
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol.errors import ErrorCode, PmNotLeaderError
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    ClientRole,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DescribeRangeItem,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
    FetchResult,
    HeartbeatRequest,
    HeartbeatResponse,
    ListRangesRequest,
    ListRangesResponse,
    Range,
    SealItem,
    SealRangesRequest,
    SealRangesResponse,
    Status,
    Stream,
    StreamOwner,
    TrimItem,
    TrimStreamsRequest,
    TrimStreamsResponse,
)
from sbpstream.protocol.messages import (
    DataNode as DataNodeMsg,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch, read_header
from sbpstream.store import StoreStats

TIMEOUT_S = 10.0  # every in-test wait is bounded by this


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # node timeout far above a restart, so the PM does not seal the killed node's ranges
    with LocalCluster(tmp_path_factory.mktemp("dn"), datanodes=2, heartbeat_interval_ms=200,
                      node_timeout_ms=20_000,
                      extra_dn_args=["--retention-interval-ms", "300"]) as c:
        yield c


def batch(n: int, tag: str = "r", size: int = 16) -> bytes:
    return build_batch([Record(value=f"{tag}-{i}".encode().ljust(size, b".")) for i in range(n)])


async def create_stream(pm: str, retention_period_ms: int = 0) -> tuple[int, Range]:
    """A new single-replica stream; returns its id and its first range (with placement)."""
    (sid,) = await create_streams(pm, retention_period_ms=retention_period_ms)
    conn = await Connection.open(pm)
    try:
        f = await conn.request_one(Opcode.LIST_RANGES, ListRangesRequest(
            timeout_ms=5000, items=(StreamOwner(sid),)).encode(), timeout_s=TIMEOUT_S)
        ranges = ListRangesResponse.decode(f.header).items[0].ranges
        return sid, ranges[-1]
    finally:
        await conn.aclose()


async def collect(stream: ResponseStream) -> list[Frame]:
    return [f async for f in stream]


async def parked_fetch(conn: Connection, sid: int, available: list[bytes]) -> ResponseStream:
    """A FETCH from offset 0 asking for more bytes than ``available`` (the batches stored so
    far), with a max_wait far above every bound here: the node sends what it has in a first,
    non-final frame and then waits for more. Returns once that frame arrived, so the poll is
    parked (its wake-up registered) when this returns; the rest of the answer is the stream's."""
    need = sum(len(b) for b in available) + 1
    req = FetchRequest(max_wait_ms=60_000, min_bytes=need, items=(FetchItem(
        stream_id=sid, request_index=0, fetch_offset=0, batch_max_bytes=1 << 20),))
    stream = await conn.stream(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)
    first = await stream.__anext__()
    assert not first.is_end and len(first.payload) == need - 1
    return stream


async def test_append_fetch_round_trip(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    conn = await Connection.open(primary(rng))
    try:
        _, res = await append(conn, [(sid, batch(3, "a")), (sid, batch(2, "b"))])
        assert [res[0].base_offset, res[0].next_offset] == [0, 3]
        assert [res[1].base_offset, res[1].next_offset] == [3, 5]
        assert res[0].stream_append_time_ms > 0
        _, results, batches = await fetch(conn, sid, 0)
        assert [read_header(b).base_offset for b in batches] == [0, 3]
        assert values(batches)[0].startswith(b"a-0") and len(values(batches)) == 5
        assert results[0].high_watermark == 5
        # a fetch from inside a batch returns that batch; at the end nothing, no error
        _, _, batches = await fetch(conn, sid, 4)
        assert [read_header(b).base_offset for b in batches] == [3]
        _, results, batches = await fetch(conn, sid, 5)
        assert batches == [] and results[0].status.ok and results[0].high_watermark == 5
        _, results, _ = await fetch(conn, sid, 99)
        assert results[0].status.code == ErrorCode.OFFSET_OUT_OF_RANGE
    finally:
        await conn.aclose()


async def pm_call(pm: str, opcode: int, header: bytes) -> Frame:
    conn = await Connection.open(pm)
    try:
        return await conn.request_one(opcode, header, timeout_s=TIMEOUT_S)
    finally:
        await conn.aclose()


async def test_long_poll_wakes_on_append(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    reader = await Connection.open(primary(rng))
    writer = await Connection.open(primary(rng))
    try:
        # nothing arrives: the poll ends after max_wait_ms with one empty result and END
        frames, results, batches = await fetch(reader, sid, 0, max_wait_ms=300, min_bytes=1)
        assert batches == [] and results[0].status.ok and frames[-1].is_end
        # a consumer parked at the end gets the batch as soon as it is acknowledged: its
        # max_wait (60 s) is far above TIMEOUT_S, so only the append can end it in time (the
        # wake-up latency itself is measured by bench.bench_datanode's end-to-end latency)
        first = batch(1, "first")
        _, res = await append(writer, [(sid, first)])
        assert res[0].status.ok
        poll = await parked_fetch(reader, sid, [first])
        _, res = await append(writer, [(sid, batch(4, "late"))])
        assert res[0].status.ok
        rest = await asyncio.wait_for(collect(poll), TIMEOUT_S)
        assert rest[-1].is_end
        results, batches = decode_fetch(rest)
        assert values(batches)[0].startswith(b"late-0") and results[0].high_watermark == 5
    finally:
        await reader.aclose()
        await writer.aclose()


async def test_fetch_streams_several_frames(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    conn = await Connection.open(primary(rng))
    try:
        big = [batch(10, f"b{i}", size=30_000) for i in range(12)]  # ~300 KB each, ~3.6 MB
        for i in range(0, len(big), 4):
            _, res = await append(conn, [(sid, b) for b in big[i : i + 4]])
            assert all(r.status.ok for r in res)
        frames, _, batches = await fetch(conn, sid, 0, max_bytes=64 << 20)
        assert len(frames) >= 3  # ~1 MiB frames
        assert all(not f.is_end for f in frames[:-1]) and frames[-1].is_end
        assert [read_header(b).base_offset for b in batches] == list(range(0, 120, 10))
        assert [b[8:] for b in batches] == [b[8:] for b in big]  # unchanged but base_offset
        assert all(len(f.payload) <= 16 << 20 for f in frames)
        # min_bytes: data streams back as it lands, END once min_bytes were sent
        poll = asyncio.ensure_future(
            fetch(conn, sid, 120, max_wait_ms=8000, min_bytes=2 * len(big[0])))
        w = await Connection.open(primary(rng))
        for i in range(2):
            await asyncio.sleep(0.2)
            await append(w, [(sid, big[i])])
        frames, _, batches = await asyncio.wait_for(poll, TIMEOUT_S)
        await w.aclose()
        assert len(batches) == 2 and len(frames) >= 2
    finally:
        await conn.aclose()


async def test_multi_item_append_answers_out_of_order(cluster: LocalCluster) -> None:
    s1, r1 = await create_stream(cluster.pm_address)
    s2, r2 = await create_stream(cluster.pm_address)
    addr = primary(r1)
    conn = await Connection.open(addr)
    try:
        corrupt = bytearray(batch(2, "bad"))
        corrupt[-1] ^= 0xFF  # CRC no longer matches
        other = s2 if primary(r2) == addr else 0
        items = [(s1, batch(2, "x")), (s1, bytes(corrupt)), (s1, batch(3, "y")),
                 (987_654_321, batch(1, "nowhere"))]
        if other:
            items.append((other, batch(1, "z")))
        frames, res = await append(conn, items)
        assert res[0].status.ok and (res[0].base_offset, res[0].next_offset) == (0, 2)
        assert res[1].status.code == ErrorCode.CORRUPT_BATCH and res[1].base_offset == -1
        assert res[2].status.ok and (res[2].base_offset, res[2].next_offset) == (2, 5)
        assert res[3].status.code == ErrorCode.RANGE_NOT_FOUND  # after asking the PM once
        # several frames, the failed item first (it did not wait for the fsync), END last
        assert len(frames) >= 2 and frames[-1].is_end
        assert [r.request_index for r in AppendResponse.decode(frames[0].header).items] == [1]
        _, _, batches = await fetch(conn, s1, 0)
        assert len(values(batches)) == 5
        # many streams in one FETCH, each item with its own status
        req = FetchRequest(max_wait_ms=0, items=(
            FetchItem(stream_id=s1, request_index=0, fetch_offset=2, batch_max_bytes=1 << 20),
            FetchItem(stream_id=987_654_321, request_index=1, fetch_offset=0),
            FetchItem(stream_id=s1, request_index=2, fetch_offset=-1)))
        frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)
        got = [r for f in frames for r in FetchResponse.decode(f.header).items]
        by_index: dict[int, list[FetchResult]] = {}
        for r in got:
            by_index.setdefault(r.request_index, []).append(r)
        assert [r.batch_length > 0 for r in by_index[0]] == [True]
        assert by_index[1][0].status.code == ErrorCode.RANGE_NOT_FOUND
        assert by_index[2][0].status.code == ErrorCode.OFFSET_OUT_OF_RANGE
    finally:
        await conn.aclose()


async def test_idempotent_duplicate_gets_original_offset(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    conn = await Connection.open(primary(rng))
    try:
        b = build_batch([Record(value=b"once")], producer_id=7, producer_epoch=0,
                        base_sequence=0)
        _, first = await append(conn, [(sid, batch(2))])
        _, a = await append(conn, [(sid, b)])
        _, again = await append(conn, [(sid, b)])
        assert first[0].next_offset == 2
        assert a[0].base_offset == again[0].base_offset == 2
        _, _, batches = await fetch(conn, sid, 0)
        assert len(values(batches)) == 3
    finally:
        await conn.aclose()


async def test_wrong_node_and_sealed_range(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    addr = primary(rng)
    others = [dn.address for dn in cluster.datanodes if dn.address != addr]
    conn = await Connection.open(addr)
    try:
        await append(conn, [(sid, batch(3))])
        if others:  # a node that does not hold the range asks the PM, then refuses
            o = await Connection.open(others[0])
            _, res = await append(o, [(sid, batch(1))])
            await o.aclose()
            assert res[0].status.code == ErrorCode.RANGE_NOT_FOUND
        f = await pm_call(cluster.pm_address, Opcode.SEAL_RANGES, SealRangesRequest(
            timeout_ms=5000, items=(SealItem(stream_id=sid, range_index=0),)).encode())
        sealed = SealRangesResponse.decode(f.header).items[0]
        assert sealed.status.ok, sealed.status
        assert sealed.ranges[0].end_offset == 3
        req = AppendRequest(timeout_ms=5000, items=(
            AppendItem(stream_id=sid, request_index=0, batch_length=len(batch(1)),
                       range_index=0),))
        fr = await conn.request_one(Opcode.APPEND, req.encode(), batch(1), timeout_s=TIMEOUT_S)
        assert AppendResponse.decode(fr.header).items[0].status.code == ErrorCode.RANGE_SEALED
        # the sealed range's end is reported so a consumer can follow into the next range
        req2 = FetchRequest(max_wait_ms=0, items=(
            FetchItem(stream_id=sid, request_index=0, fetch_offset=3, range_index=0),))
        fr = await conn.request_one(Opcode.FETCH, req2.encode(), timeout_s=TIMEOUT_S)
        r = FetchResponse.decode(fr.header).items[0]
        assert r.status.ok and r.range_end_offset == 3
    finally:
        await conn.aclose()


async def test_trim_and_delete_from_pm(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    conn = await Connection.open(primary(rng))
    try:
        for i in range(4):
            await append(conn, [(sid, batch(5, f"t{i}"))])
        f = await pm_call(cluster.pm_address, Opcode.TRIM_STREAMS, TrimStreamsRequest(
            timeout_ms=5000, items=(TrimItem(stream_id=sid, trim_offset=10),)).encode())
        assert TrimStreamsResponse.decode(f.header).items[0].status.ok
        _, results, _ = await fetch(conn, sid, 0)
        assert results[0].status.code == ErrorCode.OFFSET_TRIMMED
        assert results[0].start_offset == 10
        _, _, batches = await fetch(conn, sid, 10)
        assert read_header(batches[0]).base_offset == 10
        f = await pm_call(cluster.pm_address, Opcode.DELETE_STREAMS, DeleteStreamsRequest(
            timeout_ms=5000, items=(Stream(stream_id=sid),)).encode())
        assert DeleteStreamsResponse.decode(f.header).items[0].status.ok
        _, res = await append(conn, [(sid, batch(1))])
        assert res[0].status.code == ErrorCode.STREAM_DELETED
        _, results, _ = await fetch(conn, sid, 10)
        assert results[0].status.code == ErrorCode.STREAM_DELETED
    finally:
        await conn.aclose()


async def test_retention_trims_and_reports_to_pm(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address, retention_period_ms=500)
    conn = await Connection.open(primary(rng))
    try:
        _, res = await append(conn, [(sid, batch(4, "old"))])
        assert res[0].status.ok

        async def trimmed() -> FetchResult | None:  # retention runs every 300 ms here
            _, results, _ = await fetch(conn, sid, 0)
            return results[0] if results[0].status.code == ErrorCode.OFFSET_TRIMMED else None

        result = await eventually_async(trimmed, timeout=TIMEOUT_S, interval=0.2,
                                        what="retention trimming the stream")
        assert result.start_offset == 4

        async def pm_knows_start() -> bool:  # the node told the PM the new start
            f = await pm_call(cluster.pm_address, Opcode.DESCRIBE_STREAMS,
                              DescribeStreamsRequest(timeout_ms=1000,
                                                     stream_ids=(sid,)).encode())
            st = DescribeStreamsResponse.decode(f.header).items[0].stream
            return st is not None and st.start_offset == 4

        await eventually_async(pm_knows_start, timeout=TIMEOUT_S, interval=0.2,
                               what="the PM learning the trimmed start")
        _, res = await append(conn, [(sid, batch(1, "new"))])  # the stream goes on
        assert res[0].status.ok and res[0].base_offset == 4
    finally:
        await conn.aclose()


async def test_describe_ranges_is_authoritative(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    conn = await Connection.open(primary(rng))
    try:
        await append(conn, [(sid, batch(7))])
        f = await conn.request_one(Opcode.DESCRIBE_RANGES, DescribeRangesRequest(
            timeout_ms=1000, items=(DescribeRangeItem(stream_id=sid, range_index=0),
                                    DescribeRangeItem(stream_id=sid, range_index=5))).encode(),
            timeout_s=TIMEOUT_S)
        items = DescribeRangesResponse.decode(f.header).items
        assert items[0].range is not None
        assert (items[0].range.start_offset, items[0].range.next_offset,
                items[0].range.end_offset) == (0, 7, -1)
        assert items[1].status.code == ErrorCode.RANGE_NOT_FOUND
    finally:
        await conn.aclose()


async def test_pm_client_follows_not_leader_redirects(cluster: LocalCluster) -> None:
    """A follower PM answers PM_NOT_LEADER with the leader's address in detail."""
    async def follower(req: Request, resp: Responder) -> None:
        await resp.send(HeartbeatResponse(status=Status(
            code=ErrorCode.PM_NOT_LEADER, message="not the leader",
            detail=cluster.pm_address.encode())).encode())

    async def system_error_follower(req: Request, resp: Responder) -> None:
        raise PmNotLeaderError("not the leader", b"")  # no leader known: try the next one

    fake = Server({Opcode.HEARTBEAT: follower}, name="fake-pm")
    fake2 = Server({Opcode.HEARTBEAT: system_error_follower}, name="fake-pm2")
    await fake.start("127.0.0.1", 0)
    await fake2.start("127.0.0.1", 0)
    pool = ConnectionPool()
    try:
        pm = PmClient((fake2.address, fake.address), pool)
        r = await pm.call(HeartbeatRequest(client_id="t", client_role=ClientRole.CLIENT),
                          HeartbeatResponse)
        assert r.status.ok and pm.current == cluster.pm_address
    finally:
        await pool.close()
        await fake.close(0.5)
        await fake2.close(0.5)


def test_metrics_report_is_clamped(tmp_path: Path) -> None:
    m = Metrics(tmp_path)
    m.c.append_requests = 10**9  # far beyond int16 per second
    m.c.syncs_waiting = 10**12
    m.append_latency_ms.add(123.0)
    m.append_latency_ms.add(77.0)
    stats = StoreStats(unindexed_bytes=5, bytes_written=10**6, bytes_read=0, appends=0,
                       reads=0, fsyncs=0, segment_count=1, log_bytes=0, live_bytes=0,
                       streams=0, ranges=0, indexed_batches=0, disk_free_bytes=0)
    r = m.report(DataNodeMsg(node_id=1, advertise_addr="h:1"), stats, active_ranges=70_000)
    assert r.network_append_rate == 2**15 - 1 and r.range_active_cnt == 2**15 - 1
    assert r.uring_pending_task_cnt == 2**31 - 1
    assert r.network_append_avg_latency == 100
    assert r.disk_unindexed_data_size == 5 and r.disk_free_space > 0 and r.memory_used > 0
    assert r.disk_in_rate > 0
    r.encode()  # every field fits its wire type


async def test_graceful_stop_then_start(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    addr = primary(rng)
    node = next(dn for dn in cluster.datanodes if dn.address == addr)
    conn = await Connection.open(addr)
    three = batch(3)
    _, res = await append(conn, [(sid, three)])
    assert res[0].status.ok
    poll = await parked_fetch(conn, sid, [three])
    proc = node.proc
    assert proc is not None
    # SIGTERM: GOAWAY, end long polls, drain, close store; exit 0 means it finished within
    # the stop bound (past it the node is killed and the code is -9)
    await asyncio.to_thread(node.stop)
    assert proc.returncode == 0
    # the long poll was ended: an END frame, no error (no more data came)
    frames = await asyncio.wait_for(collect(poll), TIMEOUT_S)
    results, batches = decode_fetch(frames)
    assert frames[-1].is_end and batches == [] and all(r.status.ok for r in results)
    assert "event=datanode_stopped" in node.log_tail(10)
    await conn.aclose()
    node.start()
    await asyncio.to_thread(node.wait_ready, 30.0)
    conn = await Connection.open(addr)
    try:
        _, _, batches = await fetch(conn, sid, 0)
        assert len(values(batches)) == 3
    finally:
        await conn.aclose()


async def test_restart_after_kill_keeps_acknowledged_data(cluster: LocalCluster) -> None:
    sid, rng = await create_stream(cluster.pm_address)
    addr = primary(rng)
    node = next(dn for dn in cluster.datanodes if dn.address == addr)
    id_file = Path(node.args[node.args.index("--dir") + 1]) / "node_id"
    node_id = id_file.read_text()
    conn = await Connection.open(addr)
    acked = 0
    for i in range(10):
        _, res = await append(conn, [(sid, batch(3, f"k{i}"))])
        assert res[0].status.ok
        acked = res[0].next_offset
    await conn.aclose()
    node.kill()  # SIGKILL: no graceful close
    node.start()
    await asyncio.to_thread(node.wait_ready, 30.0)
    assert id_file.read_text() == node_id  # same identity after the restart
    conn = await Connection.open(addr)
    try:
        _, results, batches = await fetch(conn, sid, 0, max_bytes=8 << 20)
        assert results[0].status.ok, results[0].status
        assert len(values(batches)) == acked == 30
        assert values(batches)[-1].startswith(b"k9-2")
        _, res = await append(conn, [(sid, batch(1))])  # the range is still writable here
        assert res[0].status.code in (0, ErrorCode.RANGE_SEALED)
        if res[0].status.ok:
            assert res[0].base_offset == 30
    finally:
        await conn.aclose()
