"""Quotas per principal (issue 22) on a secure cluster (TLS, auth on): a PM and one data node as
processes, SDK clients logged in as users, each with its client id.

The data node charges a connection to the principal of the token it authenticated with, and
picks, per rate, the most specific quota: user+client id > user > client id > default (Kafka's
precedence). Which quota a request was charged to is read off the node's live counters
(QUOTA_COUNTERS); rates are measured as in test_quota, over whole throttle cycles.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cluster_helpers import SECURE_ADMIN, dev_certs, secure_client, secure_cluster
from test_quota import RECORD, _applied, _cycle_rate, _produce_paced
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.quota.model import QuotaKind, QuotaSpec

pytestmark = pytest.mark.timeout(240)

ADMIN = SECURE_ADMIN
USERS = {"alice": "alice-pw", "bob": "bob-pw"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    with secure_cluster(tmp_path_factory.mktemp("quota-principal"), certs, datanodes=1,
                        heartbeat_interval_ms=200, node_timeout_ms=6000) as c:
        yield c


def _client(cluster: LocalCluster, certs: Path, user: str, client_id: str) -> AsyncClient:
    password = ADMIN[1] if user == ADMIN[0] else USERS[user]
    return secure_client(cluster, certs, user, password, client_id=client_id)


@pytest.fixture(scope="module")
def users(cluster: LocalCluster, certs: Path) -> None:
    async def add() -> None:
        async with _client(cluster, certs, "admin", "admin") as admin:
            for name, password in USERS.items():
                await admin.add_user(name, password)
                await admin.add_acl(name, "append,fetch,describe", "*")
    asyncio.run(add())


@pytest.fixture
async def admin(cluster: LocalCluster, certs: Path, users: None) -> AsyncIterator[AsyncClient]:
    async with _client(cluster, certs, "admin", "admin") as c:
        yield c


async def _reset(admin: AsyncClient, addr: str) -> None:
    for q in await admin.list_quotas():
        await admin.delete_quota(q.kind, q.name, q.user)
    async def none() -> bool:
        return not (await admin.quota_counters(addr)).quotas
    await eventually_async(none, timeout=20, what="the data node drops every quota")


async def _counter_keys(admin: AsyncClient, addr: str) -> set[str]:
    return {c.key for c in (await admin.quota_counters(addr)).counters}


async def test_a_user_quota_holds_the_user_across_client_ids(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    quota = 64 * 1024
    sid = await admin.create_stream()
    addr = (await admin.data_node_addresses())[0]
    await _reset(admin, addr)
    spec = QuotaSpec(QuotaKind.USER, "", quota, user="alice")
    await admin.set_quota(spec)
    await _applied(admin, addr, spec.key, spec)
    async with _client(cluster, certs, "alice", "alice-1") as a1, \
            _client(cluster, certs, "alice", "alice-2") as a2, \
            _client(cluster, certs, "bob", "bob-1") as b:
        (t1, ms1), (t2, ms2), (tb, msb) = await asyncio.gather(
            _produce_paced(a1, sid, 5 * quota, 9.0),
            _produce_paced(a2, sid, 5 * quota, 9.0),
            _produce_paced(b, sid, quota, 9.0))
    # alice's two client ids share one counter, and together stay within her quota
    rate, cycles = _cycle_rate(t1 + t2, len(RECORD))
    print(f"user quota {quota} B/s over two client ids: achieved {rate:.0f} B/s over "
          f"{cycles} cycles ({len(t1)} + {len(t2)} records)")
    assert 0.85 * quota <= rate <= 1.15 * quota, (rate, cycles)
    assert ms1 > 0 and ms2 > 0  # both of alice's clients were held
    assert msb == 0 and len(tb) >= int(9.0 * quota / len(RECORD))  # bob has no quota
    keys = await _counter_keys(admin, addr)
    assert not {k for k in keys if k.startswith(("c/alice-", "c/bob-"))}, keys


async def test_precedence_user_client_over_user_over_client_over_default(
        cluster: LocalCluster, certs: Path, admin: AsyncClient) -> None:
    sid = await admin.create_stream()
    addr = (await admin.data_node_addresses())[0]
    await _reset(admin, addr)
    small = 16 * 1024  # 4x this is sent below at once: throttled by a small quota only
    specs = [
        QuotaSpec(QuotaKind.DEFAULT, "", small),
        QuotaSpec(QuotaKind.CLIENT, "shared", 1 << 30),
        QuotaSpec(QuotaKind.USER, "", small, user="alice"),
        QuotaSpec(QuotaKind.CLIENT, "fast", 1 << 30, user="alice"),
    ]
    for s in specs:
        await admin.set_quota(s)
    for s in specs:
        await _applied(admin, addr, s.key, s)

    async def throttled(user: str, client_id: str) -> bool:
        async with _client(cluster, certs, user, client_id) as c, \
                c.producer(linger_ms=1, batch_max_bytes=8 * 1024) as p:
            for _ in range(4 * small // len(RECORD)):
                await p.send(sid, RECORD)
            await p.flush()
            return p.throttle_time_ms > 0

    # alice as "fast": her (large) user+client-id quota, not her small user quota
    assert not await throttled("alice", "fast")
    # alice as "shared": her small user quota, not the client id's large one
    assert await throttled("alice", "shared")
    # bob (no user quota) as "shared": the client id's large quota, not the small default
    assert not await throttled("bob", "shared")
    # bob as "other": the default, per client id
    assert await throttled("bob", "other")
    # which counters were charged (never an entity's other keys)
    keys = await _counter_keys(admin, addr)
    assert not {"c/fast/produce", "u/bob/produce", "u/bob,c/shared/produce"} & keys, keys
