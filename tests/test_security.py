"""TLS, authentication and authorization on a real cluster (issue 23).

One secure LocalCluster (TLS everywhere, auth on) serves the module. ``prefix:`` rules match
stream names: data nodes look names up at the PM (sbpstream.auth.names).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import SECURE_ADMIN, dev_certs, secure_client, secure_cluster, tls_connection
from message_samples import SAMPLES

from sbpstream.auth import tokens
from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.client import scram_login
from sbpstream.auth.config import CA_FILE, SECRET_FILE, read_secret
from sbpstream.client import AsyncClient
from sbpstream.client.groups import GroupAdmin
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.net.server import PROTECTED_MODE_MESSAGE, Server
from sbpstream.net.tls import TlsConfig, client_context
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    ConnectionClosedError,
    ErrorCode,
    SbpError,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch

pytestmark = pytest.mark.timeout(240)

ADMIN = SECURE_ADMIN
OPEN_OPCODES = {Opcode.PING, Opcode.GOAWAY, Opcode.AUTHENTICATE}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    with secure_cluster(tmp_path_factory.mktemp("secure"), certs, datanodes=3,
                        heartbeat_interval_ms=300, node_timeout_ms=3000) as c:
        yield c


@pytest.fixture
async def admin(cluster: LocalCluster, certs: Path) -> AsyncIterator[AsyncClient]:
    async with secure_client(cluster, certs, *ADMIN) as c:
        yield c


async def _code(conn: Connection, op: int, header: bytes = b"", payload: bytes = b"") -> int:
    """The code a request is answered with: 0 for a normal answer, else the system error's."""
    try:
        await conn.request(op, header, payload, timeout_s=10)
    except SbpError as e:
        return int(e.code)
    return 0


def _requests() -> list[m.Message]:
    return [s for s in SAMPLES if not s.IS_RESPONSE]


# ------------------------------------------------------------------ unauthenticated: nothing


def _snapshot(db: Path) -> dict[str, list[Any]]:
    """Everything durable in the PM's metadata except data nodes' soft state (heartbeats)."""
    c = sqlite3.connect(db)
    try:
        out = {t: sorted(c.execute(f"SELECT * FROM {t}").fetchall()) for t in (
            "meta", "streams", "ranges", "range_replicas", "seal_producers", "auth_records")}
        out["data_nodes"] = sorted(c.execute(
            "SELECT node_id, host, advertise_addr, registered_ms FROM data_nodes").fetchall())
        return out
    finally:
        c.close()


