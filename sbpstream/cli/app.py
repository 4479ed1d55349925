"""The ``sbpstream`` command line: run a cluster or its servers, manage streams, move records.

Every client command takes ``--pm HOST:PORT[,HOST:PORT...]`` (or ``$SBPSTREAM_PM``; default
``127.0.0.1:12378``). Expected failures (unreachable PM, unknown stream, bad offset, bad
arguments) are reported as one line on stderr with a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, BinaryIO, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.exceptions import TyperException

from sbpstream.auth.tls import TlsFileError
from sbpstream.cli_security import (
    AllowInsecureAuthOption,
    AllowRemoteOption,
    AuthOption,
    SecretFileOption,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    print_admin_credentials,
    secure_certs,
    security_config,
)
from sbpstream.cli_security import add_commands as add_security_commands
from sbpstream.client import AsyncClient, Client, Range, Stream
from sbpstream.client._sync_support import RecordFuture
from sbpstream.client.aclient import compile_stream_pattern
from sbpstream.client.loadgen import PhaseResult, consume_load, produce_load
from sbpstream.client.producer import Offsets
from sbpstream.client.retry import backoff_observers
from sbpstream.client.types import (
    DEFAULT_PM,
    DEFAULT_RETENTION_MS,
    PM_ENV,
    Compression,
    ConsumedRecord,
    StartPosition,
    codec_of,
    pm_addresses,
)
from sbpstream.introspect.wire import Introspection
from sbpstream.net.loop import run
from sbpstream.protocol.errors import (
    ClientErrorCode,
    ErrorCode,
    OffsetOutOfRangeError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.messages import QuotaCountersResponse
from sbpstream.protocol.names import name_problem
from sbpstream.quota.counters import TtlType
from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec
from sbpstream.quota.model import validate as validate_quota
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
add_security_commands(app)  # certs, user, acl (sbpstream/cli_security.py)
group_app = typer.Typer(
    help="List, describe (members, assignments, committed offsets and lag), reset the offsets "
    "of, and delete consumer groups.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(group_app, name="group")

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


# SDK wording -> the CLI's own words, for hints raised by the SDK but shown by the CLI
_CLI_WORDS = (
    ("use auto_reset='earliest' to jump to the start", "use --from earliest to start there"),
)


def cli_words(message: str) -> str:
    for sdk, cli in _CLI_WORDS:
        message = message.replace(sdk, cli)
    return message


def one_line(message: str) -> str:
    """Errors are one line: a multi-line message (a server's, a library's) is joined."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")  # over a live progress line, if any
    err_console.print(f"sbpstream: error: {one_line(cli_words(message))}", markup=False,
                      soft_wrap=True)
    raise typer.Exit(code)


_said = {"interrupted": False}


