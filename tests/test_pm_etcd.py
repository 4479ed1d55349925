"""etcd backend specifics: URL parsing, transaction limits, fencing, warm followers, CAS ids.

Behaviour shared with SQLite is in test_pm_etcd_conformance.py; whole PM processes in
test_pm_etcd_cluster.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Iterator

import pytest
from aetcd import rpc
from etcd_fixture import EtcdServer, require_etcd
from waiting import eventually_async

from sbpstream.net.client import Connection
from sbpstream.pm.config import PmConfig
from sbpstream.pm.etcd import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_TXN_OPS,
    EtcdMetadataStore,
    is_etcd_url,
    parse_etcd_url,
)
from sbpstream.pm.leader import LeaderElection
from sbpstream.pm.metadata import (
    CreatedStream,
    NewStream,
    ProducerStateMeta,
    ReplicaMeta,
    StreamUpdate,
)
from sbpstream.pm.server import PmServer
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    FencedLeaderError,
    MetadataError,
    PmNotLeaderError,
    SbpError,
)

R1 = (ReplicaMeta(1, True),)
_prefixes = itertools.count(1)
WAIT_S = 15.0  # generous bound for elections and watches on a loaded box


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    require_etcd()
    with EtcdServer() as server:
        yield server


@pytest.fixture
def url(etcd_server: EtcdServer) -> str:
    return etcd_server.url(f"/spec{next(_prefixes)}") + "?lease_ttl_s=2"


class Pm:
    """A store plus its election, as a PM process would hold them."""

    def __init__(self, url: str, address: str) -> None:
        self.store = EtcdMetadataStore(url)
        self.election = LeaderElection(self.store, address)

    async def start(self) -> Pm:
        await self.store.open()
        self.election.start()
        return self

    async def stop(self, resign: bool = True) -> None:
        await self.election.stop(resign=resign)
        await self.store.close()


@pytest.fixture
async def pms(url: str) -> AsyncIterator[list[Pm]]:
    started: list[Pm] = []
    yield started
    for pm in started:
        await pm.stop()


async def leader(url: str, pms: list[Pm], address: str = "127.0.0.1:1") -> Pm:
    pm = await Pm(url, address).start()
    pms.append(pm)
    assert await pm.election.wait_leader(WAIT_S)
    return pm


def ids(outcomes: list[CreatedStream | SbpError]) -> list[int]:
    out = []
    for o in outcomes:
        assert isinstance(o, CreatedStream), o
        out.append(o.stream.stream_id)
    return out


def test_parse_url() -> None:
    s = parse_etcd_url("etcd://10.0.0.1:2379,10.0.0.2:2380")
    assert s.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2380))
    assert (s.prefix, s.lease_ttl_s, s.max_txn_ops) == ("/sbpstream", DEFAULT_LEASE_TTL_S,
                                                         DEFAULT_MAX_TXN_OPS)
    s = parse_etcd_url("etcd://h/team/a/?lease_ttl_s=5&max_txn_ops=64&timeout_s=1.5")
    assert s.endpoints == (("h", 2379),) and s.prefix == "/team/a"
    assert (s.lease_ttl_s, s.max_txn_ops, s.request_timeout_s) == (5, 64, 1.5)
    assert is_etcd_url("etcd://x:1") and not is_etcd_url("sqlite:/x")
    for bad in ("etcd://", "etcd://h:99999", "etcd://h:1?lease_ttl_s=1", "etcd://h:1?bogus=1",
                "etcd://h:1?max_txn_ops=2", "sqlite:/tmp/x"):
        with pytest.raises(ValueError):
            parse_etcd_url(bad)


async def test_batches_respect_max_txn_ops(url: str, pms: list[Pm]) -> None:
    pm = await leader(url + "&max_txn_ops=16", pms)
    before = pm.store.txns
    out = await pm.store.create_streams([NewStream(1, 0, R1)] * 100, 1)
    assert ids(out) == list(range(1, 101))
    # One transaction reserves the id block; then 16 ops per list: the fence compare leaves
    # 15 compares -> 7 items (2 keys each, one compare per key) per transaction.
    assert pm.store.txns - before == 1 + math.ceil(100 / 7)
    # Deleting a stream with many ranges is one range-delete, whatever the count.
    for i in range(40):
        await pm.store.seal_and_new(1, i, i + 1, R1, [])
    (d,) = await pm.store.delete_streams([1], 2)
    assert not isinstance(d, SbpError) and len(d.removed) == 41


async def test_large_batch_default_limits(url: str, pms: list[Pm]) -> None:
    pm = await leader(url, pms)
    before = pm.store.txns
    out = await pm.store.create_streams([NewStream(1, 0, R1)] * 5000, 1)
    assert ids(out) == list(range(1, 5001))
    per_txn = (DEFAULT_MAX_TXN_OPS - 1) // 2
    assert pm.store.txns - before == 1 + math.ceil(5000 / per_txn)
    # Another PM loading the prefix from scratch (paged reads) sees all of it.
    other = await Pm(url, "127.0.0.1:2").start()
    pms.append(other)
    assert len(await other.store.list_streams(0, 10_000)) == 5000


async def test_follower_redirects_and_keeps_a_warm_cache(url: str, pms: list[Pm]) -> None:
    a = await leader(url, pms, "127.0.0.1:1")
    b = await Pm(url, "127.0.0.1:2").start()
    pms.append(b)
    await eventually_async(lambda: b.election.leader_address == "127.0.0.1:1", timeout=WAIT_S,
                           what="the follower learning the leader")
    assert not b.election.is_leader
    with pytest.raises(PmNotLeaderError) as ei:
        await b.store.create_streams([NewStream(1, 0, R1)], 1)
    assert ei.value.detail == b"127.0.0.1:1"
    assert ids(await a.store.create_streams([NewStream(1, 0, R1)] * 3, 1)) == [1, 2, 3]
    await b.store.wait_applied(a.store.applied_revision)
    assert [s.stream_id for s in await b.store.list_streams(0, 10)] == [1, 2, 3]
    # A clean stop hands over at once (the lease is revoked, not left to expire).
    await a.stop()
    pms.remove(a)
    assert await b.election.wait_leader(WAIT_S)
    assert ids(await b.store.create_streams([NewStream(1, 0, R1)], 1)) == [4]


async def test_deposed_leader_writes_are_fenced(url: str, pms: list[Pm]) -> None:
    a = await leader(url, pms, "127.0.0.1:1")
    assert ids(await a.store.create_streams([NewStream(1, 0, R1)], 1)) == [1]
    token_a = a.store.leader_token
    # A stops renewing its lease without resigning (a paused process), but its store keeps the
    # token: exactly the state of a leader that has not noticed it was deposed.
    task = a.election._task
    assert task is not None
    task.cancel()
    a.election._task = None
    assert a.store.leader_token == token_a
    b = await Pm(url, "127.0.0.1:2").start()
    pms.append(b)
    assert await b.election.wait_leader(WAIT_S)
    assert b.store.leader_token is not None and b.store.leader_token > (token_a or 0)
    with pytest.raises(FencedLeaderError) as ei:
        await a.store.create_streams([NewStream(1, 0, R1)] * 3, 1)
    assert ei.value.detail == b"127.0.0.1:2"
    assert not a.store.is_leader
    with pytest.raises(PmNotLeaderError):
        await a.store.update_streams([StreamUpdate(1, 1, 5)], 1)
    # Nothing of A's attempt reached etcd: B continues the id sequence.
    assert ids(await b.store.create_streams([NewStream(1, 0, R1)], 1)) == [2]
    assert [s.stream_id for s in await b.store.list_streams(0, 10)] == [1, 2]


async def test_fenced_midway_keeps_committed_items(url: str, pms: list[Pm]) -> None:
    a = await leader(url + "&max_txn_ops=8", pms, "127.0.0.1:1")
    store = a.store
    assert ids(await store.create_streams([NewStream(1, 0, R1)] * 9, 1)) == list(range(1, 10))
    # Depose A between its transactions: revoke its lease after the first commit.
    real_commit = store._commit
    calls = 0

    async def commit_then_lose(chunk: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            assert a.election._lease_id
            await store.client.revoke(a.election._lease_id)
        await real_commit(chunk)  # type: ignore[arg-type]

    store._commit = commit_then_lose  # type: ignore[method-assign]
    # 8 ops per list: the fence compare leaves 7 -> 7 updates per transaction.
    out = await store.update_streams([StreamUpdate(i, 1, 5) for i in range(1, 10)], 1)
    assert [type(o).__name__ for o in out] == ["StreamMeta"] * 7 + ["FencedLeaderError"] * 2
    got = await store.get_streams(list(range(1, 10)))
    assert [s.retention_period_ms for s in got if s] == [5] * 7 + [0] * 2


async def test_ids_are_compare_and_swap(url: str, pms: list[Pm], etcd_server: EtcdServer
                                        ) -> None:
    """A counter moved behind the leader's back (an operator, a restore) is never reused: the
    transaction's mod_revision compare fails, the cache catches up, the chunk is re-planned."""
    a = await leader(url, pms)
    assert ids(await a.store.create_streams([NewStream(1, 0, R1)], 1)) == [1]
    key = a.store.keys.counter("next_stream_id")
    ch = rpc.insecure_channel(etcd_server.endpoint)
    try:
        await rpc.KVStub(ch).Put(rpc.PutRequest(key=key, value=b"100"), timeout=5)
    finally:
        await ch.close()
    assert ids(await a.store.create_streams([NewStream(1, 0, R1)] * 2, 1)) == [100, 101]