def _fuzz_frames(rng: random.Random, n: int) -> list[tuple[int, bytes, bytes]]:
    """Valid sample headers of every request, mutated ones, and random bytes, every opcode."""
    samples = [(int(s.OPCODE), s.encode()) for s in _requests()]
    out: list[tuple[int, bytes, bytes]] = [(op, h, b"x" * 64) for op, h in samples]
    ops = [int(o) for o in Opcode]
    while len(out) < n:
        op, header = rng.choice(samples)
        if rng.random() < 0.5:
            b = bytearray(header)
            for _ in range(rng.randint(1, 4)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            header = bytes(b)
        else:
            header = rng.randbytes(rng.randint(0, 64))
        out.append((rng.choice(ops) if rng.random() < 0.3 else op, header,
                    rng.randbytes(rng.randint(0, 32))))
    return out


async def _fuzz_one(address: str, certs: Path, frames: list[tuple[int, bytes, bytes]],
                    wrong_password: bool) -> None:
    conn = await tls_connection(address, certs)
    try:
        if wrong_password:
            with pytest.raises(AuthenticationFailedError):
                await scram_login(conn, ADMIN[0], "not-the-password")
        for op, header, payload in frames:
            if op == Opcode.GOAWAY:
                continue  # it would end the connection; it changes nothing either way
            code = await _code(conn, op, header, payload)
            if op == Opcode.AUTHENTICATE:
                continue  # may start a login; never ends one (the next frames show it)
            if op == Opcode.PING:
                assert code == 0
                continue
            assert code == ErrorCode.AUTHENTICATION_REQUIRED, (Opcode(op).name, code)
    finally:
        await conn.aclose()


async def test_unauthenticated_frames_are_refused_and_change_nothing(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    await admin.create_streams(2, replica_nums=2)  # something a fuzzer could delete
    await admin.close()
    db = cluster.directory / "pm" / "metadata.sqlite3"
    cluster.pm.stop()  # SQLite is held exclusively by the running PM
    before = _snapshot(db)
    cluster.pm.start()
    await asyncio.to_thread(cluster.pm.wait_ready)
    frames = _fuzz_frames(random.Random(23), 1500)
    await _fuzz_one(cluster.pm_address, certs, frames, wrong_password=False)
    await _fuzz_one(cluster.pm_address, certs, frames[:400], wrong_password=True)
    for dn in cluster.datanodes:
        await _fuzz_one(dn.address, certs, frames[:300], wrong_password=False)
    cluster.pm.stop()
    after = _snapshot(db)
    cluster.pm.start()
    await asyncio.to_thread(cluster.pm.wait_ready)
    assert after == before


async def test_plain_tcp_and_wrong_ca_are_refused(cluster: LocalCluster, certs: Path,
                                                  tmp_path: Path) -> None:
    other = tmp_path / "other"
    init_dev_certs(other)
    with pytest.raises(AuthenticationFailedError, match="certificate"):
        await Connection.open(cluster.pm_address, ssl_context=client_context(
            TlsConfig(ca=str(other / CA_FILE))))
    with pytest.raises(AuthenticationFailedError):
        async with AsyncClient(cluster.pm_address, user=ADMIN[0], password=ADMIN[1],
                               tls_ca=str(other / CA_FILE), retry_deadline_ms=2000) as c:
            await c.list_streams()
    with pytest.raises((ConnectionClosedError, SbpError)):  # plain TCP to a TLS listener
        conn = await Connection.open(cluster.pm_address, connect_timeout_s=2)
        await conn.ping(timeout_s=2)


async def test_forged_and_expired_tokens_are_refused(cluster: LocalCluster,
                                                     certs: Path) -> None:
    key = tokens.derive_key(read_secret(str(certs / SECRET_FILE)))
    now = tokens_now()
    forged_node = tokens.node_token(tokens.derive_key(b"f" * 32), "node", now, 60_000)
    expired = tokens.sign(tokens.Claims("admin", tokens.KIND_USER, now - 120_000,
                                        now - 60_000), key)
    valid = tokens.node_token(key, "node", now, 60_000)
    head, _, mac = valid.split(".")
    admin_claims = tokens.sign(tokens.Claims("admin", tokens.KIND_NODE, now, now + 60_000),
                               tokens.derive_key(b"f" * 32))
    tampered = f"{head}.{admin_claims.split('.')[1]}.{mac}"  # other claims, a genuine mac
    for address in (cluster.pm_address, cluster.datanodes[0].address):
        conn = await tls_connection(address, certs)
        try:
            for tok, code in ((forged_node, ErrorCode.AUTHENTICATION_FAILED),
                              (tampered, ErrorCode.AUTHENTICATION_FAILED),
                              (expired, ErrorCode.TOKEN_EXPIRED)):
                req = m.AuthenticateRequest("TOKEN", tok.encode()).encode()
                assert await _code(conn, Opcode.AUTHENTICATE, req) == code
                sync = m.SyncRangesRequest(items=(m.StreamRanges(1, ()),)).encode()
                assert await _code(conn, Opcode.SYNC_RANGES, sync) == \
                    ErrorCode.AUTHENTICATION_REQUIRED
            req = m.AuthenticateRequest("TOKEN", valid.encode()).encode()
            assert await _code(conn, Opcode.AUTHENTICATE, req) == 0
        finally:
            await conn.aclose()


def tokens_now() -> int:
    import time

    return int(time.time() * 1000)


# ------------------------------------------------------------------ ACLs


def _codes(items: Any) -> dict[int, int]:
    return {int(i.stream_id): int(i.status.code) for i in items}


async def _primary(admin: AsyncClient, sid: int) -> str:
    (rng,) = [r for r in await admin.list_ranges(sid) if r.end_offset < 0]
    return next(rn.data_node.advertise_addr for rn in rng.replica_nodes if rn.is_primary)


async def test_acls_allow_and_deny_per_stream_and_prefix(cluster: LocalCluster, certs: Path,
                                                         admin: AsyncClient) -> None:
    af = ErrorCode.AUTHORIZATION_FAILED
    eu, pay = await admin.create_streams(names=["orders.eu", "payments"], replica_nums=2)
    anon, mine = await admin.create_streams(2, replica_nums=2)  # unnamed
    await admin.add_user("alice", "alice-pw")
    await admin.add_acl("alice", "create,append,fetch,describe", "prefix:orders.")
    await admin.add_acl("alice", "append,fetch", f"stream:{mine}")
    await admin.add_acl("alice", "describe", f"prefix:{anon}")  # digits: a name, never an id
    assert ("alice", "append,fetch", f"stream:{mine}") in await admin.list_acls("alice")
    async with secure_client(cluster, certs, "alice", "alice-pw") as alice:
        us = await alice.create_stream("orders.us", replica_nums=2)  # created by its name
        for sid in (eu, us, mine):  # by name (a stream just created too), by id
            async with alice.producer(linger_ms=1) as p:
                assert await (await p.send(sid, b"mine")) == 0
            got = [r async for r in alice.consumer(sid, "earliest", end=1)]
            assert [r.value for r in got] == [b"mine"]
        assert (await alice.describe_stream("orders.eu")).stream_id == eu
        for sid in (pay, anon):  # a name outside the prefix; an unnamed stream
            with pytest.raises(SbpError) as e:
                async with alice.producer(linger_ms=1) as p:
                    await (await p.send(sid, b"not mine"))
            assert e.value.code == af
            with pytest.raises(SbpError) as e:
                await alice.describe_stream(sid)
            assert e.value.code == af
        for name in ("payments2", ""):  # create outside the prefix, or unnamed: needs *
            with pytest.raises(SbpError) as e:
                await alice.create_stream(name)
            assert e.value.code == af
        with pytest.raises(SbpError) as e:
            await alice.delete_stream(eu)
        assert e.value.code == af
        with pytest.raises(SbpError) as e:
            await alice.add_user("mallory", "pw")
        assert e.value.code == af
        from sbpstream.quota.model import QuotaKind, QuotaSpec
        with pytest.raises(SbpError) as e:  # quotas and groups' offsets are admin's too
            await alice.set_quota(QuotaSpec(QuotaKind.CLIENT, "alice", 1 << 30))
        assert e.value.code == af
        with pytest.raises(SbpError) as e:
            await alice.reset_offsets("g", "earliest")
        assert e.value.code == af
        listed = {s.stream_id for s in await alice.list_streams()}
        assert listed == {eu, us, mine}  # what alice may describe (append/fetch imply it)
        assert {s.stream_id for s in await alice.find_streams("orders.")} == {eu, us}
        assert await alice.find_streams("pay") == []
    conn = await tls_connection(cluster.pm_address, certs)
    try:
        await scram_login(conn, "alice", "alice-pw")
        # per item in one batch, the stream named after the ids included
        frame = await conn.request_one(Opcode.DESCRIBE_STREAMS, m.DescribeStreamsRequest(
            stream_ids=(eu, pay, anon), name="orders.us").encode(), timeout_s=10)
        items = m.DescribeStreamsResponse.decode(frame.header).items
        assert [(i.stream.stream_id if i.stream else None, i.status.code) for i in items] == [
            (eu, 0), (pay, af), (anon, af), (us, 0)]
        frame = await conn.request_one(Opcode.DESCRIBE_STREAMS, m.DescribeStreamsRequest(
            name="payments").encode(), timeout_s=10)
        (item,) = m.DescribeStreamsResponse.decode(frame.header).items
        assert item.status.code == af and item.stream is not None and item.stream.stream_id < 1
        # cluster-internal opcodes are refused to a user, whatever its rules
        hb = m.HeartbeatRequest("x", m.ClientRole.DATA_NODE, m.DataNode(1, "1.2.3.4:5"))
        assert await _code(conn, Opcode.HEARTBEAT, hb.encode()) == af
        assert await _code(conn, Opcode.ALLOCATE_ID, m.AllocateIdRequest().encode()) == af
    finally:
        await conn.aclose()
    dn = await tls_connection(await _primary(admin, eu), certs)
    try:
        async with secure_client(cluster, certs, "alice", "alice-pw") as alice:
            tok = await alice.credentials.token() if alice.credentials else ""
        req = m.AuthenticateRequest("TOKEN", tok.encode()).encode()
        assert await _code(dn, Opcode.AUTHENTICATE, req) == 0
        # one APPEND and one FETCH, three streams: allowed by name, denied by name, unnamed
        batch = build_batch([Record(value=b"batched")])
        append = m.AppendRequest(timeout_ms=10_000, items=tuple(
            m.AppendItem(sid, i, len(batch)) for i, sid in enumerate((eu, pay, anon))))
        frame = await dn.request_one(Opcode.APPEND, append.encode(), batch * 3, timeout_s=10)
        assert _codes(m.AppendResponse.decode(frame.header).items) == {eu: 0, pay: af, anon: af}
        fetch = m.FetchRequest(items=tuple(m.FetchItem(sid, i, 0, 1 << 20)
                                           for i, sid in enumerate((eu, pay, anon))))
        frames = await dn.request(Opcode.FETCH, fetch.encode(), timeout_s=10)
        got = {k: v for f in frames for k, v in _codes(m.FetchResponse.decode(f.header).items)
               .items()}
        assert got == {eu: 0, pay: af, anon: af}
        repl = m.AppendRequest(items=(m.AppendItem(eu, 0, 0),), replication=True)
        assert await _code(dn, Opcode.APPEND, repl.encode()) == af
        for op in (Opcode.SEAL_RANGES, Opcode.SYNC_RANGES, Opcode.TRIM_STREAMS,
                   Opcode.DELETE_STREAMS):
            sample = next(s for s in _requests() if op == s.OPCODE)
            assert await _code(dn, op, sample.encode()) == af
    finally:
        await dn.aclose()
    await admin.delete_user("alice")
    assert "alice" not in await admin.list_users()
    with pytest.raises(AuthenticationFailedError):
        async with secure_client(cluster, certs, "alice", "alice-pw") as gone:
            await gone.list_streams()


def _node_id(cluster: LocalCluster, i: int) -> int:
    return int(json.loads((cluster.directory / f"dn{i}" / "node_id").read_text())["node_id"])


async def _as(address: str, certs: Path, token: str) -> Connection:
    conn = await tls_connection(address, certs)
    req = m.AuthenticateRequest("TOKEN", token.encode()).encode()
    assert await _code(conn, Opcode.AUTHENTICATE, req) == 0
    return conn


async def test_a_node_token_speaks_only_for_its_node(cluster: LocalCluster, certs: Path,
                                                     admin: AsyncClient) -> None:
    """Node A's token cannot heartbeat as node B (nor rewrite its address), report its
    metrics or list its ranges; a data node's token cannot send a data node what only the PM
    sends; the PM's token cannot send a data node's heartbeat or replication."""
    af = ErrorCode.AUTHORIZATION_FAILED
    key = tokens.derive_key(read_secret(str(certs / SECRET_FILE)))
    a, b = _node_id(cluster, 0), _node_id(cluster, 1)
    b_addr = cluster.datanodes[1].address
    everywhere = await admin.create_stream(replica_nums=3)
    a_tok = tokens.node_token(key, f"datanode-{a}", tokens_now(), 60_000, node_id=a)
    pm_tok = tokens.node_token(key, "pm", tokens_now(), 60_000)
    pm = await _as(cluster.pm_address, certs, a_tok)
    try:
        as_b = m.HeartbeatRequest(f"datanode-{b}", m.ClientRole.DATA_NODE,
                                  m.DataNode(b, "10.9.9.9:1"))
        assert await _code(pm, Opcode.HEARTBEAT, as_b.encode()) == af
        assert await _code(pm, Opcode.REPORT_METRICS, m.ReportMetricsRequest(
            data_node=m.DataNode(b, b_addr)).encode()) == af
        assert await _code(pm, Opcode.LIST_RANGES, m.ListRangesRequest(
            items=(m.DataNode(b, b_addr),)).encode()) == af
        assert await _code(pm, Opcode.LIST_RANGES, m.ListRangesRequest(
            items=(m.DataNode(a, cluster.datanodes[0].address),)).encode()) == 0
        as_a = m.HeartbeatRequest(f"datanode-{a}", m.ClientRole.DATA_NODE,
                                  m.DataNode(a, cluster.datanodes[0].address))
        assert await _code(pm, Opcode.HEARTBEAT, as_a.encode()) == 0
    finally:
        await pm.aclose()
    (rng,) = await admin.list_ranges(everywhere)  # the PM still gives B's own address
    assert {rn.data_node.node_id: rn.data_node.advertise_addr
            for rn in rng.replica_nodes}[b] == b_addr
    pm_as_node = await _as(cluster.pm_address, certs, pm_tok)
    try:
        assert await _code(pm_as_node, Opcode.HEARTBEAT, as_b.encode()) == af
    finally:
        await pm_as_node.aclose()
    dn_b = await _as(b_addr, certs, a_tok)
    try:
        for op in (Opcode.SEAL_RANGES, Opcode.SYNC_RANGES, Opcode.TRIM_STREAMS,
                   Opcode.DELETE_STREAMS, Opcode.LIST_RANGES):
            sample = next(s for s in _requests() if op == s.OPCODE)
            assert await _code(dn_b, op, sample.encode()) == af, op
    finally:
        await dn_b.aclose()
    dn_b = await _as(b_addr, certs, pm_tok)
    try:
        repl = m.AppendRequest(items=(m.AppendItem(1, 0, 0),), replication=True)
        assert await _code(dn_b, Opcode.APPEND, repl.encode()) == af
        for op in (Opcode.SYNC_RANGES, Opcode.LIST_RANGES):  # the PM's token: past the gate
            sample = next(s for s in _requests() if op == s.OPCODE)
            assert await _code(dn_b, op, sample.encode()) != af, op
    finally:
        await dn_b.aclose()


async def test_group_and_quota_acls(cluster: LocalCluster, certs: Path,
                                    admin: AsyncClient) -> None:
    af = ErrorCode.AUTHORIZATION_FAILED
    eu, pay = await admin.create_streams(names=["gq.orders.eu", "gq.payments"])
    async with admin.producer(linger_ms=1) as p:
        for sid in (eu, pay):
            await (await p.send(sid, b"r"))
    await admin.add_user("bob", "bob-pw")
    await admin.add_acl("bob", "fetch,describe", "prefix:gq.orders.")
    await admin.add_acl("bob", "fetch", "group:g-orders")
    await admin.add_acl("bob", "describe", "group-prefix:g-")
    try:
        async with secure_client(cluster, certs, "bob", "bob-pw") as bob:
            cons = bob.consumer(["gq.orders.eu"], "earliest", group="g-orders",
                                auto_commit=False, max_wait_ms=100)
            try:  # join, heartbeat, fetch (by name at the data node), commit, leave
                rec = await cons.__anext__()
                assert (rec.stream_id, rec.value) == (eu, b"r")
                await cons.commit()
            finally:
                await cons.close()
            assert await bob.committed_offsets("g-orders") == {eu: 1}
            gadmin = GroupAdmin(bob.pm_request)
            for group, streams in (("other", ["gq.orders.eu"]),  # no fetch on the group
                                   ("g-orders", ["gq.payments"]),  # nor on the stream
                                   ("g-orders", [pay]),
                                   ("g-orders", ["gq.*"])):  # a pattern wider than the prefix
                with pytest.raises(SbpError) as e:
                    await gadmin.join(group, "", streams, 3000, "bob")
                assert e.value.code == af, (group, streams)
            await admin.commit_offsets("g-orders", {pay: 1})
            with pytest.raises(SbpError) as e:  # per item: eu committed, pay refused
                await bob.commit_offsets("g-orders", {eu: 0, pay: 0})
            assert e.value.code == af
            assert await admin.committed_offsets("g-orders") == {eu: 0, pay: 1}
            assert await bob.committed_offsets("g-orders") == {eu: 0}  # pay left out
            with pytest.raises(SbpError) as e:
                await bob.committed_offsets("g-orders", [pay])
            assert e.value.code == af
            await admin.commit_offsets("other", {eu: 1})
            with pytest.raises(SbpError) as e:  # describe on g-* only
                await bob.describe_group("other")
            assert e.value.code == af
            assert (await bob.describe_group("g-orders")).group == "g-orders"
            assert "g-orders" in await bob.list_groups()
            assert "other" not in await bob.list_groups()
            assert "other" in await admin.list_groups()
            with pytest.raises(SbpError) as e:
                await bob.list_quotas()
            assert e.value.code == af
        await admin.list_quotas()
        await admin.add_acl("bob", "describe", "*")
        async with secure_client(cluster, certs, "bob", "bob-pw") as bob:
            await bob.list_quotas()
    finally:
        await admin.delete_user("bob")


# ------------------------------------------------------------------ replication and failover


@pytest.mark.adversity
async def test_replication_failover_and_sigkill_recovery_under_tls_and_auth(
        cluster: LocalCluster, admin: AsyncClient) -> None:
    """Two replicas on three nodes; the primary is SIGKILLed with appends in flight (the PM
    seals its range and opens one elsewhere), then restarted: every acknowledged record is read
    back once, in order, over TLS with tokens everywhere."""
    (sid,) = await admin.create_streams(1, replica_nums=2)
    sent: list[bytes] = []
    futs: list[asyncio.Future[int]] = []
    async with admin.producer(linger_ms=1) as p:
        for i in range(1000):
            sent.append(b"before-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
        await futs[0]
        (rng,) = await admin.list_ranges(sid)
        primary = next(r.data_node.advertise_addr for r in rng.replica_nodes if r.is_primary)
        node = next(dn for dn in cluster.datanodes if dn.address == primary)
        for i in range(500):
            sent.append(b"during-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
        node.kill()
        for i in range(1000):
            sent.append(b"after-%d" % i)
            futs.append(await p.send(sid, sent[-1]))
        await p.flush()
        node.start()
        await asyncio.to_thread(node.wait_ready)
    offsets = [f.result() for f in futs]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    end = await admin.end_offset(sid)
    got = [r async for r in admin.consumer(sid, "earliest", end=end)]
    assert end == len(sent), (end, await admin.list_ranges(sid))
    assert [r.value for r in got] == sent
    ranges = await admin.list_ranges(sid)
    assert len(ranges) >= 2  # the PM sealed the dead primary's range and opened a new one


# ------------------------------------------------------------------ protected mode


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


async def test_protected_mode_refuses_remote_clients_and_says_why() -> None:
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    server = Server({}, name="open", protected=True)
    await server.start("0.0.0.0", 0)
    try:
        local = await Connection.open(f"127.0.0.1:{server.port}")
        assert (await local.ping()).is_response
        await local.aclose()
        remote = await Connection.open(f"{ip}:{server.port}")
        await asyncio.wait_for(remote.closed_event.wait(), 10)
        assert remote.goaway is not None and remote.goaway.message == PROTECTED_MODE_MESSAGE
        assert remote.goaway.code == ErrorCode.AUTHENTICATION_REQUIRED
    finally:
        await server.close()


def test_samples_cover_every_request_opcode() -> None:
    assert {s.OPCODE for s in _requests()} == set(Opcode)
    assert dataclasses.is_dataclass(_requests()[0])


# ------------------------------------------------------------------ token renewal


async def test_sdk_renews_its_token_before_expiry(tmp_path: Path) -> None:
    """A connection whose token is past 80% of its life authenticates again (a re-read token
    file here) before its next request; the server sees the second token."""
    from sbpstream.auth.client import Credentials
    from sbpstream.auth.gate import PM_NODE_ONLY, ServerAuth, claims_of
    from sbpstream.net.client import ConnectionPool
    from sbpstream.net.server import Request, Responder

    secret = b"r" * 32
    key = tokens.derive_key(secret)
    gate = ServerAuth(secret, PM_NODE_ONLY, {})
    seen: list[str] = []

    async def who(req: Request, resp: Responder) -> None:
        claims = claims_of(req.conn)
        seen.append(claims.principal if claims else "")
        await resp.send(m.DescribeStreamsResponse().encode())

    server = Server(gate.wrap({Opcode.DESCRIBE_STREAMS: who}), gate=gate)
    await server.start()
    now = tokens_now()
    token_file = tmp_path / "token"
    # issued 100 s ago, valid 20 s more: past its renewal point already
    token_file.write_text(tokens.sign(tokens.Claims("first", tokens.KIND_USER, now - 100_000,
                                                    now + 20_000), key))
    creds = Credentials(token_file=str(token_file), pm=(server.address,))
    pool = ConnectionPool(authenticator=creds)
    try:
        conn = await pool.get(server.address)
        await conn.request(Opcode.DESCRIBE_STREAMS, b"", timeout_s=5)
        assert creds.due(conn)
        token_file.write_text(tokens.sign(tokens.Claims("second", tokens.KIND_USER, now,
                                                        now + 600_000), key))
        again = await pool.get(server.address)
        assert again is conn and not creds.due(conn)  # renewed on the same connection
        await again.request(Opcode.DESCRIBE_STREAMS, b"", timeout_s=5)
        assert seen == ["first", "second"]
    finally:
        await pool.close()
        await server.close()


# ------------------------------------------------------------------ up --secure and the CLI


def test_up_secure_prints_admin_credentials_that_work(tmp_path: Path) -> None:
    import os
    import re
    import signal
    import subprocess
    import sys

    from waiting import eventually

    from sbpstream.net.ports import free_port

    exe = str(Path(sys.executable).with_name("sbpstream"))
    pm_port, dn_port = free_port(), free_port()
    out = tmp_path / "up.out"
    with open(out, "wb") as o:
        proc = subprocess.Popen([exe, "up", "--secure", "--dir", str(tmp_path / "d"),
                                 "--datanodes", "1", "--pm-port", str(pm_port),
                                 "--dn-port", str(dn_port)],
                                stdout=o, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        eventually(lambda: proc.poll() is not None or "SBPSTREAM_TLS_CA=" in out.read_text(),
                   timeout=90, what="up --secure's credentials")
        text = out.read_text()
        env = dict(os.environ, SBPSTREAM_PM=f"127.0.0.1:{pm_port}")
        for name in ("SBPSTREAM_USER", "SBPSTREAM_PASSWORD", "SBPSTREAM_TLS_CA"):
            match = re.search(rf"export {name}=(\S+)", text)
            assert match, text
            env[name] = match.group(1)

        def sbp(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60,
                                  env={**env, **extra}, check=False)

        created = sbp("stream", "create")
        assert created.returncode == 0, created.stderr
        assert sbp("user", "add", "bob", "--user-password", "bob-pw").returncode == 0
        assert sbp("acl", "add", "bob", "describe", f"stream:{created.stdout.strip()}"
                   ).returncode == 0
        assert "bob\tdescribe\tstream:" in sbp("acl", "list", "bob").stdout
        assert sbp("user", "list").stdout.split() == ["admin", "bob"]
        as_bob = {"SBPSTREAM_USER": "bob", "SBPSTREAM_PASSWORD": "bob-pw"}
        denied = sbp("stream", "create", **as_bob)
        assert denied.returncode != 0 and "AUTHORIZATION_FAILED" in denied.stderr
        wrong = sbp("stream", "list", SBPSTREAM_PASSWORD="wrong")
        assert wrong.returncode != 0 and "AUTHENTICATION_FAILED" in wrong.stderr
        assert sbp("user", "delete", "bob").returncode == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            for name in ("pm", "dn0"):
                pid = tmp_path / "d" / "run" / f"{name}.pid"
                if pid.exists():
                    os.kill(int(pid.read_text()), signal.SIGKILL)
            proc.wait(10)


@pytest.mark.adversity
async def test_rereplication_under_tls_and_auth(tmp_path: Path, certs: Path) -> None:
    """A replica of a sealed range is SIGKILLed for good: the PM picks another node, which
    copies the range from a survivor over TLS with a node token; the copy reads back whole."""
    from cluster_helpers import node_at
    from waiting import eventually_async

    from sbpstream.auth.client import Credentials
    from sbpstream.records import iter_all_records

    records = 1000
    with LocalCluster(tmp_path / "c", datanodes=4, heartbeat_interval_ms=200,
                      node_timeout_ms=1500, secure=certs) as cl:
        await bootstrap_admin(cl.pm_address, certs, *ADMIN)
        async with secure_client(cl, certs, *ADMIN) as client:
            (sid,) = await client.create_streams(1, replica_nums=3)
            async with client.producer(linger_ms=2) as p:
                futs = [await p.send(sid, b"v%06d" % i) for i in range(records)]
                await p.flush()
            assert sorted([f.result() for f in futs]) == list(range(records))
            await client.routing.seal(sid, 0)
            r0 = (await client.list_ranges(sid))[0]
            before = {rn.data_node.node_id for rn in r0.replica_nodes}
            victim = next(rn for rn in r0.replica_nodes if not rn.is_primary).data_node
            node_at(cl, victim.advertise_addr).kill()

            async def repaired() -> m.Range | None:
                rng = (await client.list_ranges(sid))[0]
                ids = {rn.data_node.node_id for rn in rng.replica_nodes}
                return rng if len(ids) == 3 and victim.node_id not in ids else None

            rng = await eventually_async(repaired, timeout=60, interval=0.2,
                                         what="range 0 re-replicated")
        (new_id,) = {rn.data_node.node_id for rn in rng.replica_nodes} - before
        new_addr = next(rn.data_node.advertise_addr for rn in rng.replica_nodes
                        if rn.data_node.node_id == new_id)
        creds = Credentials(user=ADMIN[0], password=ADMIN[1], pm=(cl.pm_address,),
                            tls=TlsConfig(ca=str(certs / CA_FILE)))
        conn = await Connection.open(new_addr, ssl_context=creds.ssl_context,
                                     authenticator=creds)
        values: list[bytes] = []
        try:
            while len(values) < records:
                at = len(values)
                req = m.FetchRequest(max_wait_ms=0, min_bytes=1, items=(m.FetchItem(
                    sid, 0, len(values), 1 << 20, 0),))
                for f in await conn.request(Opcode.FETCH, req.encode(), timeout_s=10):
                    for r in iter_all_records(bytes(f.payload), start_offset=len(values)):
                        if r.offset < records:
                            values.append(bytes(r.value or b""))
                assert len(values) > at, f"the new replica returned nothing at {at}"
        finally:
            await conn.aclose()
        assert values == [b"v%06d" % i for i in range(records)]


async def test_admin_http_port_serves_https(certs: Path) -> None:
    import ssl
    import urllib.error
    import urllib.request

    from sbpstream.auth.config import SERVER_CERT, SERVER_KEY
    from sbpstream.net.admin import MetricsExporter, Sample

    exporter = MetricsExporter(lambda: [Sample("sbpstream_test", "gauge", "a test", 1)],
                               tls=TlsConfig(str(certs / SERVER_CERT), str(certs / SERVER_KEY),
                                             str(certs / CA_FILE)))
    await exporter.start()
    try:
        url = f"https://127.0.0.1:{exporter.port}/metrics"
        ctx = ssl.create_default_context(cafile=str(certs / CA_FILE))
        def get() -> bytes:
            with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
                return bytes(r.read())

        body = await asyncio.to_thread(get)
        assert b"sbpstream_test 1.0" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read())
    finally:
        await exporter.close()


def test_certs_init_command(tmp_path: Path) -> None:
    import stat

    from typer.testing import CliRunner

    from sbpstream.cli import app

    r = CliRunner().invoke(app, ["certs", "init", str(tmp_path / "c"), "--host", "pm.example"])
    assert r.exit_code == 0, r.output
    names = {p.name for p in (tmp_path / "c").iterdir()}
    assert names == {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem",
                     "client-key.pem", "cluster.secret"}
    for private in ("ca-key.pem", "server-key.pem", "client-key.pem", "cluster.secret"):
        assert stat.S_IMODE((tmp_path / "c" / private).stat().st_mode) == 0o600
    assert len(read_secret(str(tmp_path / "c" / SECRET_FILE))) == 32
    pem = (tmp_path / "c" / "server.pem").read_bytes()
    from cryptography import x509

    cert = x509.load_pem_x509_certificates(pem)[0]
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "pm.example" in sans.get_values_for_type(x509.DNSName)
