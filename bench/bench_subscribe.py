"""Subscriptions through the public consumer: catch-up MB/s and end-to-end latency.

- **catch-up**: produce ``--records`` records of each size (100 B, 1 KiB) spread over 1 and
  1,000 streams, then read them all back with ``AsyncClient.consumer(streams, "earliest")``
  (subscriptions, the default; the clock runs from creating the consumer, so resolving the
  streams' starts counts). MB/s of record values, against Redis XRANGE in the same run (the
  peer as bench/peers.py runs it: pipelined XADD, XRANGE pages pipelined across keys, redis-py
  with hiredis), ``--runs`` times alternating which goes first; the ratio is taken per run and
  its median reported with min..max. Before each timed read the process lets the producer's
  client finish closing and runs a full garbage collection (``gc.collect()``), for both
  systems: the 100,000 futures the producer leaves are cyclic garbage once its tasks end, and
  without this the collector walked them during the read (full collections of 140,000
  objects, ~50-70 ms each on a loaded machine).
- **idle memory**: ``--idle-subscriptions`` (1,000) idle subscriptions on one data node: its
  RSS before and after (/proc) and its own estimate (``subscription_state_bytes`` on /metrics).
- **latency**: a producer and a consumer in **separate processes**; the producer sends
  ``--rate`` records/s of 100 B (linger 0, each carrying its send time), the consumer subscribes
  and records receive time minus send time (CLOCK_MONOTONIC is system-wide on Linux). Both
  run on uvloop (``sbpstream.net.loop.run``), as the servers and the sync client do. The data
  nodes run with ``--fsync`` (default ``always``: acknowledged = fsynced, and records are
  delivered only once committed). p50/p99/p99.9 over ``--latency-seconds``, ``--runs`` times.
  With ``--hops`` the data node runs with its hop trace on (sbpstream/datanode/hoptrace.py,
  ``SBPSTREAM_HOP_TRACE``), the producer notes when each record's ack arrived, and each record's
  latency is broken down by hop (send -> frame read at the node -> handler started -> group
  commit returned -> ack written -> ack received; commit -> delivered), p50 and p99 per hop.
  ``--cpu`` also reports each process's CPU microseconds per record over the latency run.

    .venv/bin/python -m bench.bench_subscribe [--records 100000] [--rate 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Final

from bench.bench_cpu import proc_cpu_s
from bench.common import median_spread, percentile
from bench.peers import AppendSpec, RedisSystem, payload_of
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.datanode.hoptrace import HOP_TRACE_ENV
from sbpstream.datanode.subscribe import MAX_SUBSCRIPTIONS_PER_CONNECTION
from sbpstream.net.client import Connection, ResponseStream
from sbpstream.net.loop import run as run_on_uvloop
from sbpstream.net.ports import free_port
from sbpstream.protocol.messages import FetchItem, FetchRequest

STAMP = struct.Struct(">q")
READY_TIMEOUT_S = 30.0
REDIS_TIME_CAP_S = 120.0
CATCH_UP_TIMEOUT_S = 300.0


async def _produce(pm: str, ids: list[int], records: int, size: int) -> None:
    """Append ``records`` records round-robin; raises if any failed (the catch-up would wait
    for them for ever)."""
    value = b"x" * size
    async with AsyncClient(pm) as c, c.producer(linger_ms=5) as p:
        futures = [await p.send(ids[i % len(ids)], value) for i in range(records)]
        await p.flush()
    failed = [f.exception() for f in futures if not f.done() or f.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {records} appends failed: {failed[0]!r}")


async def catch_up(pm: str, size: int, nstreams: int, records: int,
                   subscribe: bool) -> dict[str, float]:
    async with AsyncClient(pm) as c:
        ids = await c.create_streams(nstreams) if nstreams > 1 else [await c.create_stream()]
        before = asyncio.all_tasks()
        await _produce(pm, ids, records, size)
        await _settle(before)
        t0 = time.perf_counter()
        n = 0
        nbytes = 0
        cons = c.consumer(ids if nstreams > 1 else ids[0], "earliest", subscribe=subscribe)
        async with asyncio.timeout(CATCH_UP_TIMEOUT_S):  # a stall fails the run, never hangs it
            async for rec in cons:
                n += 1
                nbytes += len(rec.value or b"")
                if n >= records:
                    break
        dt = time.perf_counter() - t0
        await cons.close()
    return {"size": size, "streams": nstreams, "records": n, "seconds": dt,
            "mb_per_s": nbytes / dt / 1e6, "records_per_s": n / dt}


async def _settle(before: set[asyncio.Task[Any]]) -> None:
    """Let the producer's client finish closing (its tasks hold its 100,000 futures until they
    run) and collect its garbage: it is not the consumer's to collect in the timed read."""
    async with asyncio.timeout(READY_TIMEOUT_S):
        while any(not t.done() for t in asyncio.all_tasks() - before
                  if t is not asyncio.current_task()):
            await asyncio.sleep(0.01)
    gc.collect()


