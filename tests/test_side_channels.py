"""Side channels closed (docs/security.md, "Authorization"): introspection and quota counters
need ``describe`` on ``*``, STATS rows and listings show only what the caller may describe and
a listing's continuation names no stream, digests need ``fetch``, node tokens administer no
users. One secure LocalCluster (TLS, auth on, one data node) serves the module."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cluster_helpers import SECURE_ADMIN, dev_certs, secure_client, secure_cluster, tls_connection

from sbpstream.auth import cursor, tokens
from sbpstream.auth.bootstrap import bootstrap_token
from sbpstream.auth.client import scram_login
from sbpstream.auth.config import CA_FILE, SECRET_FILE, read_secret
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.opcodes import Opcode

pytestmark = pytest.mark.timeout(240)

ADMIN = SECURE_ADMIN
AF = ErrorCode.AUTHORIZATION_FAILED


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    with secure_cluster(tmp_path_factory.mktemp("side"), certs, datanodes=1,
                        heartbeat_interval_ms=300, node_timeout_ms=3000) as c:
        yield c


@pytest.fixture
async def admin(cluster: LocalCluster, certs: Path) -> AsyncIterator[AsyncClient]:
    async with secure_client(cluster, certs) as c:
        yield c


async def _as_user(address: str, cluster: LocalCluster, certs: Path, user: str,
                   pw: str) -> Connection:
    """A connection to ``address`` authenticated with ``user``'s token (SCRAM at the PM)."""
    pm = await tls_connection(cluster.pm_address, certs)
    try:
        token = (await scram_login(pm, user, pw)).token
    finally:
        await pm.aclose()
    return await _present(address, certs, token)


async def _present(address: str, certs: Path, token: str) -> Connection:
    conn = await tls_connection(address, certs)
    frame = await conn.request_one(Opcode.AUTHENTICATE, m.AuthenticateRequest(
        "TOKEN", token.encode()).encode(), timeout_s=10)
    m.AuthenticateResponse.decode(frame.header).status.raise_for_error()
    return conn


async def _status(conn: Connection, req: m.Message, resp_cls: type[m.Message]
                  ) -> tuple[int, str, m.Message, bytes]:
    try:
        frame = await conn.request_one(req.OPCODE, req.encode(), timeout_s=10)
    except SbpError as e:
        return int(e.code), e.message, resp_cls(), b""
    out = resp_cls.decode(frame.header)
    st = getattr(out, "status")  # noqa: B009  # every response class here has one
    return int(st.code), str(st.message), out, bytes(frame.payload)


async def _primary(admin: AsyncClient, sid: int) -> str:
    (rng,) = [r for r in await admin.list_ranges(sid) if r.end_offset < 0]
    return next(rn.data_node.advertise_addr for rn in rng.replica_nodes if rn.is_primary)


_FRESH = itertools.count()


@pytest.fixture
async def bob(admin: AsyncClient) -> AsyncIterator[tuple[int, int]]:
    """bob may fetch (and so describe) sc.mine, nothing else; sc.secret exists beside it."""
    n = next(_FRESH)
    mine, secret = await admin.create_streams(names=[f"sc.mine{n}", f"sc.secret{n}"],
                                              replica_nums=1)
    async with admin.producer(linger_ms=1) as p:
        for sid in (mine, secret):
            await (await p.send(sid, b"r"))
    await admin.add_user("bob", "bob-pw")
    for rule in await admin.list_acls("bob"):  # another test's left over
        await admin.delete_acl("bob", rule[2])
    await admin.add_acl("bob", "fetch", f"stream:{mine}")
    try:
        yield mine, secret
    finally:
        await admin.delete_user("bob")


async def test_introspection_and_quota_counters_need_describe_on_everything(
        cluster: LocalCluster, certs: Path, admin: AsyncClient, bob: tuple[int, int]) -> None:
    mine, secret = bob
    dn = await _primary(admin, mine)
    for address in (cluster.pm_address, dn):
        conn = await _as_user(address, cluster, certs, "bob", "bob-pw")
        try:
            asks: list[tuple[m.Message, type[m.Message]]] = [
                (m.InfoRequest(), m.InfoResponse),
                (m.StatsRequest(), m.StatsResponse),
                (m.ConnectionsRequest(), m.ConnectionsResponse)]
            if address == dn:
                asks.append((m.QuotaCountersRequest(), m.QuotaCountersResponse))
            for req, resp_cls in asks:
                code, message, _, payload = await _status(conn, req, resp_cls)
                assert code == AF, (address, req)
                assert "bob may not describe" in message and "'*'" in message
                assert payload == b""
            # STATS of named streams: the rows bob may describe, the others left out
            code, _, _, payload = await _status(
                conn, m.StatsRequest(stream_ids=(mine, secret)), m.StatsResponse)
            assert code == 0
            rows = json.loads(payload)["streams"]
            assert {r["stream_id"] for r in rows} == {mine}, address
            code, _, _, _ = await _status(conn, m.StatsRequest(stream_ids=(secret,)),
                                          m.StatsResponse)
            assert code == AF
            # WHOAMI is about the caller alone
            code, _, _, _ = await _status(conn, m.WhoamiRequest(), m.WhoamiResponse)
            assert code == 0
        finally:
            await conn.aclose()
    await admin.add_acl("bob", "describe", "*")
    conn = await _as_user(dn, cluster, certs, "bob", "bob-pw")
    try:
        for req, resp_cls in ((m.InfoRequest(), m.InfoResponse),
                              (m.ConnectionsRequest(), m.ConnectionsResponse),
                              (m.QuotaCountersRequest(), m.QuotaCountersResponse)):
            assert (await _status(conn, req, resp_cls))[0] == 0, req
        code, _, _, payload = await _status(conn, m.StatsRequest(), m.StatsResponse)
        assert code == 0 and {mine, secret} <= {r["stream_id"]
                                                 for r in json.loads(payload)["streams"]}
    finally:
        await conn.aclose()


