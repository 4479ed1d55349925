"""Placement Manager benchmark: metadata at scale.

A real PM process (SQLite metadata in a temp dir) with three in-process fake data nodes that
register, heartbeat and answer SYNC_RANGES. Figures, medians of ``--runs`` (default 3) with
[min..max]:

- CREATE_STREAMS throughput, batches of 1,000, up to ``--streams`` (default 100k; 1M for the
  full run): each run starts a fresh PM, so the figure includes every fsync and every SYNC_RANGES.
- PM RSS holding them (after the last create).
- LIST_RANGES latency: 1 stream, 1,000 streams, and every range of one data node (streamed in
  bounded frames), at that size.
- DESCRIBE_STREAMS latency: 1,000 ids, and one page of the listing (limit 1,000) from the middle.

With ``--restart``, instead: a PM and one real data node (subprocesses), ``--streams`` streams
at R=1 all placed on it, then the node is stopped (SIGTERM) and started again; figures: the
store's recovery and registration until it answers PING, the first acknowledged APPEND (to a
random stream, the clock starting at the process start) and the end of its background reconcile
(its log), and the whole-node LIST_RANGES (every frame received; then decoded).

    python -m bench.bench_pm [--streams 100000] [--runs 3] [--samples 5]
    python -m bench.bench_pm --restart [--streams 333000] [--samples 1]

``SBPSTREAM_BENCH_PROFILE=FILE`` runs the PM under cProfile (stats written to FILE when it stops).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from bench.common import fmt_ms, median_spread
from sbpstream.net.client import Connection
from sbpstream.net.loop import run
from sbpstream.net.ports import free_port
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol import messages as m
from sbpstream.protocol.messages import ClientRole
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch

BATCH = 1000
NODES = 3
HEARTBEAT_MS = 1000
NODE_TIMEOUT_MS = 60_000
READY_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 120.0

RespT = TypeVar("RespT", bound=m.Message)


async def call(conn: Connection, req: m.Message, resp_cls: type[RespT]) -> RespT:
    frame = await conn.request_one(req.OPCODE, req.encode(), timeout_s=CALL_TIMEOUT_S)
    return resp_cls.decode(frame.header)


class FakeNode:
    """Registers with the PM, heartbeats, and acknowledges SYNC_RANGES."""

    def __init__(self, pm_address: str) -> None:
        self.pm_address = pm_address
        self.server = Server({Opcode.SYNC_RANGES: self._sync}, name="bench-dn")
        self.node_id = 0
        self.synced = 0
        self._beat: asyncio.Task[None] | None = None
        self.pm: Connection | None = None

    async def start(self) -> FakeNode:
        await self.server.start("127.0.0.1", 0)
        self.pm = await Connection.open(self.pm_address)
        r = await call(self.pm, m.AllocateIdRequest(host="bench"), m.AllocateIdResponse)
        self.node_id = r.id
        await self._heartbeat()
        await call(self.pm, m.ReportMetricsRequest(
            data_node=m.DataNode(self.node_id, self.server.address), disk_free_space=10**12),
            m.ReportMetricsResponse)
        self._beat = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def _heartbeat(self) -> None:
        assert self.pm is not None
        await call(self.pm, m.HeartbeatRequest(
            client_id=f"bench-{self.node_id}", client_role=ClientRole.DATA_NODE,
            data_node=m.DataNode(self.node_id, self.server.address)), m.HeartbeatResponse)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_MS / 1000)
            with contextlib.suppress(Exception):
                await self._heartbeat()

    async def _sync(self, req: Request, resp: Responder) -> None:
        r = m.SyncRangesRequest.decode(req.header)
        self.synced += sum(len(sr.ranges) for sr in r.items)
        await resp.send(m.SyncRangesResponse(items=tuple(
            m.SyncResult(sr.stream_id) for sr in r.items)).encode())

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self.pm is not None:
            await self.pm.aclose()
        await self.server.close(drain_timeout_s=0.5)


def start_pm(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(directory / "pm.log", "wb")  # noqa: SIM115 - handed to the child
    # SBPSTREAM_BENCH_PROFILE=FILE: the PM runs under cProfile, its stats written to FILE at exit
    profile = os.environ.get("SBPSTREAM_BENCH_PROFILE")
    prefix = ["-m", "cProfile", "-o", profile] if profile else []
    proc = subprocess.Popen(
        [sys.executable, *prefix, "-m", "sbpstream.pm", "--port", str(port),
         "--metadata", f"sqlite:{directory / 'pm.sqlite'}",
         "--heartbeat-interval-ms", str(HEARTBEAT_MS),
         # generous: a PM busy with 1,000-item creates must not declare the fake nodes dead
         "--node-timeout-ms", str(NODE_TIMEOUT_MS), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    log.close()
    return proc, f"127.0.0.1:{port}"


async def wait_ready(proc: subprocess.Popen[bytes], address: str) -> Connection:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"PM exited with {proc.returncode}")
        try:
            c = await Connection.open(address)
            await c.ping()
            return c
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process: insensitive to other load on the machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def timed(fn: Callable[[], Awaitable[object]], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def list_ranges(conn: Connection, owners: tuple[m.RangeOwner, ...]) -> int:
    frames = await conn.request(Opcode.LIST_RANGES, m.ListRangesRequest(items=owners).encode(),
                                timeout_s=CALL_TIMEOUT_S)
    return sum(len(it.ranges) for f in frames for it in m.ListRangesResponse.decode(f.header).items)


@dataclass
class RunResult:
    create_per_s: float
    pm_cpu_ms_per_1000: float
    rss_mib: float
    synced: int
    latency_ms: dict[str, list[float]] = field(default_factory=dict)
    node_ranges: int = 0


async def one_run(streams: int, samples: int, measure: bool) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="bench-pm-") as tmp:
        proc, address = start_pm(Path(tmp))
        nodes: list[FakeNode] = []
        conn: Connection | None = None
        try:
            conn = await wait_ready(proc, address)
            nodes = [await FakeNode(address).start() for _ in range(NODES)]
            ids: list[int] = []
            cpu0 = cpu_s(proc.pid)
            t0 = time.perf_counter()
            while len(ids) < streams:
                n = min(BATCH, streams - len(ids))
                r = await call(conn, m.CreateStreamsRequest(items=tuple(
                    m.CreateStreamItem(1, 86_400_000) for _ in range(n))), m.CreateStreamsResponse)
                for it in r.items:
                    if not it.status.ok or it.stream is None:
                        raise RuntimeError(f"create failed: {it.status}")
                    ids.append(it.stream.stream_id)
            elapsed = time.perf_counter() - t0
            out = RunResult(
                create_per_s=streams / elapsed,
                pm_cpu_ms_per_1000=(cpu_s(proc.pid) - cpu0) * 1000 / (streams / BATCH),
                rss_mib=rss_mib(proc.pid),
                synced=sum(dn.synced for dn in nodes),
            )
            if measure:
                await measure_latencies(conn, ids, nodes[0].node_id, samples, out)
            return out
        finally:
            for dn in nodes:
                await dn.close()
            if conn is not None:
                await conn.aclose()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


async def measure_latencies(
    conn: Connection, ids: list[int], node_id: int, samples: int, out: RunResult
) -> None:
    rnd = random.Random(1)
    one = (m.StreamOwner(rnd.choice(ids)),)
    thousand = tuple(m.StreamOwner(i) for i in rnd.sample(ids, min(1000, len(ids))))
    node_owner = (m.DataNode(node_id, ""),)
    out.node_ranges = await list_ranges(conn, node_owner)
    mid = ids[len(ids) // 2]
    some_ids = tuple(rnd.sample(ids, min(1000, len(ids))))
    lat = out.latency_ms
    lat["LIST_RANGES 1 stream"] = await timed(lambda: list_ranges(conn, one), samples)
    lat["LIST_RANGES 1,000 streams"] = await timed(lambda: list_ranges(conn, thousand), samples)
    lat[f"LIST_RANGES 1 node ({out.node_ranges} ranges)"] = await timed(
        lambda: list_ranges(conn, node_owner), samples)
    lat["DESCRIBE_STREAMS 1,000 ids"] = await timed(lambda: call(
        conn, m.DescribeStreamsRequest(stream_ids=some_ids), m.DescribeStreamsResponse), samples)
    lat["DESCRIBE_STREAMS page of 1,000"] = await timed(lambda: call(
        conn, m.DescribeStreamsRequest(limit=1000, continuation=mid), m.DescribeStreamsResponse),
        samples)


def start_datanode(directory: Path, pm: str) -> subprocess.Popen[bytes]:
    log = open(directory / "dn.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbpstream.datanode", "--dir", str(directory / "dn"), "--pm", pm,
         "--port", str(DN_PORT[0]), "--log-level", "INFO"],
        stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    return proc


DN_PORT = [0]


async def restart_run(streams: int, samples: int) -> None:
    print(f"bench_pm --restart: {streams} streams at R=1 on one data node "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        d = Path(tmp)
        pm, address = start_pm(d)
        DN_PORT[0] = free_port()
        dn = start_datanode(d, address)
        conn = await wait_ready(pm, address)
        node_addr = f"127.0.0.1:{DN_PORT[0]}"
        try:
            await (await wait_ready(dn, node_addr)).aclose()
            ids: list[int] = []
            t0 = time.perf_counter()
            while len(ids) < streams:
                n = min(BATCH, streams - len(ids))
                r = await call(conn, m.CreateStreamsRequest(items=tuple(
                    m.CreateStreamItem(1, 86_400_000) for _ in range(n))), m.CreateStreamsResponse)
                ids += [it.stream.stream_id for it in r.items if it.stream is not None]
            print(f"  created {len(ids)} streams in {time.perf_counter() - t0:.1f} s")
            node_id = int((d / "dn" / "node_id").read_text().split(":")[1].strip(" }"))
            owner = (m.DataNode(node_id, ""),)
            for _ in range(samples):
                t0, pm0, me0 = time.perf_counter(), cpu_s(pm.pid), time.process_time()
                frames = await conn.request(Opcode.LIST_RANGES,
                                            m.ListRangesRequest(items=owner).encode(),
                                            timeout_s=CALL_TIMEOUT_S)
                t1, pm1, me1 = time.perf_counter(), cpu_s(pm.pid), time.process_time()
                n = sum(len(it.ranges) for f in frames
                        for it in m.ListRangesResponse.decode(f.header).items)
                print(f"  LIST_RANGES of the node: {n} ranges, {len(frames)} frames received "
                      f"in {t1 - t0:.2f} s (PM CPU {pm1 - pm0:.2f} s, receiver CPU "
                      f"{me1 - me0:.2f} s), decoded in {time.perf_counter() - t1:.2f} s "
                      f"(CPU {time.process_time() - me1:.2f} s; load average "
                      f"{os.getloadavg()[0]:.1f})")
            dn.terminate()
            dn.wait(120)
            t0 = time.perf_counter()
            dn = start_datanode(d, address)
            ping = await wait_ready(dn, node_addr)
            t_ping = time.perf_counter() - t0
            sid = random.Random(1).choice(ids)
            body = build_batch([Record(value=b"x" * 100)])
            req = m.AppendRequest(timeout_ms=30_000, items=(m.AppendItem(
                stream_id=sid, request_index=0, batch_length=len(body)),))
            refused: list[int] = []
            while True:  # as a client does: retry a refused append (RANGE_NOT_FOUND, ...)
                f = await ping.request_one(Opcode.APPEND, req.encode(), body, timeout_s=60)
                status = m.AppendResponse.decode(f.header).items[0].status
                if status.ok:
                    break
                refused.append(status.code)
                await asyncio.sleep(0.1)
            t_append = time.perf_counter() - t0
            await ping.aclose()
            while (d / "dn.log").read_text().count("event=reconciled") < 2:
                await asyncio.sleep(0.1)
            t_rec = time.perf_counter() - t0
            line = [x for x in (d / "dn.log").read_text().splitlines()
                    if "event=reconciled" in x][-1]
            print(f"  restart: answers PING after {t_ping:.2f} s, first APPEND acknowledged "
                  f"after {t_append:.2f} s (refused before: {refused}), reconciled after "
                  f"{t_rec:.2f} s ({line.split('event=reconciled ')[1]})")
        finally:
            await conn.aclose()
            for p in (dn, pm):
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


async def main_async(streams: int, runs: int, samples: int) -> None:
    print(f"bench_pm: {streams} streams in batches of {BATCH}, {NODES} fake data nodes, "
          f"{runs} runs (python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    results: list[RunResult] = []
    for i in range(runs):
        res = await one_run(streams, samples, measure=(i == runs - 1))
        print(f"  run {i + 1}: {res.create_per_s:.0f} streams/s, PM CPU "
              f"{res.pm_cpu_ms_per_1000:.1f} ms per 1,000, rss {res.rss_mib:.1f} MiB, "
              f"synced {res.synced}")
        results.append(res)
    rate = median_spread([r.create_per_s for r in results])
    cpu = median_spread([r.pm_cpu_ms_per_1000 for r in results])
    rss = median_spread([r.rss_mib for r in results])
    print(f"CREATE_STREAMS {rate[0]:10.0f} streams/s [{rate[1]:.0f}..{rate[2]:.0f}]")
    print(f"PM CPU per 1,000 creates {cpu[0]:10.1f} ms [{cpu[1]:.1f}..{cpu[2]:.1f}]")
    print(f"PM RSS at {streams} streams {rss[0]:10.1f} MiB [{rss[1]:.1f}..{rss[2]:.1f}]")
    print(f"latency, ms: median [min..max] of {samples} (load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)")
    for name, values in results[-1].latency_ms.items():
        print(f"  {name:34s} {fmt_ms(values)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--samples", type=int, default=5, help="latency samples per figure")
    p.add_argument("--restart", action="store_true", help="the data node restart figures")
    a = p.parse_args()
    if a.restart:
        run(restart_run(a.streams, a.samples))
    else:
        run(main_async(a.streams, a.runs, a.samples))


if __name__ == "__main__":
    main()
