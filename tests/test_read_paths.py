"""One read path (datanode/reader.py): the same records read by pull FETCH, push subscription
and fetch session move every per-stream figure the same (STATS, /v1 on the admin ports, the
node's INFO total, the fetch quota's counter); the per-connection figures (subscriptions,
sessions, throttle time) move as they are opened, closed and charged; and the read modules
import one another in one direction only."""

from __future__ import annotations

import ast
import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.introspect.wire import Introspection
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    BufferAckRequest,
    BufferAckResponse,
    ClientRole,
    FetchItem,
    FetchRequest,
    FetchResponse,
    HeartbeatRequest,
    WhoamiRequest,
    WhoamiResponse,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec
from sbpstream.records import Record, build_batch

TIMEOUT_S = 30.0
BATCHES = 6
RECORDS_PER_BATCH = 50
RECORD_BYTES = 100
TOTAL = BATCHES * RECORDS_PER_BATCH
BIG_FETCH_QUOTA = 1 << 30  # a default quota nobody reaches: every client gets its own counter


def http(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, c: LocalCluster, pm_admin: int, dn_admin: int) -> None:
        self.c = c
        self.pm_admin = pm_admin
        self.dn_admin = dn_admin
        self.dn = c.datanodes[0].address


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pm_admin, dn_admin = free_port(), free_port()
    c = LocalCluster(tmp_path_factory.mktemp("read_paths"), datanodes=1,
                     extra_pm_args=["--metrics-port", str(pm_admin)],
                     extra_dn_args=["--metrics-port", str(dn_admin)])
    with c:
        yield Cluster(c, pm_admin, dn_admin)


@pytest.fixture
async def admin(cluster: Cluster) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cluster.c.pm_address, client_id="admin") as a:
        yield a


async def _stream_with_records(admin: AsyncClient, dn: str) -> tuple[int, int]:
    """A new stream holding TOTAL records in BATCHES batches; returns (id, payload bytes)."""
    sid = await admin.create_stream(replica_nums=1)
    batches = [build_batch([Record(value=f"b{b}-r{i}".encode().ljust(RECORD_BYTES, b"."))
                            for i in range(RECORDS_PER_BATCH)]) for b in range(BATCHES)]
    conn = await Connection.open(dn)
    try:
        for b in batches:
            f = await conn.request_one(Opcode.APPEND, AppendRequest(
                timeout_ms=5000, items=(AppendItem(sid, 0, len(b)),)).encode(), b,
                timeout_s=TIMEOUT_S)
            assert AppendResponse.decode(f.header).items[0].status.ok
    finally:
        await conn.aclose()
    return sid, sum(len(b) for b in batches)


async def _client(dn: str, client_id: str) -> Connection:
    conn = await Connection.open(dn)
    await conn.request_one(Opcode.HEARTBEAT, HeartbeatRequest(
        client_id, ClientRole.CLIENT).encode(), timeout_s=TIMEOUT_S)
    return conn


def _item(sid: int) -> FetchItem:
    return FetchItem(stream_id=sid, request_index=0, fetch_offset=0, batch_max_bytes=1 << 20)


def _take(resp: FetchResponse, payload: Any, sid: int) -> int:
    got = 0
    for item, _chunk in resp.chunks(payload):
        assert item.status.ok, item.status
        if item.stream_id == sid:
            got += item.batch_length
    return got


async def _read(conn: Connection, mode: str, sid: int, nbytes: int) -> int:
    """Read every record of ``sid`` from offset 0 the ``mode`` way; returns the payload bytes."""
    if mode in ("pull", "session"):
        epoch = 0 if mode == "session" else -1
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, min_bytes=0, session_epoch=epoch, items=(_item(sid),)).encode(),
            timeout_s=TIMEOUT_S)
        heads = [FetchResponse.decode(f.header) for f in frames]
        if mode == "session":
            assert heads[-1].session_id != 0  # it is a session (the cache has room)
        return sum(_take(h, f.payload, sid) for h, f in zip(heads, frames, strict=True))
    rs = await conn.stream(Opcode.FETCH, FetchRequest(
        max_wait_ms=0, min_bytes=0, window_bytes=4 << 20, items=(_item(sid),)).encode(),
        timeout_s=TIMEOUT_S)
    got = 0
    async with asyncio.timeout(TIMEOUT_S):
        while got < nbytes:
            f = await anext(rs)
            got += _take(FetchResponse.decode(f.header), f.payload, sid)
    ack = await conn.request_one(Opcode.BUFFER_ACK, BufferAckRequest(
        fetch_request_id=rs.request_id, cancel=True).encode(), timeout_s=TIMEOUT_S)
    assert BufferAckResponse.decode(ack.header).status.ok
    return got


