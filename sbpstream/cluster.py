"""A local cluster of real processes: one PM and N data nodes on loopback.

Used by ``sbpstream up`` (foreground), the test suite and the benchmarks. Every process is a
child started with ``python -m sbpstream.pm`` / ``python -m sbpstream.datanode``; a node is
ready when it answers PING (a data node listens only once it has registered with the PM).
``stop()`` sends SIGTERM (graceful: GOAWAY and drain), then SIGKILL after a bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from sbpstream.net.ports import free_port
from sbpstream.protocol.frame import FrameDecoder, encode_frame
from sbpstream.protocol.opcodes import Opcode

READY_TIMEOUT_S = 30.0  # a cold Python start plus registration; generous for a loaded 2-core box
STOP_TIMEOUT_S = 10.0  # graceful drain bound before SIGKILL


def ping(address: str, timeout_s: float = 1.0) -> bool:
    """True when something at ``address`` answers an SBP PING."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
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

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            if ping(self.address, 0.5):
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

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)


class LocalCluster:
    """A PM on SQLite and ``datanodes`` data nodes under ``directory``."""

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
    ) -> None:
        self.directory = Path(directory)
        self.host = host
        self.env = env or {}
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
                *(extra_pm_args or []),
            ],
            self.directory / "logs" / "pm.log",
            host,
            env=self.env,
        )
        self.datanodes: list[Node] = []
        self._dn_args = list(extra_dn_args or [])
        if fsync:
            self._dn_args += ["--fsync", fsync]
        self.heartbeat_interval_ms = heartbeat_interval_ms
        for i in range(datanodes):
            self.add_datanode(dn_port + i if dn_port else None)

    def _free_port(self, host: str) -> int:
        """A free port not yet handed to another process of this cluster."""
        while True:
            port = free_port(host)
            if port not in self._ports:
                self._ports.add(port)
                return port

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
        node = Node(
            "datanode", f"dn{i}", port, [*args, *self._dn_args],
            self.directory / "logs" / f"dn{i}.log", self.host, env=self.env,
        )
        self.datanodes.append(node)
        return node

    def start(self) -> LocalCluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pm.start()
        self.pm.wait_ready()
        for dn in self.datanodes:
            dn.start()
        for dn in self.datanodes:
            dn.wait_ready()
        return self

    def stop(self) -> None:
        for dn in self.datanodes:
            dn.stop()
        self.pm.stop()

    def kill_all(self) -> None:
        for dn in self.datanodes:
            dn.kill()
        self.pm.kill()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
