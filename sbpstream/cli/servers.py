"""`sbpstream up|pm|datanode|kafka-gateway`: the cluster and the servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Final, TypeVar

import typer

from sbpstream.auth.config import DEFAULT_TOKEN_TTL_S
from sbpstream.cli.app import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    app,
    err_console,
    fail,
    main,
    said_on_command_line,
    valid_pm,
)
from sbpstream.cli.launch import (
    ConfigOption,
    LogFormatOption,
    LogLevelOption,
    ServerCommand,
    check_log_options,
    setup_logging,
    unblock_signals,
)
from sbpstream.cli.security import (
    AllowInsecureAuthOption,
    AllowRemoteOption,
    AuthOption,
    SecretFileOption,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    TlsRequireClientCertOption,
    TokenTtlOption,
    print_admin_credentials,
    secure_certs,
    security_config,
)
from sbpstream.client.types import (
    DEFAULT_PM,
    PM_ENV,
)
from sbpstream.net.loop import run_server
from sbpstream.pm.config import (
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_METADATA,
    DEFAULT_NODE_TIMEOUT_MS,
    DEFAULT_PM_PORT,
)
from sbpstream.protocol.errors import (
    SbpError,
)

DEFAULT_DN_PORT: Final = 10911
"""A data node's port when none is given: docs/cli.md and docs/operations.md use it, and
`up --dn-port` starts its first data node there."""
DEFAULT_KAFKA_PORT: Final = 9092
"""Kafka's own default port, so a Kafka client's bootstrap.servers=HOST works unchanged."""
FSYNC_POLICIES: Final = ("always", "interval", "none")
"""The values of --fsync (sbpstream.store.FsyncPolicy, not imported: it loads the store)."""


# ----------------------------------------------------------------------------------- servers

T = TypeVar("T")


@app.command()
def up(
    directory: Annotated[Path, typer.Option("--dir", help="Data directory (logs in DIR/logs).")
                         ] = Path("./data"),
    datanodes: Annotated[int, typer.Option("--datanodes", min=1, help="Number of data nodes.")
                         ] = 3,
    pm_port: Annotated[int, typer.Option("--pm-port", help="Port of the placement manager.")
                       ] = 12378,
    dn_port: Annotated[int, typer.Option(
        "--dn-port", help="Port of the first data node; the others take the next ones.")
                       ] = DEFAULT_DN_PORT,
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

    if fsync not in FSYNC_POLICIES:
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
            said_on_command_line["interrupted"] = True
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


MetricsPortOption = Annotated[int, typer.Option(
    "--metrics-port", help="Serve the admin HTTP port (Prometheus /metrics, /v1 JSON, web "
    "console) here (-1: off, 0: any).")]
PublicMetricsOption = Annotated[bool, typer.Option(
    "--public-metrics", help="With --auth, serve /metrics without credentials (else a scrape "
    "needs a Bearer token or Basic).")]

@app.command("pm", cls=ServerCommand)
def pm_server(
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = DEFAULT_PM_PORT,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    metadata: Annotated[str, typer.Option(
        "--metadata", help="Metadata store: sqlite:PATH, or etcd://HOST:PORT[,HOST:PORT...]"
        "[/PREFIX][?lease_ttl_s=3] for several PMs with one leader (docs/etcd.md)."
    )] = DEFAULT_METADATA,
    advertise: Annotated[str, typer.Option(
        "--advertise", help="HOST:PORT others use to reach this PM.")] = "",
    heartbeat_interval_ms: Annotated[int, typer.Option(
        "--heartbeat-interval-ms", help="Expected data node heartbeat period; the liveness "
        "check runs at this period.")] = DEFAULT_HEARTBEAT_INTERVAL_MS,
    node_timeout_ms: Annotated[int, typer.Option(
        "--node-timeout-ms", help="A data node silent this long is dead; its ranges move.")
                               ] = DEFAULT_NODE_TIMEOUT_MS,
    metrics_port: MetricsPortOption = -1,
    public_metrics: PublicMetricsOption = False,
    log_level: LogLevelOption = "INFO",
    log_format: LogFormatOption = "kv",
    tls_cert: TlsCertOption = "",
    tls_key: TlsKeyOption = "",
    tls_ca: TlsCaOption = "",
    tls_require_client_cert: TlsRequireClientCertOption = False,
    auth: AuthOption = False,
    secret_file: SecretFileOption = "",
    token_ttl_s: TokenTtlOption = DEFAULT_TOKEN_TTL_S,
    allow_remote_unauthenticated: AllowRemoteOption = False,
    allow_insecure_auth: AllowInsecureAuthOption = False,
    config: ConfigOption = "",
) -> None:
    """Run one placement manager (metadata, placement, liveness) in the foreground.

    Also `python -m sbpstream.pm`. SIGINT/SIGTERM shut it down cleanly (in-flight requests
    drain, soft state is flushed, the metadata file is closed)."""
    from sbpstream.pm.config import PmConfig, sqlite_path
    from sbpstream.pm.server import run_pm
    from sbpstream.private_files import private_dir

    _start_server(log_level, log_format)
    security = security_config(tls_cert, tls_key, tls_ca, auth, secret_file,
                               allow_remote_unauthenticated, allow_insecure_auth,
                               tls_require_client_cert, token_ttl_s)
    cfg = PmConfig(metadata=metadata, port=port, host=host, advertise=advertise,
                   heartbeat_interval_ms=heartbeat_interval_ms, node_timeout_ms=node_timeout_ms,
                   metrics_port=metrics_port, public_metrics=public_metrics, security=security)
    try:
        cfg.validate()
        security.validate(host)
        if not metadata.startswith("etcd://"):
            private_dir(sqlite_path(metadata).parent)
    except (ValueError, OSError) as exc:
        fail(str(exc), EXIT_USAGE)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_pm(cfg, stop)

    _serve(serve(), "placement manager", "sbpstream.pm")


@app.command("datanode", cls=ServerCommand)
def datanode_server(
    directory: Annotated[Path, typer.Option("--dir", help="Data directory of this node.",
                                            show_default=False)],
    pm: Annotated[str, typer.Option(
        "--pm", help="Placement manager address(es), HOST:PORT[,HOST:PORT...].")] = DEFAULT_PM,
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = DEFAULT_DN_PORT,
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
    retention_interval_ms: Annotated[int | None, typer.Option(
        "--retention-interval-ms", min=1, show_default=False,
        help="How often retention runs and stream configs are refreshed (default: "
        "DEFAULT_RETENTION_INTERVAL_MS of sbpstream/datanode/limits.py).")] = None,
    compaction_interval_ms: Annotated[int | None, typer.Option(
        "--compaction-interval-ms", min=1, show_default=False,
        help="How often compaction looks for segments to reclaim (default: "
        "DEFAULT_COMPACTION_INTERVAL_MS of sbpstream/datanode/limits.py).")] = None,
    metrics_port: MetricsPortOption = -1,
    public_metrics: PublicMetricsOption = False,
    log_level: LogLevelOption = "INFO",
    log_format: LogFormatOption = "kv",
    tls_cert: TlsCertOption = "",
    tls_key: TlsKeyOption = "",
    tls_ca: TlsCaOption = "",
    tls_require_client_cert: TlsRequireClientCertOption = False,
    auth: AuthOption = False,
    secret_file: SecretFileOption = "",
    token_ttl_s: TokenTtlOption = DEFAULT_TOKEN_TTL_S,
    allow_remote_unauthenticated: AllowRemoteOption = False,
    allow_insecure_auth: AllowInsecureAuthOption = False,
    config: ConfigOption = "",
) -> None:
    """Run one data node (stores and serves record batches) in the foreground.

    Also `python -m sbpstream.datanode`. SIGINT/SIGTERM stop it cleanly."""
    from sbpstream.datanode.config import DataNodeConfig
    from sbpstream.datanode.node import run_datanode
    from sbpstream.store import FsyncPolicy

    _start_server(log_level, log_format)
    intervals = {k: v for k, v in (("retention_interval_ms", retention_interval_ms),
                                   ("compaction_interval_ms", compaction_interval_ms))
                 if v is not None}
    try:
        cfg = DataNodeConfig(
            directory=directory, port=port, host=host, pm=DataNodeConfig.parse_pm_list(pm),
            advertise=advertise, heartbeat_interval_ms=heartbeat_interval_ms,
            metrics_interval_ms=metrics_interval_ms, fsync=FsyncPolicy(fsync),
            fsync_interval_ms=fsync_interval_ms, metrics_port=metrics_port, **intervals,
            public_metrics=public_metrics,
            security=security_config(tls_cert, tls_key, tls_ca, auth, secret_file,
                                     allow_remote_unauthenticated, allow_insecure_auth,
                                     tls_require_client_cert, token_ttl_s),
        )
        cfg.security.validate(host)
    except ValueError as exc:
        fail(f"--fsync {fsync!r}: expected always, interval or none"
             if fsync not in FSYNC_POLICIES else str(exc), EXIT_USAGE)
    _serve(run_datanode(cfg), "data node", "sbpstream.datanode")


@app.command("kafka-gateway", cls=ServerCommand)
def kafka_gateway(
    pm: Annotated[str, typer.Option(
        "--pm", help="Placement manager address(es), HOST:PORT[,HOST:PORT...].")] = DEFAULT_PM,
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")
                    ] = DEFAULT_KAFKA_PORT,
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
    log_level: LogLevelOption = "INFO",
    log_format: LogFormatOption = "kv",
    listener: Annotated[str, typer.Option(
        "--listener", help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (docs/kafka.md).")
                        ] = "PLAINTEXT",
    tls_cert: Annotated[str, typer.Option(
        "--tls-cert", help="PEM certificate chain (SSL, SASL_SSL listeners).")] = "",
    tls_key: Annotated[str, typer.Option("--tls-key", help="PEM key of --tls-cert.")] = "",
    tls_ca: Annotated[str, typer.Option(
        "--tls-ca", help="PEM CA verifying the PM and data nodes (TLS to the cluster).")] = "",
    allow_sasl_plaintext: Annotated[bool, typer.Option(
        "--allow-sasl-plaintext", help="Allow SASL_PLAINTEXT on an address beyond loopback.")
                                    ] = False,
    config: ConfigOption = "",
) -> None:
    """Run a Kafka wire-protocol gateway: Kafka clients produce and consume through it
    (topic T partition N = stream T.N; docs/kafka.md). Also `python -m sbpstream.kafka`."""
    from sbpstream.kafka.gateway import KafkaGateway, run_gateway

    _start_server(log_level, log_format)
    valid_pm(pm)
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

    _serve(serve(), "kafka gateway", "sbpstream.kafka")


def _start_server(log_level: str, log_format: str) -> None:
    """First steps of every server command: signals deliverable, the one log set-up."""
    unblock_signals()
    problem = check_log_options(log_level, log_format)
    if problem is not None:
        fail(problem, EXIT_USAGE)
    setup_logging(log_level, log_format)


def _serve(main: Coroutine[Any, Any, None], what: str, logger: str) -> None:
    """Run a server until it stops; a failure at start (a port in use, the metadata store
    unreachable) is one log line and one error line, exit status 1."""
    try:
        run_server(main)
    except KeyboardInterrupt:
        pass
    except (OSError, SbpError, ValueError, RuntimeError) as exc:
        logging.getLogger(logger).error("event=server_failed error=%r", str(exc))
        fail(f"{what} failed: {exc}")


def server_main(command: str, argv: list[str] | None = None) -> None:
    """``python -m sbpstream.pm|datanode|kafka``: the same command as ``sbpstream COMMAND``."""
    main([command, *(sys.argv[1:] if argv is None else argv)])
