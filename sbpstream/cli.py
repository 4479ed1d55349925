"""The ``sbpstream`` command line: run a cluster or its servers, manage streams, move records.

Every client command takes ``--pm HOST:PORT[,HOST:PORT...]`` (or ``$SBPSTREAM_PM``; default
``127.0.0.1:12378``). Expected failures (unreachable PM, unknown stream, bad offset, bad
arguments) are reported as one line on stderr with a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.exceptions import TyperException

from sbpstream.client import AsyncClient, Client, Range, Stream
from sbpstream.client.loadgen import PhaseResult, consume_load, produce_load
from sbpstream.client.types import (
    DEFAULT_PM,
    DEFAULT_RETENTION_MS,
    PM_ENV,
    Compression,
    StartPosition,
    codec_of,
    pm_addresses,
)
from sbpstream.net.loop import run
from sbpstream.protocol.errors import OffsetOutOfRangeError, SbpError
from sbpstream.records import RecordTooLargeError

T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
READ_CHUNK_BYTES = 1 << 16  # stdin is read in chunks; the lines of a chunk go in one call

err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)

app = typer.Typer(
    name="sbpstream",
    help="sbpstream: distributed stream storage. Run a local cluster with `sbpstream up`, then "
    "create streams, produce and consume records from another terminal.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
stream_app = typer.Typer(
    help="Create, describe, list, trim and delete streams; show their ranges.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(stream_app, name="stream")

PmOption = Annotated[
    str,
    typer.Option(
        "--pm",
        envvar=PM_ENV,
        help=f"Placement manager address(es), HOST:PORT[,HOST:PORT...] (env {PM_ENV}).",
        show_envvar=False,
    ),
]
TimeoutOption = Annotated[
    int,
    typer.Option("--timeout-ms", help="Give up retrying an operation after this many ms."),
]
DEFAULT_TIMEOUT_MS = 15_000


class CliError(Exception):
    """An expected failure: reported as one line, exit status 1."""


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    err_console.print(f"sbpstream: error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _client(pm: str, timeout_ms: int) -> AsyncClient:
    try:
        return AsyncClient(pm, retry_deadline_ms=timeout_ms,
                           request_timeout_ms=min(10_000, max(1000, timeout_ms)))
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)


def _run(pm: str, timeout_ms: int, body: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(client)`` on a fresh event loop; expected errors become one line."""
    client = _client(pm, timeout_ms)

    async def main() -> T:
        async with client:
            return await body(client)

    try:
        return run(main())
    except SbpError as exc:
        fail(str(exc))
    except CliError as exc:
        fail(str(exc))


# ----------------------------------------------------------------------------------- servers


@app.command()
def up(
    directory: Annotated[Path, typer.Option("--dir", help="Data directory (logs in DIR/logs).")
                         ] = Path("./data"),
    datanodes: Annotated[int, typer.Option("--datanodes", min=1, help="Number of data nodes.")
                         ] = 3,
    pm_port: Annotated[int, typer.Option("--pm-port", help="Port of the placement manager.")
                       ] = 12378,
    dn_port: Annotated[int, typer.Option(
        "--dn-port", help="Port of the first data node; the others take the next ones.")] = 10911,
    host: Annotated[str, typer.Option("--host", help="Address every server listens on.")
                    ] = "127.0.0.1",
    fsync: Annotated[str, typer.Option(
        "--fsync", help="Data node fsync policy: always, interval or none.")] = "always",
    heartbeat_interval_ms: Annotated[int, typer.Option(
        "--heartbeat-interval-ms", help="Data node heartbeat period.")] = 1000,
    node_timeout_ms: Annotated[int, typer.Option(
        "--node-timeout-ms", help="A data node silent this long is dead.")] = 5000,
) -> None:
    """Run a whole local cluster (PM on SQLite + N data nodes) in the foreground.

    Prints the addresses and how to produce and consume from a second terminal; Ctrl-C or
    SIGTERM shuts every process down gracefully.
    """
    from sbpstream.cluster import LocalCluster

    if fsync not in ("always", "interval", "none"):
        fail(f"--fsync {fsync!r}: expected always, interval or none", EXIT_USAGE)
    cluster = LocalCluster(
        directory, datanodes=datanodes, pm_port=pm_port, dn_port=dn_port, host=host,
        fsync=fsync, heartbeat_interval_ms=heartbeat_interval_ms, node_timeout_ms=node_timeout_ms,
    )
    with _stop_on_sigterm():
        try:
            _busy_ports(host, [pm_port, *(dn_port + i for i in range(datanodes))])
            err_console.print(f"starting PM and {datanodes} data node(s) under {directory} ...")
            cluster.start()
        except (RuntimeError, TimeoutError, OSError, CliError) as exc:
            cluster.stop()
            first = str(exc).splitlines()[0]
            fail(f"cluster did not start: {first} (logs: {directory / 'logs'})")
        except KeyboardInterrupt:
            cluster.stop()
            raise typer.Exit(EXIT_INTERRUPTED) from None
        _print_banner(cluster.pm_address, [dn.address for dn in cluster.datanodes], directory)
        try:
            _watch(cluster)
        except KeyboardInterrupt:
            pass
        finally:
            err_console.print("stopping the cluster ...")
            cluster.stop()
            err_console.print("stopped.")