# ------------------------------------------------------------------------------ latency roles

async def _consumer_role(pm: str, sid: int, count: int) -> None:
    """Prints ``[[offset, sent_ns, delivered_ns], ...]`` and its CPU seconds."""
    got: list[tuple[int, int, int]] = []
    async with AsyncClient(pm) as c:
        cons = c.consumer(sid, "latest")
        await cons.poll(timeout_ms=0)  # subscribed: the producer may start
        print("ready", flush=True)
        cpu0 = time.process_time()
        async for rec in cons:
            (sent,) = STAMP.unpack_from(rec.value or b"\0" * 8)
            got.append((rec.offset, sent, time.monotonic_ns()))
            if len(got) >= count:
                break
        cpu = time.process_time() - cpu0
        await cons.close()
    print(json.dumps({"records": got, "cpu_s": cpu}), flush=True)


async def _producer_role(pm: str, sid: int, rate: int, count: int, size: int) -> None:
    """Prints ``{"acks": [[offset, acked_ns], ...], "cpu_s": ...}``."""
    acks: list[tuple[int, int]] = []

    def acked(f: asyncio.Future[int]) -> None:
        if not f.cancelled() and f.exception() is None:
            acks.append((f.result(), time.monotonic_ns()))

    async with AsyncClient(pm) as c, c.producer(linger_ms=0) as p:
        await c.routing.ranges(sid)  # the lookup before the clock
        cpu0 = time.process_time()
        start = time.monotonic()
        pad = b"p" * max(0, size - STAMP.size)
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            (await p.send(sid, STAMP.pack(time.monotonic_ns()) + pad)).add_done_callback(acked)
        await p.flush()
        cpu = time.process_time() - cpu0
    print(json.dumps({"acks": acks, "cpu_s": cpu}), flush=True)


def latency(pm: str, rate: int, seconds: float, size: int,
            node_pid: int | None = None) -> dict[str, Any]:
    """One latency run; with ``node_pid``, the data node's CPU over it too. The raw records
    (``raw``: the stream, the consumer's and the producer's rows) go to the hop breakdown."""
    async def mk() -> int:
        async with AsyncClient(pm) as c:
            return await c.create_stream()

    sid = asyncio.run(mk())
    count = max(1, int(rate * seconds))
    me = [sys.executable, "-m", "bench.bench_subscribe", "--pm", pm, "--stream", str(sid),
          "--rate", str(rate), "--count", str(count), "--size", str(size)]
    cons = subprocess.Popen([*me, "--role", "consumer"], stdout=subprocess.PIPE, text=True)
    try:
        assert cons.stdout is not None
        line = cons.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"consumer did not start: {line!r}")
        node_cpu0 = proc_cpu_s(node_pid) if node_pid is not None else 0.0
        prod = subprocess.run([*me, "--role", "producer"], check=True, capture_output=True,
                              text=True, timeout=seconds * 10 + 60)
        node_cpu = proc_cpu_s(node_pid) - node_cpu0 if node_pid is not None else 0.0
        out, _ = cons.communicate(timeout=60)
    finally:
        if cons.poll() is None:
            cons.kill()
    got = json.loads(out.strip().splitlines()[-1])
    made = json.loads(prod.stdout.strip().splitlines()[-1])
    lat = sorted((recv - sent) / 1e6 for _, sent, recv in got["records"])
    n = len(lat)
    return {"rate": rate, "records": n, "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "p99_9_ms": percentile(lat, 99.9),
            "mean_ms": statistics.fmean(lat),
            "cpu_us_per_record": {"producer": made["cpu_s"] * 1e6 / n,
                                  "consumer": got["cpu_s"] * 1e6 / n,
                                  "datanode": node_cpu * 1e6 / n},
            "raw": {"stream": sid, "records": got["records"], "acks": made["acks"]}}


