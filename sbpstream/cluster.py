"""A local cluster of real processes: one PM and N data nodes on loopback.

Used by ``sbpstream up`` (foreground), the test suite and the benchmarks. Every process is a
child started with ``python -m sbpstream.pm`` / ``python -m sbpstream.datanode``; a node is
ready when it answers PING (a data node listens only once it has registered with the PM).
``stop()`` sends SIGTERM (graceful: GOAWAY and drain), then SIGKILL after a bound.

:class:`Supervisor` is what makes ``up`` a supervisor: it restarts a node that exits without
being asked to (same arguments, so the same port and data directory), after an exponential
backoff, and reports each exit and restart in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from sbpstream.auth.config import CA_FILE, SECRET_FILE, SERVER_CERT, SERVER_KEY
from sbpstream.net.ports import free_port
from sbpstream.private_files import private_dir
from sbpstream.protocol.frame import FrameDecoder, encode_frame
from sbpstream.protocol.opcodes import Opcode

READY_TIMEOUT_S = 30.0  # a cold Python start plus registration; generous for a loaded 2-core box
STOP_TIMEOUT_S = 10.0  # graceful drain bound before SIGKILL

# Supervisor: the first restart of a node that died waits RESTART_BACKOFF_INITIAL_S; each
# further death of the same node multiplies the wait by RESTART_BACKOFF_FACTOR, up to
# RESTART_BACKOFF_MAX_S. A node that stayed up RESTART_STABLE_S starts again from the first wait.
RESTART_BACKOFF_INITIAL_S = 0.5
RESTART_BACKOFF_FACTOR = 2.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_STABLE_S = 60.0
SUPERVISE_POLL_S = 0.2  # how often the supervisor looks at its children


def tcp_open(address: str, timeout_s: float = 1.0) -> bool:
    """True when something at ``address`` accepts a TCP connection (the Kafka gateway)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def ping(address: str, timeout_s: float = 1.0, tls_ca: str = "") -> bool:
    """True when something at ``address`` answers an SBP PING (over TLS, verified against
    ``tls_ca``, when given; PING needs no authentication)."""
    host, _, port = address.rpartition(":")
    try:
        with contextlib.ExitStack() as stack:
            s = stack.enter_context(socket.create_connection((host, int(port)), timeout_s))
            if tls_ca:
                ctx = ssl.create_default_context(cafile=tls_ca)
                s = stack.enter_context(ctx.wrap_socket(s, server_hostname=host))
            s.settimeout(timeout_s)
            s.sendall(encode_frame(Opcode.PING, 1, 0))
            d = FrameDecoder()
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                d.feed(chunk)
                for ev in d.events():
                    if getattr(ev, "opcode", None) == Opcode.PING:
                        return True
    except (OSError, ValueError):
        return False


