"""``sbpstream pipeline``: a Structured Streaming job from streams to a Parquet table by date.

Exactly once end to end: the source replays a micro-batch from the checkpointed offsets with
the same records, and Spark's file sink commits each batch's files through its own log in the
output directory (a replayed batch overwrites nothing and adds no second copy). Run it again
with the same ``--checkpoint`` to continue where it stopped.

Also runnable as ``python -m sbpstream.spark.pipeline --streams 1,2 --out DIR --checkpoint DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbpstream.client.types import DEFAULT_PM, PM_ENV
from sbpstream.protocol.names import StreamRef
from sbpstream.spark.meta import DriverClient
from sbpstream.spark.options import parse_source_options

POLL_S = 0.5  # how often progress is printed while the query runs


@dataclass(frozen=True, slots=True)
class Trigger:
    available_now: bool
    processing_time_s: float = 0.0

    def spark_kwargs(self) -> dict[str, Any]:
        if self.available_now:
            return {"availableNow": True}
        return {"processingTime": f"{self.processing_time_s} seconds"}


def parse_trigger(text: str) -> Trigger:
    """``available-now`` or ``processing-time=SECONDS``."""
    t = text.strip().lower()
    if t in ("available-now", "availablenow"):
        return Trigger(True)
    if t.startswith("processing-time="):
        raw = t.split("=", 1)[1]
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if seconds > 0:
            return Trigger(False, seconds)
    raise ValueError(
        f"--trigger: expected available-now or processing-time=SECONDS, got {text!r}"
    )


def build_session(master: str = "local[*]") -> Any:
    """A SparkSession whose Python workers can run the sbpstream source (UTC dates)."""
    from sbpstream.spark import prepare_environment

    prepare_environment()
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(master)
        .appName("sbpstream-pipeline")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


def start_pipeline(
    spark: Any,
    *,
    streams: Sequence[StreamRef],
    out: Path,
    checkpoint: Path,
    trigger: Trigger,
    pm: str,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    stream_pattern: str | None = None,
) -> Any:
    """Start the query: source -> ``date`` column -> Parquet partitioned by ``date``. Streams by
    name or id, or every stream whose name matches ``stream_pattern`` (new ones join)."""
    from pyspark.sql import functions as F

    options = {"pm": pm, "startingOffsets": starting_offsets}
    if streams:
        options["streams"] = ",".join(map(str, streams))
    if stream_pattern is not None:
        options["streamPattern"] = stream_pattern
    if max_offsets_per_trigger is not None:
        options["maxOffsetsPerTrigger"] = str(max_offsets_per_trigger)
    opts = parse_source_options(options, streaming=True)  # misuse fails here, option named
    view = DriverClient(opts.pm, opts.timeout_ms, opts.security)
    try:
        if opts.pattern is None:  # unknown stream / unreachable PM: one line, now
            view.check_streams(list(view.resolve(opts.streams).values()))
        else:
            view.matching(opts.pattern)
    finally:
        view.close()
    df = spark.readStream.format("sbpstream").options(**options).load()
    df = df.withColumn("date", F.to_date(F.col("timestamp")))
    return (
        df.writeStream.format("parquet")
        .partitionBy("date")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger.spark_kwargs())
        .start()
    )


def describe_progress(p: dict[str, Any]) -> str:
    src = (p.get("sources") or [{}])[0]
    end = src.get("endOffset")
    latest = src.get("latestOffset")
    rate = p.get("processedRowsPerSecond") or 0.0
    line = f"batch {p.get('batchId')}: {p.get('numInputRows', 0):,} rows ({rate:,.0f} rows/s)"
    if end:
        line += f", offsets {json.dumps(end) if not isinstance(end, str) else end}"
    if latest:
        line += f", latest {json.dumps(latest) if not isinstance(latest, str) else latest}"
    return line


def run_pipeline(
    *,
    streams: Sequence[StreamRef],
    out: Path,
    checkpoint: Path,
    trigger: Trigger,
    pm: str,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    stream_pattern: str | None = None,
    spark: Any = None,
    report: Callable[[str], None] = print,
) -> int:
    """Run until done (available-now) or interrupted (processing-time); rows written this run."""
    spark = spark or build_session()
    q = start_pipeline(
        spark,
        streams=streams,
        out=out,
        checkpoint=checkpoint,
        trigger=trigger,
        pm=pm,
        starting_offsets=starting_offsets,
        max_offsets_per_trigger=max_offsets_per_trigger,
        stream_pattern=stream_pattern,
    )
    seen = 0
    rows = 0
    t0 = time.monotonic()
    try:
        while True:
            finished = q.awaitTermination(POLL_S)
            progress = q.recentProgress
            for p in progress[seen:]:
                rows += int(p.get("numInputRows", 0))
                report(describe_progress(p))
            seen = len(progress)
            if finished:
                break
    except KeyboardInterrupt:
        report("stopping (the checkpoint keeps the position; run again to continue)")
        q.stop()
    exc = q.exception()
    if exc is not None:
        raise RuntimeError(f"pipeline failed: {_essence(str(exc))}") from None
    report(f"done: {rows:,} rows in {time.monotonic() - t0:.1f}s -> {out} (by date)")
    return rows


def _essence(message: str) -> str:
    """The line of a Spark error that carries our message, else its first line."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if "option '" in ln or "failOnDataLoss" in ln:
            return ln
    return lines[0] if lines else "unknown error"