async def _figures(cluster: Cluster, sid: int) -> dict[str, int]:
    """Every figure of what was read from ``sid``: STATS, /v1 on both admin ports, INFO."""
    async with Introspection(cluster.dn) as intro:
        (row,) = (await intro.stats([sid]))[1]["streams"]
        info = (await intro.info())[1]
    (dn_row,) = (await asyncio.to_thread(http, cluster.dn_admin, f"/v1/stats?stream={sid}"))[
        "streams"]
    pm_rows = (await asyncio.to_thread(http, cluster.pm_admin, "/v1/streams?top=1000"))[
        "streams"]
    (pm_row,) = [r for r in pm_rows if r["stream_id"] == sid]
    return {
        "stats_records": row["records_fetched"], "stats_bytes": row["bytes_fetched"],
        "dn_v1_records": dn_row["records_fetched"], "dn_v1_bytes": dn_row["bytes_fetched"],
        "pm_v1_records": pm_row["records_fetched"], "pm_v1_bytes": pm_row["bytes_fetched"],
        "node_records": info["records_fetched"], "node_bytes": info["bytes_fetched"],
    }


async def _quota_used(admin: AsyncClient, dn: str, client_id: str) -> int | None:
    """Bytes charged to ``client_id``'s fetch counter in its live window (None: none live)."""
    for c in (await admin.quota_counters(dn)).counters:
        if c.key == f"c/{client_id}/fetch":
            return BIG_FETCH_QUOTA - c.quota
    return None


async def test_pull_push_and_session_move_every_counter_the_same(
        cluster: Cluster, admin: AsyncClient) -> None:
    sid, nbytes = await _stream_with_records(admin, cluster.dn)
    spec = QuotaSpec(QuotaKind.DEFAULT, "", UNLIMITED, BIG_FETCH_QUOTA)
    await admin.set_quota(spec)

    async def applied() -> bool:
        return any(q.kind == int(QuotaKind.DEFAULT) and q.fetch_bytes_per_s == BIG_FETCH_QUOTA
                   for q in (await admin.quota_counters(cluster.dn)).quotas)
    await eventually_async(applied, timeout=20, what="the data node applies the default quota")
    try:
        moved: dict[str, dict[str, int]] = {}
        for mode in ("pull", "push", "session"):
            before = await _figures(cluster, sid)
            used = None
            for attempt in range(5):  # a quota window is 1 s: a slow machine may outlive it
                conn = await _client(cluster.dn, f"reader-{mode}-{attempt}")
                try:
                    got = await _read(conn, mode, sid, nbytes)
                    assert got == nbytes, (mode, got, nbytes)
                    used = await _quota_used(admin, cluster.dn, f"reader-{mode}-{attempt}")
                finally:
                    await conn.aclose()
                if used is not None:
                    break
            assert used is not None, f"{mode}: no live fetch counter after 5 reads"
            attempts = attempt + 1
            after = await _figures(cluster, sid)
            delta = {k: after[k] - before[k] for k in before}
            moved[mode] = {k: v // attempts for k, v in delta.items()}
            assert all(v % attempts == 0 for v in delta.values()), (mode, delta)
            moved[mode]["quota_fetch_bytes"] = used
        want = {"stats_records": TOTAL, "stats_bytes": nbytes,
                "dn_v1_records": TOTAL, "dn_v1_bytes": nbytes, "pm_v1_records": TOTAL,
                "pm_v1_bytes": nbytes, "node_records": TOTAL, "node_bytes": nbytes,
                "quota_fetch_bytes": nbytes}
        assert moved == {"pull": want, "push": want, "session": want}
    finally:
        await admin.delete_quota(QuotaKind.DEFAULT, "")


async def _me(cluster: Cluster, conn_id: int) -> dict[str, Any]:
    async with Introspection(cluster.dn) as intro:
        body = (await intro.connections())[1]
    (me,) = [c for c in body["connections"] if c["id"] == conn_id]
    return me


async def _conn_id(conn: Connection) -> int:
    f = await conn.request_one(Opcode.WHOAMI, WhoamiRequest().encode(), timeout_s=TIMEOUT_S)
    return WhoamiResponse.decode(f.header).connection_id


async def test_connection_figures_count_subscriptions_sessions_and_throttle(
        cluster: Cluster, admin: AsyncClient) -> None:
    sid, nbytes = await _stream_with_records(admin, cluster.dn)
    conn = await _client(cluster.dn, "figures")
    try:
        cid = await _conn_id(conn)
        assert {k: (await _me(cluster, cid))[k] for k in
                ("subscriptions", "sessions", "throttle_time_ms")} == {
            "subscriptions": 0, "sessions": 0, "throttle_time_ms": 0}
        # a subscription with a session (push mode): one of each while it lives
        rs = await conn.stream(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, min_bytes=0, window_bytes=4 << 20, session_epoch=0,
            items=(_item(sid),)).encode(), timeout_s=TIMEOUT_S)
        await anext(rs)

        async def open_now() -> bool:
            me = await _me(cluster, cid)
            return (me["subscriptions"], me["sessions"]) == (1, 1)
        await eventually_async(open_now, timeout=10, what="1 subscription and 1 session")
        f = await conn.request_one(Opcode.BUFFER_ACK, BufferAckRequest(
            fetch_request_id=rs.request_id, cancel=True).encode(), timeout_s=TIMEOUT_S)
        assert BufferAckResponse.decode(f.header).status.ok

        async def closed_now() -> bool:
            me = await _me(cluster, cid)
            return (me["subscriptions"], me["sessions"]) == (0, 0)
        await eventually_async(closed_now, timeout=10, what="the subscription and its session end")
        # a pull session: counted until it is closed (epoch -1)
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, session_epoch=0, items=(_item(sid),)).encode(), timeout_s=TIMEOUT_S)
        session_id = FetchResponse.decode(frames[-1].header).session_id
        assert session_id and (await _me(cluster, cid))["sessions"] == 1
        await conn.request(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, session_id=session_id, session_epoch=-1).encode(),
            timeout_s=TIMEOUT_S)
        assert (await _me(cluster, cid))["sessions"] == 0
    finally:
        await conn.aclose()
    # throttle time: what the quota charge handed this connection, added up
    quota = nbytes // 4  # one read of the stream is ~4 windows over
    spec = QuotaSpec(QuotaKind.CLIENT, "slow-reader", UNLIMITED, quota)
    await admin.set_quota(spec)

    async def applied() -> bool:
        return any(q.name == "slow-reader" and q.fetch_bytes_per_s == quota
                   for q in (await admin.quota_counters(cluster.dn)).quotas)
    await eventually_async(applied, timeout=20, what="the data node applies the client quota")
    conn = await _client(cluster.dn, "slow-reader")
    try:
        cid = await _conn_id(conn)
        frames = await conn.request(Opcode.FETCH, FetchRequest(
            max_wait_ms=0, items=(_item(sid),)).encode(), timeout_s=TIMEOUT_S)
        throttle = sum(FetchResponse.decode(f.header).throttle_time_ms for f in frames)
        assert throttle > 0
        assert (await _me(cluster, cid))["throttle_time_ms"] == throttle
    finally:
        await conn.aclose()
        await admin.delete_quota(QuotaKind.CLIENT, "slow-reader")