@dataclass
class Node:
    kind: str  # "pm" or "datanode"
    name: str
    port: int
    args: list[str]
    log_path: Path
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    pid_path: Path | None = None  # written at each start, removed at stop/kill
    metrics_port: int | None = None  # its Prometheus /metrics port, when serving one
    tls_ca: str = ""  # set when it serves TLS: readiness pings verify it against this CA

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"sbpstream.{self.kind}", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()
        if self.pid_path is not None:
            self.pid_path.parent.mkdir(parents=True, exist_ok=True)
            self.pid_path.write_text(f"{self.proc.pid}\n")

    def _forget_pid(self) -> None:
        if self.pid_path is not None:
            self.pid_path.unlink(missing_ok=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            if (tcp_open(self.address, 0.5) if self.kind == "kafka"
                    else ping(self.address, 0.5, self.tls_ca)):
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"{self.name} not ready at {self.address} after {timeout_s}s; "
            f"log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        self._forget_pid()

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(5)
        self.proc = None
        self._forget_pid()

    def pause(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)


def secure_args(certs: Path) -> list[str]:
    """The flags of a PM or data node serving TLS with auth on, from a ``certs init`` dir."""
    return ["--tls-cert", str(certs / SERVER_CERT), "--tls-key", str(certs / SERVER_KEY),
            "--tls-ca", str(certs / CA_FILE), "--auth", "--secret-file", str(certs / SECRET_FILE)]


class LocalCluster:
    """A PM on SQLite and ``datanodes`` data nodes under ``directory``.

    ``metrics_port``: the PM serves Prometheus /metrics on it and data node ``i`` on
    ``metrics_port + 1 + i``. ``pid_files``: each process's pid is kept in
    ``directory/run/NAME.pid`` while it runs.
    """

    def __init__(
        self,
        directory: Path,
        *,
        datanodes: int = 3,
        pm_port: int | None = None,
        dn_port: int | None = None,
        host: str = "127.0.0.1",
        heartbeat_interval_ms: int = 1000,
        node_timeout_ms: int = 6000,
        fsync: str | None = None,
        extra_pm_args: list[str] | None = None,
        extra_dn_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        metrics_port: int | None = None,
        pid_files: bool = False,
        secure: Path | None = None,
        kafka_port: int | None = None,
    ) -> None:
        """``secure``: a directory made by ``sbpstream certs init``: every process serves TLS
        with its certificates and authenticates with its cluster secret (docs/security.md)."""
        self.directory = Path(directory)
        self.secure = secure
        sec_args = secure_args(secure) if secure is not None else []
        extra_pm_args = [*sec_args, *(extra_pm_args or [])]
        extra_dn_args = [*sec_args, *(extra_dn_args or [])]
        self.host = host
        self.env = env or {}
        self.metrics_port = metrics_port
        self.pid_dir = self.directory / "run" if pid_files else None
        metrics_args = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
        self._ports: set[int] = set()  # handed out here: free_port only probes, never reserves
        port = pm_port or self._free_port(host)
        self.pm = Node(
            "pm",
            "pm",
            port,
            [
                "--host",
                host,
                "--port",
                str(port),
                "--metadata",
                f"sqlite:{self.directory / 'pm' / 'metadata.sqlite3'}",
                "--heartbeat-interval-ms",
                str(heartbeat_interval_ms),
                "--node-timeout-ms",
                str(node_timeout_ms),
                *metrics_args,
                *(extra_pm_args or []),
            ],
            self.directory / "logs" / "pm.log",
            host,
            env=self.env,
            pid_path=self._pid_path("pm"),
            metrics_port=metrics_port,
            tls_ca=str(secure / CA_FILE) if secure is not None else "",
        )
        self.datanodes: list[Node] = []
        self._dn_args = list(extra_dn_args or [])
        if fsync:
            self._dn_args += ["--fsync", fsync]
        self.heartbeat_interval_ms = heartbeat_interval_ms
        for i in range(datanodes):
            self.add_datanode(dn_port + i if dn_port else None)
        self.kafka: Node | None = None  # a Kafka gateway (``kafka_port``; 0: any free port)
        if kafka_port is not None:
            kport = kafka_port or self._free_port(host)
            # secure: a SASL_SSL listener with the cluster's certificate, TLS to the cluster
            kafka_sec = ["--listener", "SASL_SSL", "--tls-cert", str(secure / SERVER_CERT),
                         "--tls-key", str(secure / SERVER_KEY), "--tls-ca",
                         str(secure / CA_FILE)] if secure is not None else []
            self.kafka = Node(
                "kafka", "kafka", kport,
                ["--host", host, "--port", str(kport), "--pm", self.pm.address, *kafka_sec],
                self.directory / "logs" / "kafka.log", host, env=self.env,
                pid_path=self._pid_path("kafka"))

    def kafka_settings(self) -> str:
        """How Kafka clients reach the secure cluster's gateway (SASL_SSL, SCRAM-SHA-256): kcat
        and confluent-kafka settings, the user and password those of ``sbpstream user add``."""
        if self.kafka is None or self.secure is None:
            return ""
        ca = (self.secure / CA_FILE).resolve()
        addr = self.kafka.address
        return "\n".join([
            "Kafka gateway (SASL_SSL, SCRAM-SHA-256; any user of the cluster, its ACLs apply):",
            f"  kcat -b {addr} -X security.protocol=SASL_SSL -X sasl.mechanisms=SCRAM-SHA-256 "
            f"-X ssl.ca.location={ca} -X sasl.username=$SBPSTREAM_USER "
            "-X sasl.password=$SBPSTREAM_PASSWORD -L",
            f"  confluent-kafka: {{'bootstrap.servers': '{addr}', 'security.protocol': "
            f"'SASL_SSL', 'sasl.mechanisms': 'SCRAM-SHA-256', 'ssl.ca.location': '{ca}', "
            "'sasl.username': USER, 'sasl.password': PASSWORD}", "", ""])

    def _free_port(self, host: str) -> int:
        """A free port not yet handed to another process of this cluster."""
        while True:
            port = free_port(host)
            if port not in self._ports:
                self._ports.add(port)
                return port

    def _pid_path(self, name: str) -> Path | None:
        return self.pid_dir / f"{name}.pid" if self.pid_dir is not None else None

    @property
    def nodes(self) -> list[Node]:
        """The PM, then the data nodes, then the Kafka gateway if any."""
        return [self.pm, *self.datanodes, *([self.kafka] if self.kafka else [])]

    @property
    def pm_address(self) -> str:
        return self.pm.address

    def add_datanode(
        self,
        port: int | None = None,
        *,
        pm_address: str | None = None,
        advertise: str | None = None,
    ) -> Node:
        """Add a data node (started by ``start()``, or by ``node.start()`` later).

        ``pm_address`` and ``advertise`` let a test put the node behind proxies: the node
        reaches the PM at ``pm_address`` and tells everyone to reach it at ``advertise``.
        """
        i = len(self.datanodes)
        port = port or self._free_port(self.host)
        extra = ["--advertise", advertise] if advertise else []
        args = ["--host", self.host, "--port", str(port), "--dir", str(self.directory / f"dn{i}")]
        args += ["--pm", pm_address or self.pm.address]
        args += ["--heartbeat-interval-ms", str(self.heartbeat_interval_ms), *extra]
        metrics_port = self.metrics_port + 1 + i if self.metrics_port is not None else None
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        node = Node(
            "datanode", f"dn{i}", port, [*args, *self._dn_args],
            self.directory / "logs" / f"dn{i}.log", self.host, env=self.env,
            pid_path=self._pid_path(f"dn{i}"), metrics_port=metrics_port,
            tls_ca=self.pm.tls_ca,
        )
        self.datanodes.append(node)
        return node

    def start(self) -> LocalCluster:
        private_dir(self.directory)  # 0700 when made here: metadata and segments live in it
        self.pm.start()
        self.pm.wait_ready()
        for dn in self.datanodes:
            dn.start()
        for dn in self.datanodes:
            dn.wait_ready()
        if self.kafka is not None:
            self.kafka.start()
            self.kafka.wait_ready()
        return self

    def stop(self) -> None:
        if self.kafka is not None:
            self.kafka.stop()
        for dn in self.datanodes:
            dn.stop()
        self.pm.stop()

    def kill_all(self) -> None:
        if self.kafka is not None:
            self.kafka.kill()
        for dn in self.datanodes:
            dn.kill()
        self.pm.kill()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def exit_status(code: int) -> str:
    """``status 1`` or ``signal SIGKILL``: how a child ended, from its return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def restart_backoff_s(deaths: int) -> float:
    """The wait before restarting a node that has died ``deaths`` times in a row (1, 2, ...)."""
    wait = RESTART_BACKOFF_INITIAL_S * RESTART_BACKOFF_FACTOR ** max(0, deaths - 1)
    return min(RESTART_BACKOFF_MAX_S, wait)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM held back while a child is being started, so that Ctrl-C cannot land
    between the fork and the bookkeeping that lets a stop find the child (then delivered).
    The child inherits the blocked mask across exec; every server unblocks it first thing
    (sbpstream.cli.launch.unblock_signals), so a restarted one still stops on SIGTERM."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass
class _Watched:
    node: Node
    started_at: float
    deaths: int = 0  # consecutive deaths, each within RESTART_STABLE_S of its start
    restart_at: float | None = None  # set while the node is dead and waiting for its restart


class Supervisor:
    """Restarts the nodes of a started :class:`LocalCluster` that exit on their own.

    A node stopped through :meth:`Node.stop` / :meth:`Node.kill` (``proc`` is None) is left
    alone; any other exit, whatever its status, is a death. The node is started again with its
    own arguments (same port, same data directory) after :func:`restart_backoff_s`. ``report``
    gets one line per event. Call :meth:`poll` periodically from one thread (:meth:`run` does).
    """

    def __init__(self, cluster: LocalCluster, report: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.report = report
        self.clock = clock
        now = clock()
        self._watched = [_Watched(n, now) for n in cluster.nodes]
        self.restarts = 0

    def poll(self) -> None:
        now = self.clock()
        for w in self._watched:
            node = w.node
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(w, now)
                continue
            if node.proc is None:
                continue  # stopped by us
            code = node.proc.poll()
            if code is None:
                continue
            if now - w.started_at >= RESTART_STABLE_S:
                w.deaths = 0
            w.deaths += 1
            wait = restart_backoff_s(w.deaths)
            w.restart_at = now + wait
            pid = node.proc.pid
            node.proc = None
            self.report(f"{node.name} (pid {pid}) exited with {exit_status(code)}; restart "
                        f"{w.deaths} in {wait:g} s (log: {node.log_path})")

    def _restart(self, w: _Watched, now: float) -> None:
        node = w.node
        try:
            with _signals_deferred():
                node.start()
                w.started_at, w.restart_at = now, None
        except OSError as exc:  # e.g. the interpreter gone: a death like any other
            w.deaths += 1
            wait = restart_backoff_s(w.deaths)
            w.restart_at = now + wait
            self.report(f"{node.name} could not be started ({exc}); retrying in {wait:g} s")
            return
        self.restarts += 1
        pid = node.proc.pid if node.proc is not None else "?"
        self.report(f"{node.name} restarted: pid {pid} on {node.address}")

    def run(self) -> None:
        """Supervise until interrupted (KeyboardInterrupt or any exception from a signal)."""
        while True:
            self.poll()
            time.sleep(SUPERVISE_POLL_S)
