"""INFO, STATS, CONNECTIONS and WHOAMI on a live cluster: every figure matches the traffic the
test sent; the same figures as JSON on the admin port; the CLI commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import eventually, eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.introspect.wire import Introspection
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.protocol.errors import InvalidRequestError
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    ClientRole,
    FetchItem,
    FetchRequest,
    HeartbeatRequest,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch

EXE = str(Path(sys.executable).with_name("sbpstream"))
APPENDS = 5
RECORDS_PER_BATCH = 4


def http(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the answer's socket
            return exc.code, json.loads(exc.read())


class Cluster:
    def __init__(self, cluster: LocalCluster, pm_admin: int, dn_admin: int) -> None:
        self.c = cluster
        self.pm_admin = pm_admin
        self.dn_admin = dn_admin


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pm_admin, dn_admin = free_port(), free_port()
    c = LocalCluster(tmp_path_factory.mktemp("introspect"), datanodes=1,
                     extra_pm_args=["--metrics-port", str(pm_admin)],
                     extra_dn_args=["--metrics-port", str(dn_admin)])
    with c:
        yield Cluster(c, pm_admin, dn_admin)


async def test_every_opcode_matches_the_traffic_sent(cluster: Cluster) -> None:
    async with AsyncClient(cluster.c.pm_address) as client:
        sid = await client.create_stream(replica_nums=1)
    dn = cluster.c.datanodes[0].address
    batch = build_batch([Record(value=b"v%d" % i) for i in range(RECORDS_PER_BATCH)])
    conn = await Connection.open(dn)
    try:
        append_bytes_in = 0
        for _ in range(APPENDS):
            hdr = AppendRequest(items=(AppendItem(sid, 0, len(batch)),)).encode()
            frame = await conn.request_one(Opcode.APPEND, hdr, batch, timeout_s=10)
            assert AppendResponse.decode(frame.header).items[0].status.ok
            append_bytes_in += 24 + len(hdr) + len(batch)
        bad = AppendRequest(items=(AppendItem(sid, 0, len(batch) + 1),)).encode()
        with pytest.raises(InvalidRequestError):  # lengths do not add up: a system error
            await conn.request_one(Opcode.APPEND, bad, batch, timeout_s=10)
        append_bytes_in += 24 + len(bad) + len(batch)
        fetch = FetchRequest(items=(FetchItem(sid, 0, 0, 1 << 20),)).encode()
        await conn.request(Opcode.FETCH, fetch, timeout_s=10)

        async with Introspection(dn) as intro:
            head, info = await intro.info()
            assert head.role == info["role"] == "datanode" and head.node_id == info["node_id"] > 0
            assert head.version == info["version"] and info["uptime_ms"] > 0
            ap = info["opcodes"]["APPEND"]
            assert ap["requests"] == APPENDS + 1 and ap["errors"] == 1
            assert ap["bytes_in"] == append_bytes_in and ap["bytes_out"] > 0
            assert ap["per_minute"] == {k: v for k, v in ap.items() if k != "per_minute"}
            assert info["opcodes"]["FETCH"]["requests"] == 1
            assert info["opcodes"]["INFO"]["requests"] == 1

            head, st = await intro.stats([sid])
            assert head.stream_count == 1
            (row,) = st["streams"]
            total = APPENDS * RECORDS_PER_BATCH
            assert row["records_appended"] == row["records_fetched"] == total
            assert row["bytes_appended"] == row["bytes_fetched"] == APPENDS * len(batch)
            assert row["per_minute"]["records_appended"] == total
            assert (row["start_offset"], row["next_offset"]) == (0, total)
            assert [r["range_index"] for r in row["ranges"]] == [0] and row["ranges"][0]["primary"]
            assert row["last_append_ms"] > 0
            top = (await intro.stats())[1]["streams"]
            assert top[0]["stream_id"] == sid  # the busiest stream comes first

            # CONNECTIONS: the test's APPEND/FETCH connection, as the server counted it
            sent, received = conn.bytes_out, conn.bytes_in
            head, conns = await intro.connections()
            mine = [c for c in conns["connections"] if c["requests"] == APPENDS + 2]
            assert len(mine) == 1 and head.connection_count == conns["connection_count"] >= 2
            assert mine[0]["bytes_in"] == sent and mine[0]["bytes_out"] == received
            assert mine[0]["requests_in_flight"] == 0

            head, me = await intro.whoami()
            assert head.connection_id == me["id"] != mine[0]["id"]
            assert me["requests"] == 5 and me["requests_in_flight"] == 1  # this one
            assert head.peer == me["peer"]
    finally:
        await conn.aclose()


async def test_whoami_and_cluster_view_on_the_pm(cluster: Cluster) -> None:
    pm = cluster.c.pm_address
    async with Introspection(pm) as intro:
        conn = intro._conn
        assert conn is not None
        await conn.request_one(Opcode.HEARTBEAT, HeartbeatRequest(
            "tester-1", ClientRole.CLIENT).encode(), timeout_s=10)
        head, me = await intro.whoami()
        assert (head.client_id, head.client_role) == ("tester-1", ClientRole.CLIENT)
        assert (me["client_id"], me["client_role"]) == ("tester-1", "CLIENT")
        sock = conn.transport.get_extra_info("sockname") if conn.transport else None
        assert sock is not None and head.peer == f"{sock[0]}:{sock[1]}"
        _, info = await intro.info()
        assert info["role"] == "pm" and info["opcodes"]["HEARTBEAT"]["requests"] >= 1
        (node,) = info["nodes"]
        assert node["live"] and node["address"] == cluster.c.datanodes[0].address
        assert [c["client_id"] for c in info["clients"]] == ["tester-1"]
        _, conns = await intro.connections()
        roles = {c["client_id"]: c["client_role"] for c in conns["connections"]}
        assert roles["tester-1"] == "CLIENT" and roles[f"datanode-{node['node_id']}"] == "DATA_NODE"

    async def reported() -> dict[str, Any] | None:
        async with Introspection(pm) as i:
            n = (await i.info())[1]["nodes"][0]
        return n if n["metrics"] is not None else None

    n = await eventually_async(reported, timeout=30, interval=0.5, what="REPORT_METRICS shown")
    assert n["metrics"]["disk_free_space"] > 0


async def test_json_endpoints(cluster: Cluster) -> None:
    async with AsyncClient(cluster.c.pm_address) as client:
        sid = await client.create_stream(replica_nums=1)
        async with client.producer(linger_ms=0) as p:
            futs = [await p.send(sid, b"<b>value %d</b>" % i) for i in range(7)]
            await p.flush()
            assert [await f for f in futs] == list(range(7))
    pm, dn = cluster.pm_admin, cluster.dn_admin
    status, body = http(pm, "/v1/info")
    assert status == 200 and body["role"] == "pm" and len(body["nodes"]) == 1
    status, body = http(dn, "/v1/info")
    assert status == 200 and body["role"] == "datanode" and body["opcodes"]["APPEND"]["requests"]
    status, body = http(pm, f"/v1/stats?stream={sid}")
    assert status == 200 and body["streams"][0]["records_appended"] == 7
    status, body = http(pm, f"/v1/streams/{sid}")
    assert status == 200 and body["next_offset"] == 7 and body["records_appended"] == 7
    assert body["ranges"][0]["replicas"][0]["live"] and body["unreachable"] == []
    assert body["ranges"][0]["next_offset"] == 7  # the data node's, not the PM's last report
    status, body = http(dn, f"/v1/streams/{sid}")
    assert status == 200 and body["records_appended"] == 7 and body["next_offset"] == 7
    status, body = http(pm, f"/v1/streams/{sid}/tail?n=3")
    assert status == 200
    assert [(r["offset"], r["value"]) for r in body["records"]] == [
        (i, f"<b>value {i}</b>") for i in (4, 5, 6)]
    status, body = http(pm, "/v1/streams?top=1")
    assert status == 200 and len(body["streams"]) == 1
    status, body = http(pm, "/v1/nodes")
    assert status == 200 and body["nodes"][0]["live"] and body["under_replicated"] == []
    status, body = http(pm, "/v1/connections")
    assert status == 200 and body["connection_count"] == len(body["connections"]) >= 1
    assert http(pm, "/v1/streams/999999")[0] == 404
    assert http(pm, "/v1/stats?top=x")[0] == 400
    assert http(pm, "/v1/nope")[0] == 404
    assert http(dn, f"/v1/streams/{sid}/tail")[0] == 404  # the tail is the PM's
    with urllib.request.urlopen(f"http://127.0.0.1:{pm}/", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html") and b"console.js" in r.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{pm}/metrics", timeout=10) as r:
        assert b"sbpstream_pm_requests_total" in r.read()


def sbp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "250"}, check=False)


def test_cli_commands(cluster: Cluster) -> None:
    pm = cluster.c.pm_address
    r = sbp("info", "--pm", pm, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["role"] == "pm"
    r = sbp("nodes", "--pm", pm, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["nodes"][0]["live"] is True
    r = sbp("whoami", "--node", cluster.c.datanodes[0].address, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["requests"] == 1
    r = sbp("stats", "--pm", pm)
    assert r.returncode == 0 and "streams" in r.stdout, r.stderr
    r = sbp("connections", "--pm", pm)
    assert r.returncode == 0 and "DATA_NODE" in r.stdout, r.stderr
    r = sbp("top", "--pm", pm, "--iterations", "2", "--interval-s", "0.1")
    assert r.returncode == 0 and "data nodes" in r.stdout and "connections" in r.stdout, r.stderr
    r = sbp("nodes", "--pm", cluster.c.datanodes[0].address)
    assert r.returncode == 1 and "not a placement manager" in r.stderr  # asks the PM leader


def test_under_replicated_ranges(tmp_path: Path) -> None:
    admin = free_port()
    c = LocalCluster(tmp_path, datanodes=2, node_timeout_ms=1500,
                     extra_pm_args=["--metrics-port", str(admin)])
    with c:
        r = sbp("stream", "create", "--pm", c.pm_address, "--replicas", "2")
        assert r.returncode == 0, r.stderr
        sid = int(r.stdout.strip())
        assert http(admin, "/v1/nodes")[1]["under_replicated"] == []
        c.datanodes[1].stop()

        def under() -> list[dict[str, Any]]:
            got: list[dict[str, Any]] = http(admin, "/v1/nodes")[1]["under_replicated"]
            return got

        rows = eventually(under, timeout=30, interval=0.3, what="range shown under-replicated")
        assert rows[0]["stream_id"] == sid and rows[0]["replica_nums"] == 2
        assert len(rows[0]["live_replicas"]) == 1
