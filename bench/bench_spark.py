"""Spark connector throughput against Spark's own Parquet reader and the SDK, in one run.

Run: ``.venv/bin/python -m bench.bench_spark [--records N] [--streams S] [--value-bytes B]
[--profile DIR]``.

A LocalCluster (PM + 2 data nodes) and a ``local[2]`` session. The records: N rows over S
streams (default 300,000 over 2), a 12-byte key ``key-%08d`` and a value of B bytes (100). Every
case runs once as a warm-up, then 3 timed runs; each line gives the median rows/s with the
spread [min .. max]:

- ``sdk append``: the SDK's batching idempotent producer appends the same records through its
  bulk path (``Client.producer().send_batch`` of prebuilt ``Record`` objects, not timed; one
  future per 10,000), one producer, streams in turn;
- ``sdk append, no keys``: for reference, the SDK's bulk path (``send_batch`` of bare values,
  one future per call);
- ``spark batch write``: ``df.write.format("sbpstream")`` of ``spark.range`` rows made into the
  same key/value, one write per stream, 2 tasks each, into fresh streams;
- ``spark streaming write``: ``readStream`` over the Parquet copy (below), ``trigger(
  availableNow=True)``, one stream, into a fresh stream with a fresh checkpoint;
- ``sbpstream batch read``: ``spark.read.format("sbpstream")`` of the S streams;
- ``JVM batch read``: ``spark.read.format("sbpstream-jvm")`` of the S streams: the JVM reader
  (docs/spark.md, "The JVM reader"), no Python worker;
- ``sbpstream availableNow``: the same as ``readStream`` with ``trigger(availableNow=True)``
  (fresh checkpoint);
- ``JVM availableNow``: the same through ``readStream.format("sbpstream-jvm")`` (fresh
  checkpoint);
- ``parquet read``: ``spark.read.parquet`` over the same rows, written once from the source;
- ``parquet availableNow``: Spark's file source over that copy under ``trigger(
  availableNow=True)``: what Spark's streaming machinery costs without any Python.

Reads force every row and column into ``format("noop")``. The ratios at the end are the targets
of docs/spark.md: batch read / Parquet, availableNow / batch read, writes / SDK append.

``--reads-only`` skips the SDK and write cases (the reads and their ratios only).

``--profile DIR`` instead runs each Spark case once with ``SBPSTREAM_SPARK_PROFILE=DIR`` (cProfile
in the Python workers, see :mod:`sbpstream.spark.profiling`) and prints where the workers' time
went, per case.
"""

from __future__ import annotations

import argparse
import os
import pstats
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
from sbpstream.records import Record

RUNS = 3


def session() -> Any:
    from sbpstream.spark import prepare_environment

    prepare_environment()
    from pyspark.sql import SparkSession

    from sbpstream.spark.jvm import jar_path

    s = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark")
        .config("spark.jars", str(jar_path()))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    s.sparkContext.setLogLevel("ERROR")
    return s


Case = Callable[[], "float | None"]
"""One run of a case; the seconds to count when only part of it is timed (None: all of it)."""


def measure(name: str, records: int, fn: Case, results: dict[str, float]) -> None:
    fn()  # warm-up: worker daemons, JIT, page cache
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        timed = fn()
        times.append(time.perf_counter() - t0 if timed is None else timed)
    rates = [records / t for t in times]
    results[name] = statistics.median(rates)
    print(f"{name:<26} {statistics.median(rates):>12,.0f} rows/s   "
          f"[{min(rates):,.0f} .. {max(rates):,.0f}]   median {statistics.median(times):.2f}s",
          flush=True)


