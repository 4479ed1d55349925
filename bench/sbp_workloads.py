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
from typing import Any

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
READ_CONCURRENCY = 1000  # consumers polling at once in the many-stream catch-up
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
        ids, done = handle  # type: ignore[misc]
        n = len(ids)
        ends = [done // n + (1 if j < done % n else 0) for j in range(n)]
        got = nbytes = 0
        sem = asyncio.Semaphore(READ_CONCURRENCY)
        async with self._client() as c:
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s

            async def read_one(sid: int, end: int) -> None:
                nonlocal got, nbytes
                async with sem:
                    consumer = c.consumer(sid, 0, end=end)
                    try:
                        while not consumer.at_end and time.perf_counter() < deadline:
                            for rec in await consumer.poll():  # application code sees each record
                                nbytes += len(rec.value)
                                got += 1
                    finally:
                        await consumer.close()

            await asyncio.gather(*(read_one(s, e) for s, e in zip(ids, ends, strict=True) if e))
            seconds = time.perf_counter() - t0
        return Throughput(got, nbytes, seconds, got < done)

    async def drop(self, handle: object) -> None:
        ids, _ = handle  # type: ignore[misc]
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