def _busy_ports(host: str, ports: list[int]) -> None:
    import socket

    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise CliError(f"port {host}:{port} is not free ({exc.strerror})") from None


class _Stop(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C."""


class _stop_on_sigterm:
    def __enter__(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            raise _Stop()

        self._old = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._old)


def _print_banner(pm: str, dns: list[str], directory: Path) -> None:
    exe = "sbpstream"
    lines = [
        f"sbpstream cluster is up (data and logs under {directory}).",
        f"  placement manager: {pm}",
        *[f"  data node {i}:       {a}" for i, a in enumerate(dns)],
        "",
        "From a second terminal:",
        f"  export {PM_ENV}={pm}",
        f"  {exe} stream create                      # prints the new stream id, e.g. 1",
        f"  seq 1 5 | {exe} produce --stream 1        # one record per line",
        f"  {exe} consume --stream 1 --from earliest  # add --follow to keep reading",
        f"  {exe} bench --records 100000 --size 100",
        "",
        "Press Ctrl-C to stop.",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _watch(cluster: Any) -> None:
    """Wait for Ctrl-C/SIGTERM; report a server that exits on its own, once."""
    reported: set[str] = set()
    nodes = [cluster.pm, *cluster.datanodes]
    while True:
        time.sleep(0.5)
        for n in nodes:
            if n.proc is not None and n.proc.poll() is not None and n.name not in reported:
                reported.add(n.name)
                err_console.print(f"warning: {n.name} exited with status {n.proc.returncode}; "
                                  f"see {n.log_path}", markup=False)


@app.command("pm")
def pm_server(
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = 12378,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    metadata: Annotated[str, typer.Option(
        "--metadata", help="Metadata store: sqlite:PATH, or etcd://HOST:PORT[,HOST:PORT...]"
        "[/PREFIX][?lease_ttl_s=3] for several PMs with one leader (docs/etcd.md)."
    )] = "sqlite:./data/pm/metadata.sqlite3",
    advertise: Annotated[str, typer.Option(
        "--advertise", help="HOST:PORT others use to reach this PM.")] = "",
    heartbeat_interval_ms: Annotated[int, typer.Option(
        "--heartbeat-interval-ms", help="Expected data node heartbeat period.")] = 1000,
    node_timeout_ms: Annotated[int, typer.Option(
        "--node-timeout-ms", help="A data node silent this long is dead; its ranges move.")
                               ] = 5000,
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", help="Serve Prometheus /metrics over HTTP here (-1: off, 0: any).")
                            ] = -1,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
                         ] = "INFO",
) -> None:
    """Run one placement manager (metadata, placement, liveness) in the foreground."""
    import logging

    from sbpstream.pm.config import PmConfig, sqlite_path
    from sbpstream.pm.server import run_pm

    config = PmConfig(metadata=metadata, port=port, host=host, advertise=advertise,
                      heartbeat_interval_ms=heartbeat_interval_ms,
                      node_timeout_ms=node_timeout_ms, metrics_port=metrics_port)
    try:
        config.validate()
        if not metadata.startswith("etcd://"):
            sqlite_path(metadata).parent.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        fail(str(exc), EXIT_USAGE)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_pm(config, stop)

    try:
        run(serve())
    except (OSError, SbpError, ValueError) as exc:
        fail(f"placement manager failed: {exc}")


@app.command("datanode")
def datanode_server(
    directory: Annotated[Path, typer.Option("--dir", help="Data directory of this node.")],
    pm: PmOption = DEFAULT_PM,
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = 10911,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    advertise: Annotated[str, typer.Option(
        "--advertise", help="HOST:PORT clients use (default HOST:PORT as bound).")] = "",
    heartbeat_interval_ms: Annotated[int, typer.Option(
        "--heartbeat-interval-ms", help="Heartbeat period to the PM.")] = 1000,
    metrics_interval_ms: Annotated[int, typer.Option(
        "--metrics-interval-ms", help="Load report period to the PM.")] = 5000,
    fsync: Annotated[str, typer.Option(
        "--fsync", help="When appends are made durable: always, interval or none.")] = "always",
    fsync_interval_ms: Annotated[int, typer.Option(
        "--fsync-interval-ms", help="Period of --fsync interval.")] = 10,
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", help="Serve Prometheus /metrics over HTTP here (-1: off, 0: any).")
                            ] = -1,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
                         ] = "INFO",
) -> None:
    """Run one data node (stores and serves record batches) in the foreground."""
    import logging

    from sbpstream.datanode.config import DataNodeConfig
    from sbpstream.datanode.node import run_datanode
    from sbpstream.store import FsyncPolicy

    try:
        config = DataNodeConfig(
            directory=directory, port=port, host=host, pm=DataNodeConfig.parse_pm_list(pm),
            advertise=advertise, heartbeat_interval_ms=heartbeat_interval_ms,
            metrics_interval_ms=metrics_interval_ms, fsync=FsyncPolicy(fsync),
            fsync_interval_ms=fsync_interval_ms, metrics_port=metrics_port,
        )
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        run(run_datanode(config))
    except (OSError, SbpError, ValueError) as exc:
        fail(f"data node failed: {exc}")


# ----------------------------------------------------------------------------------- streams


@stream_app.command("create")
def stream_create(
    pm: PmOption = DEFAULT_PM,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per range.")] = 1,
    retention_ms: Annotated[int, typer.Option(
        "--retention-ms", min=1, help="How long records are kept.")] = DEFAULT_RETENTION_MS,
    count: Annotated[int, typer.Option("--count", min=1, help="How many streams to create.")
                     ] = 1,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Create streams; print the new ids, one per line."""
    ids = _run(pm, timeout_ms, lambda c: c.create_streams(
        count, replica_nums=replicas, retention_ms=retention_ms))
    sys.stdout.write("".join(f"{i}\n" for i in ids))


def _streams_table(streams: list[Stream]) -> Table:
    t = Table("stream", "replicas", "retention_ms", "start_offset")
    for s in streams:
        t.add_row(str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
                  str(s.start_offset))
    return t


@stream_app.command("describe")
def stream_describe(
    stream_ids: Annotated[list[int], typer.Argument(help="Stream ids.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Describe streams: replicas, retention, start and end offsets."""

    async def body(c: AsyncClient) -> list[tuple[Stream, int]]:
        streams = await c.describe_streams(stream_ids)
        return [(s, await c.end_offset(s.stream_id)) for s in streams]

    t = Table("stream", "replicas", "retention_ms", "start_offset", "end_offset")
    for s, end in _run(pm, timeout_ms, body):
        t.add_row(str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
                  str(s.start_offset), str(end))
    out_console.print(t)


@stream_app.command("list")
def stream_list(pm: PmOption = DEFAULT_PM, timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS) -> None:
    """List every stream."""
    streams = _run(pm, timeout_ms, lambda c: c.list_streams())
    out_console.print(_streams_table(streams))


@stream_app.command("delete")
def stream_delete(
    stream_ids: Annotated[list[int], typer.Argument(help="Stream ids.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Delete streams (their records become unreadable at once)."""
    _run(pm, timeout_ms, lambda c: c.delete_streams(stream_ids))
    err_console.print(f"deleted {len(stream_ids)} stream(s)")


@stream_app.command("trim")
def stream_trim(
    stream_id: Annotated[int, typer.Argument(help="Stream id.", show_default=False)],
    offset: Annotated[int, typer.Argument(help="New start offset: earlier records are dropped.",
                                          show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Trim a stream: drop the records before OFFSET."""
    s = _run(pm, timeout_ms, lambda c: c.trim_stream(stream_id, offset))
    err_console.print(f"stream {s.stream_id} now starts at {s.start_offset}")


@stream_app.command("ranges")
def stream_ranges(
    stream_id: Annotated[int, typer.Argument(help="Stream id.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Show a stream's ranges: offsets, state and replicas (primary marked *)."""
    ranges: list[Range] = _run(pm, timeout_ms, lambda c: c.list_ranges(stream_id))
    t = Table("range", "start", "end", "next", "state", "replicas")
    for r in ranges:
        reps = ", ".join(f"{'*' if n.is_primary else ''}{n.data_node.node_id}@"
                         f"{n.data_node.advertise_addr}" for n in r.replica_nodes)
        t.add_row(str(r.range_index), str(r.start_offset),
                  "-" if r.end_offset < 0 else str(r.end_offset), str(r.next_offset),
                  "sealed" if r.sealed else "writable", reps)
    out_console.print(t)


# ----------------------------------------------------------------------------- produce / consume


def _stdin_lines(chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[list[bytes]]:
    """Lines of stdin as bytes without their newline, a chunk's worth at a time."""
    fd = sys.stdin.fileno()
    rest = b""
    while True:
        chunk = os.read(fd, chunk_bytes)
        if not chunk:
            break
        lines = chunk.split(b"\n")
        if rest:  # the line cut at the end of the previous chunk (only it is copied again)
            lines[0] = rest + lines[0]
        rest = lines.pop()
        if lines:
            yield lines
    if rest:
        yield [rest]


@app.command()
def produce(
    stream: Annotated[int, typer.Option("--stream", help="Stream id to append to.",
                                        show_default=False)],
    pm: PmOption = DEFAULT_PM,
    key: Annotated[str | None, typer.Option("--key", help="Key of every record (UTF-8).")
                   ] = None,
    compression: Annotated[str, typer.Option(
        "--compression", help="Batch compression: none, zstd or lz4.")] = "none",
    linger_ms: Annotated[float, typer.Option(
        "--linger-ms", help="How long a batch waits for more records.")] = 5.0,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Append each line of stdin as one record (value = the line without its newline).

    Binary-safe. Exits 0 only when every record was acknowledged.
    """
    # stdin is read 1 MiB at a time; the lines of a read go to the producer in one send_batch
    # call: one call into the client's loop thread and one future per read, not per line
    produce_chunk_bytes = 1 << 20
    try:
        codec_of(compression)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)
    key_bytes = key.encode() if key is not None else None
    _valid_pm(pm)
    try:
        with Client(pm, retry_deadline_ms=timeout_ms) as c:
            c.describe_stream(stream)  # a clear error before reading any input
            p = c.producer(compression=_compression(compression), linger_ms=linger_ms)
            futs = [p.send_batch(stream, lines, key=key_bytes)
                    for lines in _stdin_lines(produce_chunk_bytes)]
            p.close()
            n = failed = 0
            first = last = -1
            first_error: BaseException | None = None
            for f in futs:
                offsets = f.result()
                n += len(offsets)
                if offsets.error is not None:
                    failed += offsets.failed
                    first_error = first_error or offsets.error
                for i in (0, len(offsets) - 1) if len(offsets) else ():
                    try:
                        off = offsets[i]
                    except SbpError:  # a failed record has no offset
                        continue
                    first = off if first < 0 else min(first, off)
                    last = max(last, off)
    except SbpError as exc:
        fail(str(exc))
    except RecordTooLargeError as exc:
        fail(f"a line is too large for one record: {exc}")
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if failed:
        fail(f"{failed} of {n} records were not acknowledged: {first_error}")
    err_console.print(f"produced {n} records to stream {stream}"
                      + (f" (offsets {first}..{last})" if n else ""))


def _valid_pm(pm: str) -> None:
    try:
        pm_addresses(pm)
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)


def _compression(name: str) -> Compression:
    try:
        codec_of(name)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)
    return cast(Compression, name.lower())


def _parse_from(value: str) -> StartPosition:
    if value == "earliest":
        return "earliest"
    if value == "latest":
        return "latest"
    try:
        off = int(value)
    except ValueError:
        fail(f"--from {value!r}: expected earliest, latest or an offset", EXIT_USAGE)
    if off < 0:
        fail(f"--from {off}: offsets are >= 0", EXIT_USAGE)
    return off


@app.command()
def consume(
    stream: Annotated[int, typer.Option("--stream", help="Stream id to read.",
                                        show_default=False)],
    pm: PmOption = DEFAULT_PM,
    start: Annotated[str, typer.Option(
        "--from", help="Where to start: earliest, latest or an offset.")] = "earliest",
    count: Annotated[int | None, typer.Option(
        "--count", min=0, help="Stop after this many records.", show_default=False)] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", help="Keep waiting for new records instead of exiting when caught up.")
                      ] = False,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Write one record value per line to stdout (raw bytes).

    Exits when caught up with the stream's end (unless --follow) or after --count records.
    """
    pos = _parse_from(start)
    _valid_pm(pm)
    out = sys.stdout.buffer
    try:
        with Client(pm, retry_deadline_ms=timeout_ms) as c:
            end = None
            if not follow:
                end = c.end_offset(stream)
                if isinstance(pos, int) and pos > end:
                    raise OffsetOutOfRangeError(
                        f"offset {pos} is beyond the end {end} of stream {stream}")
            else:
                c.describe_stream(stream)
            if count == 0:
                return
            cons = c.consumer(stream, pos, end=end)
            for n, rec in enumerate(cons, 1):
                out.write((rec.value or b"") + b"\n")
                if count is not None and n >= count:
                    break
                if follow and not cons.buffered:
                    out.flush()  # about to wait for more: show what we have
            out.flush()
    except SbpError as exc:
        fail(str(exc))
    except BrokenPipeError:
        _quiet_broken_pipe()
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _quiet_broken_pipe() -> NoReturn:
    # stdout's reader went away (e.g. `| head`): not an error; silence the flush at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0)


# ------------------------------------------------------------------------------------ bench


@app.command()
def bench(
    pm: PmOption = DEFAULT_PM,
    records: Annotated[int, typer.Option("--records", min=1, help="Records to produce.")
                       ] = 100_000,
    size: Annotated[int, typer.Option("--size", min=0, help="Bytes per record value.")] = 100,
    streams: Annotated[int, typer.Option("--streams", min=1, help="Streams to spread over.")
                       ] = 1,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per stream.")
                        ] = 1,
    compression: Annotated[str, typer.Option(
        "--compression", help="none, zstd or lz4.")] = "none",
    timeout_ms: TimeoutOption = 60_000,
) -> None:
    """Produce then consume load through the SDK; print records/s, MB/s and latencies."""
    try:
        codec_of(compression)
    except ValueError as exc:
        fail(f"--compression: {exc}", EXIT_USAGE)

    async def body(c: AsyncClient) -> tuple[PhaseResult, PhaseResult]:
        sids = await c.create_streams(streams, replica_nums=replicas)
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
                                      compression=_compression(compression))
            bar.start_task(ctask)
            cons = await consume_load(c, sids, progress=advance(ctask, [time.perf_counter()]))
        return prod, cons

    prod, cons = _run(pm, timeout_ms, body)
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
    streams: Annotated[str, typer.Option("--streams", help="Comma-separated stream ids.")],
    out: Annotated[Path, typer.Option("--out", help="Parquet output directory (by date).")],
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint directory.")],
    trigger: Annotated[str, typer.Option(
        "--trigger", help="available-now or processing-time=SECONDS.")] = "available-now",
    pm: PmOption = DEFAULT_PM,
    starting_offsets: Annotated[str, typer.Option(
        "--starting-offsets", help='earliest, latest or JSON {"<stream>": offset}.')
    ] = "earliest",
    max_offsets_per_trigger: Annotated[int | None, typer.Option(
        "--max-offsets-per-trigger", min=1, help="Records per micro-batch, at most.")] = None,
    master: Annotated[str, typer.Option("--master", help="Spark master.")] = "local[*]",
) -> None:
    """Streams to a Parquet table partitioned by date with Spark, exactly once (docs/spark.md)."""
    try:
        from sbpstream.spark.pipeline import run_from_args
    except ImportError as exc:
        fail(f"the pipeline needs the spark extra (pip install 'sbpstream[spark]'): {exc}")
    try:
        run_from_args(streams=streams, out=out, checkpoint=checkpoint, trigger=trigger, pm=pm,
                      starting_offsets=starting_offsets,
                      max_offsets_per_trigger=max_offsets_per_trigger, master=master)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, exit codes 0 / 1 (error) / 2 (usage) / 130."""
    try:
        rv = app(args=argv, prog_name="sbpstream", standalone_mode=False)
    except TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(EXIT_USAGE)
        err_console.print(f"sbpstream: error: {exc.format_message()}", markup=False,
                          soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(EXIT_INTERRUPTED)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
