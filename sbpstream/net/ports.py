"""The one free-port helper: the data node, LocalCluster, the tests and the benchmarks use it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to on ``host`` right now (IPv4 or IPv6 address).

    It only probes: the port is not reserved, so another process (or a second call) may get it
    before the caller binds it. Callers that hand out several ports dedupe them themselves.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
