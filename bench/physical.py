"""The machine's physical limits, measured in the same run as the systems under test.

* Loopback TCP: a plain socket pair in two processes (a sender child, the receiver here), big
  ``sendall`` chunks, no protocol: the ceiling for any client/server pair on this box.
* Sequential file write with an fsync after every write, the data node's group-commit pattern
  (``pwrite`` then ``fdatasync``, as ``sbpstream.store.sync`` does), at 64 KiB and 1 MiB per
  write, plus a buffered (no fsync) write for reference. Written on the same file system as the
  systems' data directories.

Every loop is bounded by a byte count and a time cap.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TCP_CHUNK_BYTES = 256 * 1024
TCP_ACCEPT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class PhysicalResult:
    name: str
    bytes: int
    seconds: float
    ops: int  # writes (file) or recv calls (tcp)
    capped: bool

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def ops_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mb_s": self.mb_s, "ops_s": self.ops_s}


def _tcp_sender(port: int, total_bytes: int, time_cap_s: float) -> None:
    buf = os.urandom(TCP_CHUNK_BYTES)
    view = memoryview(buf)
    deadline = time.monotonic() + time_cap_s
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < total_bytes and time.monotonic() < deadline:
            n = min(TCP_CHUNK_BYTES, total_bytes - sent)
            s.sendall(view[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)


def loopback_tcp(total_bytes: int, time_cap_s: float) -> PhysicalResult:
    """Stream ``total_bytes`` from a child process to this one over 127.0.0.1."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(TCP_ACCEPT_TIMEOUT_S)
        port = srv.getsockname()[1]
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_tcp_sender, args=(port, total_bytes, time_cap_s), daemon=True)
        child.start()
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(time_cap_s + 10)
                buf = bytearray(TCP_CHUNK_BYTES)
                got = calls = 0
                t0 = time.perf_counter()
                while True:
                    n = conn.recv_into(buf)
                    if n == 0:
                        break
                    got += n
                    calls += 1
                seconds = time.perf_counter() - t0
        finally:
            child.join(time_cap_s + 10)
            if child.is_alive():
                child.kill()
                child.join(5)
    return PhysicalResult("loopback TCP", got, seconds, calls, got < total_bytes)


def file_write(
    directory: Path, write_bytes: int, total_bytes: int, time_cap_s: float, *, fsync: bool
) -> PhysicalResult:
    """Sequential ``pwrite`` of ``write_bytes`` at a time, ``fdatasync`` after each if ``fsync``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"physical-{write_bytes}-{int(fsync)}.dat"
    buf = os.urandom(write_bytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = ops = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + time_cap_s
        while pos < total_bytes and time.monotonic() < deadline:
            pos += os.pwrite(fd, buf, pos)
            if fsync:
                os.fdatasync(fd)
            ops += 1
        if not fsync:
            os.fdatasync(fd)  # the buffered figure includes getting it to disk once at the end
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    kib = write_bytes // 1024
    label = f"file write {kib} KiB + fdatasync each" if fsync else f"file write {kib} KiB buffered"
    return PhysicalResult(label, pos, seconds, ops, pos < total_bytes)


def measure_all(directory: Path, *, quick: bool) -> list[PhysicalResult]:
    """One measurement of every physical limit (the caller repeats it for medians)."""
    scale = 1 if not quick else 8
    cap_s = 5.0 if not quick else 0.5
    return [
        loopback_tcp(4 * 1024**3 // scale, cap_s),
        file_write(directory, 64 * 1024, 256 * 1024**2 // scale, cap_s, fsync=True),
        file_write(directory, 1024 * 1024, 512 * 1024**2 // scale, cap_s, fsync=True),
        file_write(directory, 1024 * 1024, 512 * 1024**2 // scale, cap_s, fsync=False),
    ]


if __name__ == "__main__":  # pragma: no cover - manual check
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sbpbench-phys-") as d:
        for r in measure_all(Path(d), quick=False):
            print(f"{r.name:40s} {r.mb_s:10.1f} MB/s {r.ops_s:10.1f} ops/s capped={r.capped}")
