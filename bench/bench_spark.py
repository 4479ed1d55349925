"""Spark connector throughput against Spark's own Parquet reader and the SDK, in one run.

Run: ``.venv/bin/python -m bench.bench_spark [--records N] [--write-records W] [--streams S]
[--value-bytes B] [--streaming-reads] [--profile DIR]``.

A LocalCluster (PM + 2 data nodes) and a ``local[2]`` session. The rows: a 12-byte key
``key-%08d`` and a value of B bytes (100), over S streams (2). Every case runs once as a
warm-up, then 3 timed runs; each line gives the median rows/s with the spread [min .. max], the
median wall time and the median CPU seconds of each process kind (the Spark JVM, PySpark's
Python workers, the data nodes, the PM; /proc, children reaped included):

Writes, W rows (default 300,000):

- ``sdk send (sync)``: the sync client's per-record ``Producer.send(stream, value, key=)`` of
  the same keyed records, until ``flush`` (the keys and values are made before the clock);
- ``sdk send (async)``: the async client's per-record ``await producer.send(...)`` loop, until
  ``flush``; the faster of the two is the bar the writes are held to (issue 34: >= 0.5x);
- ``spark batch write``: one ``df.write.format("sbpstream")`` of the same rows (made once from
  ``spark.range`` and cached, as the SDK cases make theirs before the clock), routed to S fresh
  streams by a ``stream`` column: one Spark job of 2 tasks;
- ``spark streaming write``: ``readStream`` over a Parquet copy of the rows, ``trigger(
  availableNow=True)``, into a fresh stream with a fresh checkpoint.

Reads, N rows (default 1,000,000), the query ``SELECT sum(length(value)), count(*)`` collected
and checked (each reader may prune the columns it does not need, as Parquet does):

- ``parquet read``: ``spark.read.parquet`` over the same rows (written once from the source);
- ``JVM read``: ``spark.read.format("sbpstream-jvm")``: the JVM reader, no Python worker;
- ``python read``: ``spark.read.format("sbpstream")``: the Python data source.

After the reads, where their time went (summed over the 3 timed runs, per run): for the JVM
reader, :class:`io.sbpstream.spark.ReadStats` (planning with its PM lookups, waiting for FETCH
answers, decoding them into column vectors, Spark's work on each batch); for the Python source,
``SBPSTREAM_SPARK_PHASES`` (:mod:`sbpstream.spark.profiling`: planning and its PM lookups, FETCH
waits, decode, Arrow batch, the hand-off to Spark), per worker. These are sums over the tasks,
which run 2 at a time, so they can exceed the wall time.

``--streaming-reads`` adds ``readStream`` ... ``trigger(availableNow=True)`` of the N rows into
``format("noop")`` for both readers and for Parquet.

``--profile DIR`` instead runs each Spark case once with ``SBPSTREAM_SPARK_PROFILE=DIR`` (cProfile
in the Python workers, see :mod:`sbpstream.spark.profiling`) and prints where the workers' time
went, per case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from sbpstream.client import AsyncClient, Client
from sbpstream.cluster import LocalCluster
from sbpstream.records import Record
from sbpstream.spark.profiling import PHASES_ENV

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
    cpus: list[dict[str, float]] = []
    for _ in range(RUNS):
        cpu0 = _tree_cpu()
        own0 = time.process_time()
        t0 = time.perf_counter()
        timed = fn()
        times.append(time.perf_counter() - t0 if timed is None else timed)
        cpu1 = _tree_cpu()
        cpu1["bench (SDK, driver)"] = time.process_time() - own0
        cpus.append({k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()})
    rates = [records / t for t in times]
    results[name] = statistics.median(rates)
    roles = sorted({k for c in cpus for k in c if not k.startswith("other")})
    cpu = ", ".join(f"{k} {statistics.median(c.get(k, 0.0) for c in cpus):.2f}" for k in roles)
    print(f"{name:<24} {statistics.median(rates):>11,.0f} rows/s  "
          f"[{min(rates):,.0f} .. {max(rates):,.0f}]  {statistics.median(times):.2f}s; "
          f"CPU s: {cpu}", flush=True)


def split(records: int, streams: int) -> list[int]:
    return [records // streams + (1 if i < records % streams else 0) for i in range(streams)]


class Bench:
    def __init__(self, spark: Any, client: Client, pm: str, tmp: Path, args: Any) -> None:
        self.spark, self.client, self.pm, self.tmp = spark, client, pm, tmp
        self.records: int = args.records
        self.write_records: int = args.write_records
        self.streams: int = args.streams
        self.value_bytes: int = args.value_bytes
        self.runs = 0
        self.sids: list[int] = []  # the streams the reads read
        self.parquet = tmp / "parquet"  # the read rows
        self.parquet_w = tmp / "parquet-w"  # the streaming write's input
        self.value = b"v" * self.value_bytes
        self.keys = [b"key-%08d" % i for i in range(max(split(self.write_records, 1)))]
        self._rows: Any = None

    def _next(self) -> int:
        self.runs += 1
        return self.runs

    def _drop(self, sids: list[int]) -> None:
        for s in sids:  # keep the disk small between runs
            self.client.delete_stream(s)

    def _check(self, sids: list[int], records: int) -> None:
        ends = [self.client.end_offset(s) for s in sids]
        assert sum(ends) == records, ends

    # -- setup

    def load(self) -> None:
        """The N read rows into S streams (the SDK's bulk path), and their Parquet copies."""
        self.sids = self.client.create_streams(self.streams)
        with self.client.producer() as p:
            at = 0
            for sid, n in zip(self.sids, split(self.records, self.streams), strict=True):
                for i in range(at, at + n, 10_000):
                    p.send_batch(sid, [Record(value=self.value, key=b"key-%08d" % j)
                                       for j in range(i, min(at + n, i + 10_000))])
                at += n
            p.flush()
        self._check(self.sids, self.records)
        self.spark.read.format("sbpstream-jvm").option("pm", self.pm).option(
            "streams", ",".join(map(str, self.sids))).load().select(
            "key", "value").write.parquet(str(self.parquet))
        self.spark.read.parquet(str(self.parquet)).limit(self.write_records).write.parquet(
            str(self.parquet_w))

    # -- writes

    def sdk_send_sync(self) -> float:
        sids = self.client.create_streams(self.streams)
        value, keys = self.value, self.keys
        t0 = time.perf_counter()
        with self.client.producer() as p:
            for sid, n in zip(sids, split(self.write_records, self.streams), strict=True):
                send = p.send
                for i in range(n):
                    send(sid, value, key=keys[i])
            p.flush()
        elapsed = time.perf_counter() - t0
        self._check(sids, self.write_records)
        self._drop(sids)
        return elapsed

    def sdk_send_async(self) -> float:
        sids = self.client.create_streams(self.streams)
        value, keys = self.value, self.keys

        async def run() -> float:
            async with AsyncClient(self.pm) as c:
                p = c.producer()
                t0 = time.perf_counter()
                for sid, n in zip(sids, split(self.write_records, self.streams), strict=True):
                    send = p.send
                    for i in range(n):
                        await send(sid, value, key=keys[i])
                await p.flush()
                elapsed = time.perf_counter() - t0
                await p.close()
                return elapsed

        elapsed = asyncio.run(run())
        self._check(sids, self.write_records)
        self._drop(sids)
        return elapsed

    def rows(self) -> Any:
        """The W rows to write, made once and cached in Spark's memory (as the SDK cases make
        their records before the clock): key, value and ``part``, which of the S streams."""
        if self._rows is None:
            counts = split(self.write_records, self.streams)
            bounds = [sum(counts[: i + 1]) for i in range(len(counts))]
            part = " ".join(f"WHEN id < {b} THEN {i}" for i, b in enumerate(bounds))
            self._rows = self.spark.range(self.write_records, numPartitions=2).selectExpr(
                "concat('key-', lpad(cast(id AS string), 8, '0')) AS key",
                f"repeat('v', {self.value_bytes}) AS value", f"CASE {part} END AS part",
            ).cache()
            assert self._rows.count() == self.write_records
        return self._rows

    def batch_write(self) -> float:
        """One ``df.write`` of the W cached rows, routed to S fresh streams by a ``stream``
        column (one Spark job, 2 tasks)."""
        from pyspark.sql import functions as F

        sids = self.client.create_streams(self.streams)
        route = F.lit(sids[-1])
        for i, sid in enumerate(sids[:-1]):
            route = F.when(F.col("part") == i, F.lit(sid)).otherwise(route)
        df = self.rows().select("key", "value", route.alias("stream"))
        t0 = time.perf_counter()
        df.write.format("sbpstream").option("pm", self.pm).mode("append").save()
        elapsed = time.perf_counter() - t0
        self._check(sids, self.write_records)
        self._drop(sids)
        return elapsed

    def streaming_write(self) -> float:
        (sid,) = self.client.create_streams(1)
        t0 = time.perf_counter()
        q = (
            self.spark.readStream.schema(self.spark.read.parquet(str(self.parquet_w)).schema)
            .parquet(str(self.parquet_w)).select("key", "value")
            .writeStream.format("sbpstream").option("pm", self.pm).option("stream", sid)
            .option("checkpointLocation", str(self.tmp / f"ckw{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()
        elapsed = time.perf_counter() - t0
        self._check([sid], self.write_records)
        self._drop([sid])
        return elapsed

    # -- reads: sum(length(value)) and count(*)

    def _query(self, df: Any) -> None:
        from pyspark.sql import functions as F

        row = df.agg(F.sum(F.length("value")).alias("bytes"), F.count(F.lit(1)).alias("n")
                     ).collect()[0]
        assert (row["n"], row["bytes"]) == (self.records, self.records * self.value_bytes), row

    def _load(self, fmt: str) -> Any:
        return self.spark.read.format(fmt).option("pm", self.pm).option(
            "streams", ",".join(map(str, self.sids))).load()

    def parquet_read(self) -> None:
        self._query(self.spark.read.parquet(str(self.parquet)))

    def jvm_read(self) -> None:
        self._query(self._load("sbpstream-jvm"))

    def python_read(self) -> None:
        self._query(self._load("sbpstream"))

    # -- streaming reads (--streaming-reads), every row into noop

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

    def parquet_available_now(self) -> None:
        """Spark's own file source under availableNow: its streaming machinery, no Python."""
        q = (
            self.spark.readStream.schema(self.spark.read.parquet(str(self.parquet)).schema)
            .parquet(str(self.parquet)).writeStream.format("noop")
            .option("checkpointLocation", str(self.tmp / f"ck{self._next()}"))
            .trigger(availableNow=True).start()
        )
        q.awaitTermination()


def jvm_stats(spark: Any, reset: bool = False) -> list[int] | None:
    """The JVM reader's ReadStats (None from a jar without them)."""
    try:
        stats = spark._jvm.io.sbpstream.spark.ReadStats
        if reset:
            stats.reset()
            return []
        return list(stats.snapshot())
    except Exception:  # py4j: no such class in an older jar
        return None


def report_jvm(snap: list[int] | None, runs: int) -> None:
    if not snap:
        print("  JVM reader: no ReadStats in this jar")
        return
    plan_ns, plans, fetch_ns, fetches, decode_ns, rows, consume_ns, parts = snap
    ms = 1e6 * runs
    print(f"  JVM reader, per run: planning {plan_ns / ms:.0f} ms ({plans // runs} plan, PM "
          f"lookups inside); {parts // runs} partitions; FETCH waits {fetch_ns / ms:.0f} ms "
          f"({fetches // runs} answers); decode into column vectors {decode_ns / ms:.0f} ms; "
          f"Spark on the batches {consume_ns / ms:.0f} ms; {rows // runs:,} rows "
          "(task times summed over 2 cores)")


def report_python(where: Path, runs: int) -> None:
    secs: dict[str, float] = {}
    counts: dict[str, int] = {}
    files = list(where.glob("*.json"))
    for f in files:
        d = json.loads(f.read_text())
        for k, v in d["seconds"].items():
            secs[k] = secs.get(k, 0.0) + v
        for k, v in d["counts"].items():
            counts[k] = counts.get(k, 0) + v
        f.unlink()
    ms = 1000 / runs
    fetch = secs.get("fetch", 0.0) - secs.get("decode", 0.0)
    print(f"  python source, per run: planning {secs.get('plan', 0.0) * ms:.0f} ms "
          f"({counts.get('pm_lookups', 0) // runs} PM lookups in planning and reads); "
          f"{counts.get('fetch', 0) // runs} batches; FETCH waits {fetch * ms:.0f} ms; decode "
          f"{secs.get('decode', 0.0) * ms:.0f} ms; Arrow batches {secs.get('arrow', 0.0) * ms:.0f}"
          f" ms; hand-off to Spark (PySpark's serialization, the JVM's conversion) "
          f"{secs.get('handoff', 0.0) * ms:.0f} ms; {counts.get('rows', 0) // runs:,} rows "
          "(task times summed over 2 cores)")


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
    ap.add_argument("--records", type=int, default=1_000_000, help="rows read")
    ap.add_argument("--write-records", type=int, default=300_000, help="rows written")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--reads-only", action="store_true", help="skip the write cases")
    ap.add_argument("--writes-only", action="store_true", help="skip the read cases")
    ap.add_argument("--streaming-reads", action="store_true",
                    help="also availableNow reads of every row (both readers and Parquet)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile each Spark case once into DIR instead of timing")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    tmp = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    phases_dir = tmp / "phases"
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        os.environ["SBPSTREAM_SPARK_PROFILE"] = str(args.profile.resolve())
    else:
        os.environ[PHASES_ENV] = str(phases_dir)  # the workers inherit it
    try:
        with LocalCluster(tmp / "cluster", datanodes=2) as cluster, \
                Client(cluster.pm_address) as client:
            spark = session()
            b = Bench(spark, client, cluster.pm_address, tmp, args)
            b.load()
            writes: list[tuple[str, Case]] = [
                ("spark batch write", b.batch_write),
                ("spark streaming write", b.streaming_write),
            ]
            reads: list[tuple[str, Case]] = [
                ("parquet read", b.parquet_read),
                ("JVM read", b.jvm_read),
                ("python read", b.python_read),
            ]
            streaming: list[tuple[str, Case]] = [
                ("parquet availableNow", b.parquet_available_now),
                ("JVM availableNow", b.jvm_available_now),
                ("python availableNow", b.available_now),
            ] if args.streaming_reads else []
            if args.profile is not None:
                for f in args.profile.glob("*.prof"):
                    f.unlink()
                for name, fn in [*writes, *reads, *streaming]:
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
            res: dict[str, float] = {}
            if not args.reads_only:
                print(f"writes: {args.write_records:,} rows ({args.value_bytes} B values, 12 B "
                      f"keys, {args.streams} streams), local[2], medians of {RUNS} "
                      "(rows/s [min .. max], wall, CPU seconds per process kind):", flush=True)
                measure("sdk send (sync)", args.write_records, b.sdk_send_sync, res)
                measure("sdk send (async)", args.write_records, b.sdk_send_async, res)
                for name, fn in writes:
                    measure(name, args.write_records, fn, res)
            if not args.writes_only:
                print(f"reads: sum(length(value)) and count(*) of {args.records:,} rows, medians "
                      f"of {RUNS}:", flush=True)
                for name, fn in [*reads, *streaming]:
                    jvm_stats(spark, reset=True)
                    for f in phases_dir.glob("*.json"):
                        f.unlink()
                    measure(name, args.records, fn, res)
                    if name == "JVM read":
                        report_jvm(jvm_stats(spark), RUNS + 1)  # the warm-up run counts too
                    elif name == "python read":
                        report_python(phases_dir, RUNS + 1)
            if "parquet read" in res:
                for r, goal in (("JVM read", 1.0), ("python read", 0.6)):
                    print(f"{r + ' / parquet read':<40} {res[r] / res['parquet read']:.2f}x   "
                          f"(target >= {goal})")
            if "sdk send (sync)" in res:
                bar = max(res["sdk send (sync)"], res["sdk send (async)"])
                for w, _ in writes:
                    print(f"{w + ' / sdk per-record send':<40} {res[w] / bar:.2f}x   "
                          f"(target >= 0.5; the faster SDK send, {bar:,.0f} records/s)")
            spark.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
