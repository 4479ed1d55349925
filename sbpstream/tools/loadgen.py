"""Load generation through the SDK: what ``sbpstream bench`` and ``bench/bench_sdk.py`` drive.

:func:`produce_load` appends ``records`` records of ``size`` bytes round-robin over streams and
measures each record's latency (from ``send`` to its acknowledgement); :func:`consume_load` reads
them back with one consumer per stream, checking counts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sbpstream.client.aclient import AsyncClient
from sbpstream.client.types import Compression

Progress = Callable[[int], None]  # called with the number of records just completed


@dataclass(slots=True)
class PhaseResult:
    """Throughput and latency of one phase (produce or consume)."""

    records: int
    bytes: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)  # sorted; empty for consume

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def percentile_ms(self, p: float) -> float:
        """Nearest-rank percentile of the latencies (nan when there are none)."""
        lat = self.latencies_ms
        if not lat:
            return float("nan")
        k = min(len(lat) - 1, max(0, round(p / 100 * (len(lat) - 1))))
        return lat[k]


async def produce_load(
    client: AsyncClient,
    stream_ids: Sequence[int],
    records: int,
    size: int,
    *,
    progress: Progress | None = None,
    compression: Compression | None = None,
    linger_ms: float = 5.0,
) -> PhaseResult:
    """Append ``records`` records of ``size`` random bytes round-robin over ``stream_ids``."""
    value = os.urandom(size)
    latencies: list[float] = []
    done = 0
    clock = time.perf_counter
    nstreams = len(stream_ids)

    def acked(sent_at: float) -> Callable[[asyncio.Future[int]], None]:
        def cb(f: asyncio.Future[int]) -> None:
            nonlocal done
            if not f.cancelled() and f.exception() is None:
                latencies.append((clock() - sent_at) * 1000)
            done += 1
            if progress is not None and done % 1000 == 0:
                progress(1000)

        return cb

    t0 = clock()
    async with client.producer(linger_ms=linger_ms, compression=compression) as p:
        futs: list[asyncio.Future[int]] = []
        for i in range(records):
            f = await p.send(stream_ids[i % nstreams], value)
            f.add_done_callback(acked(clock()))
            futs.append(f)
        await p.flush()
    seconds = clock() - t0
    if progress is not None and done % 1000:
        progress(done % 1000)
    for f in futs:
        f.result()  # raise the first failure
    latencies.sort()
    return PhaseResult(records, records * size, seconds, latencies)


async def consume_load(
    client: AsyncClient,
    stream_ids: Sequence[int],
    *,
    progress: Progress | None = None,
) -> PhaseResult:
    """Read every stream from its start to its current end, concurrently (columns path)."""
    t0 = time.perf_counter()
    totals = await asyncio.gather(*(_read_stream(client, s, progress) for s in stream_ids))
    seconds = time.perf_counter() - t0
    return PhaseResult(sum(n for n, _ in totals), sum(b for _, b in totals), seconds)


async def _read_stream(client: AsyncClient, stream_id: int,
                       progress: Progress | None) -> tuple[int, int]:
    end = await client.end_offset(stream_id)
    cons = client.consumer(stream_id, "earliest", end=end)
    n = nbytes = 0
    while not cons.at_end:
        batch = await cons.poll_columns()
        got = len(batch)
        n += got
        nbytes += sum(len(v) for v in batch.columns.values if v is not None)
        if progress is not None and got:
            progress(got)
    return n, nbytes
