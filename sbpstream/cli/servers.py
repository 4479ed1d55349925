"""`sbpstream up|pm|datanode|kafka-gateway`: the cluster and the servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, TypeVar

import typer

from sbpstream.cli.app import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    PmOption,
    _said,
    _valid_pm,
    app,
    err_console,
    fail,
)
from sbpstream.cli.security import (
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
from sbpstream.client.types import (
    DEFAULT_PM,
    PM_ENV,
)
from sbpstream.net.loop import run
from sbpstream.protocol.errors import (
    SbpError,
)

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


