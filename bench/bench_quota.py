"""Quotas (issue 22): achieved rate against the quota, and the cost of enforcement.

1. **Achieved vs quota**: one producer with its own client id and a produce quota of
   ``--quota`` bytes/s, offered 1x, 2x and 10x that (paced), for ``--seconds`` each. The rate is
   bytes acknowledged per second over whole throttle cycles (from the end of one burst of
   acknowledgements to the end of a later one; a cycle is one window's quota plus the wait the
   node asked for); at 1x, where the node never throttles, over the run after its first second.
2. **Cost on unthrottled appends** (A/B in the same run): one producer sends ``--records``
   100-byte records as fast as it can, in rounds that alternate A (no quota stored: enforcement
   short-circuits) and B (a default, ``--client-quotas`` client-id quotas and a quota on each
   stream written, all far above what is sent: every APPEND is counted, none throttled).
   Meanwhile ``--swarm`` other connections, each its own client id, send an empty FETCH every
   0.5 s in both modes, so in B that many counters stay alive. The machine is shared and
   noisy: rounds are interleaved in A B B A blocks so slow periods (and any effect of a round's
   position) fall on both modes alike, and the figure is the B/A ratio of each block, its
   median per run (``--blocks`` blocks), and the median and spread of those over ``--runs``.
3. **Per-request cost** (``micro``): timeit of one APPEND's charge, in microseconds.

    .venv/bin/python -m bench.bench_quota [--only achieved|cost|micro] [--quota 262144]
        [--seconds 8] [--records 100000] [--blocks 3] [--runs 3] [--swarm 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.net.loop import run
from sbpstream.protocol.messages import ClientRole, FetchItem, FetchRequest, HeartbeatRequest
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.enforcer import PRODUCE, QuotaEnforcer
from sbpstream.quota.model import MAX_BYTES_PER_S, MAX_REQUESTS_PER_S, QuotaKind, QuotaSpec

RECORD = b"q" * 1000
GAP_S = 0.25  # a pause this long between acknowledgements ends a burst


def cycle_rate(times: list[float], nbytes: int) -> float | None:
    times = sorted(times)
    ends = [i for i in range(len(times) - 1) if times[i + 1] - times[i] > GAP_S]
    ends.append(len(times) - 1)
    if len(ends) < 4:
        return None
    first, last = ends[0], ends[-1]
    return (last - first) * nbytes / (times[last] - times[first])


async def offered(c: AsyncClient, sid: int, rate_bps: float, seconds: float) -> list[float]:
    loop = asyncio.get_running_loop()
    acked: list[float] = []
    async with c.producer(linger_ms=5, batch_max_bytes=16 * 1024) as p:
        start, sent = loop.time(), 0
        while loop.time() - start < seconds:
            due = int((loop.time() - start) * rate_bps / len(RECORD)) + 1
            while sent < due and p.buffered_bytes < 4 * rate_bps:
                fut = await p.send(sid, RECORD)
                fut.add_done_callback(lambda _f: acked.append(loop.time()))
                sent += 1
            await asyncio.sleep(0.02)
        await p.flush()
    return acked


async def achieved(pm: str, quota: int, seconds: float) -> list[dict[str, Any]]:
    out = []
    async with AsyncClient(pm, client_id="bench-admin") as admin:
        for factor in (1, 2, 10):
            cid = f"bench-{factor}x"
            await admin.set_quota(QuotaSpec(QuotaKind.CLIENT, cid, quota))
            await asyncio.sleep(1.0)  # the data node pulls quotas every heartbeat (200 ms)
            sid = await admin.create_stream()
            async with AsyncClient(pm, client_id=cid) as c:
                acked = await offered(c, sid, factor * quota, seconds)
                throttle_ms = c.routing.throttle.throttle_time_ms_total
            rate = cycle_rate(acked, len(RECORD))
            if rate is None:  # never throttled: the steady rate after the first second
                t0 = min(acked) + 1.0
                late = [t for t in acked if t >= t0]
                rate = len(late) * len(RECORD) / (max(late) - t0) if late else 0.0
            out.append({"overload": factor, "quota_bps": quota, "achieved_bps": round(rate),
                        "ratio": round(rate / quota, 3), "throttle_ms_total": throttle_ms})
            print(f"{factor:>3}x offered: {rate / 1024:8.1f} KiB/s achieved of "
                  f"{quota / 1024:.1f} KiB/s quota ({rate / quota:.1%}), "
                  f"throttled {throttle_ms} ms in all")
    return out


SWARM_INTERVAL_S = 0.5  # each swarm connection's request period (counters live 1 s)
SETTLE_S = 0.5  # after a mode switch, before a round


async def swarm(addr: str, sid: int, n: int, stop: asyncio.Event) -> None:
    """``n`` connections, each with its own client id, each sending one empty FETCH every
    :data:`SWARM_INTERVAL_S`: the same small load in both modes, and with quotas on, ``n``
    live request counters (plus the producer's) on the node during every round."""
    conns = [await Connection.open(addr) for _ in range(n)]
    try:
        for i, c in enumerate(conns):
            await c.request_one(Opcode.HEARTBEAT, HeartbeatRequest(
                client_id=f"swarm-{i}", client_role=ClientRole.CLIENT).encode(), timeout_s=10)
        fetch = FetchRequest(items=(FetchItem(sid, 0, 0, 1),)).encode()

        async def one(c: Connection) -> None:
            while not stop.is_set():
                await c.request_one(Opcode.FETCH, fetch, timeout_s=10)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SWARM_INTERVAL_S)

        await asyncio.gather(*(one(c) for c in conns))
    finally:
        for c in conns:
            c.close()


