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
   0.5 s in both modes, so in B that many counters stay alive. The machine is shared and noisy,
   so rounds are short and interleaved in ``--blocks`` A B B A blocks (slow periods, drift and
   any effect of a round's position fall on both modes alike); the figure is the median over
   blocks of each block's B/A ratio, with its min..max, quartiles and a bootstrap 95% interval
   of the median (blocks resampled). Honesty checks, from the node's /metrics around every
   round: in B the node's ``quota_charged{rate="produce"}`` moved by exactly its APPEND count,
   in A not at all; no response was throttled.
3. **Per-request cost** (``micro``): timeit of one APPEND's charge on the node's own path
   (``AppendHandler._charge`` -> ``NodeQuotas.charge``, a real connection object), in
   microseconds. With ``cost``, that cost divided by the mean time of one APPEND in the A
   rounds of the same run (round time / APPENDs the node counted) bounds the relative cost from
   above independently of the noise: adding ``c`` to every APPEND lengthens the period between
   APPENDs by at most ``c``.

    .venv/bin/python -m bench.bench_quota [--only achieved|cost|micro] [--quota 262144]
        [--seconds 8] [--records 30000] [--blocks 16] [--swarm 200] [--client-quotas 200]
        [--batch-bytes 524288] [--fsync none|interval|always] [--heartbeat-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import tempfile
import time
import timeit
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from sbpstream.auth.gate import CONN_CLAIMS
from sbpstream.auth.tokens import KIND_USER, Claims
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.datanode.append import AppendHandler
from sbpstream.datanode.context import NodeContext
from sbpstream.datanode.quota import NodeQuotas
from sbpstream.net.client import Connection
from sbpstream.net.loop import run
from sbpstream.net.ports import free_port
from sbpstream.net.server import Request, Server, ServerConnection
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    ClientRole,
    FetchItem,
    FetchRequest,
    HeartbeatRequest,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.enforcer import PRODUCE
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
        sids = [await admin.create_stream() for _ in range(3)]
        addr = await _data_node(admin)
        held = len(await admin.list_quotas())
        for n, (factor, sid) in enumerate(zip((1, 2, 10), sids, strict=True), 1):
            cid = f"bench-{factor}x"
            await admin.set_quota(QuotaSpec(QuotaKind.CLIENT, cid, quota))
            await _quotas_applied(admin, addr, held + n)  # pulled at the node's next heartbeat
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


async def _data_node(admin: AsyncClient) -> str:
    """The one data node's address, once a stream's range names it (bounded wait; found
    through the streams' ranges, so some stream must exist)."""
    for _ in range(200):
        if addrs := await admin.data_node_addresses():
            return addrs[0]
        await asyncio.sleep(0.05)
    raise RuntimeError("no data node registered with the PM")


async def _quotas_applied(admin: AsyncClient, addr: str, count: int) -> None:
    """Wait (bounded) until the data node enforces ``count`` quotas."""
    for _ in range(200):
        if len((await admin.quota_counters(addr)).quotas) == count:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the data node did not apply {count} quotas")


def _metrics_ports() -> int:
    """A port P with P and P + 1 free: LocalCluster serves the PM's /metrics on P and the data
    node's on P + 1."""
    for _ in range(100):
        port = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _node_metrics(port: int) -> dict[str, float]:
    """The data node's APPEND count and produce charges, off its /metrics."""
    wanted = {'sbpstream_datanode_requests_total{opcode="APPEND"}': "appends",
              'sbpstream_datanode_quota_charged_total{rate="produce"}': "charged"}
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in wanted:
                out[wanted[name]] = float(value)
    out.setdefault("appends", 0.0)  # a counter is served once it has a value
    out.setdefault("charged", 0.0)
    return out


def bootstrap_median(values: list[float], rounds: int = 5000,
                     seed: int = 22) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def _cpu_ns(pid: int) -> int:
    """CPU time a process has used, in ns: the sum over its threads' schedstat (ns resolution,
    where /proc/<pid>/stat counts 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def unthrottled(pm: str, metrics_port: int, node_pid: int, pm_pid: int, records: int,
                      blocks: int, swarm_n: int, client_quotas: int,
                      batch_bytes: int) -> dict[str, Any]:
    """A B B A blocks: appends with no quota stored (A) and with quotas far above what is sent
    (B: a default, ``client_quotas`` client-id quotas, and a quota on every stream written; all
    with every rate set, so each APPEND charges its client's produce and request counters and
    its stream's). Returns the per-round rates and APPEND counts and the block ratios B/A."""
    loop = asyncio.get_running_loop()
    high = (MAX_BYTES_PER_S, MAX_BYTES_PER_S, MAX_REQUESTS_PER_S)
    async with AsyncClient(pm, client_id="bench-admin") as admin, \
            AsyncClient(pm, client_id="bench-free") as c:
        await asyncio.gather(*(admin.delete_quota(q.kind, q.name, q.user)
                               for q in await admin.list_quotas()))
        swarm_sid = await admin.create_stream()
        addr = await _data_node(admin)
        stop = asyncio.Event()
        swarm_task = asyncio.create_task(swarm(addr, swarm_sid, swarm_n, stop))
        small = b"r" * 100
        modes = "A" + "ABBA" * blocks  # the first round warms up (routing, buffers): dropped
        sids = [await admin.create_stream() for _ in modes]
        b_specs = [QuotaSpec(QuotaKind.DEFAULT, "", *high),
                   *(QuotaSpec(QuotaKind.CLIENT, f"bench-q-{i}", *high)
                     for i in range(client_quotas)),
                   *(QuotaSpec(QuotaKind.STREAM, str(sid), *high) for sid in sids)]
        rounds: list[dict[str, Any]] = []
        live = 0
        try:
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
                before = await asyncio.to_thread(_node_metrics, metrics_port)
                async with c.producer(linger_ms=2, batch_max_bytes=batch_bytes) as p:
                    pm0, cpu0, t0 = _cpu_ns(pm_pid), _cpu_ns(node_pid), loop.time()
                    futs = [await p.send(sid, small) for _ in range(records)]
                    await p.flush()
                    took, cpu = loop.time() - t0, _cpu_ns(node_pid) - cpu0
                    pm_cpu = _cpu_ns(pm_pid) - pm0
                    assert all(f.exception() is None for f in futs)
                after = await asyncio.to_thread(_node_metrics, metrics_port)
                appends = int(after["appends"] - before["appends"])
                charged = int(after["charged"] - before["charged"])
                # honesty: B counts every APPEND against the quotas, A none
                assert charged == (appends if mode == "B" else 0), (mode, appends, charged)
                rounds.append({"mode": mode, "records_per_s": records / took, "seconds": took,
                               "node_cpu_s": cpu / 1e9, "pm_cpu_s": pm_cpu / 1e9,
                               "appends": appends, "charged": charged})
                if mode == "B":
                    live = max(live, len((await admin.quota_counters(addr)).counters))
            assert c.routing.throttle.throttled_responses == 0
        finally:
            stop.set()
            await swarm_task
    rounds = rounds[1:]  # the warm-up round
    throughput, node_cpu = [], []  # per A B B A block: the cost, > 0 when B is worse
    for k in range(blocks):
        a, b1, b2, a2 = rounds[4 * k:4 * k + 4]
        throughput.append(1 - (b1["records_per_s"] + b2["records_per_s"])
                          / (a["records_per_s"] + a2["records_per_s"]))
        node_cpu.append((b1["node_cpu_s"] + b2["node_cpu_s"])
                        / (a["node_cpu_s"] + a2["node_cpu_s"]) - 1)
    return {"rounds": rounds, "throughput_cost": throughput, "node_cpu_cost": node_cpu,
            "live_counters_in_b": live}


def summary(costs: list[float]) -> dict[str, Any]:
    """Median, quartiles, bootstrap 95% interval of the median, min and max."""
    med = statistics.median(costs)
    q1, _, q3 = statistics.quantiles(costs, n=4) if len(costs) > 1 else (med, med, med)
    lo, hi = bootstrap_median(costs)
    return {"median": med, "quartiles": [q1, q3], "bootstrap95": [lo, hi],
            "min_max": [min(costs), max(costs)], "blocks": costs}


def _pct(v: dict[str, Any]) -> str:
    return (f"median {v['median']:+.2%}; quartiles {v['quartiles'][0]:+.2%} .. "
            f"{v['quartiles'][1]:+.2%}; bootstrap 95% of the median {v['bootstrap95'][0]:+.2%} .. "
            f"{v['bootstrap95'][1]:+.2%}; blocks {v['min_max'][0]:+.2%} .. {v['min_max'][1]:+.2%}")


def report_cost(res: dict[str, Any], micro_us: float, records: int, swarm_n: int,
                client_quotas: int, batch_bytes: int) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = res["rounds"]
    thr, cpu = summary(res["throughput_cost"]), summary(res["node_cpu_cost"])
    per_append_us = {m: statistics.median(r["seconds"] / r["appends"] * 1e6
                                          for r in rounds if r["mode"] == m) for m in "AB"}
    cpu_per_append_us = {m: statistics.median(r["node_cpu_s"] / r["appends"] * 1e6
                                              for r in rounds if r["mode"] == m) for m in "AB"}
    recs_per_append = statistics.median(records / r["appends"] for r in rounds)
    bound = micro_us / per_append_us["A"]
    rates = {m: statistics.median(r["records_per_s"] for r in rounds if r["mode"] == m)
             for m in "AB"}
    load = os.getloadavg()
    print(f"rounds of {records} x 100 B (batch_max_bytes {batch_bytes}), {len(rounds) // 4} "
          f"A B B A blocks, {swarm_n} swarm client ids, {res['live_counters_in_b']} live "
          f"counters in B; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"A (no quotas) median {rates['A']:,.0f} rec/s, B (quotas) {rates['B']:,.0f} rec/s; "
          f"{recs_per_append:.0f} records per APPEND; every B APPEND charged "
          f"({sum(r['charged'] for r in rounds)} charges, none in A)")
    print("throughput cost per block (1 - B/A): "
          + " ".join(f"{c:+.1%}" for c in res["throughput_cost"]))
    print(f"  throughput cost: {_pct(thr)}")
    aa = summary([1 - b[3]["records_per_s"] / b[0]["records_per_s"]
                  for b in (rounds[k:k + 4] for k in range(0, len(rounds), 4))])
    print(f"  noise floor, A/A (1 - second A / first A of each block): {_pct(aa)}")
    print("node CPU cost per block (B/A - 1): "
          + " ".join(f"{c:+.1%}" for c in res["node_cpu_cost"]))
    print(f"  node CPU cost: {_pct(cpu)}; node CPU per APPEND A {cpu_per_append_us['A']:.0f} us,"
          f" B {cpu_per_append_us['B']:.0f} us")
    pm_cpu = {m: statistics.median(r["pm_cpu_s"] / r["seconds"] for r in rounds
                                   if r["mode"] == m) for m in "AB"}
    print(f"  PM CPU while appending (median share of one core): A {pm_cpu['A']:.1%}, "
          f"B {pm_cpu['B']:.1%} (it serves the data node's quota pulls)")
    print(f"cross-check: {micro_us:.2f} us per APPEND charge / {per_append_us['A']:.0f} us per "
          f"APPEND unthrottled (A rounds) = at most {bound:.2%}")
    return {"records": records, "batch_bytes": batch_bytes, "swarm": swarm_n,
            "client_quotas": client_quotas, "rounds": rounds, "throughput_cost": thr,
            "node_cpu_cost": cpu, "a_a_throughput": aa, "records_per_append": recs_per_append,
            "per_append_us": per_append_us, "node_cpu_per_append_us": cpu_per_append_us,
            "pm_cpu_share": pm_cpu,
            "micro_us": micro_us, "bound": bound, "loadavg": load,
            "live_counters_in_b": res["live_counters_in_b"]}


def micro(n: int = 100_000) -> dict[str, float]:
    """The per-request enforcement cost alone, in microseconds (timeit, best of 9): an APPEND
    of one batch charged on the data node's own path (``AppendHandler._charge`` ->
    ``NodeQuotas.charge``: connection plan check, clock read, client produce and requests
    counters, the stream's two) against quotas that never throttle, with 5,000 other
    counters in the table; the same with a principal; and with no quota stored."""
    high = (MAX_BYTES_PER_S, MAX_BYTES_PER_S, MAX_REQUESTS_PER_S)
    out: dict[str, float] = {}
    server = Server({})
    item = AppendRequest(items=(AppendItem(7, 0, 16_384),))
    for label, principal in (("client quota + stream quota", ""),
                             ("same, with a principal", "alice"), ("no quota stored", None)):
        quotas = NodeQuotas()
        if principal is not None:
            quotas.enforcer.load([
                QuotaSpec(QuotaKind.DEFAULT, "", *high), QuotaSpec(QuotaKind.STREAM, "7", *high),
                *(QuotaSpec(QuotaKind.CLIENT, f"c{i}", *high) for i in range(1000))])
            now = time.monotonic_ns()
            for i in range(2500):
                quotas.enforcer.charge(f"other-{i}", PRODUCE, 100, {}, now)
        conn = ServerConnection(server)
        conn.client_id = "bench"
        if principal:
            conn.attributes[CONN_CLAIMS] = Claims(principal, KIND_USER, 0, 1 << 50)
        handler = AppendHandler(cast(NodeContext, SimpleNamespace(quotas=quotas)))
        req = Request(Opcode.APPEND, 1, 0, b"", b"x" * 16_384, conn, 0.0)
        t = min(timeit.repeat(lambda h=handler, r=req: h._charge(r, item),
                              number=n, repeat=9))
        out[label] = t / n * 1e6
        if principal is not None:
            assert quotas.enforcer.charged[PRODUCE] >= n * 9 and not quotas.enforcer.throttled
    print("per-APPEND enforcement on the node's path (timeit, best of 9): " + ", ".join(
        f"{k} {v:.2f} us" for k, v in out.items()) + "; 5,000 other counters in the table")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quota", type=int, default=256 * 1024)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--records", type=int, default=30_000, help="records per A or B round")
    ap.add_argument("--blocks", type=int, default=16, help="A B B A blocks")
    ap.add_argument("--swarm", type=int, default=200,
                    help="other client ids keeping request counters alive (both modes)")
    ap.add_argument("--client-quotas", type=int, default=200,
                    help="client-id quotas stored in mode B besides the default")
    ap.add_argument("--batch-bytes", type=int, default=512 * 1024,
                    help="the producer's batch_max_bytes in the cost rounds (small: many "
                    "small APPENDs, the worst case for a per-request cost)")
    ap.add_argument("--heartbeat-ms", type=int, default=1000,
                    help="the data node's heartbeat interval, which is also how often it pulls "
                    "the quotas from the PM (1000 is the default of a data node)")
    ap.add_argument("--fsync", default="none", choices=("none", "interval", "always"),
                    help="the data node's fsync policy (none: no disk wait hides the CPU cost)")
    ap.add_argument("--only", choices=("achieved", "cost", "micro"), default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    if args.only in (None, "micro", "cost"):
        figures["micro_us"] = micro()
    if args.only != "micro":
        port = _metrics_ports()
        with tempfile.TemporaryDirectory(prefix="bench-quota-") as d, \
                LocalCluster(Path(d), datanodes=1, heartbeat_interval_ms=args.heartbeat_ms,
                             metrics_port=port, fsync=args.fsync) as cluster:
            if args.only in (None, "achieved"):
                figures["achieved"] = run(achieved(cluster.pm_address, args.quota,
                                                   args.seconds))
            if args.only in (None, "cost"):
                node, pm = cluster.datanodes[0].proc, cluster.pm.proc
                assert node is not None and pm is not None
                res = run(unthrottled(cluster.pm_address, port + 1, node.pid, pm.pid,
                                      args.records, args.blocks, args.swarm, args.client_quotas,
                                      args.batch_bytes))
                figures["unthrottled"] = report_cost(
                    res, figures["micro_us"]["client quota + stream quota"], args.records,
                    args.swarm, args.client_quotas, args.batch_bytes)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
