"""PM configuration: one frozen dataclass, built by ``sbpstream pm`` (= ``python -m sbpstream.pm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from sbpstream.auth.config import SecurityConfig
from sbpstream.pm.backends import check_metadata_url
from sbpstream.pm.backends import sqlite_path as sqlite_path  # the CLI's import

DEFAULT_PM_PORT: Final = 12378
"""design.md section 8: everything that names the PM defaults to 127.0.0.1:12378."""

DEFAULT_METADATA: Final = "sqlite:./data/pm/metadata.sqlite3"
"""Where `sbpstream pm` keeps its metadata when not told: under ./data like `sbpstream up`."""

DEFAULT_HEARTBEAT_INTERVAL_MS: Final = 1000
DEFAULT_NODE_TIMEOUT_MS: Final = 5000
"""Five missed heartbeats: long enough to ride out a GC pause or a busy disk, short enough that a
writer whose node died gets a new range within seconds."""

MIN_INTERVAL_MS: Final = 10
"""Below this the liveness sweep would spin; nothing real heartbeats faster."""


@dataclass(frozen=True, slots=True)
class PmConfig:
    metadata: str
    """``sqlite:PATH`` (the embedded default, one PM) or
    ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX][?lease_ttl_s=3]`` (several PMs, one leader;
    docs/etcd.md)."""
    port: int = DEFAULT_PM_PORT
    """0 picks a free port (see :attr:`PmServer.port`)."""
    host: str = "127.0.0.1"
    advertise: str = ""
    """``host:port`` others should use; empty = ``host:port`` as bound."""
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    """How often nodes are expected to heartbeat; the PM checks liveness at this period."""
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS
    """A data node silent this long is dead: its writable ranges are sealed and renewed."""
    metrics_port: int = -1
    """Prometheus ``/metrics`` over HTTP on this port (host = ``host``); -1 = off, 0 = any."""
    public_metrics: bool = False
    """With auth on, ``/metrics`` without credentials (``--public-metrics``): off by default."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, auth, protected mode (docs/security.md)."""

    def validate(self) -> None:
        """Raise ValueError with a message an operator can act on."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port}: must be 0..65535")
        if self.heartbeat_interval_ms < MIN_INTERVAL_MS:
            raise ValueError(f"--heartbeat-interval-ms must be >= {MIN_INTERVAL_MS}")
        if self.node_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"--node-timeout-ms ({self.node_timeout_ms}) must exceed "
                f"--heartbeat-interval-ms ({self.heartbeat_interval_ms})"
            )
        if self.advertise and ":" not in self.advertise:
            raise ValueError(f"--advertise {self.advertise!r}: expected HOST:PORT")
        check_metadata_url(self.metadata)
