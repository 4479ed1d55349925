"""Replication benchmark (issue: replication and failover).

1. Append MB/s at replica_nums R = 1, 2, 3 on one host, in the same run, through the SDK
   producer (1 KiB records, fsync-acknowledged data nodes), medians of ``--runs`` with spread.
2. Failover time: under a steady append load at R = 3, kill -9 a secondary of the writable
   range and measure the time from the kill to the first acknowledged write on the new range
   (the producer's seal-and-resend path), and the same for the primary.

    .venv/bin/python -m bench.bench_replication [--records 30000] [--runs 3] [--fsync always]

With ``--streams N`` (and typically ``--datanodes 3 --no-failover``): the records go round-robin
over N streams per R, R=1 and R=3 alternate within each run, and the same-run ratio R=3/R=1 is
reported (median of the runs' ratios). ``--plain`` sends as ``make bench`` does (each record's
future kept, no callback): the client is then no longer what limits R=1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.common import median_spread
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run
from sbpstream.tools.loadgen import produce_load

FAILOVER_BOUND_S = 60.0  # a failover not done within this is reported as a failure


async def throughput(pm: str, replicas: int, records: int, size: int, streams: int = 1,
                     plain: bool = False) -> float:
    async with AsyncClient(pm) as client:
        sids: list[int] = []
        while len(sids) < streams:  # in chunks, as bench/sbp_workloads.py creates them
            sids += await client.create_streams(min(500, streams - len(sids)),
                                                replica_nums=replicas)
        if not plain:
            res = await produce_load(client, sids, records, size)
            return res.mb_per_s
        # make bench's append (bench/sbp_workloads.py): send each record, flush, no callbacks
        value = os.urandom(size)
        async with client.producer(linger_ms=5.0) as p:
            t0 = time.perf_counter()
            futs = [await p.send(sids[i % streams], value) for i in range(records)]
            await p.flush()
            seconds = time.perf_counter() - t0
        for f in futs:
            f.result()
        return records * size / seconds / 1e6


def same_run_ratio(pm: str, records: int, size: int, streams: int, runs: int,
                   plain: bool = False) -> None:
    print(f"append through the SDK, {records} records of {size} B over {streams} streams; "
          f"R=1 then R=3 in each run, {runs} runs"
          + ("; plain sends (make bench's loop)" if plain else ""))
    r1s, r3s, ratios = [], [], []
    for i in range(runs):
        r1 = run(throughput(pm, 1, records, size, streams, plain))
        r3 = run(throughput(pm, 3, records, size, streams, plain))
        r1s.append(r1)
        r3s.append(r3)
        ratios.append(r3 / r1)
        print(f"  run {i + 1}: R=1 {r1:.1f} MB/s, R=3 {r3:.1f} MB/s, ratio {r3 / r1:.2f}")
    for name, vals in (("R=1 MB/s", r1s), ("R=3 MB/s", r3s), ("R=3 / R=1", ratios)):
        m, lo, hi = median_spread(vals)
        print(f"  {name:10}: {m:7.2f} [{lo:.2f}..{hi:.2f}]")


async def failover(cluster: LocalCluster, which: str) -> float:
    """Seconds from kill -9 of the writable range's ``which`` replica to the first ack after."""
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=90_000) as client:
        sid = await client.create_stream(replica_nums=3)
        p = client.producer(linger_ms=1)
        acks: list[tuple[float, int]] = []  # (time acknowledged, offset)
        stop = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop.is_set() and i < 1_000_000:
                f = await p.send(sid, b"x" * 100)
                f.add_done_callback(
                    lambda f: f.exception() or acks.append((time.monotonic(), f.result())))
                i += 1
                if i % 50 == 0:
                    await asyncio.sleep(0.005)

        task = asyncio.ensure_future(load())
        while len(acks) < 500:
            await asyncio.sleep(0.01)
        (rng,) = [r for r in await client.list_ranges(sid) if not r.sealed]
        victim = next(rn for rn in rng.replica_nodes if rn.is_primary == (which == "primary"))
        node = next(dn for dn in cluster.datanodes
                    if dn.address == victim.data_node.advertise_addr)
        t_kill = time.monotonic()
        node.kill()
        deadline = t_kill + FAILOVER_BOUND_S
        result = float("nan")
        while time.monotonic() < deadline:
            new = [r for r in await client.list_ranges(sid) if r.range_index > rng.range_index]
            if new:
                start = new[0].start_offset
                after = [t for t, off in list(acks) if off >= start and t > t_kill]
                if after:  # the first write acknowledged on the new range
                    result = min(after) - t_kill
                    break
            await asyncio.sleep(0.02)
        stop.set()
        await task
        await p.close()
        node.start()
        await asyncio.to_thread(node.wait_ready)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fsync", default="always", choices=["always", "interval", "none"])
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--datanodes", type=int, default=5)
    ap.add_argument("--no-failover", action="store_true")
    ap.add_argument("--plain", action="store_true",
                    help="with --streams: send as make bench does (no per-record callback or "
                         "latency bookkeeping, which make the client the limit)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cluster = LocalCluster(Path(d), datanodes=a.datanodes, heartbeat_interval_ms=200,
                               node_timeout_ms=2000, fsync=a.fsync)
        cluster.start()
        try:
            if a.streams > 1:
                same_run_ratio(cluster.pm_address, a.records, a.size, a.streams, a.runs,
                               a.plain)
                if a.no_failover:
                    return
            print(f"append through the SDK, {a.records} records of {a.size} B, fsync={a.fsync}, "
                  f"5 data nodes on one host; medians of {a.runs} [min..max]")
            base = None
            for r in (1, 2, 3):
                vals = [run(throughput(cluster.pm_address, r, a.records, a.size))
                        for _ in range(a.runs)]
                m, lo, hi = median_spread(vals)
                base = base or m
                print(f"  R={r}: {m:7.1f} MB/s [{lo:.1f}..{hi:.1f}]  ({m / base:.2f} of R=1)")
            print("failover at R=3 (kill -9 -> first acknowledged write after it)")
            for which in ("secondary", "primary"):
                vals = [run(failover(cluster, which)) for _ in range(a.runs)]
                m, lo, hi = median_spread(vals)
                print(f"  {which:9}: {m:6.2f} s [{lo:.2f}..{hi:.2f}]")
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