def interrupted(message: str = "sbpstream: interrupted") -> NoReturn:
    """Ctrl-C: one line, exit status 130."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")
    err_console.print(message, markup=False)
    _said["interrupted"] = True
    raise typer.Exit(EXIT_INTERRUPTED)


def explain(exc: SbpError, pm: str) -> str:
    """The error's message, with its likely cause when the SDK's words do not say it."""
    text = str(exc)
    if exc.code == ErrorCode.UNSUPPORTED_OPERATION and "datanode" in text:
        return (f"--pm {pm} points at a data node, not a placement manager ({text}); "
                f"`sbpstream up` prints the PM address (default {DEFAULT_PM})")
    last = waiting.last
    if (exc.code in (ClientErrorCode.CONNECTION_CLOSED, ClientErrorCode.CLIENT_TIMEOUT)
            and last is not None and last[0] == "data node"):
        return (f"{text} (the data node at {last[1]} looks down: {last[2]}; "
                "`sbpstream stream ranges ID` shows which nodes hold the stream)")
    return text


_ADDRESS = re.compile(r"(\[[0-9a-fA-F:]+\]:\d+|[A-Za-z0-9_.-]+:\d+)")


class WaitReporter:
    """Says on stderr what a command is waiting for once the SDK has retried for ~1 s.

    Fed by the SDK's backoff hook (from the client's event-loop thread): ``waiting for the
    placement manager at 127.0.0.1:1 (connection refused), 3 s of 15 s``. Remembers the last
    thing waited for, so a final error can name the likely cause.
    """

    FIRST_S = 1.0  # quiet for short hiccups
    EVERY_S = 2.0  # then one line per this many seconds

    def __init__(self) -> None:
        self.pm: set[str] = set()
        self.last: tuple[str, str, str] | None = None  # (what, address, cause)
        self._last_line = 0.0

    def use_pm(self, pm: str) -> None:
        try:
            self.pm = set(pm_addresses(pm))
        except ValueError:
            self.pm = set()

    def describe(self, err: BaseException) -> tuple[str, str, str]:
        msg = getattr(err, "message", str(err))
        m = _ADDRESS.search(msg)
        addr = m.group(1) if m else ""
        cause = _cause_of(err)
        if addr and addr in self.pm:
            return "placement manager", addr, cause
        if addr:
            return "data node", addr, cause
        if isinstance(err, SbpError) and err.code == ErrorCode.NOT_ENOUGH_DATA_NODES:
            return "enough live data nodes", "", cause
        return "a retry", "", cause

    def __call__(self, err: BaseException, elapsed_s: float, deadline_s: float) -> None:
        what, addr, cause = self.last = self.describe(err)
        now = time.monotonic()
        if elapsed_s < self.FIRST_S or now - self._last_line < self.EVERY_S:
            return
        self._last_line = now
        target = f"the {what} at {addr}" if addr else what
        sys.stderr.write(f"waiting for {target} ({cause}), {elapsed_s:.0f} s of "
                         f"{deadline_s:.0f} s\n")
        sys.stderr.flush()


def _cause_of(err: BaseException) -> str:
    root = err.__cause__
    if isinstance(root, TimeoutError):
        return "no answer"
    if isinstance(root, OSError) and root.errno:
        return os.strerror(root.errno).lower()
    if isinstance(err, SbpError):
        return f"{err.code.name}: {err.message}"
    return str(err)


waiting = WaitReporter()


class LiveCount:
    """A live ``N records, R records/s`` line on stderr, only when stderr is a terminal."""

    AFTER_S = 1.0  # short work shows nothing
    EVERY_S = 0.25

    def __init__(self, verb: str, enabled: bool | None = None) -> None:
        self.verb = verb
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.count = 0
        self._t0 = time.monotonic()
        self._next = self._t0 + self.AFTER_S
        self._shown = False

    def add(self, n: int) -> None:
        self.count += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.EVERY_S
        rate = self.count / max(now - self._t0, 1e-9)
        sys.stderr.write(f"\r\x1b[K{self.verb} {self.count:,} records, {rate:,.0f} records/s")
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._shown = False


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sbpstream")
    except PackageNotFoundError:
        from sbpstream import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"sbpstream {_version()}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
                       ] = False,
    user: Annotated[str, typer.Option("--user", help="Authenticate as this user "
                                      "(env SBPSTREAM_USER).")] = "",
    password: Annotated[str, typer.Option("--password", help="The user's password "
                                          "(env SBPSTREAM_PASSWORD).")] = "",
    token_file: Annotated[str, typer.Option("--token-file", help="Authenticate with the token "
                                            "in this file (env SBPSTREAM_TOKEN_FILE).")] = "",
    tls_ca: Annotated[str, typer.Option("--tls-ca", help="Connect over TLS, verifying servers "
                                        "against this CA (env SBPSTREAM_TLS_CA).")] = "",
) -> None:
    # handed to the SDK through its environment variables (docs/security.md)
    for name, value in (("SBPSTREAM_USER", user), ("SBPSTREAM_PASSWORD", password),
                        ("SBPSTREAM_TOKEN_FILE", token_file), ("SBPSTREAM_TLS_CA", tls_ca)):
        if value:
            os.environ[name] = value


def _client(pm: str, timeout_ms: int) -> AsyncClient:
    """The one client every command uses: --pm, and the credentials and CA given before the
    command (or by $SBPSTREAM_USER, _PASSWORD, _TOKEN_FILE, _TLS_CA)."""
    waiting.use_pm(pm)
    try:
        return AsyncClient(pm, retry_deadline_ms=timeout_ms,
                           request_timeout_ms=min(10_000, max(1000, timeout_ms)),
                           client_id=_CLIENT["id"])
    except TlsFileError as exc:
        fail(str(exc), EXIT_USAGE)
    except ValueError as exc:
        fail(f"--pm: {exc}", EXIT_USAGE)


class ClientIntrospection(Introspection):
    """INFO, STATS, CONNECTIONS and WHOAMI on the connection ``client`` keeps to ``address``
    (TLS, authenticated); the client closes it."""

    def __init__(self, client: AsyncClient, address: str) -> None:
        super().__init__(address)
        self.client = client

    async def __aenter__(self) -> ClientIntrospection:
        # the client's pool: TLS and credentials, no client-id HEARTBEAT (WHOAMI counts only
        # what the command asked)
        self._conn = await self.client._pool.get(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn = None


def _run(pm: str, timeout_ms: int, body: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(client)`` on a fresh event loop; expected errors become one line."""
    client = _client(pm, timeout_ms)

    async def main() -> T:
        async with client:
            return await body(client)

    try:
        return run(main())
    except SbpError as exc:
        fail(explain(exc, pm))
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
    admin_port: Annotated[int, typer.Option(
        "--admin-port", "--metrics-port",
        help="Admin HTTP ports (web console, /v1 JSON, Prometheus /metrics): the PM on this "
        "port, data node i on this port + 1 + i.")] = 12380,
    secure: Annotated[bool, typer.Option(
        "--secure", help="TLS and authentication everywhere (certificates under DIR/certs); "
        "prints the admin credentials.")] = False,
    kafka_port: Annotated[int | None, typer.Option(
        "--kafka-port", help="Also run a Kafka gateway on this port (docs/kafka.md).",
        show_default=False)] = None,
) -> None:
    """Run a whole local cluster (PM on SQLite + N data nodes) in the foreground, supervised.

    Prints the addresses, pids and how to produce and consume from a second terminal. A server
    that dies is restarted (same port and data) after a growing backoff, and said so on stderr.
    Ctrl-C stops every process gracefully and exits 130; SIGTERM does the same and exits 0.
    """
    from sbpstream.cluster import LocalCluster, Supervisor

    if fsync not in ("always", "interval", "none"):
        fail(f"--fsync {fsync!r}: expected always, interval or none", EXIT_USAGE)
    directory = directory.absolute()  # printed paths work from any directory
    cluster = LocalCluster(
        directory, datanodes=datanodes, pm_port=pm_port, dn_port=dn_port, host=host,
        fsync=fsync, heartbeat_interval_ms=heartbeat_interval_ms, node_timeout_ms=node_timeout_ms,
        metrics_port=admin_port, pid_files=True, kafka_port=kafka_port,
        secure=secure_certs(directory) if secure else None,
    )
    ports = [n.port for n in cluster.nodes]
    ports += [n.metrics_port for n in cluster.nodes if n.metrics_port is not None]
    with _stop_on_sigterm():
        try:
            _busy_ports(host, ports)
            err_console.print(f"starting PM and {datanodes} data node(s) under {directory} ...")
            cluster.start()
        except (RuntimeError, TimeoutError, OSError, CliError) as exc:
            cluster.stop()
            first = str(exc).splitlines()[0]
            logs = directory / "logs"
            fail(f"cluster did not start: {first}" + (f" (logs: {logs})" if logs.is_dir() else ""))
        except KeyboardInterrupt:
            _shut_down(cluster)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        scheme = "https" if secure else "http"  # the admin ports serve TLS when secure
        _print_banner(cluster, console=f"{scheme}://{host}:{admin_port}/", scheme=scheme)
        if secure:
            try:
                print_admin_credentials(cluster)
            except (SbpError, OSError) as exc:
                _shut_down(cluster)
                fail(f"could not create the admin user: {exc}")
            sys.stdout.write(cluster.kafka_settings())  # Kafka clients' SASL_SSL settings
        supervisor = Supervisor(
            cluster, lambda line: err_console.print(line, markup=False, soft_wrap=True))
        try:
            supervisor.run()
        except _Stop:  # SIGTERM: a requested stop, exit 0
            err_console.print("stopping the cluster ...")
            _shut_down(cluster)
            err_console.print("stopped.")
        except KeyboardInterrupt:  # Ctrl-C: one line, exit 130
            err_console.print("sbpstream: interrupted; stopping the cluster ...", end="")
            _shut_down(cluster)
            err_console.print(" stopped.", markup=False)
            _said["interrupted"] = True
            raise typer.Exit(EXIT_INTERRUPTED) from None