async def test_listing_continuation_names_no_filtered_stream(
        cluster: LocalCluster, certs: Path, admin: AsyncClient, bob: tuple[int, int]) -> None:
    mine, secret = bob
    hidden = await admin.create_streams(names=[f"sc.hidden{i}.{secret}" for i in range(4)],
                                        replica_nums=1)
    every = {s.stream_id for s in await admin.list_streams()}
    conn = await _as_user(cluster.pm_address, cluster, certs, "bob", "bob-pw")
    try:
        for prefix in ("", "sc."):
            seen: list[int] = []
            continuation, pages = -1, 0
            while True:
                frame = await conn.request_one(Opcode.DESCRIBE_STREAMS, m.DescribeStreamsRequest(
                    limit=1, name_prefix=prefix, continuation=continuation).encode(),
                    timeout_s=10)
                out = m.DescribeStreamsResponse.decode(frame.header)
                seen += [r.stream.stream_id for r in out.items if r.stream is not None]
                pages += 1
                assert pages <= len(every) + 2, "the listing does not end"
                if out.continuation < 0:
                    break
                # a page of one stream: the PM's continuation is that stream's id, filtered or
                # not; what bob gets is none of them
                assert out.continuation >= cursor.SEALED_BIT
                assert out.continuation not in every | set(hidden) | {secret}
                continuation = out.continuation
            assert seen == [mine], prefix
    finally:
        await conn.aclose()
    async with AsyncClient(cluster.pm_address, user="bob", password="bob-pw",
                           tls_ca=str(certs / CA_FILE)) as client:  # the SDK pages through
        assert [s.stream_id for s in await client.list_streams()] == [mine]


async def test_digest_needs_fetch(cluster: LocalCluster, certs: Path,
                                  admin: AsyncClient, bob: tuple[int, int]) -> None:
    mine, secret = bob
    await admin.add_user("dora", "dora-pw")
    try:
        await admin.add_acl("dora", "describe", f"stream:{secret}")
        await admin.add_acl("bob", "describe", f"stream:{secret}")
        dn = await _primary(admin, mine)
        digest = m.DescribeRangesRequest(items=(
            m.DescribeRangeItem(stream_id=secret, range_index=0, digest_end_offset=1 << 62),
            m.DescribeRangeItem(stream_id=mine, range_index=0, digest_end_offset=1 << 62)))
        plain = m.DescribeRangesRequest(items=(
            m.DescribeRangeItem(stream_id=secret, range_index=0),))
        conn = await _as_user(dn, cluster, certs, "bob", "bob-pw")
        try:
            code, _, out, _ = await _status(conn, digest, m.DescribeRangesResponse)
            assert code == 0
            refused, ok = out.items  # type: ignore[attr-defined]
            assert refused.status.code == AF and not refused.digest
            assert "bob may not fetch stream" in refused.status.message
            assert ok.status.code == 0 and ok.digest and ok.digest_end_offset == 1
            code, _, out, _ = await _status(conn, plain, m.DescribeRangesResponse)
            (item,) = out.items  # type: ignore[attr-defined]
            assert item.status.code == 0  # describing the range needs describe only
        finally:
            await conn.aclose()
    finally:
        await admin.delete_user("dora")


async def test_node_token_may_not_administer_users(cluster: LocalCluster, certs: Path,
                                                   admin: AsyncClient) -> None:
    secret = read_secret(str(certs / SECRET_FILE))
    now = int(time.time() * 1000)
    node = tokens.node_token(tokens.derive_key(secret), "cli", now, 60_000)
    conn = await _present(cluster.pm_address, certs, node)
    try:
        for req, resp_cls in (
                (m.ManageUsersRequest(1, "mallory", "pw"), m.ManageUsersResponse),
                (m.ManageUsersRequest(3), m.ManageUsersResponse),
                (m.ManageAclsRequest(1, m.AclEntry("mallory", "all", "*")),
                 m.ManageAclsResponse)):
            code, message, _, _ = await _status(conn, req, resp_cls)
            assert code == AF, req
            assert "node token" in message
        # cluster-internal work goes on with it
        frame = await conn.request_one(Opcode.DESCRIBE_STREAMS, m.DescribeStreamsRequest(
            limit=10).encode(), timeout_s=10)
        assert m.DescribeStreamsResponse.decode(frame.header).status.code == 0
    finally:
        await conn.aclose()
    assert "mallory" not in await admin.list_users()
    # the bootstrap path: a short-lived *user* token with admin on *, from the secret
    conn = await _present(cluster.pm_address, certs, bootstrap_token(secret))
    try:
        code, _, out, _ = await _status(conn, m.ManageUsersRequest(3), m.ManageUsersResponse)
        assert code == 0 and "admin" in {u.name for u in out.users}  # type: ignore[attr-defined]
        (sid,) = await admin.create_streams(names=["sc.boot"], replica_nums=1)
        code, _, out, _ = await _status(conn, m.DescribeStreamsRequest(stream_ids=(sid,)),
                                        m.DescribeStreamsResponse)
        (item,) = out.items  # type: ignore[attr-defined]
        assert item.status.code == AF  # admin on * only: no stream's data or metadata
    finally:
        await conn.aclose()
