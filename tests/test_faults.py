"""Wire faults between a client and a real data node or PM, through the fault proxy.

A delaying link still gets every answer; a truncated or corrupted stream gives the client a clear
error, and the server lives on and keeps serving its other clients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from raw_sbp import append_one, fetch, values
from tcp_proxy import Fault, TcpProxy

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import ConnectionClosedError, ErrorCode, SbpError
from sbpstream.records import Record, build_batch

TIMEOUT_S = 15.0
"""Bound of every request here (hang guard, far above the delays injected)."""

VALUE_BYTES = 64 * 1024
"""One record this big makes a frame whose payload starts well before byte 4096: the faults
below hit payload bytes, past any header of these requests and responses."""

FAULT_AT = 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("faults"), datanodes=1) as c:
        yield c


@pytest.fixture(scope="module")
def dn_address(cluster: LocalCluster) -> str:
    return cluster.datanodes[0].address


@pytest.fixture
async def proxy(dn_address: str) -> AsyncIterator[TcpProxy]:
    p = await TcpProxy(dn_address).start()
    try:
        yield p
    finally:
        await p.close()


async def new_stream(pm: str) -> int:
    async with AsyncClient(pm) as c:
        return await c.create_stream()


def big_batch(tag: bytes) -> bytes:
    return build_batch([Record(value=tag * (VALUE_BYTES // len(tag)))])


async def append(conn: Connection, sid: int, batch: bytes) -> int:
    """The batch's base offset; a refused append raises its error."""
    item = await append_one(conn, sid, batch, timeout_s=TIMEOUT_S)
    if not item.status.ok:
        raise item.status.error()
    return item.base_offset


async def fetch_values(conn: Connection, sid: int) -> list[bytes]:
    _, _, batches = await fetch(conn, sid, timeout_s=TIMEOUT_S)
    return values(batches)


async def still_serves(cluster: LocalCluster, bystander: Connection, sid: int) -> None:
    """The data node process runs and answers a client that was connected all along, and a new
    one; appends still land after the fault."""
    assert cluster.datanodes[0].running
    await bystander.ping()
    fresh = await Connection.open(cluster.datanodes[0].address)
    try:
        offset = await append(fresh, sid, build_batch([Record(value=b"after")]))
        assert (await fetch_values(bystander, sid))[offset] == b"after"
    finally:
        await fresh.aclose()


async def test_delaying_link_still_answers(cluster: LocalCluster, proxy: TcpProxy) -> None:
    proxy.set_faults(up=Fault(delay_s=0.05), down=Fault(delay_s=0.05))
    sid = await new_stream(cluster.pm_address)
    conn = await Connection.open(proxy.address)
    try:
        batches = [build_batch([Record(value=b"d%d" % i)]) for i in range(5)]
        assert [await append(conn, sid, b) for b in batches] == [0, 1, 2, 3, 4]
        assert await fetch_values(conn, sid) == [b"d%d" % i for i in range(5)]
    finally:
        await conn.aclose()


async def test_pm_through_a_delaying_link_still_answers(cluster: LocalCluster) -> None:
    proxy = await TcpProxy(cluster.pm_address).start()
    try:
        proxy.set_faults(up=Fault(delay_s=0.05), down=Fault(delay_s=0.05))
        async with AsyncClient(proxy.address) as c:
            ids = await c.create_streams(3)
            assert [s.stream_id for s in await c.describe_streams(ids)] == ids
    finally:
        await proxy.close()


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_truncated_stream_is_a_clear_error(
    cluster: LocalCluster, proxy: TcpProxy, direction: str
) -> None:
    sid = await new_stream(cluster.pm_address)
    bystander = await Connection.open(cluster.datanodes[0].address)
    try:
        cut = Fault(truncate_after=FAULT_AT)
        if direction == "up":  # the data node reads half an APPEND frame, then EOF
            proxy.set_faults(up=cut)
            conn = await Connection.open(proxy.address)
            with pytest.raises(ConnectionClosedError):
                await append(conn, sid, big_batch(b"up"))
        else:  # the client reads half a FETCH response, then EOF
            await append(bystander, sid, big_batch(b"down"))
            proxy.set_faults(down=cut)
            conn = await Connection.open(proxy.address)
            with pytest.raises(ConnectionClosedError):
                await fetch_values(conn, sid)
        await conn.aclose()
        assert proxy.truncated == 1
        await still_serves(cluster, bystander, sid)
    finally:
        await bystander.aclose()


async def test_flipped_byte_to_the_server_is_refused(cluster: LocalCluster,
                                                     proxy: TcpProxy) -> None:
    sid = await new_stream(cluster.pm_address)
    bystander = await Connection.open(cluster.datanodes[0].address)
    proxy.set_faults(up=Fault(flip_at=FAULT_AT))
    conn = await Connection.open(proxy.address)
    try:
        with pytest.raises(SbpError) as ei:
            await append(conn, sid, big_batch(b"flip"))
        assert ei.value.code == ErrorCode.CHECKSUM_MISMATCH
        assert proxy.flipped == 1
        assert await fetch_values(bystander, sid) == []  # nothing of the corrupt frame landed
        # the same connection goes on: the corruption cost one request, not the connection
        assert await append(conn, sid, big_batch(b"ok")) == 0
        await still_serves(cluster, bystander, sid)
    finally:
        await conn.aclose()
        await bystander.aclose()


async def test_flipped_byte_to_the_client_is_a_clear_error(cluster: LocalCluster,
                                                           proxy: TcpProxy) -> None:
    sid = await new_stream(cluster.pm_address)
    bystander = await Connection.open(cluster.datanodes[0].address)
    await append(bystander, sid, big_batch(b"fetched"))
    proxy.set_faults(down=Fault(flip_at=FAULT_AT))
    conn = await Connection.open(proxy.address)
    try:
        with pytest.raises(SbpError, match="corrupt response frame"):
            await fetch_values(conn, sid)
        assert proxy.flipped == 1
        assert await fetch_values(conn, sid) == [b"fetched" * (VALUE_BYTES // 7)]
        await still_serves(cluster, bystander, sid)
    finally:
        await conn.aclose()
        await bystander.aclose()
