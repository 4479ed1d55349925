"""Helpers shared by the multi-process replication tests."""

from __future__ import annotations

from sbpstream.cluster import LocalCluster, Node
from sbpstream.net.client import Connection
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse, Range
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import iter_all_records


def node_at(cluster: LocalCluster, address: str) -> Node:
    return next(dn for dn in cluster.datanodes if dn.address == address)


async def read_range(address: str, rng: Range) -> list[bytes]:
    """Every record value of a sealed range, read straight from one replica."""
    conn = await Connection.open(address)
    out: list[bytes] = []
    offset = rng.start_offset
    try:
        while offset < rng.end_offset:
            req = FetchRequest(max_wait_ms=0, min_bytes=1, items=(FetchItem(
                stream_id=rng.stream_id, request_index=0, fetch_offset=offset,
                batch_max_bytes=1 << 20, range_index=rng.range_index),))
            frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=10)
            got = 0
            for f in frames:
                for item in FetchResponse.decode(f.header).items:
                    if item.status.code:
                        raise item.status.error()
                for r in iter_all_records(bytes(f.payload), start_offset=offset):
                    if r.offset >= rng.end_offset:
                        break
                    assert r.offset == offset, f"gap or reorder at {offset} on {address}"
                    out.append(bytes(r.value or b""))
                    offset += 1
                    got += 1
            assert got, f"replica {address} returned nothing at {offset} < {rng.end_offset}"
    finally:
        await conn.aclose()
    return out
