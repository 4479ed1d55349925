"""The data node's configuration (what ``python -m sbpstream.datanode`` parses into)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sbpstream.auth.config import SecurityConfig
from sbpstream.datanode.limits import (
    DEFAULT_COMPACTION_INTERVAL_MS,
    DEFAULT_FETCH_FRAME_BYTES,
    DEFAULT_RETENTION_INTERVAL_MS,
    MAX_FETCH_FRAME_BYTES,
)
from sbpstream.net.client import parse_address
from sbpstream.store import FsyncPolicy

DEFAULT_PM = "127.0.0.1:12378"
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class DataNodeConfig:
    """``pm`` lists PM addresses (``host:port``); a PM_NOT_LEADER redirect is followed to the
    leader it names. ``advertise`` is what clients and the PM use to reach this node (default
    ``host:port`` once bound)."""

    directory: Path
    port: int = 0
    host: str = DEFAULT_HOST
    pm: tuple[str, ...] = (DEFAULT_PM,)
    advertise: str = ""
    heartbeat_interval_ms: int = 1000
    metrics_interval_ms: int = 5000
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS
    fsync_interval_ms: int = 10
    retention_interval_ms: int = DEFAULT_RETENTION_INTERVAL_MS
    compaction_interval_ms: int = DEFAULT_COMPACTION_INTERVAL_MS
    fetch_frame_bytes: int = DEFAULT_FETCH_FRAME_BYTES
    metrics_port: int = -1
    """Prometheus ``/metrics`` over HTTP on this port (host = ``host``); -1 = off, 0 = any."""
    public_metrics: bool = False
    """With auth on, ``/metrics`` without credentials (``--public-metrics``): off by default."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, auth, protected mode (docs/security.md)."""

    def __post_init__(self) -> None:
        if not self.pm:
            raise ValueError("at least one PM address is needed (--pm)")
        for addr in self.pm:
            parse_address(addr)
        if self.advertise:
            parse_address(self.advertise)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        for name in ("heartbeat_interval_ms", "metrics_interval_ms", "fsync_interval_ms",
                     "retention_interval_ms", "compaction_interval_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 4096 <= self.fetch_frame_bytes <= MAX_FETCH_FRAME_BYTES:
            raise ValueError(f"fetch_frame_bytes must be within [4096, {MAX_FETCH_FRAME_BYTES}]")

    @staticmethod
    def parse_pm_list(text: str) -> tuple[str, ...]:
        return tuple(a.strip() for a in text.split(",") if a.strip())