HOPS: Final = ("send->read", "read->handler", "handler->durable", "durable->ack written",
               "ack written->ack received", "durable->delivered", "send->delivered")
"""The hops of the breakdown, in the order a record passes them (see --hops)."""


def hop_breakdown(raw: dict[str, Any], trace: list[list[int]]) -> dict[str, dict[str, float]]:
    """p50 and p99 (ms) of each hop of one run, joining the node's trace rows (its stream's),
    the consumer's and the producer's rows by offset."""
    by_offset: dict[int, list[int]] = {}
    for sid, base, nxt, *times in trace:
        if sid == raw["stream"]:
            for off in range(base, nxt):
                by_offset[off] = times
    acks = dict(raw["acks"])
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for off, sent, recv in raw["records"]:
        t = by_offset.get(off)
        ack = acks.get(off)
        if t is None or ack is None:
            continue
        read, start, durable, written = t
        for h, a, b in zip(HOPS, (sent, read, start, durable, written, durable, sent),
                           (read, start, durable, written, ack, recv, recv), strict=True):
            hops[h].append((b - a) / 1e6)
    out: dict[str, dict[str, float]] = {}
    for h, xs in hops.items():
        xs.sort()
        if xs:
            out[h] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}
    return out


# ------------------------------------------------------------------------------ idle memory

def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"metric {name} not served")


async def _idle_subscriptions(cl: LocalCluster, count: int) -> dict[str, float]:
    """Open ``count`` idle subscriptions (one empty stream each, raw FETCHes with a 1 MiB
    window, MAX_SUBSCRIPTIONS_PER_CONNECTION per connection) on the one data node; return its
    RSS and its own accounting before and after."""
    node = cl.datanodes[0]
    assert node.proc is not None and node.metrics_port is not None
    pid, port = node.proc.pid, node.metrics_port
    async with AsyncClient(cl.pm_address) as c:
        ids: list[int] = []
        while len(ids) < count:
            ids += await c.create_streams(min(1000, count - len(ids)))
        ranges = await asyncio.gather(*(c.routing.ranges(sid) for sid in ids))
        conns: list[Connection] = []
        streams: list[ResponseStream] = []
        await asyncio.sleep(1.0)  # settle (the node's first range bookkeeping, heartbeats)
        before = _rss_bytes(pid)
        try:
            for i, (sid, rs) in enumerate(zip(ids, ranges, strict=True)):
                if i % MAX_SUBSCRIPTIONS_PER_CONNECTION == 0:
                    conns.append(await Connection.open(node.address))
                req = FetchRequest(window_bytes=1 << 20, items=(FetchItem(
                    stream_id=sid, fetch_offset=0, range_index=rs[-1].range_index),))
                streams.append(await conns[-1].stream(req.OPCODE, req.encode(), timeout_s=None))
            for st in streams:  # every subscription answered its first frame: it is open
                await st.__anext__()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while _metric(port, "sbpstream_datanode_subscriptions") < count:
                if time.monotonic() > deadline:
                    raise RuntimeError("the subscriptions did not all open")
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            after = _rss_bytes(pid)
            state = _metric(port, "sbpstream_datanode_subscription_state_bytes")
            subs = _metric(port, "sbpstream_datanode_subscriptions")
        finally:
            for conn in conns:
                await conn.aclose()
        await c.delete_streams(ids)
    return {"subscriptions": subs, "rss_before": before, "rss_after": after,
            "rss_delta_per_subscription": (after - before) / count,
            "node_state_bytes": state, "node_state_per_subscription": state / count}


