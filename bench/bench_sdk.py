"""End-to-end SDK benchmark against Redis Streams, measured by the same script in the same run.

For each record size (100 B and 1 KiB by default):

- **throughput**: produce N records (sbpstream: the batching idempotent producer, futures per
  record; Redis: XADD in redis-py pipelines of 1000, hiredis parser), then read them all back
  (sbpstream: the consumer's columns path; Redis: XRANGE pages of 10,000). Records/s and MB/s,
  median of ``--runs`` (3) runs, with the spread.
- **latency**: closed loop, one record at a time (send, wait for the acknowledgement), so the
  figure is the round trip of one durable append, not time spent queued behind a flood.
  Percentiles over ``--latency-samples`` appends.

Setups: a LocalCluster (1 PM + ``--datanodes`` data nodes, fsync ``--fsync``, default
``interval`` = every 10 ms, the closest to Redis' ``appendfsync everysec``) on loopback; a
redis-server started on a free port in a temp dir with ``--appendonly yes --appendfsync everysec
--save ''``. Ratio = sbpstream / Redis (> 1: sbpstream is faster).

    .venv/bin/python -m bench.bench_sdk [--records 100000] [--sizes 100,1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers import redis_parser
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run
from sbpstream.net.ports import free_port
from sbpstream.tools.loadgen import consume_load, produce_load

REDIS_PIPELINE = 1000  # XADDs per round trip
REDIS_PAGE = 10_000  # entries per XRANGE
READY_TIMEOUT_S = 20.0


@dataclass
class Run:
    produce_rps: float
    produce_mbps: float
    consume_rps: float
    consume_mbps: float


@dataclass
class Result:
    system: str
    size: int
    runs: list[Run]
    latencies_ms: list[float]

    def median(self, field: str) -> float:
        return statistics.median(getattr(r, field) for r in self.runs)

    def spread(self, field: str) -> str:
        vals = [getattr(r, field) for r in self.runs]
        return f"{min(vals):,.0f}..{max(vals):,.0f}"

    def pct(self, p: float) -> float:
        lat = sorted(self.latencies_ms)
        if not lat:
            return float("nan")
        return lat[min(len(lat) - 1, round(p / 100 * (len(lat) - 1)))]


# ------------------------------------------------------------------------------------ sbpstream


async def sbp_throughput(pm: str, records: int, size: int, streams: int) -> Run:
    async with AsyncClient(pm) as c:
        sids = await c.create_streams(streams)
        prod = await produce_load(c, sids, records, size)
        cons = await consume_load(c, sids)
        if cons.records != records:
            raise AssertionError(f"sbpstream read back {cons.records} of {records}")
        return Run(prod.records_per_s, prod.mb_per_s, cons.records_per_s, cons.mb_per_s)


async def sbp_latency(pm: str, size: int, samples: int) -> list[float]:
    value = os.urandom(size)
    out: list[float] = []
    async with AsyncClient(pm) as c:
        sid = await c.create_stream()
        async with c.producer(linger_ms=0) as p:
            for _ in range(samples):
                t0 = time.perf_counter()
                await (await p.send(sid, value))
                out.append((time.perf_counter() - t0) * 1000)
    return out


# ---------------------------------------------------------------------------------------- redis


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis)")
        print(f"redis-py reply parser: {redis_parser()}", file=sys.stderr)  # hiredis or refuse
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                self.client().ping()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def redis_throughput(server: RedisServer, records: int, size: int, streams: int,
                     tag: str) -> Run:
    r = server.client()
    keys = [f"bench:{tag}:{i}" for i in range(streams)]
    value = os.urandom(size)
    t0 = time.perf_counter()
    for start in range(0, records, REDIS_PIPELINE):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(records, start + REDIS_PIPELINE)):
            pipe.xadd(keys[i % streams], {"v": value})
        pipe.execute()
    produce_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = nbytes = 0
    for key in keys:
        last = "-"
        while True:
            page = r.xrange(key, min=last, max="+", count=REDIS_PAGE)
            if not page:
                break
            for _, fields in page:
                nbytes += len(fields[b"v"])
            n += len(page)
            last = "(" + page[-1][0].decode()
    consume_s = time.perf_counter() - t0
    for key in keys:
        r.delete(key)
    r.close()
    if n != records:
        raise AssertionError(f"redis read back {n} of {records}")
    total = records * size
    return Run(records / produce_s, total / produce_s / 1e6, n / consume_s,
               nbytes / consume_s / 1e6)


def redis_latency(server: RedisServer, size: int, samples: int) -> list[float]:
    r = server.client()
    value = os.urandom(size)
    out: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        r.xadd("bench:latency", {"v": value})
        out.append((time.perf_counter() - t0) * 1000)
    r.delete("bench:latency")
    r.close()
    return out


# ----------------------------------------------------------------------------------------- main


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-sdk-") as tmp:
        cluster = LocalCluster(Path(tmp) / "sbp", datanodes=args.datanodes, fsync=args.fsync)
        redis_dir = Path(tmp) / "redis"
        redis_dir.mkdir()
        server = RedisServer(redis_dir)
        try:
            cluster.start()
            server.start()
            for size in args.sizes:
                sbp = Result("sbpstream", size, [], [])
                red = Result("redis", size, [], [])
                for i in range(args.runs):  # interleaved, so drift in the machine hits both
                    sbp.runs.append(run(sbp_throughput(cluster.pm_address, args.records, size,
                                                       args.streams)))
                    red.runs.append(redis_throughput(server, args.records, size, args.streams,
                                                     f"{size}:{i}"))
                    log(f"size={size} run={i + 1}: sbpstream {sbp.runs[-1].produce_rps:,.0f} "
                        f"rec/s, redis {red.runs[-1].produce_rps:,.0f} rec/s")
                sbp.latencies_ms = run(sbp_latency(cluster.pm_address, size,
                                                   args.latency_samples))
                red.latencies_ms = redis_latency(server, size, args.latency_samples)
                results += [sbp, red]
        finally:
            server.stop()
            cluster.stop()
    return results


def report(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"SDK end to end vs Redis Streams: {args.records} records per run, median of "
        f"{args.runs} runs [min..max], {args.streams} stream(s); sbpstream: "
        f"{args.datanodes} data node(s), fsync={args.fsync}; redis: appendfsync everysec",
        f"{'size':>6} {'system':<10} {'produce rec/s':>14} {'MB/s':>7} {'consume rec/s':>14} "
        f"{'MB/s':>7} {'p50 ms':>7} {'p99 ms':>7}  produce spread",
    ]
    for r in results:
        lines.append(
            f"{r.size:>6} {r.system:<10} {r.median('produce_rps'):>14,.0f} "
            f"{r.median('produce_mbps'):>7.1f} {r.median('consume_rps'):>14,.0f} "
            f"{r.median('consume_mbps'):>7.1f} {r.pct(50):>7.2f} {r.pct(99):>7.2f}  "
            f"{r.spread('produce_rps')}"
        )
    lines.append("ratio sbpstream/redis (> 1: sbpstream faster; latency: < 1 is faster)")
    by = {(r.system, r.size): r for r in results}
    for size in args.sizes:
        s, d = by[("sbpstream", size)], by[("redis", size)]
        lines.append(
            f"{size:>6} produce x{s.median('produce_rps') / d.median('produce_rps'):.2f}  "
            f"consume x{s.median('consume_rps') / d.median('consume_rps'):.2f}  "
            f"p50 latency x{s.pct(50) / d.pct(50):.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_sdk", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100_000, help="records per throughput run")
    p.add_argument("--sizes", default="100,1024", help="record sizes in bytes, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="throughput runs (median reported)")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--datanodes", type=int, default=1)
    p.add_argument("--fsync", default="interval", choices=["always", "interval", "none"])
    p.add_argument("--latency-samples", type=int, default=1000)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    results = measure(args, lambda m: print(m, file=sys.stderr, flush=True))
    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps([
            {"system": r.system, "size": r.size, "runs": [vars(x) for x in r.runs],
             "p50_ms": r.pct(50), "p99_ms": r.pct(99)} for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
