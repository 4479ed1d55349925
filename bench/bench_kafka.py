"""The Kafka gateway against the SDK, in one run: records/s and MB/s of record values.

One LocalCluster (``--datanodes`` data nodes, data node ``--fsync`` policy) with the gateway
process (``python -m sbpstream.kafka``, as ``sbpstream up --kafka-port`` runs it). For each
side, ``--records`` records of ``--size`` bytes with an 8-byte key into a fresh 1-partition
topic / stream, then all read back from the start:

- **sdk**: ``AsyncClient.producer().send_batch`` (chunks of 1,000) and the subscribing
  ``AsyncClient.consumer``;
- **kafka**: a confluent-kafka (librdkafka) ``Producer`` (idempotent, ``linger.ms=5``) through the
  gateway, then a confluent-kafka ``Consumer`` by assignment.

Each phase is timed from its first record to the last acknowledged (produce) or received
(consume) record. ``--runs`` repeats and reports the median.

    .venv/bin/python -m bench.bench_kafka [--records 200000] [--size 100] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sbpstream.client import AsyncClient, Record
from sbpstream.cluster import LocalCluster


async def sdk_produce(pm: str, name: str, records: int, size: int) -> float:
    value = b"x" * size
    async with AsyncClient(pm) as c:
        sid = await c.create_stream(name)
        async with c.producer(linger_ms=5) as p:
            t0 = time.perf_counter()
            futs = []
            for start in range(0, records, 1000):
                chunk = [Record(value, b"%08d" % i) for i in range(start, min(records,
                                                                              start + 1000))]
                futs.append(await p.send_batch(sid, chunk))
            await p.flush()
            dt = time.perf_counter() - t0
            for f in futs:
                assert (await f).error is None
    return dt


async def sdk_consume(pm: str, name: str, records: int) -> float:
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


def kafka_produce(bootstrap: str, topic: str, records: int, size: int) -> float:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True,
                  "queue.buffering.max.messages": 1_000_000})
    value = b"x" * size
    failed = []
    t0 = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value=value, key=b"%08d" % i, partition=0,
                          on_delivery=lambda err, _m: failed.append(err) if err else None)
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
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False})
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--datanodes", type=int, default=1)
    ap.add_argument("--fsync", default="interval", choices=("always", "interval", "none"))
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in (
        "sdk produce", "kafka produce", "sdk consume", "kafka consume")}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
            Path(tmp), datanodes=args.datanodes, fsync=args.fsync, kafka_port=0) as cluster:
        assert cluster.kafka is not None
        bootstrap = cluster.kafka.address
        for run in range(args.runs):
            name = f"sdk-{run}"
            times["sdk produce"].append(
                asyncio.run(sdk_produce(cluster.pm_address, name, args.records, args.size)))
            times["sdk consume"].append(
                asyncio.run(sdk_consume(cluster.pm_address, name, args.records)))
            topic = f"kafka{run}"
            times["kafka produce"].append(
                kafka_produce(bootstrap, topic, args.records, args.size))
            times["kafka consume"].append(kafka_consume(bootstrap, topic, args.records))
    out = {}
    print(f"{args.records:,} records of {args.size} B (+8 B key), {args.datanodes} data node(s), "
          f"fsync {args.fsync}, median of {args.runs}")
    for what, ts in times.items():
        dt = statistics.median(ts)
        rate = args.records / dt
        mbs = rate * args.size / 1e6
        out[what] = {"seconds": ts, "records_per_s": rate, "mb_per_s": mbs}
        print(f"  {what:<14} {rate:>10,.0f} rec/s  {mbs:7.1f} MB/s  ({dt:.2f} s)")
    for phase in ("produce", "consume"):
        ratio = out[f"kafka {phase}"]["records_per_s"] / out[f"sdk {phase}"]["records_per_s"]
        print(f"  gateway/SDK {phase}: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