def idle_memory(count: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d, \
            LocalCluster(Path(d), datanodes=1, fsync="none", metrics_port=free_port()) as cl:
        r = asyncio.run(_idle_subscriptions(cl, count))
    mib = (r["rss_after"] - r["rss_before"]) / 2**20
    print(f"{count} idle subscriptions: node RSS +{mib:.2f}"
          f" MiB ({r['rss_delta_per_subscription']:.0f} B each); the node's own estimate "
          f"{r['node_state_bytes'] / 2**20:.2f} MiB "
          f"({r['node_state_per_subscription']:.0f} B each)",
          flush=True)
    return r


def redis_catch_up(redis: RedisSystem, size: int, nstreams: int, records: int) -> dict[str, float]:
    """Redis at its best (pipelined XADD, XRANGE pages pipelined across keys, hiredis)."""
    spec = AppendSpec(size, nstreams, records, REDIS_TIME_CAP_S)
    _, handle = asyncio.run(redis.append(spec, payload_of(size)))
    gc.collect()  # as before the sbpstream catch-up
    tp = asyncio.run(redis.catch_up(handle, spec))
    asyncio.run(redis.drop(handle))
    return {"size": size, "streams": nstreams, "records": tp.records, "seconds": tp.seconds,
            "mb_per_s": tp.mb_s, "records_per_s": tp.records_s}


def compare(pm: str, redis: RedisSystem | None, sizes: list[int], counts: list[int],
            records: int, runs: int) -> list[dict[str, object]]:
    """Catch-up MB/s of the subscribing consumer and of Redis XRANGE, ``runs`` times each in
    the same run (alternating), with the ratio taken per run and its median reported."""
    rows: list[dict[str, object]] = []
    for size in sizes:
        for n in counts:
            sbp: list[float] = []
            red: list[float] = []
            ratios: list[float] = []
            for run in range(runs):
                order = ("sbp", "redis") if run % 2 == 0 else ("redis", "sbp")
                got: dict[str, float] = {}
                for who in order:
                    if who == "sbp":
                        got[who] = asyncio.run(catch_up(pm, size, n, records, True))["mb_per_s"]
                    elif redis is not None:
                        got[who] = redis_catch_up(redis, size, n, records)["mb_per_s"]
                sbp.append(got["sbp"])
                if "redis" in got:
                    red.append(got["redis"])
                    ratios.append(got["sbp"] / got["redis"])
            row: dict[str, object] = {"size": size, "streams": n, "records": records,
                                      "sbp_mb_per_s": sbp, "redis_mb_per_s": red,
                                      "ratio": ratios}
            rows.append(row)
            line = (f"catch-up size={size:5d} streams={n:5d}  sbpstream "
                    f"{_spread(sbp, '.2f')} MB/s")
            if ratios:
                line += (f"  Redis XRANGE {_spread(red, '.2f')} MB/s  "
                         f"ratio {_spread(ratios, '.2f')}x")
            print(line, flush=True)
    return rows


def _spread(values: list[float], fmt: str) -> str:
    m, lo, hi = median_spread(values)
    return f"{m:{fmt}} [{lo:{fmt}}..{hi:{fmt}}]"


def fsync_floor(directory: Path, samples: int = 300) -> dict[str, float]:
    """fdatasync latency of a 100-byte append on the disk the data nodes use: the floor of an
    fsync-acknowledged record's latency (a group commit may wait out one fsync in progress, then
    run its own)."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    took: list[float] = []
    try:
        for _ in range(samples):
            os.write(fd, b"x" * 100)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            took.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    took.sort()
    return {"p50_ms": percentile(took, 50), "p99_ms": percentile(took, 99),
            "p99_9_ms": percentile(took, 99.9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--sizes", default="100,1024")
    ap.add_argument("--streams", default="1,1000")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (medians, ratios per run)")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis XRANGE comparison")
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--latency-seconds", type=float, default=10.0)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-catch-up", action="store_true")
    ap.add_argument("--hops", action="store_true",
                    help="latency broken down per hop (the data node's hop trace on)")
    ap.add_argument("--idle-subscriptions", type=int, default=1000,
                    help="idle subscriptions whose node memory is measured (0: skip)")
    ap.add_argument("--fsync", default="always")
    ap.add_argument("--datanodes", type=int, default=1)
    ap.add_argument("--role", choices=("consumer", "producer"))
    ap.add_argument("--pm")
    ap.add_argument("--stream", type=int)
    ap.add_argument("--count", type=int)
    ap.add_argument("--size", type=int, default=100)
    a = ap.parse_args()
    if a.role == "consumer":
        run_on_uvloop(_consumer_role(a.pm, a.stream, a.count))
        return 0
    if a.role == "producer":
        run_on_uvloop(_producer_role(a.pm, a.stream, a.rate, a.count, a.size))
        return 0
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results: dict[str, object] = {"catch_up": [], "latency": [], "idle_memory": None}
    if a.idle_subscriptions > 0:
        results["idle_memory"] = idle_memory(a.idle_subscriptions)
    trace_dir = tempfile.TemporaryDirectory()
    trace_path = Path(trace_dir.name) / "hops.jsonl"
    env = {HOP_TRACE_ENV: str(trace_path)} if a.hops and not a.skip_latency else {}
    lats: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d, \
            LocalCluster(Path(d) / "sbp", datanodes=a.datanodes, fsync=a.fsync, env=env) as cl:
        redis: RedisSystem | None = None
        if not a.no_redis and not a.skip_catch_up:
            redis = RedisSystem(Path(d) / "redis")
            redis.start()
        try:
            if not a.skip_catch_up:
                results["catch_up"] = compare(
                    cl.pm_address, redis, [int(x) for x in a.sizes.split(",")],
                    [int(x) for x in a.streams.split(",")], a.records, a.runs)
        finally:
            if redis is not None:
                redis.stop()
        if not a.skip_latency:
            floor = fsync_floor(Path(d))
            results["fsync_floor"] = floor
            print(f"fdatasync of 100 B on this disk: p50 {floor['p50_ms']:.2f} ms  p99 "
                  f"{floor['p99_ms']:.2f} ms  p99.9 {floor['p99_9_ms']:.2f} ms", flush=True)
            pid = cl.datanodes[0].proc.pid if cl.datanodes[0].proc is not None else None
            lats = [latency(cl.pm_address, a.rate, a.latency_seconds, 100, pid)
                    for _ in range(a.runs)]
            for key in ("p50_ms", "p99_ms", "p99_9_ms"):
                print(f"latency {a.rate} rec/s separate processes fsync={a.fsync} {key[:-3]}: "
                      f"{_spread([x[key] for x in lats], '.2f')} ms", flush=True)
            for who in ("producer", "datanode", "consumer"):
                print(f"latency run CPU us/record {who}: "
                      f"{_spread([x['cpu_us_per_record'][who] for x in lats], '.1f')}",
                      flush=True)
    if lats and a.hops:  # the node wrote its trace when it stopped
        rows = [json.loads(line) for line in trace_path.read_text().splitlines()]
        trace = [r for r in rows if isinstance(r, list)]
        per_run = [hop_breakdown(x["raw"], trace) for x in lats]
        for h in HOPS:
            for p in ("p50", "p99"):
                vals = [r[h][p] for r in per_run if h in r]
                if vals:
                    print(f"hop {h:<26} {p}: {_spread(vals, '.3f')} ms", flush=True)
        results["hops"] = per_run
    trace_dir.cleanup()
    for x in lats:
        del x["raw"]
    results["latency"] = lats
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
