"""Quotas end to end (issue 22): a PM and one data node as processes, SDK clients with ids.

Rates are measured the way the quota is defined, in bytes acknowledged (or delivered) per
second, over whole throttle cycles: from the end of one burst of acknowledgements to the end of
a later one (a cycle is a window's quota plus the wait the node asked for). The assertions are
about bytes against the quota with a tolerance, never about latencies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import InvalidRequestError
from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec

pytestmark = pytest.mark.timeout(180)

RECORD = b"x" * 1000
GAP_S = 0.25  # a pause this long between acknowledgements ends a burst (windows are 1 s)
BACKLOG_S = 0.5
"""A paced producer keeps at most this many seconds of its offered rate buffered: a producer
offering 5x or 10x its quota still holds 2.5 to 5 windows' worth, so it is over quota all along,
and its final flush (drained at the quota rate) takes seconds, not the ~40 s that 4 s of backlog
at 10x took."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d: Path = tmp_path_factory.mktemp("quota")
    with LocalCluster(d, datanodes=1, heartbeat_interval_ms=200, node_timeout_ms=6000) as c:
        yield c


@pytest.fixture
async def admin(cluster: LocalCluster) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cluster.pm_address, client_id="admin") as c:
        yield c


async def _applied(admin: AsyncClient, addr: str, key: str, spec: QuotaSpec | None) -> None:
    """Wait until the data node enforces ``spec`` for ``key`` (None: no quota for it)."""
    async def seen() -> bool:
        quotas = (await admin.quota_counters(addr)).quotas
        got = {QuotaSpec(QuotaKind(q.kind), q.name, user=q.user).key: q for q in quotas}
        if spec is None:
            return key not in got
        q = got.get(key)
        return q is not None and (q.produce_bytes_per_s, q.fetch_bytes_per_s,
                                  q.requests_per_s) == spec.rates()
    await eventually_async(seen, timeout=20, what=f"data node applies quota {key}")


def _cycle_rate(times: list[float], nbytes: int) -> tuple[float, int]:
    """Bytes per second over whole cycles: from the end of the first burst to the end of the
    last one (each time is one acknowledged record of ``nbytes``). Also the cycles counted."""
    times = sorted(times)
    ends = [i for i in range(len(times) - 1) if times[i + 1] - times[i] > GAP_S]
    ends.append(len(times) - 1)
    assert len(ends) >= 4, f"only {len(ends)} bursts: the quota did not throttle"
    first, last = ends[0], ends[-1]
    return (last - first) * nbytes / (times[last] - times[first]), len(ends) - 1


async def _produce_paced(c: AsyncClient, sid: int, rate_bps: int, duration_s: float
                         ) -> tuple[list[float], int]:
    """Offer ``rate_bps`` for ``duration_s``; the acknowledgement time of every record."""
    loop = asyncio.get_running_loop()
    acked: list[float] = []
    async with c.producer(linger_ms=5, batch_max_bytes=16 * 1024) as p:
        start = loop.time()
        sent = 0
        while loop.time() - start < duration_s:
            due = int((loop.time() - start) * rate_bps / len(RECORD)) + 1
            while sent < due and p.buffered_bytes < BACKLOG_S * rate_bps:
                fut = await p.send(sid, RECORD)
                fut.add_done_callback(lambda _f: acked.append(loop.time()))
                sent += 1
            await asyncio.sleep(0.02)
        await p.flush()
        return acked, p.throttle_time_ms


async def test_produce_quota_holds_a_10x_producer_and_spares_another_client(
        cluster: LocalCluster, admin: AsyncClient) -> None:
    quota = 64 * 1024
    sid = await admin.create_stream()
    addr = (await admin.data_node_addresses())[0]
    heavy = QuotaSpec(QuotaKind.CLIENT, "heavy", quota)
    light = QuotaSpec(QuotaKind.CLIENT, "light", 8 * quota)
    await admin.set_quota(heavy)
    await admin.set_quota(light)
    await _applied(admin, addr, heavy.key, heavy)
    await _applied(admin, addr, light.key, light)
    async with AsyncClient(cluster.pm_address, client_id="heavy") as h, \
            AsyncClient(cluster.pm_address, client_id="light") as li:
        (acked, throttled_ms), (light_acked, light_throttled_ms) = await asyncio.gather(
            _produce_paced(h, sid, 10 * quota, 9.0),
            _produce_paced(li, sid, quota, 9.0))
        assert h.routing.throttle.waits > 0
    # record values only: the node also charges the batch and record headers (a few percent)
    rate, cycles = _cycle_rate(acked, len(RECORD))
    print(f"produce quota {quota} B/s: achieved {rate:.0f} B/s over {cycles} cycles")
    assert 0.85 * quota <= rate <= 1.15 * quota, (rate, cycles)
    assert throttled_ms > 0
    assert light_throttled_ms == 0  # the second client, under its own quota, is never throttled
    assert len(light_acked) >= int(9.0 * quota / len(RECORD))
    counters = await admin.quota_counters(addr)
    keys = {c.key for c in counters.counters}
    assert "c/light/produce" in keys or light_acked  # live while its window lasts
    # counters expire: with no traffic, every window ends and its record goes
    async def expired() -> bool:
        return not [c for c in (await admin.quota_counters(addr)).counters
                    if c.key.startswith("c/heavy/")]
    await eventually_async(expired, timeout=30, what="the heavy client's counters expire")


async def test_fetch_quota_holds_a_consumer(cluster: LocalCluster, admin: AsyncClient) -> None:
    quota = 48 * 1024
    sid = await admin.create_stream()
    async with admin.producer(batch_max_bytes=4096) as p:  # small batches: many fetches
        for _ in range(8 * quota // len(RECORD)):
            await p.send(sid, RECORD)
        await p.flush()
    end = await admin.end_offset(sid)
    addr = (await admin.data_node_addresses())[0]
    spec = QuotaSpec(QuotaKind.CLIENT, "reader", UNLIMITED, quota)
    await admin.set_quota(spec)
    await _applied(admin, addr, spec.key, spec)
    loop = asyncio.get_running_loop()
    # long polls (a request per round) and a subscription (pushed rounds) alike
    for subscribe in (False, True):
        times: list[float] = []
        async with AsyncClient(cluster.pm_address, client_id="reader") as r:
            consumer = r.consumer(sid, "earliest", end=end, batch_max_bytes=8 * 1024,
                                  subscribe=subscribe)
            async for _rec in consumer:
                times.append(loop.time())
            assert consumer.throttle_time_ms > 0
        rate, cycles = _cycle_rate(times, len(RECORD))
        print(f"fetch quota {quota} B/s (subscribe={subscribe}): achieved {rate:.0f} B/s "
              f"over {cycles} cycles")
        if subscribe:  # pushed a quota window per round: never faster than the quota
            assert rate <= 1.15 * quota, (rate, cycles)
        else:
            assert 0.85 * quota <= rate <= 1.15 * quota, (rate, cycles)


async def test_hostile_quota_values_get_clear_errors(admin: AsyncClient) -> None:
    for spec, message in [
        (QuotaSpec(QuotaKind.CLIENT, "a", 0), "would stop all traffic"),
        (QuotaSpec(QuotaKind.CLIENT, "a", -1024), "is negative"),
        (QuotaSpec(QuotaKind.DEFAULT, "", 1 << 62), "above the largest"),
        (QuotaSpec(QuotaKind.STREAM, "x", 5), "positive stream id"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            await admin.set_quota(spec)
    with pytest.raises(InvalidRequestError, match="no quota for client/ghost"):
        await admin.delete_quota(QuotaKind.CLIENT, "ghost")
