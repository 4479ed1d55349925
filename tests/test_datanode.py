"""Data node against a real PM and real data node processes (LocalCluster), over SBP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    AppendResult,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
    FetchResult,
    ListRangesRequest,
    ListRangesResponse,
    Range,
    StreamOwner,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch, iter_records, read_header

TIMEOUT_S = 10.0  # every in-test wait is bounded by this


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("dn"), datanodes=2, heartbeat_interval_ms=200,
                      node_timeout_ms=3000) as c:
        yield c


def batch(n: int, tag: str = "r", size: int = 16) -> bytes:
    return build_batch([Record(value=f"{tag}-{i}".encode().ljust(size, b".")) for i in range(n)])


async def create_stream(pm: str) -> tuple[int, Range]:
    """A new single-replica stream; returns its id and its first range (with placement)."""
    conn = await Connection.open(pm)
    try:
        f = await conn.request_one(Opcode.CREATE_STREAMS, CreateStreamsRequest(
            timeout_ms=5000, items=(CreateStreamItem(replica_nums=1),)).encode(),
            timeout_s=TIMEOUT_S)
        res = CreateStreamsResponse.decode(f.header).items[0]
        assert res.status.ok, res.status
        assert res.stream is not None
        sid = res.stream.stream_id
        f = await conn.request_one(Opcode.LIST_RANGES, ListRangesRequest(
            timeout_ms=5000, items=(StreamOwner(sid),)).encode(), timeout_s=TIMEOUT_S)
        ranges = ListRangesResponse.decode(f.header).items[0].ranges
        return sid, ranges[-1]
    finally:
        await conn.aclose()


def primary(r: Range) -> str:
    return next(rn.data_node.advertise_addr for rn in r.replica_nodes if rn.is_primary)


async def append(conn: Connection, items: list[tuple[int, bytes]],
                 ) -> tuple[list[Frame], dict[int, AppendResult]]:
    req = AppendRequest(timeout_ms=5000, items=tuple(
        AppendItem(stream_id=sid, request_index=i, batch_length=len(b))
        for i, (sid, b) in enumerate(items)))
    frames = await conn.request(Opcode.APPEND, req.encode(), [b for _, b in items],
                                timeout_s=TIMEOUT_S)
    results = {r.request_index: r for f in frames for r in AppendResponse.decode(f.header).items}
    assert sorted(results) == list(range(len(items)))
    return frames, results


async def fetch(conn: Connection, sid: int, offset: int, *, max_wait_ms: int = 0,
                min_bytes: int = 0, max_bytes: int = 1 << 20,
                ) -> tuple[list[Frame], list[FetchResult], list[bytes]]:
    req = FetchRequest(max_wait_ms=max_wait_ms, min_bytes=min_bytes, items=(
        FetchItem(stream_id=sid, request_index=0, fetch_offset=offset,
                  batch_max_bytes=max_bytes),))
    frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=TIMEOUT_S)
    results: list[FetchResult] = []
    batches: list[bytes] = []
    for f in frames:
        pos = 0
        payload = bytes(f.payload)
        for r in FetchResponse.decode(f.header).items:
            results.append(r)
            if r.batch_length:
                batches.append(payload[pos : pos + r.batch_length])
                pos += r.batch_length
        assert pos == len(payload)
    return frames, results, batches


def values(batches: list[bytes]) -> list[bytes]:
    return [bytes(rec.value or b"") for b in batches for rec in iter_records(b)]


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
