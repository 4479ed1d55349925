"""The userspace link of :meth:`netbed.NetBed.flaky`: forwards Ethernet frames between two
interfaces over AF_PACKET sockets, dropping and delaying them (the kernel here has no netem).

    python tests/netbed_relay.py DEV_A DEV_B LOSS DELAY_MS JITTER_MS SEED STATS_PATH

Both sockets use PACKET_VNET_HDR: veths hand over 64 KiB GSO super-frames with partial
checksums, and the virtio-net header that comes with each frame on receive makes the kernel
rebuild the same super-frame on send. Each frame is dropped with probability LOSS, else sent
DELAY_MS +- JITTER_MS later, never before an earlier frame of its direction. The counters
(``seen``, ``dropped``, ``sent``, ``send_errors``) are rewritten to STATS_PATH as JSON (the file
appears once both sockets are bound). Exits on SIGTERM or when its parent is gone.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Final

RELAY_BUFFER_BYTES: Final = 256 * 1024
"""Receive buffer per frame: a GSO super-frame is at most 64 KiB plus headers by default."""

RELAY_SOCKET_BUFFER_BYTES: Final = 8 * 1024 * 1024
"""Kernel socket buffers of the relay, so bursts queue instead of being dropped unseen."""

RELAY_STATS_INTERVAL_S: Final = 0.2
"""How often the relay rewrites its counters file (when they changed)."""

PARENT_CHECK_S: Final = 0.5
"""Longest wait between checks that the bed's process (the parent) still lives."""

# Linux ABI numbers the socket module does not name (<linux/if_ether.h>, <linux/if_packet.h>,
# <asm-generic/socket.h>).
ETH_P_ALL: Final = 3
SOL_PACKET: Final = 263
PACKET_VNET_HDR: Final = 15
PACKET_OUTGOING: Final = 4
SO_RCVBUFFORCE: Final = 33
SO_SNDBUFFORCE: Final = 32


def _relay_socket(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RELAY_SOCKET_BUFFER_BYTES)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, RELAY_SOCKET_BUFFER_BYTES)
    s.bind((dev, ETH_P_ALL))
    s.setblocking(False)
    return s


def relay_main(args: Sequence[str]) -> None:
    """Forward frames between two interfaces, lossy and late: ``A B LOSS DELAY_MS JITTER_MS
    SEED STATS_PATH``. Exits on SIGTERM or when its parent (the bed's owner) is gone."""
    dev_a, dev_b, loss_s, delay_s, jitter_s, seed_s, stats_s = args
    loss, delay, jitter = float(loss_s), float(delay_s) / 1e3, float(jitter_s) / 1e3
    rng, stats_path, parent = random.Random(int(seed_s)), Path(stats_s), os.getppid()
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    a, b = _relay_socket(dev_a), _relay_socket(dev_b)
    peer = {a.fileno(): b, b.fileno(): a}
    queues: dict[int, deque[tuple[float, bytes]]] = {a.fileno(): deque(), b.fileno(): deque()}
    last_due = {a.fileno(): 0.0, b.fileno(): 0.0}
    counts = {"seen": 0, "dropped": 0, "sent": 0, "send_errors": 0}
    buf = bytearray(RELAY_BUFFER_BYTES)
    written: dict[str, int] | None = None
    next_write = 0.0

    def write_stats() -> None:
        nonlocal written
        if counts != written:
            tmp = stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(counts))
            tmp.replace(stats_path)
            written = dict(counts)

    def send(fd: int, frame: bytes) -> None:
        try:
            peer[fd].send(frame)
            counts["sent"] += 1
        except OSError:
            counts["send_errors"] += 1

    write_stats()
    while not stop and os.getppid() == parent:
        now = time.monotonic()
        for fd, q in queues.items():
            while q and q[0][0] <= now:
                send(fd, q.popleft()[1])
        heads = [q[0][0] for q in queues.values() if q]
        wait = min([PARENT_CHECK_S, *(max(h - now, 0.0) for h in heads)])
        try:
            readable, _, _ = select.select([a, b], [], [], wait)
        except InterruptedError:
            continue
        for sock in readable:
            fd = sock.fileno()
            for _ in range(64):
                try:
                    n, addr = sock.recvfrom_into(buf)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue
                counts["seen"] += 1
                if loss and rng.random() < loss:
                    counts["dropped"] += 1
                    continue
                frame = bytes(buf[:n])
                if delay == 0 and not queues[fd]:
                    send(fd, frame)
                    continue
                due = max(time.monotonic() + delay + rng.uniform(-jitter, jitter), last_due[fd])
                last_due[fd] = due
                queues[fd].append((due, frame))
        if time.monotonic() >= next_write:
            write_stats()
            next_write = time.monotonic() + RELAY_STATS_INTERVAL_S
    write_stats()


if __name__ == "__main__":
    relay_main(sys.argv[1:])