def _shut_down(cluster: Any) -> None:
    """Stop every process gracefully; a second Ctrl-C (or SIGTERM) kills what is left."""
    try:
        cluster.stop()
    except KeyboardInterrupt:
        cluster.kill_all()


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


def _print_banner(cluster: Any, console: str = "", scheme: str = "http") -> None:
    exe = "sbpstream"
    pm = cluster.pm_address

    def row(label: str, node: Any) -> str:
        metrics = (f"  metrics {scheme}://{node.host}:{node.metrics_port}/metrics"
                   if node.metrics_port is not None else "")
        pid = node.proc.pid if node.proc is not None else "?"
        return f"  {label:<19}{node.address}  pid {pid}{metrics}"

    lines = [
        f"sbpstream cluster is up (data under {cluster.directory}, logs under "
        f"{cluster.directory / 'logs'}, pid files under {cluster.pid_dir}).",
        row("placement manager:", cluster.pm),
        *([f"  {'web console:':<19}{console}"] if console else []),
        *[row(f"data node {i}:", dn) for i, dn in enumerate(cluster.datanodes)],
        *([row("kafka gateway:", cluster.kafka)] if getattr(cluster, "kafka", None) else []),
        "A server that dies is restarted on the same port with the same data.",
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
    public_metrics: Annotated[bool, typer.Option(
        "--public-metrics", help="With --auth, serve /metrics without credentials.")] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
                         ] = "INFO",
    tls_cert: TlsCertOption = "",
    tls_key: TlsKeyOption = "",
    tls_ca: TlsCaOption = "",
    auth: AuthOption = False,
    secret_file: SecretFileOption = "",
    allow_remote_unauthenticated: AllowRemoteOption = False,
    allow_insecure_auth: AllowInsecureAuthOption = False,
) -> None:
    """Run one placement manager (metadata, placement, liveness) in the foreground."""

    from sbpstream.pm.config import PmConfig, sqlite_path
    from sbpstream.pm.server import run_pm
    from sbpstream.private_files import private_dir

    security = security_config(tls_cert, tls_key, tls_ca, auth, secret_file,
                               allow_remote_unauthenticated, allow_insecure_auth)
    config = PmConfig(metadata=metadata, port=port, host=host, advertise=advertise,
                      heartbeat_interval_ms=heartbeat_interval_ms,
                      node_timeout_ms=node_timeout_ms, metrics_port=metrics_port,
                      public_metrics=public_metrics, security=security)
    try:
        config.validate()
        security.validate(host)
        if not metadata.startswith("etcd://"):
            private_dir(sqlite_path(metadata).parent)
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
    public_metrics: Annotated[bool, typer.Option(
        "--public-metrics", help="With --auth, serve /metrics without credentials.")] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
                         ] = "INFO",
    tls_cert: TlsCertOption = "",
    tls_key: TlsKeyOption = "",
    tls_ca: TlsCaOption = "",
    auth: AuthOption = False,
    secret_file: SecretFileOption = "",
    allow_remote_unauthenticated: AllowRemoteOption = False,
    allow_insecure_auth: AllowInsecureAuthOption = False,
) -> None:
    """Run one data node (stores and serves record batches) in the foreground."""

    from sbpstream.datanode.config import DataNodeConfig
    from sbpstream.datanode.node import run_datanode
    from sbpstream.store import FsyncPolicy

    try:
        config = DataNodeConfig(
            directory=directory, port=port, host=host, pm=DataNodeConfig.parse_pm_list(pm),
            advertise=advertise, heartbeat_interval_ms=heartbeat_interval_ms,
            metrics_interval_ms=metrics_interval_ms, fsync=FsyncPolicy(fsync),
            fsync_interval_ms=fsync_interval_ms, metrics_port=metrics_port,
            public_metrics=public_metrics,
            security=security_config(tls_cert, tls_key, tls_ca, auth, secret_file,
                                     allow_remote_unauthenticated, allow_insecure_auth),
        )
        config.security.validate(host)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        run(run_datanode(config))
    except (OSError, SbpError, ValueError) as exc:
        fail(f"data node failed: {exc}")


@app.command("kafka-gateway")
def kafka_gateway(
    pm: PmOption = DEFAULT_PM,
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = 9092,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    advertise: Annotated[str, typer.Option(
        "--advertise", help="HOST:PORT Metadata tells clients (default HOST:PORT as bound).")
                         ] = "",
    partitions: Annotated[int, typer.Option(
        "--partitions", min=1, help="Partitions of a topic created on first use.")] = 1,
    replicas: Annotated[int, typer.Option(
        "--replicas", min=1, help="Replicas of the streams of a topic created without a "
        "replication factor.")] = 1,
    auto_create: Annotated[bool, typer.Option(
        "--auto-create/--no-auto-create", help="Create unknown topics a client asks for.")
                           ] = True,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR.")
                         ] = "INFO",
    listener: Annotated[str, typer.Option(
        "--listener", help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (docs/kafka.md).")
                        ] = "PLAINTEXT",
    tls_cert: Annotated[str, typer.Option("--tls-cert", help="PEM certificate (SSL listeners).")
                        ] = "",
    tls_key: Annotated[str, typer.Option("--tls-key", help="PEM key of --tls-cert.")] = "",
    tls_ca: Annotated[str, typer.Option(
        "--tls-ca", help="PEM CA verifying the PM and data nodes.")] = "",
    allow_sasl_plaintext: Annotated[bool, typer.Option(
        "--allow-sasl-plaintext", help="Allow SASL_PLAINTEXT beyond loopback.")] = False,
) -> None:
    """Run a Kafka wire-protocol gateway: Kafka clients produce and consume through it
    (topic T partition N = stream T.N; docs/kafka.md)."""
    from sbpstream.kafka.gateway import KafkaGateway, run_gateway

    _valid_pm(pm)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        gw = KafkaGateway(pm, host=host, port=port, advertised=advertise or None,
                          auto_create=auto_create, default_partitions=partitions,
                          replicas=replicas, listener=listener, tls_cert=tls_cert,
                          tls_key=tls_key, tls_ca=tls_ca,
                          allow_sasl_plaintext=allow_sasl_plaintext)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)

    async def serve() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_gateway(gw)

    try:
        run(serve())
    except (OSError, SbpError, ValueError) as exc:
        fail(f"kafka gateway failed: {exc}")


# ----------------------------------------------------------------------------------- streams


