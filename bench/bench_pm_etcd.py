"""PM metadata on etcd beside SQLite, in one run; and leader failover time.

Figures are medians of ``--runs`` (default 3) with [min..max]; every run starts from an empty
store (a fresh SQLite file, a fresh etcd key prefix):

- **create**: ``--streams`` streams (default 10,000; ``--streams 100000`` for the big run)
  through ``MetadataStore.create_streams`` in batches of ``--batch`` (default 1,000 items, the
  size of one CREATE_STREAMS request): streams/s and per-batch latency (p50, p99).
- **seal-and-new**: ``--seals`` sequential ``seal_and_new`` calls on distinct streams (the
  SEAL_RANGES metadata write): ops/s and latency (p50, p99).
- **describe**: ``get_streams`` of 1,000 ids (a DESCRIBE_STREAMS batch): latency.
- **failover** (etcd only): three ``python -m sbpstream.pm`` processes on etcd with a
  ``--lease-ttl`` second lease; the leader is killed with SIGKILL (lease expires) or stopped
  with SIGTERM (it resigns); time from the signal until another PM answers DESCRIBE_STREAMS as
  leader.

The metadata figures are for the store alone (in-process, no network between client and PM),
so they show what each backend costs per durable write: SQLite's fsync against etcd's raft
round trip and fsync, plus JSON encoding and the watch that applies every write to the cache.

    python -m bench.bench_pm_etcd [--streams 10000] [--batch 1000] [--seals 500] [--runs 3]
                                  [--lease-ttl 2] [--skip-failover]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import fmt_ms, median_spread, percentile
from sbpstream.cluster import Node
from sbpstream.net.client import Connection
from sbpstream.net.loop import run
from sbpstream.net.ports import free_port
from sbpstream.pm.etcd import EtcdMetadataStore
from sbpstream.pm.leader import LeaderElection
from sbpstream.pm.metadata import CreatedStream, MetadataStore, NewStream, ReplicaMeta
from sbpstream.pm.sqlite_meta import SqliteMetadataStore
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import PmNotLeaderError, SbpError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from etcd_fixture import EtcdServer  # the shared etcd launcher lives in tests/

REPLICAS = (ReplicaMeta(1, True),)
DESCRIBE_IDS = 1000
ELECTION_TIMEOUT_S = 15.0
"""Bound on waiting for a (new) leader in the failover measurement."""
PROBE_INTERVAL_S = 0.02
"""Failover is measured to this resolution."""

_prefixes = itertools.count(1)


@dataclass
class Figures:
    create_rate: list[float] = field(default_factory=list)
    create_p50_ms: list[float] = field(default_factory=list)
    create_p99_ms: list[float] = field(default_factory=list)
    seal_rate: list[float] = field(default_factory=list)
    seal_p50_ms: list[float] = field(default_factory=list)
    seal_p99_ms: list[float] = field(default_factory=list)
    describe_ms: list[float] = field(default_factory=list)


async def _timed(fn: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def measure(store: MetadataStore, args: argparse.Namespace, fig: Figures) -> None:
    lat: list[float] = []
    t0 = time.perf_counter()
    made = 0
    for start in range(0, args.streams, args.batch):
        n = min(args.batch, args.streams - start)
        items = [NewStream(1, 0, REPLICAS)] * n
        t1 = time.perf_counter()
        out = await store.create_streams(items, 1)
        lat.append((time.perf_counter() - t1) * 1000)
        made += sum(isinstance(o, CreatedStream) for o in out)
    fig.create_rate.append(made / (time.perf_counter() - t0))
    lat.sort()
    fig.create_p50_ms.append(percentile(lat, 50))
    fig.create_p99_ms.append(percentile(lat, 99))
    if made != args.streams:
        raise RuntimeError(f"created {made} of {args.streams} streams")

    seals = min(args.seals, args.streams)
    lat = []
    t0 = time.perf_counter()
    for sid in range(1, seals + 1):
        t1 = time.perf_counter()
        await store.seal_and_new(sid, 0, 100, REPLICAS, [])
        lat.append((time.perf_counter() - t1) * 1000)
    fig.seal_rate.append(seals / (time.perf_counter() - t0))
    lat.sort()
    fig.seal_p50_ms.append(percentile(lat, 50))
    fig.seal_p99_ms.append(percentile(lat, 99))

    ids = list(range(1, min(DESCRIBE_IDS, args.streams) + 1))
    samples = [await _timed(lambda: store.get_streams(ids)) for _ in range(5)]
    fig.describe_ms.append(sorted(samples)[len(samples) // 2])


async def run_sqlite(args: argparse.Namespace, fig: Figures) -> None:
    d = Path(tempfile.mkdtemp(prefix="bench-pm-sqlite-"))
    try:
        store = SqliteMetadataStore(d / "pm.sqlite")
        await store.open()
        try:
            await measure(store, args, fig)
        finally:
            await store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def run_etcd(etcd: EtcdServer, args: argparse.Namespace, fig: Figures) -> None:
    store = EtcdMetadataStore(etcd.url(f"/bench{next(_prefixes)}"))
    await store.open()
    election = LeaderElection(store, "127.0.0.1:1")
    election.start()
    try:
        if not await election.wait_leader(ELECTION_TIMEOUT_S):
            raise RuntimeError("no leadership on a fresh prefix")
        await measure(store, args, fig)
    finally:
        await election.stop()
        await store.close()


async def _serves(address: str) -> bool:
    try:
        conn = await Connection.open(address, connect_timeout_s=0.5)
    except SbpError:
        return False
    try:
        req = m.DescribeStreamsRequest(timeout_ms=1000, limit=1)
        await conn.request_one(req.OPCODE, req.encode(), timeout_s=1.0)
        return True
    except (PmNotLeaderError, SbpError, OSError):
        return False
    finally:
        await conn.aclose()


async def _leader_of(addresses: list[str]) -> str:
    deadline = time.monotonic() + ELECTION_TIMEOUT_S
    while time.monotonic() < deadline:
        for a in addresses:
            if await _serves(a):
                return a
        await asyncio.sleep(PROBE_INTERVAL_S)
    raise RuntimeError(f"no leader among {addresses} within {ELECTION_TIMEOUT_S}s")


async def failover_once(etcd: EtcdServer, ttl_s: int, sig: signal.Signals, work: Path) -> float:
    url = etcd.url(f"/failover{next(_prefixes)}") + f"?lease_ttl_s={ttl_s}"
    pms = []
    for i in range(3):
        port = free_port()
        pms.append(Node("pm", f"pm{i}", port, ["--port", str(port), "--metadata", url,
                                              "--log-level", "WARNING"], work / f"pm{i}.log"))
    try:
        for p in pms:
            p.start()
        for p in pms:
            await asyncio.to_thread(p.wait_ready)
        leader = await _leader_of([p.address for p in pms])
        victim = next(p for p in pms if p.address == leader)
        others = [p.address for p in pms if p is not victim]
        assert victim.proc is not None
        t0 = time.monotonic()
        victim.proc.send_signal(sig)
        await _leader_of(others)
        return time.monotonic() - t0
    finally:
        for p in pms:
            p.stop()


async def main_async(args: argparse.Namespace) -> None:
    sqlite, etcd_fig = Figures(), Figures()
    kill_s: list[float] = []
    term_s: list[float] = []
    work = Path(tempfile.mkdtemp(prefix="bench-pm-etcd-"))
    with EtcdServer(work / "etcd") as etcd:
        for i in range(args.runs):
            # Alternate the order so neither backend always runs on a warmer machine.
            order = (run_sqlite, run_etcd) if i % 2 == 0 else (run_etcd, run_sqlite)
            for fn in order:
                if fn is run_sqlite:
                    await run_sqlite(args, sqlite)
                else:
                    await run_etcd(etcd, args, etcd_fig)
            print(f"run {i + 1}/{args.runs}: create/s sqlite={sqlite.create_rate[-1]:,.0f} "
                  f"etcd={etcd_fig.create_rate[-1]:,.0f}", flush=True)
        if not args.skip_failover:
            for _ in range(args.runs):
                kill_s.append(await failover_once(etcd, args.lease_ttl, signal.SIGKILL, work))
                term_s.append(await failover_once(etcd, args.lease_ttl, signal.SIGTERM, work))
    shutil.rmtree(work, ignore_errors=True)
    report(args, sqlite, etcd_fig, kill_s, term_s)


def _rate(values: list[float]) -> str:
    med, lo, hi = median_spread(values)
    return f"{med:,.0f} [{lo:,.0f}..{hi:,.0f}]"


def report(args: argparse.Namespace, s: Figures, e: Figures, kill_s: list[float],
           term_s: list[float]) -> None:
    print(f"\nPM metadata: {args.streams:,} streams in batches of {args.batch:,}, "
          f"{min(args.seals, args.streams):,} seals; medians of {args.runs} [min..max]\n")
    print("| figure | SQLite | etcd |\n|---|---|---|")
    rows = [
        ("create streams/s", _rate(s.create_rate), _rate(e.create_rate)),
        ("create batch p50 ms", fmt_ms(s.create_p50_ms), fmt_ms(e.create_p50_ms)),
        ("create batch p99 ms", fmt_ms(s.create_p99_ms), fmt_ms(e.create_p99_ms)),
        ("seal-and-new ops/s", _rate(s.seal_rate), _rate(e.seal_rate)),
        ("seal-and-new p50 ms", fmt_ms(s.seal_p50_ms), fmt_ms(e.seal_p50_ms)),
        ("seal-and-new p99 ms", fmt_ms(s.seal_p99_ms), fmt_ms(e.seal_p99_ms)),
        (f"describe {DESCRIBE_IDS:,} ids ms", fmt_ms(s.describe_ms), fmt_ms(e.describe_ms)),
    ]
    for name, a, b in rows:
        print(f"| {name} | {a} | {b} |")
    if kill_s:
        print(f"\nLeader failover, 3 PMs, lease TTL {args.lease_ttl}s "
              f"(signal -> another PM serves):")
        print(f"- kill -9 (lease expires): {fmt_ms(kill_s)} s")
        print(f"- SIGTERM (leader resigns): {fmt_ms(term_s)} s")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_pm_etcd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--seals", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lease-ttl", type=int, default=2, help="leader lease TTL (s), >= 2")
    p.add_argument("--skip-failover", action="store_true")
    args = p.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("etcd not on PATH (Debian etcd-server; `make sysdeps` installs it)")
    run(main_async(args))


if __name__ == "__main__":
    main()
