"""Raw SBP requests over one :class:`Connection`: the create-streams, append and fetch calls
tests make below the SDK, to see the frames and per-item results exactly as a server sends them.
One copy for every test module (no test module defines its own)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

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
    Range,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import iter_records

REQUEST_TIMEOUT_S = 10.0
"""Hang guard of one request (a loaded 2-core machine answers in milliseconds)."""
REQUEST_TIMEOUT_MS = 5000
"""The server-side deadline the requests carry."""
CREATE_TRIES = 100
"""A fresh PM answers NOT_ENOUGH_DATA_NODES until a node's first heartbeat: tries, 50 ms apart."""


async def create_streams(pm: str, n: int = 1, *, replica_nums: int = 1,
                         retention_period_ms: int = 0) -> list[int]:
    """``n`` new streams on the PM at ``pm``; waits (bounded) for the PM to know enough nodes."""
    conn = await Connection.open(pm)
    try:
        item = CreateStreamItem(replica_nums=replica_nums, retention_period_ms=retention_period_ms)
        for _ in range(CREATE_TRIES):
            f = await conn.request_one(Opcode.CREATE_STREAMS, CreateStreamsRequest(
                timeout_ms=REQUEST_TIMEOUT_MS, items=(item,) * n).encode(),
                timeout_s=REQUEST_TIMEOUT_S)
            res = CreateStreamsResponse.decode(f.header).items
            if res[0].status.code != ErrorCode.NOT_ENOUGH_DATA_NODES:
                break
            await asyncio.sleep(0.05)
        out = []
        for r in res:
            assert r.status.ok and r.stream is not None, r.status
            out.append(r.stream.stream_id)
        return out
    finally:
        await conn.aclose()


def primary(r: Range) -> str:
    """The address of a range's primary replica."""
    return next(rn.data_node.advertise_addr for rn in r.replica_nodes if rn.is_primary)


async def append(conn: Connection, items: Sequence[tuple[int, bytes]], *,
                 timeout_ms: int = REQUEST_TIMEOUT_MS, range_index: int = -1,
                 timeout_s: float = REQUEST_TIMEOUT_S,
                 ) -> tuple[list[Frame], list[AppendResult]]:
    """One APPEND of ``(stream id, batch)`` items: the response frames and the results in
    request order (each item answered exactly once)."""
    req = AppendRequest(timeout_ms=timeout_ms, items=tuple(
        AppendItem(stream_id=sid, request_index=i, batch_length=len(b), range_index=range_index)
        for i, (sid, b) in enumerate(items)))
    frames = await conn.request(Opcode.APPEND, req.encode(), [b for _, b in items],
                                timeout_s=timeout_s)
    results = {r.request_index: r for f in frames for r in AppendResponse.decode(f.header).items}
    assert sorted(results) == list(range(len(items))), results
    return frames, [results[i] for i in range(len(items))]


async def append_one(conn: Connection, sid: int, batch: bytes, *,
                     timeout_ms: int = REQUEST_TIMEOUT_MS, range_index: int = -1,
                     timeout_s: float = REQUEST_TIMEOUT_S) -> AppendResult:
    """One batch to one stream: its result, whatever the status."""
    _, (res,) = await append(conn, [(sid, batch)], timeout_ms=timeout_ms,
                             range_index=range_index, timeout_s=timeout_s)
    return res


async def append_ok(conn: Connection, sid: int, batches: Sequence[bytes]) -> list[AppendResult]:
    """Batches to one stream in one request, every one acknowledged."""
    _, results = await append(conn, [(sid, b) for b in batches])
    for r in results:
        assert r.status.ok, r.status
    return results


def decode_fetch(frames: list[Frame]) -> tuple[list[FetchResult], list[bytes]]:
    """A FETCH response's results and its batches (of the results that carry one)."""
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
    return results, batches


async def fetch(conn: Connection, sid: int, offset: int = 0, *, max_wait_ms: int = 0,
                min_bytes: int = 0, max_bytes: int = 1 << 20,
                timeout_s: float = REQUEST_TIMEOUT_S,
                ) -> tuple[list[Frame], list[FetchResult], list[bytes]]:
    """One FETCH of one stream from ``offset``: frames, results and batches."""
    req = FetchRequest(max_wait_ms=max_wait_ms, min_bytes=min_bytes, items=(
        FetchItem(stream_id=sid, request_index=0, fetch_offset=offset,
                  batch_max_bytes=max_bytes),))
    frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=timeout_s)
    results, batches = decode_fetch(frames)
    return frames, results, batches


def values(batches: list[bytes]) -> list[bytes]:
    """Every record value of ``batches``, in order."""
    return [bytes(rec.value or b"") for b in batches for rec in iter_records(b)]
