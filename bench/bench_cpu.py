"""CPU microseconds per record in each process: producer, data node, consumer, PM (issue 34).

A PM and one data node (``--fsync``, default ``always``) run as their own processes
(:class:`LocalCluster`); the producer and the consumer each run in a process of their own
(``--role``, on uvloop like the servers). For each record size (100 B, 1 KiB) and each mode:

- **append single**: the async SDK's per-record ``await p.send(sid, value)`` (linger 5 ms), then
  ``flush``; **append batched**: ``send_whole`` of pre-built :class:`Record` lists of
  ``BATCH_RECORDS`` records (one batch each; the lists are built before the clock starts).
- **read single**: ``async for rec in consumer`` from the earliest offset (a subscription: the
  data node pushes); **read batched**: ``poll_columns`` (the columnar bulk path) until all are read.

CPU time: the producer and consumer measure their own (``time.process_time``, user + system,
every thread, from opening the client to closing it: imports and interpreter start-up are not
counted); the data node's and PM's come from ``/proc/PID/task/*/schedstat`` (on-CPU ns of each
live thread, the data node's fsync thread included; /proc/PID/stat's 10 ms ticks were 0.2 us per
record at 50,000 records, too coarse) before and after each phase, so their idle work
(heartbeats) during the phase is counted too. Each figure is the median of ``--runs`` runs with
min..max.

    .venv/bin/python -m bench.bench_cpu [--records 100000] [--runs 3] [--fsync always]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from bench.common import median_spread
from sbpstream.client import AsyncClient
from sbpstream.client.types import Record
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run as run_on_uvloop

BATCH_RECORDS: Final = 1000
"""Records per ``send_whole`` call in the batched append (100 KiB of 100 B records, 1 MiB of
1 KiB ones: well inside one batch)."""

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second of /proc/PID/stat's utime and stime."""

ROLE_TIMEOUT_S: Final = 600.0
"""A producer or consumer phase that takes longer has hung: the run fails instead."""


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``: the on-CPU nanoseconds of its live threads
    (/proc/PID/task/*/schedstat; a thread that ended is not counted, the servers' are
    long-lived), else utime + stime of /proc/PID/stat (10 ms ticks) without schedstat."""
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread ending meanwhile
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except (FileNotFoundError, PermissionError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": field 3 is fields[0]
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


# ------------------------------------------------------------------------------ roles

async def _produce(pm: str, sid: int, records: int, size: int, mode: str) -> float:
    value = b"v" * size
    prebuilt = ([Record(value=value) for _ in range(min(BATCH_RECORDS, records))]
                if mode == "batched" else [])
    t0 = time.process_time()
    async with AsyncClient(pm) as c, c.producer(linger_ms=5) as p:
        if mode == "single":
            for _ in range(records):
                await p.send(sid, value)
        else:
            futures = []
            for i in range(0, records, BATCH_RECORDS):
                chunk = prebuilt[:min(BATCH_RECORDS, records - i)]
                futures.append(await p.send_whole(sid, chunk))
        await p.flush()
    return time.process_time() - t0


async def _consume(pm: str, sid: int, records: int, mode: str) -> float:
    t0 = time.process_time()
    n = 0
    async with AsyncClient(pm) as c:
        cons = c.consumer(sid, "earliest")
        async with asyncio.timeout(ROLE_TIMEOUT_S):
            if mode == "single":
                async for _ in cons:
                    n += 1
                    if n >= records:
                        break
            else:
                while n < records:
                    n += len(await cons.poll_columns(timeout_ms=1000))
        await cons.close()
    took = time.process_time() - t0
    if n != records:
        raise RuntimeError(f"read {n} records, expected {records}")
    return took


# ------------------------------------------------------------------------------ orchestration

def _phase(cl: LocalCluster, cmd: list[str]) -> dict[str, float]:
    """Run one role process; the CPU seconds of every process over it."""
    pids = {"datanode": cl.datanodes[0].proc.pid, "pm": cl.pm.proc.pid}  # type: ignore[union-attr]
    before = {k: proc_cpu_s(p) for k, p in pids.items()}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         timeout=ROLE_TIMEOUT_S).stdout
    got = {k: proc_cpu_s(p) - before[k] for k, p in pids.items()}
    got["client"] = json.loads(out.strip().splitlines()[-1])["cpu_s"]
    return got


def one_run(cl: LocalCluster, records: int, size: int, mode: str) -> dict[str, float]:
    """Append then read ``records`` records: CPU us per record of each process in each phase."""
    async def mk() -> int:
        async with AsyncClient(cl.pm_address) as c:
            return await c.create_stream()

    sid = asyncio.run(mk())
    me = [sys.executable, "-m", "bench.bench_cpu", "--pm", cl.pm_address, "--stream", str(sid),
          "--records", str(records), "--size", str(size), "--mode", mode]
    ap = _phase(cl, [*me, "--role", "producer"])
    rd = _phase(cl, [*me, "--role", "consumer"])
    us = 1e6 / records
    return {"append producer": ap["client"] * us, "append datanode": ap["datanode"] * us,
            "append pm": ap["pm"] * us, "read consumer": rd["client"] * us,
            "read datanode": rd["datanode"] * us, "read pm": rd["pm"] * us}


def _fmt(values: list[float]) -> str:
    m, lo, hi = median_spread(values)
    return f"{m:.2f} [{lo:.2f}..{hi:.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--sizes", default="100,1024")
    ap.add_argument("--modes", default="single,batched")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fsync", default="always")
    ap.add_argument("--role", choices=("producer", "consumer"))
    ap.add_argument("--pm")
    ap.add_argument("--stream", type=int)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--mode", default="single", choices=("single", "batched"))
    a = ap.parse_args()
    if a.role == "producer":
        cpu = run_on_uvloop(_produce(a.pm, a.stream, a.records, a.size, a.mode))
        print(json.dumps({"cpu_s": cpu}), flush=True)
        return 0
    if a.role == "consumer":
        cpu = run_on_uvloop(_consume(a.pm, a.stream, a.records, a.mode))
        print(json.dumps({"cpu_s": cpu}), flush=True)
        return 0
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs", flush=True)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as d, \
            LocalCluster(Path(d), datanodes=1, fsync=a.fsync) as cl:
        for size in (int(x) for x in a.sizes.split(",")):
            for mode in a.modes.split(","):
                runs = [one_run(cl, a.records, size, mode) for _ in range(a.runs)]
                row: dict[str, object] = {"size": size, "mode": mode, "records": a.records}
                for key in runs[0]:
                    row[key] = [r[key] for r in runs]
                rows.append(row)
                print(f"size={size:5d} {mode:8s} CPU us/record: " + "  ".join(
                    f"{key} {_fmt([r[key] for r in runs])}" for key in runs[0]), flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
