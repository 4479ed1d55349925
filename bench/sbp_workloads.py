"""The sbpstream side of the benchmark: a local cluster and the workloads through the public SDK.

One :class:`SbpCluster` (PM + data nodes, ``--fsync always``) serves two systems in the same run:
streams created with ``replica_nums=1`` and ``replica_nums=3``. Appends go through
``AsyncClient.producer()`` (batching, idempotent; every record's future resolves to its offset
once the primary has fsynced it, and with 3 replicas once every replica holds it); catch-up reads
through ``AsyncClient.consumer(...).poll()`` (records handed to application code as
``ConsumedRecord``); the latency workload follows the stream with a long-polling consumer.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

from bench.peers import (
    AppendSpec,
    Latency,
    LatencySpec,
    Schedule,
    Throughput,
    index_of,
    payload_of,
    stamped,
)

CREATE_CHUNK = 1000  # streams per CREATE_STREAMS request
CONSUMER_MAX_WAIT_MS = 500  # long-poll bound of the latency consumer
LATENCY_LINGER_MS = 0.0  # the latency workload sends each record at once, as the peers do
THROUGHPUT_LINGER_MS = 5.0  # the SDK's default


class SbpCluster:
    """A LocalCluster with ``datanodes`` data nodes fsyncing every append (group commit)."""

    def __init__(self, directory: Path, datanodes: int = 3) -> None:
        from sbpstream.cluster import LocalCluster

        self.directory = directory
        self.cluster = LocalCluster(directory, datanodes=datanodes, fsync="always")
        self.datanodes = datanodes

    @property
    def pm_address(self) -> str:
        return str(self.cluster.pm_address)

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        self.cluster.stop()

    def pids(self) -> dict[str, int]:
        """Process ids of the PM and data nodes (for profilers)."""
        out: dict[str, int] = {}
        for node in [self.cluster.pm, *self.cluster.datanodes]:
            if node.proc is not None:
                out[node.name] = node.proc.pid
        return out


def sbp_version() -> str:
    try:
        import sbpstream

        return str(getattr(sbpstream, "__version__", "dev"))
    except ImportError:
        return "unavailable"


class SbpSystem:
    acks = (
        "--fsync always: a record's future resolves after the primary's group commit "
        "(pwrite, then one fdatasync covering every append written before it) and, with "
        "replica_nums 3, after every replica holds it"
    )

    def __init__(self, cluster: SbpCluster, replica_nums: int) -> None:
        self.cluster = cluster
        self.replica_nums = replica_nums
        self.name = f"sbpstream r{replica_nums}"

    def _client(self) -> Any:
        from sbpstream.client import AsyncClient

        return AsyncClient(self.cluster.pm_address)

    async def _create(self, client: Any, count: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < count:
            n = min(CREATE_CHUNK, count - len(ids))
            ids += await client.create_streams(n, replica_nums=self.replica_nums)
        return ids

    async def probe(self) -> None:
        """Create and delete one stream: raises when this replica_nums is not served."""
        async with self._client() as c:
            (sid,) = await self._create(c, 1)
            await c.delete_streams([sid])

    async def append(self, spec: AppendSpec, payload: bytes) -> tuple[Throughput, object]:
        async with self._client() as c:
            ids = await self._create(c, spec.streams)
            futures: list[asyncio.Future[int]] = []
            p = c.producer(linger_ms=THROUGHPUT_LINGER_MS)
            try:
                t0 = time.perf_counter()
                deadline = t0 + spec.time_cap_s
                n = spec.streams
                for i in range(spec.records):
                    if i % 1000 == 0 and time.perf_counter() > deadline:
                        break
                    futures.append(await p.send(ids[i % n], payload))
                await p.flush()
                seconds = time.perf_counter() - t0
            finally:
                await p.close()
        acked = sum(1 for f in futures if f.done() and f.exception() is None)
        if acked < len(futures):
            first = next(f.exception() for f in futures if f.done() and f.exception())
            raise RuntimeError(f"{len(futures) - acked} of {len(futures)} appends failed: {first}")
        tp = Throughput(acked, acked * len(payload), seconds, acked < spec.records)
        return tp, (ids, acked)

    async def catch_up(self, handle: object, spec: AppendSpec) -> Throughput:
        ids, done = cast(tuple[list[int], int], handle)
        n = len(ids)
        ends = [done // n + (1 if j < done % n else 0) for j in range(n)]
        got = nbytes = 0
        async with self._client() as c:
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s

            async def read_one(sid: int, end: int) -> None:
                nonlocal got, nbytes
                consumer = c.consumer(sid, 0, end=end)
                try:
                    while not consumer.at_end and time.perf_counter() < deadline:
                        for rec in await consumer.poll():  # application code sees each record
                            nbytes += len(rec.value)
                            got += 1
                finally:
                    await consumer.close()

            if n == 1:
                await read_one(ids[0], ends[0])
            else:  # one consumer over every stream: the SDK's way to read many (a subscription
                # per data node, streams added to it), as Redis pipelines XRANGE over the keys;
                # read a list of records per poll() as with one stream (and as XRANGE returns
                # a list): `async for` costs ~1 us more per record in the application
                consumer = c.consumer(ids, 0)
                try:
                    async with asyncio.timeout(spec.time_cap_s):
                        while got < done:
                            for rec in await consumer.poll():  # application code sees each
                                nbytes += len(rec.value or b"")
                                got += 1
                except TimeoutError:
                    pass  # capped: reported through got < done
                finally:
                    await consumer.close()
            seconds = time.perf_counter() - t0
        return Throughput(got, nbytes, seconds, got < done)

    async def drop(self, handle: object) -> None:
        ids, _ = cast(tuple[list[int], int], handle)
        async with self._client() as c:
            for i in range(0, len(ids), CREATE_CHUNK):
                await c.delete_streams(ids[i : i + CREATE_CHUNK])

    async def latency(self, spec: LatencySpec) -> Latency:
        pad = payload_of(spec.record_bytes)
        out = Latency(0, 0)
        async with self._client() as c:
            (sid,) = await self._create(c, 1)
            schedule = Schedule(spec.rate_per_s)
            stop_at = time.perf_counter() + spec.time_cap_s
            sending = True

            async def consume() -> None:
                consumer = c.consumer(sid, 0, max_wait_ms=CONSUMER_MAX_WAIT_MS)
                try:
                    while sending or out.received < out.sent:
                        if time.perf_counter() > stop_at + 1.0:
                            out.capped = True
                            return
                        recs = await consumer.poll()
                        now = time.perf_counter()
                        for rec in recs:
                            due = schedule.due(index_of(rec.value))
                            out.latencies_ms.append((now - due) * 1000)
                        out.received += len(recs)
                finally:
                    await consumer.close()

            reader = asyncio.create_task(consume())
            p = c.producer(linger_ms=LATENCY_LINGER_MS)
            try:
                async for i in schedule.aindices(spec.records, stop_at):
                    await p.send(sid, stamped(i, spec.record_bytes, pad))
                    out.sent += 1
                await p.flush()
            finally:
                sending = False
                await p.close()
            await reader
            await c.delete_streams([sid])
        return out


# ------------------------------------------------------------------------------ profiling

PROFILE_RATE_HZ = 100
PROFILE_TOP = 20


def summarize_raw(path: Path, top: int = PROFILE_TOP) -> tuple[int, list[str]]:
    """Top frames (self and inclusive) of a py-spy ``--format raw`` file: (samples, lines)."""
    import collections
    import re

    self_c: collections.Counter[str] = collections.Counter()
    incl_c: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")
                  if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl_c[f] += n
    out = [f"{total} samples (threads not idle)", "self (the frame itself is on CPU):"]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in self_c.most_common(top)]
    out += ["inclusive (the frame is on the stack):"]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in incl_c.most_common(top)]
    return total, out


async def _profiled(
    name: str, pids: dict[str, int], out_dir: Path, body: Any, seconds: float
) -> list[str]:
    """Run ``body()`` repeatedly for ``seconds`` while py-spy records every process in pids."""
    import shutil
    import signal
    import subprocess
    import sys

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for pname, pid in pids.items():
        raw = out_dir / f"{name}-{pname}.raw"
        procs[pname] = (
            subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(raw),
                 "--rate", str(PROFILE_RATE_HZ), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ),
            raw,
        )
    await asyncio.sleep(1.0)  # py-spy attaches
    t0 = time.perf_counter()
    rounds = 0
    figures: list[str] = []
    try:
        while time.perf_counter() - t0 < seconds:
            figures.append(str(await body()))
            rounds += 1
    finally:
        wall = time.perf_counter() - t0
        for p, _ in procs.values():
            p.send_signal(signal.SIGINT)
        for p, _ in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    lines = [f"# {name}: {rounds} rounds in {wall:.1f} s, py-spy at {PROFILE_RATE_HZ} Hz"]
    lines += [f"# round figures: {'; '.join(figures)}"]
    for pname, (_, raw) in procs.items():
        if not raw.exists():
            lines.append(f"## {pname}: no profile written")
            continue
        total, summary = summarize_raw(raw)
        busy = total / (wall * PROFILE_RATE_HZ) if wall else 0.0
        if total < 0.02 * wall * PROFILE_RATE_HZ:  # an idle process: not worth the lines
            lines.append(f"## {pname}: idle ({total} samples)")
            raw.unlink()
            continue
        lines.append(f"## {pname}: ~{100 * busy:.0f}% of one core busy in Python threads")
        lines += summary
        raw.unlink()
    return lines


PROFILE_WORKLOADS = (AppendSpec(1024, 1, 100_000, 30.0), AppendSpec(100, 1000, 100_000, 30.0))


async def profile_main(out_dir: Path, seconds: float, datanodes: int) -> None:
    """Profile the append and catch-up of each PROFILE_WORKLOADS spec, client and servers."""
    import os
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sbpbench-prof-") as d:
        cluster = SbpCluster(Path(d), datanodes=datanodes)
        cluster.start()
        try:
            system = SbpSystem(cluster, 1)
            pids = {**cluster.pids(), "client": os.getpid()}
            for spec in PROFILE_WORKLOADS:
                payload = payload_of(spec.record_bytes)
                handles: list[object] = []
                tag = spec.label.replace(" ", "")

                async def append_round(spec: AppendSpec = spec, payload: bytes = payload,
                                       handles: list[object] = handles) -> str:
                    tp, h = await system.append(spec, payload)
                    handles.append(h)
                    return f"{tp.mb_s:.1f} MB/s"

                report += await _profiled(f"append-{tag}", pids, out_dir, append_round, seconds)

                async def read_round(spec: AppendSpec = spec,
                                     handles: list[object] = handles) -> str:
                    tp = await system.catch_up(handles[-1], spec)
                    return f"{tp.mb_s:.1f} MB/s"

                report += await _profiled(f"catchup-{tag}", pids, out_dir, read_round, seconds)
                for h in handles:
                    await system.drop(h)
        finally:
            cluster.stop()
    stamp = time.strftime("%Y-%m-%d")
    path = out_dir / f"{stamp}-profile.txt"
    path.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    import argparse

    from sbpstream.net.loop import run

    ap = argparse.ArgumentParser(
        prog="python -m bench.sbp_workloads",
        description="profile sbpstream's append and catch-up hot paths with py-spy",
    )
    ap.add_argument("--profile", action="store_true", required=True)
    ap.add_argument("--out", type=Path, default=Path("bench/results/profiles"))
    ap.add_argument("--seconds", type=float, default=15.0, help="profiled time per workload")
    ap.add_argument("--datanodes", type=int, default=1)
    a = ap.parse_args()
    run(profile_main(a.out, a.seconds, a.datanodes))