def split(records: int, streams: int) -> list[int]:
    return [records // streams + (1 if i < records % streams else 0) for i in range(streams)]


class Bench:
    def __init__(self, spark: Any, client: Client, pm: str, tmp: Path, args: Any) -> None:
        self.spark, self.client, self.pm, self.tmp = spark, client, pm, tmp
        self.records: int = args.records
        self.streams: int = args.streams
        self.value_bytes: int = args.value_bytes
        self.runs = 0
        self.sids: list[int] = []  # the streams the reads read
        self.parquet = tmp / "parquet"

    def _next(self) -> int:
        self.runs += 1
        return self.runs

    def _drop(self, sids: list[int]) -> None:
        for s in sids:  # keep the disk small between runs
            self.client.delete_stream(s)

    def sdk_append(self) -> float:
        sids = self.client.create_streams(self.streams)
        recs = [[Record(value=b"v" * self.value_bytes, key=b"key-%08d" % i)
                 for i in range(n)] for n in split(self.records, self.streams)]
        t0 = time.perf_counter()
        with self.client.producer() as p:
            for sid, rs in zip(sids, recs, strict=True):
                for i in range(0, len(rs), 10_000):
                    p.send_batch(sid, rs[i : i + 10_000])
            p.flush()
        elapsed = time.perf_counter() - t0
        self._check(sids)
        self._drop(sids)
        return elapsed

    def sdk_append_bulk(self) -> float:
        """The SDK's fastest path, for reference: ``send_batch`` of bare values (no keys)."""
        sids = self.client.create_streams(self.streams)
        values = [b"v" * self.value_bytes] * max(split(self.records, self.streams))
        t0 = time.perf_counter()
        with self.client.producer() as p:
            for sid, n in zip(sids, split(self.records, self.streams), strict=True):
                for i in range(0, n, 10_000):
                    p.send_batch(sid, values[i : min(n, i + 10_000)])
            p.flush()
        elapsed = time.perf_counter() - t0
        self._check(sids)
        self._drop(sids)
        return elapsed

    def _check(self, sids: list[int]) -> None:
        ends = [self.client.end_offset(s) for s in sids]
        assert sum(ends) == self.records, ends

    def batch_write(self, keep: bool = False) -> float:
        sids = self.client.create_streams(self.streams)
        t0 = time.perf_counter()
        for sid, n in zip(sids, split(self.records, self.streams), strict=True):
            (
                self.spark.range(n, numPartitions=2)
                .selectExpr("format_string('key-%08d', id) AS key",
                            f"repeat('v', {self.value_bytes}) AS value")
                .write.format("sbpstream").option("pm", self.pm).option("stream", sid)
                .mode("append").save()
            )
        elapsed = time.perf_counter() - t0
        self._check(sids)
        if keep:
            self.sids = sids
        else:
            self._drop(sids)
        return elapsed

    def streaming_write(self) -> float:
        (sid,) = self.client.create_streams(1)
        t0 = time.perf_counter()
        q = (
            self.spark.readStream.schema(self.spark.read.parquet(str(self.parquet)).schema)
            .parquet(str(self.parquet)).select("key", "value")
            .writeStream.format("sbpstream").option("pm", self.pm).option("stream", sid)
            .option("checkpointLocation", str(self.tmp / f"ckw{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()
        elapsed = time.perf_counter() - t0
        self._check([sid])
        self._drop([sid])
        return elapsed

    def _source(self) -> Any:
        return self.spark.read.format("sbpstream").option("pm", self.pm).option(
            "streams", ",".join(map(str, self.sids))).load()

    def batch_read(self) -> None:
        self._source().write.format("noop").mode("overwrite").save()

    def jvm_batch_read(self) -> None:
        df = self.spark.read.format("sbpstream-jvm").option("pm", self.pm).option(
            "streams", ",".join(map(str, self.sids))).load()
        df.write.format("noop").mode("overwrite").save()

    def available_now(self, fmt: str = "sbpstream") -> None:
        """``readStream`` with ``trigger(availableNow=True)`` of every row, fresh checkpoint."""
        q = (
            self.spark.readStream.format(fmt).option("pm", self.pm)
            .option("streams", ",".join(map(str, self.sids)))
            .option("startingOffsets", "earliest").load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(self.tmp / f"ck{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()
        got = sum(p["numInputRows"] for p in q.recentProgress)
        assert got == self.records, got

    def jvm_available_now(self) -> None:
        self.available_now("sbpstream-jvm")

    def empty_read(self) -> None:
        """A batch read of no rows: the fixed cost of a query (planning, tasks, workers)."""
        self.spark.read.format("sbpstream").option("pm", self.pm).option(
            "streams", ",".join(map(str, self.sids))).option("startingOffsets", "latest").load(
        ).write.format("noop").mode("overwrite").save()

    def empty_available_now(self) -> None:
        """availableNow with nothing to read: a streaming query's fixed cost."""
        q = (
            self.spark.readStream.format("sbpstream").option("pm", self.pm)
            .option("streams", ",".join(map(str, self.sids)))
            .option("startingOffsets", "latest").load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(self.tmp / f"ck{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()

    def parquet_available_now(self) -> None:
        """Spark's own file source under availableNow: its streaming machinery, no Python."""
        q = (
            self.spark.readStream.schema(self.spark.read.parquet(str(self.parquet)).schema)
            .parquet(str(self.parquet)).writeStream.format("noop")
            .option("checkpointLocation", str(self.tmp / f"ck{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()

    def write_parquet(self) -> None:
        self._source().write.parquet(str(self.parquet))
        count = self.spark.read.parquet(str(self.parquet)).count()
        assert count == self.records, count

    def parquet_read(self) -> None:
        self.spark.read.parquet(str(self.parquet)).write.format("noop").mode("overwrite").save()


def _tree_cpu() -> dict[str, float]:
    """CPU seconds (user + system, reaped children included) of this process's descendants,
    by role: the Spark JVM, PySpark's Python workers and runners, the data nodes, the PM. A
    process that ended since the last call takes its CPU with it (its parent may count it)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    info: dict[int, tuple[str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(d.name)] = int(fields[1])
        info[int(d.name)] = (cmd, sum(int(x) for x in fields[11:15]) / tick)
    mine = {os.getpid()}
    grew = True
    while grew:
        more = {p for p, pp in parents.items() if pp in mine} - mine
        grew = bool(more)
        mine |= more
    out: dict[str, float] = {}
    for p in mine - {os.getpid()}:
        cmd, cpu = info[p]
        role = ("spark JVM" if "java" in cmd.split(" ")[0] else "pyspark workers"
                if "pyspark" in cmd else "data nodes" if "sbpstream.datanode" in cmd
                else "PM" if "sbpstream.pm" in cmd
                else "other: " + " ".join(Path(w).name for w in cmd.split(" ")[:3]))
        out[role] = out.get(role, 0.0) + cpu
    return out


def report_profile(where: Path, kind: str, top: int = 18) -> None:
    files = sorted(str(p) for p in where.glob(f"{kind}-*.prof"))
    if not files:
        print(f"  (no {kind} profile)")
        return
    st = pstats.Stats(*files, stream=sys.stdout)
    total = st.total_tt  # type: ignore[attr-defined]
    print(f"  {len(files)} profiled {kind} tasks, {total:.2f}s of worker CPU in all")
    st.strip_dirs().sort_stats("tottime").print_stats(top)
    for f in files:
        os.unlink(f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--reads-only", action="store_true",
                    help="skip the SDK append and the write cases")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile each Spark case once into DIR instead of timing")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        os.environ["SBPSTREAM_SPARK_PROFILE"] = str(args.profile.resolve())
    tmp = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    try:
        with LocalCluster(tmp / "cluster", datanodes=2) as cluster, \
                Client(cluster.pm_address) as client:
            spark = session()
            b = Bench(spark, client, cluster.pm_address, tmp, args)
            b.batch_write(keep=True)
            b.write_parquet()
            cases: list[tuple[str, Case]] = [
                ("spark batch write", b.batch_write),
                ("spark streaming write", b.streaming_write),
                ("sbpstream batch read", b.batch_read),
                ("JVM batch read", b.jvm_batch_read),
                ("sbpstream availableNow", b.available_now),
                ("JVM availableNow", b.jvm_available_now),
                ("parquet read", b.parquet_read),
                ("parquet availableNow", b.parquet_available_now),
            ]
            if args.profile is not None:
                for f in args.profile.glob("*.prof"):
                    f.unlink()
                for name, fn in [*cases, ("empty batch read", b.empty_read),
                                 ("empty availableNow", b.empty_available_now)]:
                    fn()  # warm: the workers already imported everything
                    for f in args.profile.glob("*.prof"):
                        f.unlink()
                    cpu0 = _tree_cpu()
                    t0 = time.perf_counter()
                    fn()
                    wall = time.perf_counter() - t0
                    cpu1 = _tree_cpu()
                    used = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
                    print(f"\n== {name}: one profiled run, {wall:.2f}s wall; CPU seconds: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(used.items())))
                    report_profile(args.profile, "write" if "write" in name else "read")
                spark.stop()
                return
            print(f"{args.records:,} rows ({args.value_bytes} B values, 12 B keys, "
                  f"{args.streams} streams), local[2], medians of {RUNS} "
                  "(rows/s [min .. max]):", flush=True)
            res: dict[str, float] = {}
            if args.reads_only:
                cases = [c for c in cases if "write" not in c[0]]
            else:
                measure("sdk append", args.records, b.sdk_append, res)
                measure("sdk append, no keys", args.records, b.sdk_append_bulk, res)
            for name, fn in cases:
                measure(name, args.records, fn, res)
            read, now = res["sbpstream batch read"], res["sbpstream availableNow"]
            print(f"{'batch read / parquet read':<32} {read / res['parquet read']:.2f}x   "
                  "(target >= 1.0)")
            print(f"{'JVM batch read / parquet read':<32} "
                  f"{res['JVM batch read'] / res['parquet read']:.2f}x   (target >= 1.0)")
            print(f"{'availableNow / batch read':<32} {now / read:.2f}x   (target >= 0.7)")
            jvm_now = res["JVM availableNow"]
            print(f"{'JVM availableNow / JVM batch read':<32} "
                  f"{jvm_now / res['JVM batch read']:.2f}x   (target >= 0.7); "
                  f"{jvm_now / res['parquet availableNow']:.2f}x of Parquet's availableNow")
            for w in ("spark batch write", "spark streaming write") if res.get(
                    "sdk append") else ():
                print(f"{w + ' / sdk append':<40} {res[w] / res['sdk append']:.2f}x   "
                      f"(target >= 0.5; {res[w] / res['sdk append, no keys']:.2f}x of the "
                      "SDK's keyless bulk path)")
            spark.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