async def _quotas_applied(admin: AsyncClient, addr: str, count: int) -> None:
    """Wait (bounded) until the data node enforces ``count`` quotas."""
    for _ in range(200):
        if len((await admin.quota_counters(addr)).quotas) == count:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the data node did not apply {count} quotas")


async def unthrottled(pm: str, records: int, blocks: int, runs: int, swarm_n: int,
                      client_quotas: int) -> dict[str, Any]:
    """A/B/A/B: appends with no quota stored (A) and with quotas far above what is sent (B:
    a default, ``client_quotas`` client-id quotas, and a quota on every stream written; all
    with every rate set, so each APPEND charges its client's produce and request counters and
    its stream's), rounds interleaved A B B A so machine noise, drift and any effect of a
    round's position fall on both alike. The figure is the ratio B/A of each ABBA block (sum of
    its two B rates over its two A rates), its median per run, and the median and spread of
    those over the runs."""
    loop = asyncio.get_running_loop()
    high = (MAX_BYTES_PER_S, MAX_BYTES_PER_S, MAX_REQUESTS_PER_S)
    out_runs: list[dict[str, Any]] = []
    async with AsyncClient(pm, client_id="bench-admin") as admin, \
            AsyncClient(pm, client_id="bench-free") as c:
        await asyncio.gather(*(admin.delete_quota(q.kind, q.name, q.user)
                               for q in await admin.list_quotas()))
        swarm_sid = await admin.create_stream()
        addr = (await admin.data_node_addresses())[0]
        stop = asyncio.Event()
        swarm_task = asyncio.create_task(swarm(addr, swarm_sid, swarm_n, stop))
        small = b"r" * 100
        try:
            for run_no in range(runs):
                modes = "ABBA" * blocks  # each block is symmetric: drift and order effects
                sids = [await admin.create_stream() for _ in modes]  # cancel within it
                b_specs = [QuotaSpec(QuotaKind.DEFAULT, "", *high),
                           *(QuotaSpec(QuotaKind.CLIENT, f"bench-q-{i}", *high)
                             for i in range(client_quotas)),
                           *(QuotaSpec(QuotaKind.STREAM, str(sid), *high) for sid in sids)]
                rates: dict[str, list[float]] = {"A": [], "B": []}
                live = 0
                for i, (mode, sid) in enumerate(zip(modes, sids, strict=True)):
                    if i == 0 or mode != modes[i - 1]:
                        if mode == "B":
                            await asyncio.gather(*(admin.set_quota(q) for q in b_specs))
                            await _quotas_applied(admin, addr, len(b_specs))
                        else:
                            await asyncio.gather(*(admin.delete_quota(q.kind, q.name)
                                                   for q in await admin.list_quotas()))
                            await _quotas_applied(admin, addr, 0)
                        await asyncio.sleep(SETTLE_S)  # the PM's writes of the switch are done
                    async with c.producer(linger_ms=2) as p:
                        t0 = loop.time()
                        futs = [await p.send(sid, small) for _ in range(records)]
                        await p.flush()
                        rates[mode].append(records / (loop.time() - t0))
                        assert all(f.exception() is None for f in futs)
                    if mode == "B":
                        live = max(live, len((await admin.quota_counters(addr)).counters))
                assert c.routing.throttle.throttled_responses == 0
                a, b = rates["A"], rates["B"]
                ratios = [(b[2 * k] + b[2 * k + 1]) / (a[2 * k] + a[2 * k + 1])
                          for k in range(blocks)]
                med = statistics.median(ratios)
                out_runs.append({"rates": rates, "block_ratios": [round(r, 4) for r in ratios],
                                 "median_ratio": round(med, 4), "live_counters_in_b": live})
                print(f"run {run_no + 1}: A (no quotas) median {statistics.median(a):,.0f} "
                      f"rec/s, B (quotas, {live} live counters) {statistics.median(b):,.0f} "
                      f"rec/s; ABBA block ratios B/A {', '.join(f'{r:.3f}' for r in ratios)}; "
                      f"median {med - 1:+.1%}")
        finally:
            stop.set()
            await swarm_task
    meds = [r["median_ratio"] for r in out_runs]
    overall = statistics.median(meds)
    print(f"unthrottled appends, {records} x 100 B per round, {blocks} ABBA blocks x {runs} runs: "
          f"cost of enforcement {overall - 1:+.1%} (median of run medians; runs "
          f"{min(meds) - 1:+.1%} .. {max(meds) - 1:+.1%})")
    return {"records": records, "blocks": blocks, "runs": out_runs, "swarm": swarm_n,
            "client_quotas": client_quotas, "median_ratio": round(overall, 4),
            "spread": [round(min(meds), 4), round(max(meds), 4)]}


