"""Spark source throughput: batch read and streaming availableNow vs Spark's own Parquet reader.

Run: ``.venv/bin/python -m bench.bench_spark [--records N] [--streams S] [--value-bytes B]``.

A LocalCluster (PM + 2 data nodes) is filled with N records over S streams (default 1,000,000
over 2, 100-byte values, 12-byte keys) through the sbpstream sink (``df.write``, timed once).
On a ``local[2]`` session each read forces every row and column into a no-op sink
(``format("noop")``), one warm-up then 3 timed runs, median reported:

- ``sbpstream batch``: ``spark.read.format("sbpstream")``
- ``sbpstream availableNow``: ``readStream`` with ``trigger(availableNow=True)`` (fresh checkpoint)
- ``parquet``: ``spark.read.parquet`` over the same rows, written once from the source
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster

RUNS = 3


def fill(spark: Any, pm: str, streams: int, records: int, value_bytes: int) -> list[int]:
    """Fill the streams through the sbpstream sink (one timed run: also the sink's figure)."""
    with Client(pm) as c:
        sids = c.create_streams(streams)
        t0 = time.perf_counter()
        for i, sid in enumerate(sids):
            n = records // streams + (1 if i < records % streams else 0)
            (
                spark.range(n, numPartitions=2)
                .selectExpr("format_string('key-%08d', id) AS key",
                            f"repeat('v', {value_bytes}) AS value")
                .write.format("sbpstream").option("pm", pm).option("stream", sid)
                .mode("append").save()
            )
        el = time.perf_counter() - t0
        ends = [c.end_offset(s) for s in sids]
    print(f"sbpstream batch write      {records / el:>12,.0f} rows/s   (one run, {el:.2f}s, "
          f"{streams} streams x 2 tasks); ends {ends}", flush=True)
    assert sum(ends) == records, ends
    return sids


def session() -> Any:
    from sbpstream.spark import prepare_environment

    prepare_environment()
    from pyspark.sql import SparkSession

    s = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    s.sparkContext.setLogLevel("ERROR")
    return s


def measure(name: str, records: int, fn: Callable[[], None]) -> tuple[str, list[float]]:
    fn()  # warm-up: worker daemons, JIT, page cache
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    rates = [records / t for t in times]
    print(f"{name:<26} {statistics.median(rates):>12,.0f} rows/s   "
          f"[{min(rates):,.0f} .. {max(rates):,.0f}]   median {statistics.median(times):.2f}s",
          flush=True)
    return name, times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--value-bytes", type=int, default=100)
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    tmp = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    try:
        with LocalCluster(tmp / "cluster", datanodes=2) as cluster:
            pm = cluster.pm_address
            spark = session()
            sids = fill(spark, pm, args.streams, args.records, args.value_bytes)
            streams = ",".join(map(str, sids))

            def source() -> Any:
                return spark.read.format("sbpstream").option("pm", pm).option(
                    "streams", streams).load()

            def batch() -> None:
                source().write.format("noop").mode("overwrite").save()

            runs = iter(range(1000))

            def available_now() -> None:
                ck = tmp / f"ck{next(runs)}"
                q = (
                    spark.readStream.format("sbpstream").option("pm", pm)
                    .option("streams", streams).option("startingOffsets", "earliest").load()
                    .writeStream.format("noop").option("checkpointLocation", str(ck))
                    .trigger(availableNow=True).start()
                )
                q.awaitTermination()
                got = sum(p["numInputRows"] for p in q.recentProgress)
                assert got == args.records, got

            parquet = tmp / "parquet"
            source().write.parquet(str(parquet))
            count = spark.read.parquet(str(parquet)).count()
            assert count == args.records, count

            def parquet_read() -> None:
                spark.read.parquet(str(parquet)).write.format("noop").mode("overwrite").save()

            print(f"{args.records:,} rows, local[2], medians of {RUNS} (rows/s [min .. max]):")
            measure("sbpstream batch read", args.records, batch)
            measure("sbpstream availableNow", args.records, available_now)
            measure("parquet (Spark reader)", args.records, parquet_read)
            spark.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