def parse_streams_arg(text: str) -> list[StreamRef]:
    """``--streams``: comma-separated stream names or ids (ValueError, one line)."""
    opts = parse_source_options({"pm": DEFAULT_PM, "streams": text}, streaming=True)
    return list(opts.streams)


def run_from_args(
    *,
    streams: str,
    out: Path,
    checkpoint: Path,
    trigger: str = "available-now",
    pm: str | None = None,
    starting_offsets: str = "earliest",
    max_offsets_per_trigger: int | None = None,
    master: str = "local[*]",
) -> int:
    """What ``sbpstream pipeline`` calls; ValueError/RuntimeError carry a one-line message."""
    parsed_trigger = parse_trigger(trigger)
    stream_ids = parse_streams_arg(streams)
    return run_pipeline(
        streams=stream_ids,
        out=out,
        checkpoint=checkpoint,
        trigger=parsed_trigger,
        pm=pm or os.environ.get(PM_ENV) or DEFAULT_PM,
        starting_offsets=starting_offsets,
        max_offsets_per_trigger=max_offsets_per_trigger,
        spark=build_session(master),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sbpstream.spark.pipeline",
        description="Streams -> Parquet by date, exactly once, with Spark Structured Streaming.",
    )
    ap.add_argument("--streams", required=True, help="comma-separated stream ids")
    ap.add_argument("--out", required=True, type=Path, help="output Parquet directory")
    ap.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory")
    ap.add_argument("--trigger", default="available-now",
                    help="available-now (default) or processing-time=SECONDS")
    ap.add_argument("--pm", default=os.environ.get(PM_ENV) or DEFAULT_PM,
                    help=f"placement manager address(es) (env {PM_ENV})")
    ap.add_argument("--starting-offsets", default="earliest",
                    help="earliest (default), latest or JSON {\"<stream>\": offset}")
    ap.add_argument("--max-offsets-per-trigger", type=int, default=None)
    ap.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    args = ap.parse_args(argv)
    try:
        run_from_args(
            streams=args.streams,
            out=args.out,
            checkpoint=args.checkpoint,
            trigger=args.trigger,
            pm=args.pm,
            starting_offsets=args.starting_offsets,
            max_offsets_per_trigger=args.max_offsets_per_trigger,
            master=args.master,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"sbpstream pipeline: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
