"""Quotas (issue 22): achieved rate against the quota, and the cost of enforcement.

1. **Achieved vs quota**: one producer with its own client id and a produce quota of
   ``--quota`` bytes/s, offered 1x, 2x and 10x that (paced), for ``--seconds`` each. The rate is
   bytes acknowledged per second over whole throttle cycles (from the end of one burst of
   acknowledgements to the end of a later one; a cycle is one window's quota plus the wait the
   node asked for); at 1x, where the node never throttles, over the run after its first second.
2. **Cost on unthrottled appends**: the same producer sends ``--records`` records as fast as it
   can, with no quota stored (enforcement short-circuits) and with a default quota far above
   what it sends (every APPEND is counted, none throttled), alternating ``--runs`` times in the
   same run on the same cluster. Records/s medians and their ratio.

    .venv/bin/python -m bench.bench_quota [--quota 262144] [--seconds 8] [--records 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run
from sbpstream.quota.model import MAX_BYTES_PER_S, QuotaKind, QuotaSpec

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


async def unthrottled(pm: str, records: int, runs: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    rates: dict[str, list[float]] = {"no quotas": [], "quota enforced": []}
    async with AsyncClient(pm, client_id="bench-admin") as admin:
        for q in await admin.list_quotas():
            await admin.delete_quota(q.kind, q.name)
        for i in range(2 * runs):
            sid = await admin.create_stream()  # a fresh producer id and stream per run
            async with AsyncClient(pm, client_id="bench-free") as c:
                mode = "no quotas" if i % 2 == 0 else "quota enforced"
                if mode == "quota enforced":
                    await admin.set_quota(QuotaSpec(QuotaKind.DEFAULT, "", MAX_BYTES_PER_S,
                                                    MAX_BYTES_PER_S, 1 << 30))
                else:
                    for q in await admin.list_quotas():
                        await admin.delete_quota(q.kind, q.name)
                await asyncio.sleep(1.0)  # pulled by the data node
                small = b"r" * 100
                async with c.producer(linger_ms=2) as p:
                    t0 = loop.time()
                    futs = [await p.send(sid, small) for _ in range(records)]
                    await p.flush()
                    rates[mode].append(records / (loop.time() - t0))
                    assert all(f.exception() is None for f in futs)
                assert c.routing.throttle.throttled_responses == 0
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["quota enforced"] / med["no quotas"]
    print(f"unthrottled appends, {records} x 100 B, median of {runs}: "
          f"{med['no quotas']:,.0f} rec/s without quotas, {med['quota enforced']:,.0f} rec/s "
          f"with enforcement ({ratio - 1:+.1%})")
    return {"records": records, "runs": runs, "rates": rates, "medians": med,
            "ratio": round(ratio, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quota", type=int, default=256 * 1024)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-quota-") as d, \
            LocalCluster(Path(d), datanodes=1, heartbeat_interval_ms=200) as cluster:
        rates = run(achieved(cluster.pm_address, args.quota, args.seconds))
        cost = run(unthrottled(cluster.pm_address, args.records, args.runs))
    if args.json is not None:
        args.json.write_text(json.dumps({"achieved": rates, "unthrottled": cost}, indent=2))


if __name__ == "__main__":
    main()
