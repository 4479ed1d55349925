"""A real etcd for tests and benchmarks: started on free loopback ports in a temporary data
directory, stopped (and its directory removed) afterwards.

``etcd`` comes from Debian's ``etcd-server`` (``scripts/ensure-sysdeps.sh`` installs it for
``make test``). When the binary is absent, :func:`require_etcd` skips the test with the reason.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Final

from sbpstream.net.ports import free_port

ETCD_READY_TIMEOUT_S: Final = 20.0
"""etcd starts in well under a second; 20 s covers a loaded 2-core CI box and a cold disk."""

ETCD_STOP_TIMEOUT_S: Final = 5.0
"""Graceful stop bound before SIGKILL (etcd flushes its WAL on SIGTERM)."""

DEFAULT_MAX_TXN_OPS: Final = 128
"""etcd's own default --max-txn-ops, stated explicitly so the tests run against the limit the
backend is designed for."""


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd binary, or skip the calling test with a clear reason."""
    import pytest

    path = etcd_binary()
    if path is None:
        pytest.skip("etcd binary not on PATH (install Debian etcd-server; `make test` does)")
    return path


class EtcdServer:
    """One single-member etcd on 127.0.0.1. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        max_txn_ops: int = DEFAULT_MAX_TXN_OPS,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="sbp-etcd-"))
        self.max_txn_ops = max_txn_ops
        self.extra_args = extra_args
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "") -> str:
        """A ``--metadata`` URL for this server (``prefix`` like ``/t1`` isolates a test)."""
        return f"etcd://{self.endpoint}{prefix}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    def start(self) -> EtcdServer:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd binary not on PATH (Debian package etcd-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client_port, self.peer_port = free_port(), free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            binary,
            "--name", "default",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--max-txn-ops", str(self.max_txn_ops),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + ETCD_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(
                    f"http://{self.endpoint}/health", timeout=1.0
                ) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {ETCD_READY_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(ETCD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(ETCD_STOP_TIMEOUT_S)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

