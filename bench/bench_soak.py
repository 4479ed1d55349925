"""Crash soak: SIGKILL data nodes and the PM under load, then account for every record.

A local cluster (a PM on SQLite and ``--datanodes`` data nodes) serves ``--streams`` streams at
``--replicas``; one idempotent producer appends small records (each value names its stream and
sequence) as fast as it can. Meanwhile ``--cycles`` times a random victim (the PM with
probability ``--pm-share``, else a random data node) is killed with SIGKILL, left down for a
moment, and restarted; the next kill waits until it is back. Then the producer flushes, every
stream is read back from its start, and ``sbpstream check`` runs until the cluster is clean (the
replicas converge; bounded by ``--converge-s``). Prints, as JSON and as one line:

- acked: records acknowledged; lost: acknowledged records not read back at their offset;
- duplicates: values read more than once; failed: sends that failed (a future raised);
- check_problems: problems ``sbpstream check`` still reported at the end (0: converged).

Run: ``python -m bench.bench_soak --cycles 100 --replicas 2`` (and ``--replicas 3``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sbpstream.client.aclient import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import SbpError
from sbpstream.tools.check import check_cluster


@dataclass
class SoakResult:
    cycles: int
    replicas: int
    streams: int
    dn_kills: int = 0
    pm_kills: int = 0
    acked: int = 0
    lost: int = 0
    duplicates: int = 0
    failed: int = 0
    check_problems: int = -1
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # a few failed sends / problems, for reading


async def _produce(client: AsyncClient, stream_ids: list[int], stop: asyncio.Event,
                   acked: dict[int, dict[int, bytes]], res: SoakResult) -> None:
    producer = client.producer(linger_ms=2, primary_retry_ms=5_000)
    pending: set[asyncio.Future[int]] = set()

    def done(sid: int, value: bytes) -> Callable[[asyncio.Future[int]], None]:
        def cb(f: asyncio.Future[int]) -> None:
            pending.discard(f)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                acked[sid][f.result()] = value
            else:
                res.failed += 1
                if len(res.errors) < 10:
                    res.errors.append(f"send failed: {exc!r}")
        return cb

    seq = 0
    async with producer:
        while not stop.is_set():
            for sid in stream_ids:
                value = f"{sid}:{seq}".encode()
                fut = await producer.send(sid, value)
                fut.add_done_callback(done(sid, value))
                pending.add(fut)
            seq += 1
            if len(pending) > 20_000:
                await asyncio.sleep(0.01)
            elif seq % 50 == 0:
                await asyncio.sleep(0)
        await producer.flush()
    if pending:
        await asyncio.wait(pending)


async def _kill_loop(cluster: LocalCluster, res: SoakResult, rng: random.Random,
                     pm_share: float) -> None:
    for _ in range(res.cycles):
        await asyncio.sleep(rng.uniform(0.3, 1.2))
        if rng.random() < pm_share:
            node = cluster.pm
            res.pm_kills += 1
        else:
            node = rng.choice(cluster.datanodes)
            res.dn_kills += 1
        await asyncio.to_thread(node.kill)
        await asyncio.sleep(rng.uniform(0.1, 2.0))
        await asyncio.to_thread(node.start)
        await asyncio.to_thread(node.wait_ready)


async def _read_back(client: AsyncClient, stream_ids: list[int],
                     acked: dict[int, dict[int, bytes]], res: SoakResult) -> None:
    for sid in stream_ids:
        end = await client.end_offset(sid)
        seen: dict[int, bytes] = {}
        consumer = client.consumer(sid, "earliest", end=end)
        async for rec in consumer:
            seen[rec.offset] = rec.value or b""
        await consumer.close()
        counts = Counter(seen.values())
        res.duplicates += sum(n - 1 for n in counts.values() if n > 1)
        for off, value in acked[sid].items():
            if seen.get(off) != value:
                res.lost += 1
                if len(res.errors) < 10:
                    res.errors.append(f"lost: stream {sid} offset {off} {value!r} read "
                                      f"{seen.get(off)!r}")


PHASE_BOUND_S = float(os.environ.get("SBP_SOAK_PHASE_BOUND_S", "300"))
"""A hang guard on the flush and on the read-back (far above their expected time)."""


async def _bounded(work: Awaitable[None], what: str) -> None:
    """Await ``work``; past PHASE_BOUND_S print every task's stack (where it hangs) and fail."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=PHASE_BOUND_S)
    if not done:
        for t in asyncio.all_tasks():
            t.print_stack(file=sys.stderr)
        task.cancel()
        raise RuntimeError(f"{what} did not finish within {PHASE_BOUND_S:.0f}s")
    task.result()