def micro(n: int = 200_000) -> dict[str, float]:
    """The per-request enforcement cost alone, in microseconds (timeit, best of 5): an APPEND
    charged against quotas that never throttle (client produce + requests, one stream's), with
    5,000 other live counters; and the same call with no quotas loaded."""
    enf = QuotaEnforcer()
    now = time.monotonic_ns()
    high = (MAX_BYTES_PER_S, MAX_BYTES_PER_S, MAX_REQUESTS_PER_S)
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", *high), QuotaSpec(QuotaKind.STREAM, "7", *high),
              *(QuotaSpec(QuotaKind.CLIENT, f"c{i}", *high) for i in range(1000))])
    for i in range(2500):
        enf.charge(f"other-{i}", PRODUCE, 100, {}, now)
    per_stream = {7: 16_384}
    out: dict[str, float] = {}
    for label, user in (("client quota", ""), ("principal, default", "alice")):
        t = min(timeit.repeat(lambda u=user: enf.charge("bench", PRODUCE, 16_384, per_stream,
                                                         now, u), number=n, repeat=5))
        out[label] = t / n * 1e6
    empty = QuotaEnforcer()
    t = min(timeit.repeat(lambda: empty.charge("bench", PRODUCE, 16_384, {}, now),
                          number=n, repeat=5))
    out["no quotas"] = t / n * 1e6
    print("per-request enforcement (timeit, best of 5): " + ", ".join(
        f"{k} {v:.2f} us" for k, v in out.items()) + f"; {len(enf.counters)} live counters")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quota", type=int, default=256 * 1024)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--records", type=int, default=100_000, help="records per A or B round")
    ap.add_argument("--blocks", type=int, default=3, help="A B B A blocks per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--swarm", type=int, default=200,
                    help="other client ids keeping request counters alive (both modes)")
    ap.add_argument("--client-quotas", type=int, default=200,
                    help="client-id quotas stored in mode B besides the default")
    ap.add_argument("--only", choices=("achieved", "cost", "micro"), default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    if args.only in (None, "micro"):
        figures["micro_us"] = micro()
    if args.only != "micro":
        with tempfile.TemporaryDirectory(prefix="bench-quota-") as d, \
                LocalCluster(Path(d), datanodes=1, heartbeat_interval_ms=200) as cluster:
            if args.only in (None, "achieved"):
                figures["achieved"] = run(achieved(cluster.pm_address, args.quota,
                                                   args.seconds))
            if args.only in (None, "cost"):
                figures["unthrottled"] = run(unthrottled(
                    cluster.pm_address, args.records, args.blocks, args.runs, args.swarm,
                    args.client_quotas))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
