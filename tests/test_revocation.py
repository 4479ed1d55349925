"""Revocation reaches live reads: subscriptions and fetch sessions under an expired or renewed
token (docs/security.md, "Revocation and live reads").

One secure LocalCluster (TLS, auth on, one data node) serves the module. Tokens come from a
SCRAM login (real rules, after a real ACL delete) or, for expiry, are minted with the cluster
secret with a short life: the same thing a short ``--token-ttl-s`` gives, without waiting for a
PM-wide TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cluster_helpers import SECURE_ADMIN, dev_certs, secure_client, secure_cluster, tls_connection

from sbpstream.auth import tokens
from sbpstream.auth.acl import AclRule, parse_ops
from sbpstream.auth.client import scram_login
from sbpstream.auth.config import SECRET_FILE, read_secret
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection, ResponseStream
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.opcodes import Opcode

pytestmark = pytest.mark.timeout(240)

ADMIN = SECURE_ADMIN
AF = ErrorCode.AUTHORIZATION_FAILED
WAIT_S = 30.0
"""Bound on every wait for a condition (the cluster is shared by other tests' processes)."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    with secure_cluster(tmp_path_factory.mktemp("revocation"), certs, datanodes=1,
                        heartbeat_interval_ms=300, node_timeout_ms=3000) as c:
        yield c


@pytest.fixture
async def admin(cluster: LocalCluster, certs: Path) -> AsyncIterator[AsyncClient]:
    async with secure_client(cluster, certs) as c:
        yield c


async def _present(conn: Connection, token: str) -> None:
    """AUTHENTICATE with a token on ``conn`` (first time, or a renewal)."""
    frame = await conn.request_one(Opcode.AUTHENTICATE, m.AuthenticateRequest(
        "TOKEN", token.encode()).encode(), timeout_s=10)
    m.AuthenticateResponse.decode(frame.header).status.raise_for_error()


async def _login(cluster: LocalCluster, certs: Path, user: str, pw: str) -> str:
    conn = await tls_connection(cluster.pm_address, certs)
    try:
        return (await scram_login(conn, user, pw)).token
    finally:
        await conn.aclose()


def _minted(certs: Path, principal: str, ops: str, resource: str, life_ms: int) -> str:
    now = int(time.time() * 1000)
    key = tokens.derive_key(read_secret(str(certs / SECRET_FILE)))
    return tokens.sign(tokens.Claims(principal, tokens.KIND_USER, now, now + life_ms,
                                     (AclRule(principal, parse_ops(ops), resource),)), key)


async def _primary(admin: AsyncClient, sid: int) -> str:
    (rng,) = [r for r in await admin.list_ranges(sid) if r.end_offset < 0]
    return next(rn.data_node.advertise_addr for rn in rng.replica_nodes if rn.is_primary)


async def _append(admin: AsyncClient, sid: int, value: bytes) -> None:
    async with admin.producer(linger_ms=1) as p:
        await (await p.send(sid, value))


def _subscribe(sids: list[int], *, session: bool = False) -> bytes:
    return m.FetchRequest(window_bytes=1 << 20, session_epoch=0 if session else -1, items=tuple(
        m.FetchItem(stream_id=s, request_index=i, fetch_offset=0)
        for i, s in enumerate(sids))).encode()


async def _until(rs: ResponseStream, pred: object, what: str) -> list[m.FetchResponse]:
    """Read frames until ``pred(frames so far)`` holds, within WAIT_S."""
    got: list[m.FetchResponse] = []
    async with asyncio.timeout(WAIT_S):
        async for frame in rs:
            got.append(m.FetchResponse.decode(frame.header))
            if pred(got):  # type: ignore[operator]
                return got
    raise AssertionError(f"the subscription ended before {what}: {got}")


def _results(frames: list[m.FetchResponse]) -> list[m.FetchResult]:
    return [it for f in frames for it in f.items]