async def test_newer_schema_is_refused(url: str, etcd_server: EtcdServer) -> None:
    store = EtcdMetadataStore(url)
    ch = rpc.insecure_channel(etcd_server.endpoint)
    try:
        await rpc.KVStub(ch).Put(rpc.PutRequest(key=store.keys.schema, value=b"99"), timeout=5)
    finally:
        await ch.close()
    with pytest.raises(MetadataError, match="newer"):
        await store.open()


async def test_unreachable_etcd_is_a_clear_error() -> None:
    store = EtcdMetadataStore("etcd://127.0.0.1:1?timeout_s=0.5")
    with pytest.raises(MetadataError, match="no etcd endpoint answered"):
        await store.open()


async def test_server_turns_a_fenced_write_into_pm_not_leader(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader deposed between the leadership check and its write answers the whole request
    with PM_NOT_LEADER (a system error frame), never with a half-applied batch."""
    server = PmServer(PmConfig(metadata=url, port=0))
    await server.start()
    try:
        assert server.election is not None and await server.election.wait_leader(WAIT_S)
        store = server.meta
        assert isinstance(store, EtcdMetadataStore)
        assert ids(await store.create_streams([NewStream(1, 0, R1)] * 2, 1)) == [1, 2]
        lease_id = server.election._lease_id
        real_commit = store._commit

        async def deposed_then_commit(chunk: object) -> None:
            # Deposed after the server's leadership check passed, before the write reaches etcd.
            await store.client.revoke(lease_id)
            await real_commit(chunk)  # type: ignore[arg-type]

        store._commit = deposed_then_commit  # type: ignore[method-assign]
        conn = await Connection.open(server.address)
        try:
            req = m.UpdateStreamsRequest(timeout_ms=2000, items=(m.Stream(1, 1, 5),
                                                                 m.Stream(2, 1, 5)))
            with pytest.raises(PmNotLeaderError):
                await conn.request_one(req.OPCODE, req.encode(), timeout_s=5.0)
        finally:
            await conn.aclose()
        assert "event=etcd_write_fenced" in caplog.text
        assert [s.retention_period_ms for s in await store.get_streams([1, 2]) if s] == [0, 0]
    finally:
        await server.close()


async def test_leader_key_deleted_behind_the_leaders_back(
    url: str, pms: list[Pm], etcd_server: EtcdServer
) -> None:
    """An operator deletes P/leader: the leader stops leading as soon as its watch sees it
    (not only at its next write), and a follower takes over."""
    a = await leader(url, pms, "127.0.0.1:1")
    b = await Pm(url, "127.0.0.1:2").start()
    pms.append(b)
    ch = rpc.insecure_channel(etcd_server.endpoint)
    try:
        await rpc.KVStub(ch).DeleteRange(rpc.DeleteRangeRequest(key=a.store.keys.leader),
                                         timeout=5)
    finally:
        await ch.close()
    await eventually_async(lambda: a.election.is_leader != b.election.is_leader,
                           timeout=WAIT_S, interval=0.02, what="a clean handover")
    assert await b.election.wait_leader(WAIT_S) or await a.election.wait_leader(WAIT_S)
    leaders = [p for p in (a, b) if p.election.is_leader]
    assert len(leaders) == 1
    assert ids(await leaders[0].store.create_streams([NewStream(1, 0, R1)], 1)) == [1]


async def test_values_in_etcd_keep_their_format(url: str, pms: list[Pm]) -> None:
    """The keys and JSON values of docs/etcd.md, byte for byte: a prefix written by any
    earlier sbpstream of this layout version must still load."""
    pm = await leader(url, pms)
    st = pm.store
    nid = await st.allocate_node_id("host-a", 1000)
    reps = (ReplicaMeta(3, False), ReplicaMeta(2, True))
    ids(await st.create_streams([NewStream(2, 60_000, reps)], 2000))
    await st.seal_and_new(1, 0, 42, (ReplicaMeta(5, False), ReplicaMeta(4, True)),
                          [ProducerStateMeta(7, 1, 11, 30)])
    await st.trim_streams([(1, 3)], 3000)
    resp = await st.client.range(st.keys.root, st.keys.root_end)
    got = {kv.key[len(st.keys.root):]: kv.value for kv in resp.kvs if b"leader" not in kv.key}
    sid = b"%020d" % 1
    assert got == {
        b"meta/schema_version": b"1",
        b"meta/next_stream_id": b"2",
        b"meta/next_node_id": b"2",
        b"nodes/%010d" % nid: b'{"host":"host-a","advertise_addr":"","registered_ms":1000,'
                              b'"last_heartbeat_ms":0,"metrics":null,"metrics_ms":0}',
        b"streams/" + sid: b'{"replica_nums":2,"retention_period_ms":60000,"start_offset":3,'
                           b'"deleted":false,"created_ms":2000,"updated_ms":3000}',
        # As the placement gave them at create; sorted (primary first) when a rule rewrote.
        b"ranges/" + sid + b"/0000000000": b'{"start_offset":3,"end_offset":42,'
                                           b'"next_offset":42,"replicas":[[2,1],[3,0]]}',
        b"ranges/" + sid + b"/0000000001": b'{"start_offset":42,"end_offset":-1,'
                                           b'"next_offset":42,"replicas":[[4,1],[5,0]]}',
        b"seal_producers/" + sid + b"/0000000000": b"[[7,1,11,30]]",
    }
