"""PM configuration: one frozen dataclass, built by ``sbpstream pm`` (= ``python -m sbpstream.pm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sbpstream.auth.config import SecurityConfig

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
        if self.metadata.startswith("etcd://"):
            validate_etcd_url(self.metadata)
        else:
            sqlite_path(self.metadata)


def validate_etcd_url(metadata: str) -> None:
    """ValueError for a malformed etcd URL, or when the etcd extra (aetcd) is not installed."""
    try:
        from sbpstream.pm.etcd import parse_etcd_url  # the optional etcd dependency
    except ImportError as e:
        raise ValueError(
            f"--metadata {metadata!r}: the etcd backend needs aetcd (pip install "
            f"'sbpstream[etcd]'): {e}"
        ) from e
    parse_etcd_url(metadata)


def sqlite_path(metadata: str) -> Path:
    """The file of a ``sqlite:PATH`` metadata URL; ValueError for anything else."""
    scheme, sep, rest = metadata.partition(":")
    if scheme == "sqlite" and sep and rest:
        return Path(rest.removeprefix("//") if rest.startswith("///") else rest)
    raise ValueError(f"--metadata {metadata!r}: expected sqlite:PATH or etcd://HOST:PORT")
