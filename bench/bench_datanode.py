"""Data node over loopback against Redis Streams, in one run.

    .venv/bin/python -m bench.bench_datanode [--runs 3] [--quick]

sbpstream: one PM and one data node (``--fsync always``: an APPEND is acknowledged after the
fsync covering it), driven with SBP requests built from pre-built record batches. Redis:
``redis-server --appendonly yes --appendfsync everysec --save ''`` (acknowledged before fsync).

* append MB/s: RECORDS records of RECORD_BYTES over 1 and 1,000 streams, acknowledged;
  sbpstream sends APPEND requests of ~1 MiB (many items) with APPEND_IN_FLIGHT in flight;
  Redis pipelines XADD (bench.peers);
* fetch MB/s: read everything back from offset 0 (catch-up); sbpstream FETCH of all the streams
  at once, batches delivered in frames (record bytes counted from each batch's header); Redis
  pipelined XRANGE pages;
* end-to-end latency at LATENCY_RATE records/s, records due within LATENCY_LINGER_MS in one
  APPEND (a producer's linger.ms), from each record's scheduled send time to its delivery to a
  consumer parked in a long-poll FETCH; Redis: one XADD per record and XREAD BLOCK.

Figures are medians of ``--runs`` runs (min..max beside them); every loop has a time cap.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers import (
    AppendSpec,
    Latency,
    LatencySpec,
    RedisSystem,
    Schedule,
    Throughput,
    index_of,
    payload_of,
    stamped,
)
from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.net.loop import run
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record, build_batch, iter_records, read_header

RECORD_BYTES = 1024
RECORDS = 65_536  # 64 MiB of values per append run
APPEND_REQUEST_BYTES = 1 << 20  # batches per APPEND request, about
APPEND_IN_FLIGHT = 8  # APPEND requests in flight on the connection
FETCH_ITEM_BYTES = 4 << 20  # batch_max_bytes per FETCH item
LATENCY_RATE = 2000  # records/s
LATENCY_SECONDS = 5
# Kafka's producer default since 4.0 (KIP-1030). With 1 ms (2 records per APPEND, 1,000 APPENDs
# and as many FETCH round trips a second) a CPU-starved node queues: see docs/datanode.md.
LATENCY_LINGER_MS = 5
TIME_CAP_S = 60.0
CALL_TIMEOUT_S = 30.0


@dataclass
class Result:
    append_mb_s: float
    fetch_mb_s: float


# ------------------------------------------------------------------------------ sbpstream


async def create_streams(pm: str, n: int) -> list[int]:
    conn = await Connection.open(pm)
    try:
        ids: list[int] = []
        while len(ids) < n:
            k = min(1000, n - len(ids))
            f = await conn.request_one(Opcode.CREATE_STREAMS, CreateStreamsRequest(
                timeout_ms=10_000, items=tuple(CreateStreamItem(replica_nums=1)
                                               for _ in range(k))).encode(),
                timeout_s=CALL_TIMEOUT_S)
            for it in CreateStreamsResponse.decode(f.header).items:
                it.status.raise_for_error()
                assert it.stream is not None
                ids.append(it.stream.stream_id)
        return ids
    finally:
        await conn.aclose()


def prebuild(streams: list[int], records: int) -> list[list[tuple[int, bytes]]]:
    """APPEND requests of ~1 MiB: each stream's records cut into batches, round robin."""
    per_stream = records // len(streams)
    per_batch = max(1, min(per_stream, APPEND_REQUEST_BYTES // RECORD_BYTES // 8))
    value = payload_of(RECORD_BYTES)
    one = build_batch([Record(value=value)] * per_batch)
    batches = [(sid, one) for _ in range(per_stream // per_batch) for sid in streams]
    requests: list[list[tuple[int, bytes]]] = [[]]
    size = 0
    for sid, b in batches:
        if size + len(b) > APPEND_REQUEST_BYTES and requests[-1]:
            requests.append([])
            size = 0
        requests[-1].append((sid, b))
        size += len(b)
    return requests


async def sbp_append(addr: str, requests: list[list[tuple[int, bytes]]]) -> Throughput:
    conn = await Connection.open(addr)
    sem = asyncio.Semaphore(APPEND_IN_FLIGHT)
    value_bytes = 0
    records = 0
    deadline = time.perf_counter() + TIME_CAP_S

    async def one(items: list[tuple[int, bytes]]) -> None:
        nonlocal value_bytes, records
        try:
            hdr = AppendRequest(timeout_ms=30_000, items=tuple(
                AppendItem(stream_id=sid, request_index=i, batch_length=len(b))
                for i, (sid, b) in enumerate(items))).encode()
            frames = await conn.request(Opcode.APPEND, hdr, [b for _, b in items],
                                        timeout_s=CALL_TIMEOUT_S)
            for f in frames:
                for r in AppendResponse.decode(f.header).items:
                    r.status.raise_for_error()
            n = sum(read_header(b).record_count for _, b in items)
            records += n
            value_bytes += n * RECORD_BYTES
        finally:
            sem.release()

    t0 = time.perf_counter()
    tasks = []
    for items in requests:
        if time.perf_counter() > deadline:
            break
        await sem.acquire()
        tasks.append(asyncio.ensure_future(one(items)))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t0
    await conn.aclose()
    return Throughput(records, value_bytes, seconds)


async def sbp_fetch(addr: str, streams: list[int], expected: int) -> Throughput:
    conn = await Connection.open(addr)
    offsets = dict.fromkeys(streams, 0)
    records = 0
    t0 = time.perf_counter()
    deadline = t0 + TIME_CAP_S
    while offsets and time.perf_counter() < deadline:
        active = list(offsets)[:10_000]
        req = FetchRequest(max_wait_ms=0, min_bytes=0, items=tuple(
            FetchItem(stream_id=sid, request_index=i, fetch_offset=offsets[sid],
                      batch_max_bytes=FETCH_ITEM_BYTES) for i, sid in enumerate(active)))
        rs = await conn.stream(Opcode.FETCH, req.encode(), timeout_s=CALL_TIMEOUT_S)
        got: dict[int, int] = {}
        async for f in rs:
            payload = f.payload
            pos = 0
            for r in FetchResponse.decode(f.header).items:
                if r.batch_length:
                    h = read_header(payload, pos)
                    records += h.record_count
                    got[r.stream_id] = h.base_offset + h.record_count
                    pos += r.batch_length
        for sid in active:
            if sid in got:
                offsets[sid] = got[sid]
            else:
                del offsets[sid]  # nothing more: caught up
    seconds = time.perf_counter() - t0
    await conn.aclose()
    return Throughput(records, records * RECORD_BYTES, seconds, records < expected)


async def sbp_latency(addr: str, sid: int) -> Latency:
    """Records due within one LATENCY_LINGER_MS window share one batch and one APPEND, sent
    when the window closes (a producer with linger.ms); latency is per record, from its due
    time, so the linger counts against sbpstream."""
    total = LATENCY_RATE * LATENCY_SECONDS
    pad = payload_of(RECORD_BYTES)
    schedule = Schedule(LATENCY_RATE)
    ticks: dict[int, list[int]] = {}
    for i in range(total):
        ticks.setdefault(int((schedule.due(i) - schedule.t0) * 1000) // LATENCY_LINGER_MS,
                         []).append(i)
    groups = list(ticks.values())
    batches = [build_batch([Record(value=stamped(i, RECORD_BYTES, pad)) for i in g])
               for g in groups]
    headers = [AppendRequest(timeout_ms=30_000, items=(
        AppendItem(stream_id=sid, request_index=0, batch_length=len(b)),)).encode()
        for b in batches]
    producer = await Connection.open(addr)
    consumer = await Connection.open(addr)
    out = Latency(0, 0)
    stop_at = time.perf_counter() + LATENCY_SECONDS + 20.0

    async def consume() -> None:
        offset = 0
        while out.received < total and time.perf_counter() < stop_at:
            req = FetchRequest(max_wait_ms=500, min_bytes=1, items=(
                FetchItem(stream_id=sid, request_index=0, fetch_offset=offset,
                          batch_max_bytes=1 << 20),))
            rs = await consumer.stream(Opcode.FETCH, req.encode(), timeout_s=CALL_TIMEOUT_S)
            async for f in rs:
                now = time.perf_counter()
                pos = 0
                for r in FetchResponse.decode(f.header).items:
                    if not r.batch_length:
                        continue
                    b = f.payload[pos : pos + r.batch_length]
                    pos += r.batch_length
                    for rec in iter_records(b):
                        if rec.offset >= offset:
                            out.latencies_ms.append(
                                (now - schedule.due(index_of(bytes(rec.value or b"")))) * 1000)
                            out.received += 1
                            offset = rec.offset + 1

    pending: set[asyncio.Task[object]] = set()
    reader = asyncio.ensure_future(consume())
    for g, group in enumerate(groups):
        delay = schedule.due(group[-1]) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() > stop_at:
            break
        t = asyncio.ensure_future(producer.request_one(Opcode.APPEND, headers[g], batches[g],
                                                       timeout_s=CALL_TIMEOUT_S))
        pending.add(t)
        t.add_done_callback(pending.discard)
        out.sent += len(group)
    if pending:
        await asyncio.wait(pending, timeout=CALL_TIMEOUT_S)
    try:
        await asyncio.wait_for(reader, max(1.0, stop_at - time.perf_counter()))
    except TimeoutError:
        out.capped = True
    await producer.aclose()
    await consumer.aclose()
    return out


# ------------------------------------------------------------------------------ runner


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):9.1f} [{min(xs):.1f}..{max(xs):.1f}]"


async def one_run(c: LocalCluster, redis: RedisSystem, records: int,
                  results: dict[str, list[float]]) -> None:
    addr = c.datanodes[0].address
    for n in (1, 1000):
        streams = await create_streams(c.pm_address, n)
        reqs = prebuild(streams, records)
        tp = await sbp_append(addr, reqs)
        fp = await sbp_fetch(addr, streams, tp.records)
        results.setdefault(f"sbp append {n}", []).append(tp.mb_s)
        results.setdefault(f"sbp fetch {n}", []).append(fp.mb_s)
        spec = AppendSpec(RECORD_BYTES, n, records, TIME_CAP_S)
        rtp, handle = await redis.append(spec, payload_of(RECORD_BYTES))
        rfp = await redis.catch_up(handle, spec)
        await redis.drop(handle)
        results.setdefault(f"redis append {n}", []).append(rtp.mb_s)
        results.setdefault(f"redis fetch {n}", []).append(rfp.mb_s)
    (sid,) = await create_streams(c.pm_address, 1)
    lat = await sbp_latency(addr, sid)
    rlat = await redis.latency(LatencySpec(LATENCY_RATE, LATENCY_RATE * LATENCY_SECONDS,
                                           RECORD_BYTES, LATENCY_SECONDS + 20.0))
    for name, la in (("sbp", lat), ("redis", rlat)):
        for p in (50, 99, 99.9):
            results.setdefault(f"{name} latency p{p}", []).append(la.pct(p))
        results.setdefault(f"{name} latency received", []).append(float(la.received))


def report(results: dict[str, list[float]], runs: int) -> None:
    print(f"\nmedians of {runs} runs [min..max]; {RECORD_BYTES} B records; sbpstream --fsync "
          "always (ack after fsync) vs Redis appendfsync everysec (ack before fsync); latency: "
          f"sbpstream producer linger {LATENCY_LINGER_MS} ms, Redis one XADD per record")
    print(f"{'workload':<28}{'sbpstream':>26}{'redis':>26}{'ratio':>8}")
    for n in (1, 1000):
        for w in ("append", "fetch"):
            s, r = results[f"sbp {w} {n}"], results[f"redis {w} {n}"]
            ratio = statistics.median(a / b for a, b in zip(s, r, strict=True) if b)
            print(f"{w + ' MB/s, ' + str(n) + ' stream(s)':<28}{med(s):>26}{med(r):>26}"
                  f"{ratio:>7.2f}x")
    for p in (50, 99, 99.9):
        s, r = results[f"sbp latency p{p}"], results[f"redis latency p{p}"]
        ratio = statistics.median(a / b for a, b in zip(s, r, strict=True) if b)
        print(f"{'latency ms p' + str(p) + f' @{LATENCY_RATE}/s':<28}{med(s):>26}{med(r):>26}"
              f"{ratio:>7.2f}x")
    print(f"{'latency records received':<28}{med(results['sbp latency received']):>26}"
          f"{med(results['redis latency received']):>26}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1/8 of the records, one run")
    a = ap.parse_args()
    runs = 1 if a.quick else a.runs
    records = RECORDS // 8 if a.quick else RECORDS
    with tempfile.TemporaryDirectory(prefix="bench-dn-") as tmp:
        redis = RedisSystem(Path(tmp) / "redis")
        redis.start()
        try:
            with LocalCluster(Path(tmp) / "sbp", datanodes=1, fsync="always") as c:
                results: dict[str, list[float]] = {}
                for i in range(runs):
                    print(f"run {i + 1}/{runs} ...", flush=True)
                    run(one_run(c, redis, records, results))
                report(results, runs)
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