READ_MODULES = ("fetch", "subscribe", "sessions", "reader", "frames")


def _datanode_imports(module: str) -> set[str]:
    """Every datanode module ``module`` imports: module-level, in functions, TYPE_CHECKING."""
    import sbpstream.datanode as dn
    path = Path(dn.__file__).with_name(f"{module}.py")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else f"sbpstream.datanode.{node.module}"
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        out |= {n.split(".")[2] for n in names if n.startswith("sbpstream.datanode.")}
    return out & set(READ_MODULES) - {module}


def test_the_read_modules_import_one_way() -> None:
    graph = {m: _datanode_imports(m) for m in READ_MODULES}

    def reaches(a: str, b: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph[a])
    circles = [m for m in READ_MODULES if reaches(m, m)]
    assert not circles, graph
    assert "reader" in graph["fetch"] and "reader" in graph["subscribe"]  # the one reader


def _text(renderable: Any) -> str:
    from rich.console import Console
    console = Console(record=True, width=400, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_cli_views_show_the_counted_figures() -> None:
    from sbpstream.introspect.views import connections_view, info_view, stats_view
    conn = {"id": 7, "peer": "127.0.0.1:5", "client_id": "c", "client_role": "CLIENT",
            "age_s": 1.0, "bytes_in": 1, "bytes_out": 2, "requests": 3,
            "requests_in_flight": 1, "subscriptions": 2, "sessions": 3,
            "throttle_time_ms": 4567}
    text = _text(connections_view({"connection_count": 1, "connections": [conn]}))
    assert "subs" in text and "throttle ms" in text
    assert "│ 2 " in text and "│ 3 " in text and "4567" in text
    info = {"role": "datanode", "version": "v", "node_id": 1, "address": "a", "uptime_ms": 1000,
            "connections_open": 1, "totals": {"requests": 0, "bytes_in": 0, "bytes_out": 0,
                                              "errors": 0, "per_minute": {
                                                  "requests": 0, "bytes_in": 0, "bytes_out": 0,
                                                  "errors": 0}},
            "opcodes": {}, "records_fetched": 3000000, "bytes_fetched": 98765}
    text = _text(info_view(info))
    assert "records out" in text and "3000000" in text and "98765" in text
    row = {"stream_id": 9, "records_appended": 5, "bytes_appended": 6, "records_fetched": 3000000,
           "per_minute": {"records_appended": 0, "bytes_appended": 0, "records_fetched": 11,
                          "bytes_fetched": 0}, "start_offset": 0, "next_offset": 5,
           "ranges": 1, "last_append_ms": 0}
    text = _text(stats_view({"streams": [row]}))
    assert "records out" in text and "3000000" in text
