"""`sbpstream bench|pipeline|check`: load, a Spark pipeline, a replica check."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sbpstream.cli.app import (
    EXIT_ERROR,
    EXIT_USAGE,
    UNSET,
    PmOption,
    TimeoutOption,
    app,
    compression_of,
    err_console,
    fail,
    interrupted,
    out_console,
    run_command,
    timeout_or,
)
from sbpstream.client import AsyncClient
from sbpstream.client.aclient import compile_stream_pattern
from sbpstream.client.types import (
    codec_of,
)
from sbpstream.protocol.errors import (
    SbpError,
)
from sbpstream.tools.loadgen import PhaseResult, consume_load, produce_load

# ------------------------------------------------------------------------------------ bench

T = TypeVar("T")


BENCH_TIMEOUT_MS: Final = 60_000
"""bench moves more data than one command: a slow machine gets a minute before it gives up."""
BenchTimeoutOption = Annotated[int, typer.Option(
    "--timeout-ms", callback=timeout_or(BENCH_TIMEOUT_MS), show_default=False,
    help=f"Give up retrying after this many ms (default: the global --timeout-ms, "
    f"{BENCH_TIMEOUT_MS}).")]


@app.command()
def bench(
    pm: PmOption = "",
    records: Annotated[int, typer.Option("--records", min=1, help="Records to produce.")
                       ] = 100_000,
    size: Annotated[int, typer.Option("--size", min=0, help="Bytes per record value.")] = 100,
    streams: Annotated[int, typer.Option("--streams", min=1, help="Streams to spread over.")
                       ] = 1,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per stream.")
                        ] = 1,
    compression: Annotated[str, typer.Option(
        "--compression", help="none, zstd or lz4.")] = "none",
    keep: Annotated[bool, typer.Option(
        "--keep", help="Keep the streams it creates (deleted at the end otherwise).")] = False,
    timeout_ms: BenchTimeoutOption = UNSET,
) -> None:
    """Produce then consume load through the SDK; print records/s, MB/s and latencies.

    Works on streams of its own, which it deletes when done unless --keep.
    """
    try:
        codec_of(compression)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)

    async def body(c: AsyncClient) -> tuple[PhaseResult, PhaseResult]:
        sids = await c.create_streams(streams, replica_nums=replicas)
        try:
            return await load(c, sids)
        finally:
            if keep:
                err_console.print(f"kept stream(s) {','.join(map(str, sids))} (--keep)")
            else:
                await c.delete_streams(sids)
                err_console.print(f"deleted the {len(sids)} bench stream(s) "
                                  "(--keep keeps them)")

    async def load(c: AsyncClient, sids: list[int]) -> tuple[PhaseResult, PhaseResult]:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                      console=err_console) as bar:
            t0 = time.perf_counter()
            ptask = bar.add_task("produce", total=records, rate="")
            ctask = bar.add_task("consume", total=records, rate="", start=False)

            def advance(task: Any, start: list[float]) -> Callable[[int], None]:
                def cb(n: int) -> None:
                    bar.advance(task, n)
                    done = bar.tasks[task].completed
                    el = time.perf_counter() - start[0]
                    bar.update(task, rate=f"{done / el:,.0f} rec/s" if el > 0 else "")
                return cb

            prod = await produce_load(c, sids, records, size, progress=advance(ptask, [t0]),
                                      compression=compression_of(compression))
            bar.start_task(ctask)
            cons = await consume_load(c, sids, progress=advance(ctask, [time.perf_counter()]))
        return prod, cons

    prod, cons = run_command(pm, timeout_ms, body)
    t = Table("phase", "records", "records/s", "MB/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms",
              title=f"{records} records x {size} B over {streams} stream(s), "
                    f"{replicas} replica(s)")
    for name, r in (("produce", prod), ("consume", cons)):
        lat = r.latencies_ms
        t.add_row(name, str(r.records), f"{r.records_per_s:,.0f}", f"{r.mb_per_s:,.1f}",
                  *(f"{r.percentile_ms(p):.2f}" if lat else "-" for p in (50, 99, 99.9)),
                  f"{lat[-1]:.2f}" if lat else "-")
    out_console.print(t)
    if cons.records != records:
        fail(f"consumed {cons.records} records, expected {records}")


# --------------------------------------------------------------------------------- pipeline


@app.command()
def pipeline(
    out: Annotated[Path, typer.Option("--out", help="Parquet output directory (by date).")],
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint directory.")],
    trigger: Annotated[str, typer.Option(
        "--trigger", help="available-now or processing-time=SECONDS.")] = "available-now",
    pm: PmOption = "",
    starting_offsets: Annotated[str, typer.Option(
        "--starting-offsets", help='earliest, latest or JSON {"<stream>": offset}.')
    ] = "earliest",
    max_offsets_per_trigger: Annotated[int | None, typer.Option(
        "--max-offsets-per-trigger", min=1, help="Records per micro-batch, at most.")] = None,
    master: Annotated[str, typer.Option("--master", help="Spark master.")] = "local[*]",
    streams: Annotated[str | None, typer.Option(
        "--streams", help="Comma-separated stream names or ids.", show_default=False)] = None,
    stream_pattern: Annotated[str | None, typer.Option(
        "--stream-pattern", help="Instead of --streams: every stream whose whole name matches "
        "this regular expression; streams created later join at the next trigger.",
        show_default=False)] = None,
) -> None:
    """Streams to a Parquet table partitioned by date with Spark, exactly once (docs/spark.md).

    Ctrl-C stops the query between py4j calls and exits 130; the checkpoint keeps the position.
    """
    try:
        from sbpstream.spark.pipeline import (
            build_session,
            parse_streams_arg,
            parse_trigger,
            run_pipeline,
        )
    except ImportError as exc:
        fail(f"the pipeline needs the spark extra (make install, or pip install "
             f"'dist/sbpstream-<version>-py3-none-any.whl[spark]'; docs/spark.md): {exc}")
    try:
        parsed_trigger = parse_trigger(trigger)
        if (streams is None) == (stream_pattern is None):
            raise ValueError("give --streams (names or ids) or --stream-pattern (a regex)")
        stream_ids = parse_streams_arg(streams) if streams is not None else []
        if stream_pattern is not None:
            compile_stream_pattern(stream_pattern)
    except (ValueError, SbpError) as exc:
        fail(str(exc), EXIT_USAGE)
    box: dict[str, Any] = {}

    def work() -> None:
        # Spark runs in this thread, so SIGINT reaches the main thread only, never in the middle
        # of a py4j socket read (PySpark's own SIGINT handler, installed only when the session
        # starts in the main thread, made a py4j call from inside an interrupted one).
        try:
            box["spark"] = build_session(master)
            if box.get("interrupted"):
                return
            box["rows"] = run_pipeline(
                streams=stream_ids, out=out, checkpoint=checkpoint, trigger=parsed_trigger, pm=pm,
                starting_offsets=starting_offsets,
                max_offsets_per_trigger=max_offsets_per_trigger, spark=box["spark"],
                stream_pattern=stream_pattern,
                report=lambda line: print(line, flush=True))
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=work, name="sbpstream-pipeline", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        box["interrupted"] = True
        with contextlib.suppress(KeyboardInterrupt):
            _stop_queries(box.get("spark"))
            worker.join(STOP_PIPELINE_S)
        interrupted("sbpstream: interrupted: the query stopped; the checkpoint keeps its "
                    "position (run the same command again to continue)")
    error = box.get("error")
    if isinstance(error, ValueError | RuntimeError | SbpError):
        fail(str(error))
    if error is not None:
        raise error


STOP_PIPELINE_S = 60.0  # bound on a graceful stop of the streaming query after Ctrl-C


def _stop_queries(spark: Any) -> None:
    """Stop the session's streaming queries (a stopped batch is replayed on the next run)."""
    if spark is None:
        return
    with contextlib.suppress(Exception):
        spark.sparkContext.setLogLevel("OFF")  # q.stop() logs the interrupted batch's stack
    for q in spark.streams.active:
        with contextlib.suppress(Exception):
            q.stop()


@app.command("check")
def check(
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Send each replica found short, unsealed or missing its range "
        "(SYNC_RANGES): it copies what it lacks from another replica.")] = False,
    stream: Annotated[list[int] | None, typer.Option(
        "--stream", help="Check only this stream (repeatable).")] = None,
) -> None:
    """Compare every range's replicas with each other and with the PM (docs/operations.md).

    Prints each problem, one a line; exits 1 when there is any, 0 when the cluster is clean.
    """
    from sbpstream.tools.check import check_cluster

    report = run_command(pm, timeout_ms,
                         lambda c: check_cluster(c, repair=repair, stream_ids=stream))
    for p in report.problems:
        print(p)
    for line in report.repaired:
        print(f"repair: {line}")
    print(f"checked {report.streams} stream(s), {report.ranges} range(s), "
          f"{report.replicas} replica(s): {len(report.problems)} problem(s)")
    if report.problems:
        raise typer.Exit(EXIT_ERROR)