async def soak(directory: Path, *, cycles: int, replicas: int, streams: int = 4,
               datanodes: int = 3, seed: int = 1, pm_share: float = 0.4,
               converge_s: float = 90.0, fsync: str = "none") -> SoakResult:
    res = SoakResult(cycles=cycles, replicas=replicas, streams=streams)
    rng = random.Random(seed)
    t0 = time.monotonic()
    cluster = LocalCluster(directory, datanodes=datanodes, heartbeat_interval_ms=200,
                           node_timeout_ms=1500, fsync=fsync)
    await asyncio.to_thread(cluster.start)
    try:
        async with AsyncClient(cluster.pm_address, retry_deadline_ms=120_000,
                               request_timeout_ms=5_000) as client:
            ids = await client.create_streams(streams, replica_nums=replicas)
            acked: dict[int, dict[int, bytes]] = {sid: {} for sid in ids}
            stop = asyncio.Event()
            producing = asyncio.create_task(_produce(client, ids, stop, acked, res))
            try:
                await _kill_loop(cluster, res, rng, pm_share)
            finally:
                stop.set()
                await _bounded(producing, "the producer's flush")
            res.acked = sum(len(a) for a in acked.values())
            await _bounded(_read_back(client, ids, acked, res), "the read-back")
            deadline = time.monotonic() + converge_s
            while True:
                try:
                    report = await check_cluster(client)
                    res.check_problems = len(report.problems)
                except SbpError as exc:
                    report = None
                    res.check_problems = -1
                    last = str(exc)
                if report is not None and report.ok:
                    break
                if time.monotonic() > deadline:
                    res.errors.extend(str(p) for p in (report.problems if report else [])[:10])
                    if report is None:
                        res.errors.append(f"check failed: {last}")
                    break
                await asyncio.sleep(1.0)
    finally:
        await asyncio.to_thread(cluster.stop)
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--datanodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pm-share", type=float, default=0.4)
    ap.add_argument("--converge-s", type=float, default=90.0)
    ap.add_argument("--fsync", default="none", help="the data nodes' policy (SIGKILL of a "
                    "process loses no page cache, so 'none' is as safe here and faster)")
    ap.add_argument("--dir", type=Path, default=None, help="keep the cluster's files here")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    a = ap.parse_args(argv)
    tmp = a.dir or Path(tempfile.mkdtemp(prefix="sbp-soak-"))
    try:
        res = asyncio.run(soak(tmp, cycles=a.cycles, replicas=a.replicas, streams=a.streams,
                               datanodes=a.datanodes, seed=a.seed, pm_share=a.pm_share,
                               converge_s=a.converge_s, fsync=a.fsync))
    finally:
        if a.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(asdict(res)))
    if not a.json:
        print(f"soak R={res.replicas}: {res.cycles} kill cycles ({res.dn_kills} data node, "
              f"{res.pm_kills} PM) in {res.seconds}s: acked={res.acked} lost={res.lost} "
              f"duplicates={res.duplicates} failed={res.failed} "
              f"check_problems={res.check_problems}")


if __name__ == "__main__":
    main()