async def test_subscription_ends_when_its_token_expires_unrenewed(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    (sid,) = await admin.create_streams(names=["rv.expiry"], replica_nums=1)
    await _append(admin, sid, b"a")
    conn = await tls_connection(await _primary(admin, sid), certs)
    try:
        await _present(conn, _minted(certs, "eve", "fetch", "*", 3_000))
        rs = await conn.stream(Opcode.FETCH, _subscribe([sid]), timeout_s=WAIT_S)
        frames = await _until(rs, lambda fs: any(r.batch_length for r in _results(fs)),
                              "the first record")
        # nothing renews the token: the subscription ends with TOKEN_EXPIRED, unasked
        frames = await _until(rs, lambda fs: fs[-1].status.code != 0, "it ended")
        assert frames[-1].status.code == ErrorCode.TOKEN_EXPIRED
        with pytest.raises(SbpError) as e:  # and nothing new is served on that connection
            await conn.request(Opcode.FETCH, _subscribe([sid]), timeout_s=10)
        assert e.value.code == ErrorCode.TOKEN_EXPIRED
    finally:
        await conn.aclose()


async def test_fetch_session_stops_after_expiry(cluster: LocalCluster, certs: Path,
                                                admin: AsyncClient) -> None:
    (sid,) = await admin.create_streams(names=["rv.session-expiry"], replica_nums=1)
    await _append(admin, sid, b"a")
    conn = await tls_connection(await _primary(admin, sid), certs)
    try:
        await _present(conn, _minted(certs, "eve", "fetch", "*", 2_000))
        (frame,) = await conn.request(Opcode.FETCH, m.FetchRequest(
            session_epoch=0, items=(m.FetchItem(sid, 0, 0),)).encode(), timeout_s=10)
        session = m.FetchResponse.decode(frame.header).session_id
        assert session
        # a long poll asking to wait far longer than the token lives ends by its expiry
        frames = await conn.request(Opcode.FETCH, m.FetchRequest(
            max_wait_ms=25_000, min_bytes=1 << 20, session_id=session,
            session_epoch=1).encode(), timeout_s=WAIT_S)
        assert frames
        async with asyncio.timeout(WAIT_S):
            while True:  # the next poll is refused once the token has expired
                try:
                    await conn.request(Opcode.FETCH, m.FetchRequest(
                        session_id=session, session_epoch=2).encode(), timeout_s=10)
                except SbpError as e:
                    assert e.code == ErrorCode.TOKEN_EXPIRED
                    break
                await asyncio.sleep(0.2)
    finally:
        await conn.aclose()


async def test_renewal_after_acl_delete_ends_the_revoked_stream_only(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    keep, lose = await admin.create_streams(names=["rv.keep", "rv.lose"], replica_nums=1)
    for sid in (keep, lose):
        await _append(admin, sid, b"0")
    await admin.add_user("carol", "carol-pw")
    await admin.add_acl("carol", "fetch", f"stream:{keep}")
    await admin.add_acl("carol", "fetch", f"stream:{lose}")
    conn = await tls_connection(await _primary(admin, keep), certs)
    try:
        await _present(conn, await _login(cluster, certs, "carol", "carol-pw"))
        rs = await conn.stream(Opcode.FETCH, _subscribe([keep, lose], session=True),
                               timeout_s=WAIT_S)
        await _until(rs, lambda fs: {r.stream_id for r in _results(fs) if r.batch_length}
                     == {keep, lose}, "both streams' first record")
        await admin.delete_acl("carol", f"stream:{lose}")
        # the SDK's renewal: a new login, the new token presented on the same connection
        await _present(conn, await _login(cluster, certs, "carol", "carol-pw"))
        await _append(admin, lose, b"1")
        frames = await _until(rs, lambda fs: any(r.stream_id == lose and r.status.code
                                                 for r in _results(fs)), "lose ended")
        (refused,) = [r for r in _results(frames) if r.stream_id == lose and r.status.code]
        assert refused.status.code == AF
        assert "carol may not fetch stream" in refused.status.message
        assert f"sbpstream acl add carol fetch stream:{lose}" in refused.status.message
        assert not any(r.stream_id == lose and r.batch_length for r in _results(frames))
        await _append(admin, keep, b"1")
        await _append(admin, lose, b"2")
        frames = await _until(rs, lambda fs: any(r.stream_id == keep and r.batch_length
                                                 for r in _results(fs)), "keep goes on")
        assert not any(r.stream_id == lose for r in _results(frames))
        assert frames[-1].status.code == 0
    finally:
        await conn.aclose()
        await admin.delete_user("carol")


async def test_session_update_rechecks_the_whole_session(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    keep, lose, new = await admin.create_streams(names=["rv.s.keep", "rv.s.lose", "rv.s.new"],
                                                 replica_nums=1)
    for sid in (keep, lose, new):
        await _append(admin, sid, b"0")
    conn = await tls_connection(await _primary(admin, keep), certs)
    try:
        await _present(conn, _minted(certs, "dave", "fetch", "prefix:rv.s.", 600_000))
        (frame,) = await conn.request(Opcode.FETCH, m.FetchRequest(
            session_epoch=0, items=(m.FetchItem(keep, 0, 0), m.FetchItem(lose, 1, 0))).encode(),
            timeout_s=10)
        first = m.FetchResponse.decode(frame.header)
        assert {r.stream_id for r in first.items if r.batch_length} == {keep, lose}
        # a new token allowing keep and new only; an update adding new (and naming nothing of
        # what the session holds) still ends lose
        now = int(time.time() * 1000)
        key = tokens.derive_key(read_secret(str(certs / SECRET_FILE)))
        rules = tuple(AclRule("dave", parse_ops("fetch"), f"stream:{s}") for s in (keep, new))
        await _present(conn, tokens.sign(tokens.Claims("dave", tokens.KIND_USER, now,
                                                       now + 600_000, rules), key))
        frames = await conn.request(Opcode.FETCH, m.FetchRequest(
            session_id=first.session_id, session_epoch=1,
            items=(m.FetchItem(new, 2, 0),)).encode(), timeout_s=10)
        got = _results([m.FetchResponse.decode(f.header) for f in frames])
        assert [r.status.code for r in got if r.stream_id == lose] == [AF]
        assert any(r.stream_id == new and r.batch_length for r in got)
        await _append(admin, lose, b"1")
        frames = await conn.request(Opcode.FETCH, m.FetchRequest(
            session_id=first.session_id, session_epoch=2).encode(), timeout_s=10)
        assert not [r for f in frames for r in m.FetchResponse.decode(f.header).items
                    if r.stream_id == lose]  # out of the session
    finally:
        await conn.aclose()
