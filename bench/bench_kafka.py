"""The Kafka gateway against the SDK, in one run: records/s, the ratio to the SDK's fastest
path for the same records, and CPU seconds per record of the gateway and data node processes.

One LocalCluster (``--datanodes`` data nodes, data node ``--fsync`` policy) with the gateway
process (``python -m sbpstream.kafka``, as ``sbpstream up --kafka-port`` runs it). For each
side, ``--records`` records of ``--size`` bytes with an 8-byte key into a fresh 1-partition
topic / stream, then all read back from the start:

- **sdk send_batch**: ``AsyncProducer.send_batch`` of :class:`Record` objects (chunks of 1,000);
- **sdk send_whole**: ``AsyncProducer.send_whole`` of 10,000-record chunks, one batch each (what
  the gateway does with each Kafka batch);
- **sdk iterate**: the subscribing ``AsyncConsumer``, one record at a time;
- **sdk columns**: ``poll_columns`` of a long-polling consumer (the bulk read path);
- **kafka produce**: a confluent-kafka (librdkafka) ``Producer`` through the gateway at its usual
  fast settings (idempotent, ``acks=all``, ``linger.ms=5``, ``batch.num.messages=10000``);
- **kafka consume**: a confluent-kafka ``Consumer`` by assignment with large fetches
  (``max.partition.fetch.bytes`` 8 MiB, ``consume(10000)``).

Each phase is timed from its first record to the last acknowledged (produce) or received
(consume) record; the CPU seconds of the benchmark process (the client: the SDK, or
librdkafka's threads), the gateway and the data node (``/proc/<pid>/stat``) are taken around each
phase, per record. ``--profile DIR`` runs py-spy on the gateway during the first run's Kafka
phases. ``--runs`` repeats; the report gives medians with min-max spreads, and the
gateway/SDK ratio against the faster SDK path of each direction, per run.

    .venv/bin/python -m bench.bench_kafka [--records 200000] [--size 100] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sbpstream.client import AsyncClient, Record
from sbpstream.cluster import LocalCluster

WHOLE_CHUNK = 10_000
"""Records per send_whole call: a 10,000-message Kafka batch's worth."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
PY_SPY = os.environ.get("PY_SPY", "/work/main/.venv/bin/py-spy")
"""The py-spy of --profile."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def records_of(records: int, size: int) -> list[Record]:
    value = b"x" * size
    return [Record(value, b"%08d" % i) for i in range(records)]


async def sdk_send_batch(pm: str, name: str, recs: list[Record]) -> float:
    async with AsyncClient(pm) as c:
        sid = await c.create_stream(name)
        async with c.producer(linger_ms=5) as p:
            t0 = time.perf_counter()
            futs = [await p.send_batch(sid, recs[s:s + 1000]) for s in range(0, len(recs), 1000)]
            await p.flush()
            dt = time.perf_counter() - t0
            for f in futs:
                assert (await f).error is None
    return dt


async def sdk_send_whole(pm: str, name: str, recs: list[Record]) -> float:
    async with AsyncClient(pm) as c:
        sid = await c.create_stream(name)
        async with c.producer(linger_ms=5) as p:
            t0 = time.perf_counter()
            futs = [await p.send_whole(sid, recs[s:s + WHOLE_CHUNK])
                    for s in range(0, len(recs), WHOLE_CHUNK)]
            await p.flush()
            dt = time.perf_counter() - t0
            for f in futs:
                assert (await f).error is None
    return dt


async def sdk_iterate(pm: str, name: str, records: int) -> float:
    async with AsyncClient(pm) as c:
        sid = await c.resolve_stream(name)
        t0 = time.perf_counter()
        n = 0
        cons = c.consumer(sid, "earliest")
        async for _rec in cons:
            n += 1
            if n >= records:
                break
        dt = time.perf_counter() - t0
        await cons.close()
    return dt


async def sdk_columns(pm: str, name: str, records: int) -> float:
    async with AsyncClient(pm) as c:
        sid = await c.resolve_stream(name)
        t0 = time.perf_counter()
        n = 0
        cons = c.consumer(sid, "earliest", subscribe=False, batch_max_bytes=8 * 1024 * 1024)
        while n < records:
            n += len(await cons.poll_columns(1000))
        dt = time.perf_counter() - t0
        await cons.close()
    return dt


def kafka_produce(bootstrap: str, topic: str, records: int, size: int) -> float:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True,
                  "acks": "all", "batch.num.messages": 10_000, "batch.size": 4_000_000,
                  "queue.buffering.max.messages": 1_000_000})
    value = b"x" * size
    failed = []

    def delivered(err: object, _msg: object) -> None:
        if err:
            failed.append(err)

    t0 = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value=value, key=b"%08d" % i, partition=0,
                          on_delivery=delivered)
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(300) == 0
    dt = time.perf_counter() - t0
    assert not failed, failed[:3]
    return dt


def kafka_consume(bootstrap: str, topic: str, records: int) -> float:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench",
                  "enable.auto.commit": False, "max.partition.fetch.bytes": 8 * 1024 * 1024,
                  "fetch.max.bytes": 64 * 1024 * 1024})
    c.assign([TopicPartition(topic, 0, 0)])
    n = 0
    t0 = time.perf_counter()
    while n < records:
        for m in c.consume(10_000, 1.0):
            assert m.error() is None, m.error()
            n += 1
    dt = time.perf_counter() - t0
    c.close()
    return dt


def spread(xs: list[float]) -> str:
    return f"{min(xs):,.0f}-{max(xs):,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--datanodes", type=int, default=1)
    ap.add_argument("--fsync", default="interval", choices=("always", "interval", "none"))
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--profile", type=Path, default=None,
                    help="py-spy the gateway during the Kafka phases of the first run into "
                         "this directory (collapsed stacks: produce.txt, consume.txt)")
    args = ap.parse_args()
    n = args.records
    recs = records_of(n, args.size)
    phases = ("sdk send_batch", "sdk send_whole", "kafka produce",
              "sdk iterate", "sdk columns", "kafka consume")
    rate: dict[str, list[float]] = {k: [] for k in phases}
    gw_us: dict[str, list[float]] = {k: [] for k in phases}
    dn_us: dict[str, list[float]] = {k: [] for k in phases}
    cl_us: dict[str, list[float]] = {k: [] for k in phases}
    ratios: dict[str, list[float]] = {"produce": [], "consume": []}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
            Path(tmp), datanodes=args.datanodes, fsync=args.fsync, kafka_port=0) as cluster:
        assert cluster.kafka is not None and cluster.kafka.proc is not None
        bootstrap = cluster.kafka.address
        gw_pid = cluster.kafka.proc.pid
        dn_pids = [d.proc.pid for d in cluster.datanodes if d.proc is not None]

        def timed(phase: str, fn: Callable[[], float]) -> None:
            spy = None
            if args.profile and phase.startswith("kafka") and not rate[phase]:
                args.profile.mkdir(parents=True, exist_ok=True)
                spy = subprocess.Popen(
                    [PY_SPY, "record", "--pid", str(gw_pid), "--format", "raw", "--rate", "250",
                     "-o", str(args.profile / f"{phase.split()[1]}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)  # attached
            g0 = cpu_seconds(gw_pid)
            d0 = sum(cpu_seconds(p) for p in dn_pids)
            c0 = time.process_time()
            dt = fn()
            cl_us[phase].append((time.process_time() - c0) / n * 1e6)
            if spy is not None:
                spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
                spy.wait(60)
            gw_us[phase].append((cpu_seconds(gw_pid) - g0) / n * 1e6)
            dn_us[phase].append((sum(cpu_seconds(p) for p in dn_pids) - d0) / n * 1e6)
            rate[phase].append(n / dt)

        pm = cluster.pm_address
        for run in range(args.runs):
            b, w, topic = f"b{run}", f"w{run}", f"kafka{run}"
            timed("sdk send_batch", lambda: asyncio.run(sdk_send_batch(pm, b, recs)))  # noqa: B023
            timed("sdk send_whole", lambda: asyncio.run(sdk_send_whole(pm, w, recs)))  # noqa: B023
            timed("sdk iterate", lambda: asyncio.run(sdk_iterate(pm, b, n)))  # noqa: B023
            timed("sdk columns", lambda: asyncio.run(sdk_columns(pm, w, n)))  # noqa: B023
            timed("kafka produce",
                  lambda: kafka_produce(bootstrap, topic, n, args.size))  # noqa: B023
            timed("kafka consume", lambda: kafka_consume(bootstrap, topic, n))  # noqa: B023
            for direction, sdk in (("produce", ("sdk send_batch", "sdk send_whole")),
                                   ("consume", ("sdk iterate", "sdk columns"))):
                best = max(rate[s][-1] for s in sdk)
                ratios[direction].append(rate[f"kafka {direction}"][-1] / best)
    print(f"{n:,} records of {args.size} B (+8 B key), {args.datanodes} data node(s), "
          f"fsync {args.fsync}; median of {args.runs} (min-max)")
    print(f"  {'phase':<15} {'records/s':>10} {'spread':>19}  {'client':>7}  {'gateway':>7}"
          f"  {'data node':>9}   (CPU us per record)")
    out: dict[str, object] = {}
    for what in phases:
        r = rate[what]
        print(f"  {what:<15} {statistics.median(r):>10,.0f} {spread(r):>19}  "
              f"{statistics.median(cl_us[what]):>7.2f}  {statistics.median(gw_us[what]):>7.2f}"
              f"  {statistics.median(dn_us[what]):>9.2f}")
        out[what] = {"records_per_s": r, "client_cpu_us_per_record": cl_us[what],
                     "gateway_cpu_us_per_record": gw_us[what],
                     "datanode_cpu_us_per_record": dn_us[what]}
    for direction, rs in ratios.items():
        print(f"  gateway/fastest SDK {direction}: {statistics.median(rs):.2f} "
              f"({min(rs):.2f}-{max(rs):.2f})")
    out["ratios"] = ratios
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