@stream_app.command("create")
def stream_create(
    names: Annotated[list[str] | None, typer.Argument(
        help="Names of the streams to create, one stream each (unique; 1-249 characters of "
        "a-z A-Z 0-9 . _ -, not all digits). Without names: --count unnamed streams.",
        show_default=False)] = None,
    pm: PmOption = DEFAULT_PM,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per range.")] = 1,
    retention_ms: Annotated[int, typer.Option(
        "--retention-ms", min=1, help="How long records are kept.")] = DEFAULT_RETENTION_MS,
    count: Annotated[int, typer.Option("--count", min=1, help="How many streams to create.")
                     ] = 1,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Create streams; print the new ids, one per line."""
    for name in names or ():
        problem = name_problem(name)
        if problem is not None:
            fail(problem, EXIT_USAGE)
    ids = _run(pm, timeout_ms, lambda c: c.create_streams(
        count, replica_nums=replicas, retention_ms=retention_ms, names=names or ()))
    sys.stdout.write("".join(f"{i}\n" for i in ids))


def _streams_table(streams: list[tuple[Stream, int | None]],
                   stored: dict[int, int] | None = None) -> Table:
    """One row per stream; ``stored`` (stream id -> bytes, from STATS) adds a bytes column."""
    cols = ["stream", "replicas", "retention_ms", "start_offset", "end_offset", "records"]
    t = Table(*cols, *(["bytes"] if stored is not None else []))
    # names are never cut (a narrow terminal or a pipe: rich squeezes the number columns)
    t.add_column("name", no_wrap=True,
                 min_width=max((len(s.name) for s, _ in streams), default=4))
    for s, end in streams:
        row = [str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
               str(s.start_offset), "-" if end is None else str(end),
               "-" if end is None else str(max(0, end - s.start_offset))]
        if stored is not None:
            row.append(str(stored[s.stream_id]) if s.stream_id in stored else "-")
        t.add_row(*row, s.name or "-")
    return t


STORED_BYTES_CHUNK = 1_000
"""Streams per STATS request of `stream list` (each row is a few hundred bytes of JSON)."""


async def _stored_bytes(c: AsyncClient, ids: list[int]) -> dict[int, int]:
    """Stream id -> bytes stored (each range once), from the PM's STATS; {} when unavailable."""
    out: dict[int, int] = {}
    try:
        async with ClientIntrospection(c, c.pm_addresses[0]) as i:
            for at in range(0, len(ids), STORED_BYTES_CHUNK):
                _, body = await i.stats(ids[at:at + STORED_BYTES_CHUNK])
                for row in body.get("streams", ()):
                    out[int(row["stream_id"])] = int(row.get("bytes_stored", 0))
    except (SbpError, OSError, ValueError):
        return {}
    return out


@stream_app.command("describe")
def stream_describe(
    stream_ids: Annotated[list[str], typer.Argument(help="Stream names or ids.",
                                                    show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Describe streams: replicas, retention, start and end offsets.

    Each id is reported on its own: a deleted or unknown one gets a row saying so (and the exit
    status is 1), the others are still shown.
    """

    async def one(c: AsyncClient, sid: str) -> tuple[Stream, int] | str:
        try:
            s = await c.describe_stream(sid)
            return s, await c.end_offset(sid)
        except StreamDeletedError:
            return "deleted"
        except StreamNotFoundError:
            return "not found"

    async def body(c: AsyncClient) -> list[tuple[Stream, int] | str]:
        return list(await asyncio.gather(*(one(c, sid) for sid in stream_ids)))

    results = _run(pm, timeout_ms, body)
    missing = [(sid, r) for sid, r in zip(stream_ids, results, strict=True) if isinstance(r, str)]
    if len(missing) == len(stream_ids):
        fail("; ".join(f"stream {sid} {state}" for sid, state in missing))
    t = Table("stream", "state", "replicas", "retention_ms", "start_offset", "end_offset",
              "name")
    for sid, r in zip(stream_ids, results, strict=True):
        if isinstance(r, str):
            t.add_row(str(sid), r, "-", "-", "-", "-", "-")
        else:
            s, end = r
            t.add_row(str(s.stream_id), "active", str(s.replica_nums),
                      str(s.retention_period_ms), str(s.start_offset), str(end), s.name or "-")
    out_console.print(t)
    if missing:
        fail("; ".join(f"stream {sid} {state}" for sid, state in missing))


@stream_app.command("list")
def stream_list(pm: PmOption = DEFAULT_PM, timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS) -> None:
    """List every stream: start and end offsets (end: the next offset to be written), records,
    bytes stored (each range counted once, from the data nodes' STATS), name."""

    async def end_of(c: AsyncClient, s: Stream) -> tuple[Stream, int | None]:
        try:
            return s, await c.end_offset(s.stream_id)
        except (StreamNotFoundError, StreamDeletedError):  # deleted since it was listed
            return s, None

    async def body(c: AsyncClient) -> tuple[list[tuple[Stream, int | None]], dict[int, int]]:
        streams = await c.list_streams()
        rows = list(await asyncio.gather(*(end_of(c, s) for s in streams)))
        return rows, await _stored_bytes(c, [s.stream_id for s in streams])

    rows, stored = _run(pm, timeout_ms, body)
    out_console.print(_streams_table(rows, stored))


@stream_app.command("update")
def stream_update(
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
    retention_ms: Annotated[int | None, typer.Option(
        "--retention-ms", min=1, help="New retention: how long records are kept.",
        show_default=False)] = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, help="New replica count of the ranges.", show_default=False)
                        ] = None,
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Change a stream's retention and/or replica count; print its new description."""
    if retention_ms is None and replicas is None:
        fail("nothing to change: give --retention-ms and/or --replicas", EXIT_USAGE)
    s = _run(pm, timeout_ms, lambda c: c.update_stream(
        stream_id, replica_nums=replicas, retention_ms=retention_ms))
    t = Table("stream", "replicas", "retention_ms", "start_offset")
    t.add_row(str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
              str(s.start_offset))
    out_console.print(t)


@stream_app.command("delete")
def stream_delete(
    stream_ids: Annotated[list[str], typer.Argument(help="Stream names or ids.",
                                                    show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Delete streams (their records become unreadable at once)."""
    _run(pm, timeout_ms, lambda c: c.delete_streams(stream_ids))
    err_console.print(f"deleted {len(stream_ids)} stream(s)")


@stream_app.command("trim")
def stream_trim(
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
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
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Show a stream's ranges: offsets, state and replicas (primary marked *).

    The writable range's next offset is asked of its primary, so it is live.
    """

    async def body(c: AsyncClient) -> list[Range]:
        ranges = await c.list_ranges(stream_id)
        if ranges and not ranges[-1].sealed:
            try:
                ranges[-1] = await c.describe_range(stream_id, ranges[-1].range_index)
            except SbpError as exc:  # the PM's figure is better than nothing
                err_console.print(f"warning: the primary did not answer ({exc}); "
                                  "'next' may be stale", markup=False)
        return ranges

    ranges: list[Range] = _run(pm, timeout_ms, body)
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
    stream: Annotated[str, typer.Option("--stream", help="Stream name or id to append to.",
                                        show_default=False)],
    pm: PmOption = DEFAULT_PM,
    key: Annotated[str | None, typer.Option("--key", help="Key of every record (UTF-8).")
                   ] = None,
    key_separator: Annotated[str | None, typer.Option(
        "--key-separator", help="Each line is KEY<SEP>VALUE, split at the first SEP "
        "(like kafka-console-producer's parse.key/key.separator).", show_default=False)] = None,
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
    if key_separator is not None and key is not None:
        fail("--key and --key-separator exclude each other", EXIT_USAGE)
    if key_separator == "":
        fail("--key-separator must not be empty", EXIT_USAGE)
    sep = key_separator.encode() if key_separator is not None else None
    _valid_pm(pm)
    try:
        with Client(pm, retry_deadline_ms=timeout_ms, client_id=_CLIENT["id"]) as c:
            sid = c.resolve_stream(_stream_ref(stream))
            c.describe_stream(sid)  # a clear error before reading any input
            p = c.producer(compression=_compression(compression), linger_ms=linger_ms)
            batches: list[concurrent.futures.Future[Offsets]] = []
            singles: list[RecordFuture] = []
            live = LiveCount("produced")
            for lines in _stdin_lines(produce_chunk_bytes):
                live.add(len(lines))
                if sep is not None:  # a key per line: records one at a time
                    pairs = _split_keys(lines, sep, len(singles))
                    singles += [p.send(sid, v, key=k) for k, v in pairs]
                else:  # one call (one cross-thread hop) per chunk of stdin
                    batches.append(p.send_batch(sid, lines, key=key_bytes))
            p.close()
            live.clear()
            n = failed = 0
            first = last = -1
            first_error: BaseException | None = None
            for single in singles:
                n += 1
                error = single.exception()
                if error is not None:
                    failed += 1
                    first_error = first_error or error
                else:
                    off = single.result()
                    first = off if first < 0 else min(first, off)
                    last = max(last, off)
            for f in batches:
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
        fail(explain(exc, pm))
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    except RecordTooLargeError as exc:
        fail(f"a line is too large for one record: {exc}")
    except KeyboardInterrupt:
        interrupted()
    if failed:
        why = explain(first_error, pm) if isinstance(first_error, SbpError) else first_error
        fail(f"{failed} of {n} records were not acknowledged: {why}")
    err_console.print(f"produced {n} records to stream {stream}"
                      + (f" (offsets {first}..{last})" if n else ""))


def _stream_ref(text: str) -> int | str:
    """``--stream NAME|ID``: digits are an id, anything else a name (checked here, one line)."""
    problem = None if text.strip().isdigit() else name_problem(text)
    if problem is not None:
        raise CliError(f"--stream: {problem}")
    return text


def _split_keys(lines: list[bytes], sep: bytes, first_line: int) -> list[tuple[bytes, bytes]]:
    """KEY<SEP>VALUE lines as (key, value); a line without SEP is an error naming it."""
    out = []
    for i, ln in enumerate(lines):
        k, found, v = ln.partition(sep)
        if not found:
            raise CliError(f"line {first_line + i + 1} has no key separator {sep.decode()!r} "
                           "(--key-separator)")
        out.append((k, v))
    return out


def _valid_pm(pm: str) -> None:
    waiting.use_pm(pm)
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
    stream: Annotated[str, typer.Option("--stream", help="Stream name or id to read.",
                                        show_default=False)],
    pm: PmOption = DEFAULT_PM,
    start: Annotated[str, typer.Option(
        "--from", help="Where to start: earliest, latest or an offset.")] = "earliest",
    count: Annotated[int | None, typer.Option(
        "--count", min=0, help="Stop after this many records.", show_default=False)] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", help="Keep waiting for new records instead of exiting when caught up.")
                      ] = False,
    print_offset: Annotated[bool, typer.Option(
        "--print-offset", help="Prefix each value with Offset:N and a tab.")] = False,
    print_timestamp: Annotated[bool, typer.Option(
        "--print-timestamp", help="Prefix each value with CreateTime:MS and a tab.")] = False,
    print_key: Annotated[bool, typer.Option(
        "--print-key", help="Prefix each value with its key (null if none) and a tab.")
                         ] = False,
    output_format: Annotated[str, typer.Option(
        "--format", help="raw (the value, with the --print-* prefixes) or json (one object "
        "per record: stream, offset, timestamp_ms, key, value, headers; bytes that are not "
        "UTF-8 go in key_base64/value_base64).")] = "raw",
    group: Annotated[str | None, typer.Option(
        "--group", help="Read as a member of this consumer group: resume at its committed "
        "offset (--from only when it has none) and commit what was written.",
        show_default=False)] = None,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Write one record per line to stdout: its value as raw bytes, or JSON with --format json.

    Exits when caught up with the stream's end (unless --follow) or after --count records.
    --print-timestamp, --print-offset and --print-key prefix the value, tab-separated, in that
    order (as kafka-console-consumer's print.timestamp/print.offset/print.key). With --group
    the next run resumes after the last record written (offsets are committed every few
    seconds and at exit: a record may be written again after a crash, never skipped).
    """
    pos = _parse_from(start)
    if output_format not in ("raw", "json"):
        fail(f"--format {output_format!r}: expected raw or json", EXIT_USAGE)
    line_of = _record_formatter(output_format, print_timestamp, print_offset, print_key)
    _valid_pm(pm)
    out = sys.stdout.buffer
    try:
        with Client(pm, retry_deadline_ms=timeout_ms) as c:
            sid = c.resolve_stream(_stream_ref(stream))
            end = None
            if not follow:
                end = c.end_offset(sid)
                if isinstance(pos, int) and pos > end:
                    raise OffsetOutOfRangeError(
                        f"offset {pos} is beyond the end {end} of stream {stream}")
            else:
                c.describe_stream(sid)
            if count == 0:
                return
            if group is not None:
                _consume_group(c, group, sid, pos, end, count, line_of, out)
                return
            cons = c.consumer(sid, pos, end=end)
            live = LiveCount("consumed")
            for n, rec in enumerate(cons, 1):
                out.write(line_of(rec))
                live.add(1)
                if count is not None and n >= count:
                    break
                if follow and not cons.buffered:
                    out.flush()  # about to wait for more: show what we have
            live.clear()
            out.flush()
    except SbpError as exc:
        fail(explain(exc, pm))
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except KeyboardInterrupt:
        interrupted()


def _consume_group(c: Client, group: str, sid: int, pos: StartPosition, end: int | None,
                   count: int | None, line_of: Callable[[ConsumedRecord], bytes],
                   out: BinaryIO) -> None:
    """``consume --group``: a group member; without --follow it stops at ``end``."""
    if end is not None:
        done = c.committed_offsets(group, [sid]).get(sid)
        if done is not None and done >= end:
            return  # the group has read everything there is
    live = LiveCount("consumed")
    with c.consumer(sid, pos, group=group) as cons:
        for n, rec in enumerate(cons, 1):
            out.write(line_of(rec))
            live.add(1)
            if (count is not None and n >= count) or (end is not None and rec.offset + 1 >= end):
                break
            if end is None and not cons.buffered:
                out.flush()
        live.clear()
        out.flush()


def _record_formatter(fmt: str, timestamp: bool, offset: bool, key: bool
                      ) -> Callable[[ConsumedRecord], bytes]:
    """How ``consume`` turns a record into one output line (newline included)."""
    if fmt == "json":
        def as_json(rec: ConsumedRecord) -> bytes:
            obj: dict[str, Any] = {"stream": rec.stream_id, "offset": rec.offset,
                                   "timestamp_ms": rec.timestamp_ms}
            _put_bytes(obj, "key", rec.key)
            _put_bytes(obj, "value", rec.value)
            if rec.headers:
                obj["headers"] = [_put_bytes({"name": n}, "value", v) for n, v in rec.headers]
            return json.dumps(obj, ensure_ascii=False).encode() + b"\n"
        return as_json
    if not (timestamp or offset or key):
        return lambda rec: (rec.value or b"") + b"\n"

    def prefixed(rec: ConsumedRecord) -> bytes:
        parts = []
        if timestamp:
            parts.append(b"CreateTime:%d" % rec.timestamp_ms)
        if offset:
            parts.append(b"Offset:%d" % rec.offset)
        if key:
            parts.append(b"null" if rec.key is None else rec.key)
        parts.append(rec.value or b"")
        return b"\t".join(parts) + b"\n"
    return prefixed


def _put_bytes(obj: dict[str, Any], name: str, data: bytes | None) -> dict[str, Any]:
    """``obj[name]`` = the UTF-8 text of ``data`` (None: null), else ``obj[name_base64]``."""
    if data is None:
        obj[name] = None
    else:
        try:
            obj[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            obj[f"{name}_base64"] = base64.b64encode(data).decode("ascii")
    return obj


def _quiet_broken_pipe() -> NoReturn:
    # stdout's reader went away (e.g. `| head`): not an error; silence the flush at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0)


# ------------------------------------------------------------------------------- groups


@group_app.command("list")
def group_list(pm: PmOption = DEFAULT_PM, timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS
               ) -> None:
    """Print every consumer group with live members or committed offsets, one a line."""
    names = _run(pm, timeout_ms, lambda c: c.list_groups())
    sys.stdout.write("".join(f"{n}\n" for n in names))


@group_app.command("describe")
def group_describe(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Per stream: committed offset, end offset, lag and the member reading it; then the
    members (as kafka-consumer-groups --describe)."""
    info = _run(pm, timeout_ms, lambda c: c.describe_group(group))
    out_console.print(f"group {info.group}: {info.state}, generation {info.generation}, "
                      f"{len(info.members)} members")
    t = Table("stream", "committed", "end_offset", "lag", "member")
    for s in info.streams:
        t.add_row(str(s.stream_id), "-" if s.committed < 0 else str(s.committed),
                  "-" if s.end_offset < 0 else str(s.end_offset),
                  "-" if s.lag < 0 else str(s.lag), s.member_id or "-")
    out_console.print(t)
    if info.members:
        mt = Table("member", "client", "host", "subscribed", "assigned")
        for mb in info.members:
            mt.add_row(mb.member_id, mb.client_id, mb.host, str(len(mb.stream_ids)),
                       ",".join(map(str, mb.assigned)) or "-")
        out_console.print(mt)


@group_app.command("reset-offsets")
def group_reset_offsets(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    to: Annotated[str, typer.Option(
        "--to", help="earliest, latest or an offset.", show_default=False)],
    streams: Annotated[list[str] | None, typer.Option(
        "--stream", help="Stream name or id (repeatable; default: every stream the group has "
        "committed).", show_default=False)] = None,
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Move a stopped group's committed offsets; prints stream and new offset per line."""
    pos: StartPosition
    if to in ("earliest", "latest"):
        pos = "earliest" if to == "earliest" else "latest"
    elif to.isdigit():
        pos = int(to)
    else:
        fail(f"--to {to!r}: expected earliest, latest or an offset", EXIT_USAGE)
    try:
        refs: list[int | str] = [_stream_ref(s) for s in streams or []]
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    new = _run(pm, timeout_ms, lambda c: c.reset_offsets(group, pos, refs))
    sys.stdout.write("".join(f"{sid}\t{off}\n" for sid, off in sorted(new.items())))


@group_app.command("delete")
def group_delete(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Forget a stopped group and its committed offsets."""
    _run(pm, timeout_ms, lambda c: c.delete_group(group))


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
    keep: Annotated[bool, typer.Option(
        "--keep", help="Keep the streams it creates (deleted at the end otherwise).")] = False,
    timeout_ms: TimeoutOption = 60_000,
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


# ----------------------------------------------------------------------------- introspection

NodeOption = Annotated[str, typer.Option(
    "--node", help="Ask this server (a data node's HOST:PORT) instead of the PM.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")]


def _introspect(pm: str, node: str, body: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    """Run ``body(Introspection)`` against ``--node`` or the first PM address, on a connection
    of the command's client (``_client``: TLS and credentials as every other command)."""
    try:
        address = node or pm_addresses(pm)[0]
    except ValueError as exc:
        fail(f"--pm/--node: {exc}", EXIT_USAGE)
    client = _client(pm, DEFAULT_TIMEOUT_MS)

    async def main() -> T:
        async with client, ClientIntrospection(client, address) as i:
            return await body(i)

    try:
        return run(main())
    except SbpError as exc:
        fail(f"{address}: {explain(exc, pm)}")


def _show(data: Any, as_json: bool, view: Callable[[Any], Any]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        out_console.print(view(data))


@app.command()
def info(pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False) -> None:
    """Server figures (INFO): uptime, version, role, requests, bytes and errors by opcode."""
    from sbpstream.introspect.views import info_view

    _show(_introspect(pm, node, lambda i: i.info())[1], as_json, info_view)


@app.command()
def stats(
    pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False,
    stream: Annotated[list[int] | None, typer.Option(
        "--stream", help="Only this stream (repeatable).")] = None,
    top: Annotated[int, typer.Option("--top", help="Without --stream: this many streams, "
                                     "highest rates first (0: the server's default).")] = 0,
) -> None:
    """Per-stream traffic (STATS): records and bytes in and out, per-minute rates, offsets."""
    from sbpstream.introspect.views import stats_view

    _show(_introspect(pm, node, lambda i: i.stats(stream or (), top))[1], as_json, stats_view)


@app.command()
def connections(
    pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False,
    limit: Annotated[int, typer.Option("--limit", help="List at most this many.")] = 0,
) -> None:
    """The server's open connections (CONNECTIONS)."""
    from sbpstream.introspect.views import connections_view

    _show(_introspect(pm, node, lambda i: i.connections(limit))[1], as_json, connections_view)


@app.command()
def whoami(pm: PmOption = DEFAULT_PM, node: NodeOption = "", as_json: JsonOption = False) -> None:
    """This CLI's own connection as the server sees it (WHOAMI)."""
    from sbpstream.introspect.views import whoami_view

    _show(_introspect(pm, node, lambda i: i.whoami())[1], as_json, whoami_view)


@app.command()
def nodes(pm: PmOption = DEFAULT_PM, as_json: JsonOption = False) -> None:
    """The PM's cluster view: data nodes (liveness, heartbeat, reported load, ranges),
    under-replicated ranges, live clients."""
    from sbpstream.introspect.views import nodes_view

    body = _introspect(pm, "", lambda i: i.info())[1]
    keys = ("nodes", "under_replicated", "clients", "stream_count", "streams_truncated")
    if "nodes" not in body:
        fail("the server is not a PM (no cluster view)")
    _show({k: body[k] for k in keys}, as_json, nodes_view)


@app.command()
def top(
    pm: PmOption = DEFAULT_PM,
    streams: Annotated[int, typer.Option("--streams", help="Streams shown.")] = 10,
    interval_s: Annotated[float, typer.Option("--interval-s", help="Refresh period.")] = 1.0,
    iterations: Annotated[int, typer.Option(
        "--iterations", help="Stop after this many refreshes (0: until Ctrl-C).")] = 0,
) -> None:
    """A live view of the cluster, refreshed every second: nodes, top streams, connections."""
    from rich.live import Live

    from sbpstream.introspect.views import top_view

    async def body(i: Any) -> None:
        with Live(console=out_console, auto_refresh=False) as live:
            n = 0
            while True:
                info = (await i.info())[1]
                figures = (await i.stats((), streams))[1]
                conns = (await i.connections())[1]
                live.update(top_view(info, figures, conns), refresh=True)
                n += 1
                if iterations and n >= iterations:
                    return
                await asyncio.sleep(interval_s)

    _introspect(pm, "", body)


@app.command("check")
def check(
    pm: PmOption = DEFAULT_PM,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Send each replica found short, unsealed or missing its range "
        "(SYNC_RANGES): it copies what it lacks from another replica.")] = False,
    stream: Annotated[list[int] | None, typer.Option(
        "--stream", help="Check only this stream (repeatable).")] = None,
) -> None:
    """Compare every range's replicas with each other and with the PM (docs/operations.md).

    Prints each problem, one a line; exits 1 when there is any, 0 when the cluster is clean.
    """
    from sbpstream.client.check import check_cluster

    report = _run(pm, timeout_ms, lambda c: check_cluster(c, repair=repair, stream_ids=stream))
    for p in report.problems:
        print(p)
    for line in report.repaired:
        print(f"repair: {line}")
    print(f"checked {report.streams} stream(s), {report.ranges} range(s), "
          f"{report.replicas} replica(s): {len(report.problems)} problem(s)")
    if report.problems:
        raise typer.Exit(EXIT_ERROR)


# ------------------------------------------------------------------------------------ quotas

quota_app = typer.Typer(
    help="Quotas per user, user+client id, client id, stream, or default: set, list, delete; "
    "live counters.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(quota_app, name="quota")

CLIENT_ID_ENV = "SBPSTREAM_CLIENT_ID"
_CLIENT = {"id": os.environ.get(CLIENT_ID_ENV, "")}
"""The client id every client command sends (``--client-id ID`` anywhere on the command line
of a command other than ``quota``, or $SBPSTREAM_CLIENT_ID): the data nodes apply its quotas."""


def _take_client_id(argv: list[str]) -> list[str]:
    """Remove ``--client-id ID`` / ``--client-id=ID`` from a client command's arguments and
    remember it; ``quota`` commands keep theirs (there it names the quota's client)."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] == ["quota"]:
        return argv
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--client-id":
            value = next(it, None)
            if value is None:
                fail("--client-id needs a value", EXIT_USAGE)
            _CLIENT["id"] = value
        elif a.startswith("--client-id="):
            _CLIENT["id"] = a.split("=", 1)[1]
        else:
            out.append(a)
    return out


def _entity(client_id: str | None, stream: int | None, default: bool,
            user: str | None) -> tuple[QuotaKind, str, str]:
    """The quota entity the options name: (kind, client id or stream id, principal)."""
    if user is not None and stream is None and not default:
        if client_id is not None:
            return QuotaKind.CLIENT, client_id, user  # that user's connections with that id
        return QuotaKind.USER, "", user
    given = [x for x in (client_id is not None, stream is not None, default) if x]
    if len(given) != 1 or user is not None:
        fail("name exactly one of --user NAME [--client-id ID], --client-id ID, --stream S, "
             "--default", EXIT_USAGE)
    if client_id is not None:
        return QuotaKind.CLIENT, client_id, ""
    if stream is not None:
        return QuotaKind.STREAM, str(stream), ""
    return QuotaKind.DEFAULT, "", ""


QUserOption = Annotated[str | None, typer.Option(
    "--user", help="A user's (principal's) quota, for all its client ids; with --client-id, "
    "for that client id of the user only. (Authenticate with the global --user before "
    "'quota', or $SBPSTREAM_USER.)")]
QClientOption = Annotated[str | None, typer.Option("--client-id", help="A client id's quota.")]
QStreamOption = Annotated[int | None, typer.Option("--stream", help="A stream's quota.")]
QDefaultOption = Annotated[bool, typer.Option(
    "--default", help="The default quota (each client id without its own).")]


def _rate(n: int | None) -> str:
    return "-" if n is None or n == UNLIMITED else f"{n:,}"


@quota_app.command("set")
def quota_set(
    pm: PmOption = DEFAULT_PM,
    user: QUserOption = None,
    client_id: QClientOption = None,
    stream: QStreamOption = None,
    default: QDefaultOption = False,
    produce_bytes_per_s: Annotated[int | None, typer.Option(
        "--produce-bytes-per-s", help="Bytes/s a client (or all, for a stream) may append.")
                                   ] = None,
    fetch_bytes_per_s: Annotated[int | None, typer.Option(
        "--fetch-bytes-per-s", help="Bytes/s it may fetch.")] = None,
    requests_per_s: Annotated[int | None, typer.Option(
        "--requests-per-s", help="APPEND and FETCH requests/s.")] = None,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Create or replace a quota (each data node enforces it for its own traffic). Which one
    applies, per rate: --user with --client-id, then --user, then --client-id, then --default."""
    kind, name, principal = _entity(client_id, stream, default, user)
    spec = QuotaSpec(kind, name,
                     UNLIMITED if produce_bytes_per_s is None else produce_bytes_per_s,
                     UNLIMITED if fetch_bytes_per_s is None else fetch_bytes_per_s,
                     UNLIMITED if requests_per_s is None else requests_per_s, principal)
    try:
        validate_quota(spec)
    except SbpError as exc:
        fail(exc.message, EXIT_USAGE)
    q = _run(pm, timeout_ms, lambda c: c.set_quota(spec))
    out_console.print(f"quota {q.key}: produce {_rate(q.produce_bytes_per_s)} B/s, fetch "
                      f"{_rate(q.fetch_bytes_per_s)} B/s, requests {_rate(q.requests_per_s)}/s",
                      markup=False)


@quota_app.command("list")
def quota_list(pm: PmOption = DEFAULT_PM, timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
               ) -> None:
    """Every quota the PM stores (- = not limited by this quota)."""
    quotas = _run(pm, timeout_ms, lambda c: c.list_quotas())
    t = Table("QUOTA", "PRODUCE B/S", "FETCH B/S", "REQUESTS/S", box=None)
    for q in quotas:
        t.add_row(q.key, _rate(q.produce_bytes_per_s), _rate(q.fetch_bytes_per_s),
                  _rate(q.requests_per_s))
    out_console.print(t)


@quota_app.command("delete")
def quota_delete(
    pm: PmOption = DEFAULT_PM,
    user: QUserOption = None,
    client_id: QClientOption = None,
    stream: QStreamOption = None,
    default: QDefaultOption = False,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """Delete a quota."""
    kind, name, principal = _entity(client_id, stream, default, user)
    q = _run(pm, timeout_ms, lambda c: c.delete_quota(kind, name, principal))
    out_console.print(f"deleted quota {q.key}", markup=False)


@quota_app.command("counters")
def quota_counters(
    pm: PmOption = DEFAULT_PM,
    node: Annotated[list[str] | None, typer.Option(
        "--node", help="A data node HOST:PORT (repeatable); default: every node holding a "
        "range of some stream.")] = None,
    timeout_ms: TimeoutOption = DEFAULT_TIMEOUT_MS,
) -> None:
    """The live Throttr-style counters of the data nodes: quota left in the window and the
    TTL left (Throttr's QUERY)."""
    async def body(c: AsyncClient) -> list[tuple[str, QuotaCountersResponse]]:
        nodes = node or await c.data_node_addresses()
        return [(a, await c.quota_counters(a)) for a in nodes]

    t = Table("NODE", "COUNTER", "QUOTA LEFT", "TTL LEFT", box=None)
    for addr, resp in _run(pm, timeout_ms, body):
        for k in resp.counters:
            unit = TtlType(k.ttl_type).name.lower() if k.ttl_type in range(1, 7) else "?"
            t.add_row(addr, k.key, f"{k.quota:,}", f"{k.ttl} {unit}")
    out_console.print(t)


# ------------------------------------------------------------------------------------- main


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Python warnings (the SDK's InsecureCredentialsWarning) as one line on stderr."""
    sys.stderr.write(f"sbpstream: warning: {one_line(str(message))}\n")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors, exit codes 0 / 1 (error) / 2 (usage) / 130."""
    backoff_observers.append(waiting)
    # the SDK's warnings (e.g. event=append_failed) are summed up by the command's own error line
    logging.getLogger("sbpstream.client").addHandler(logging.NullHandler())
    logging.getLogger("sbpstream.auth").addHandler(logging.NullHandler())  # warned below
    warnings.showwarning = _warning_line
    try:
        args = sys.argv[1:] if argv is None else argv
        rv = app(args=_take_client_id(list(args)), prog_name="sbpstream", standalone_mode=False)
    except TlsFileError as exc:  # from a client built outside _client (produce, consume)
        err_console.print(f"sbpstream: error: {one_line(str(exc))}", markup=False,
                          soft_wrap=True)
        sys.exit(EXIT_USAGE)
    except TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(EXIT_USAGE)
        err_console.print(f"sbpstream: error: {exc.format_message()}", markup=False,
                          soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        rv = EXIT_INTERRUPTED
    except typer.Exit as exc:
        rv = exc.exit_code
    if rv == EXIT_INTERRUPTED and not _said["interrupted"]:
        # click turns a KeyboardInterrupt inside a command into exit status 130, silently
        with contextlib.suppress(KeyboardInterrupt):
            err_console.print("sbpstream: interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
