"""The etcd ``--metadata`` URL and the settings it carries (no etcd client needed)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Final

DEFAULT_PREFIX: Final = "/sbpstream"
DEFAULT_ETCD_PORT: Final = 2379

DEFAULT_LEASE_TTL_S: Final = 3
"""Leader lease. A killed leader is replaced within about this long; shorter makes a GC pause or
a slow disk depose a healthy leader. etcd rounds a TTL below its minimum (about 2 s with default
raft timing) up to that minimum."""

MIN_LEASE_TTL_S: Final = 2
"""etcd's own floor with default raft timing (1.5 x election timeout, rounded up)."""

DEFAULT_MAX_TXN_OPS: Final = 128
"""etcd's default ``--max-txn-ops``: operations per transaction, per list (compare, success,
failure). A cluster started with a larger limit may be told with ``?max_txn_ops=N``."""

DEFAULT_REQUEST_TIMEOUT_S: Final = 5.0
"""One etcd RPC. A quorum write takes milliseconds; five seconds covers an etcd leader election
(about one election timeout, 1 s by default) with a wide margin."""


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    @property
    def endpoint_list(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.endpoints]


def is_etcd_url(url: str) -> bool:
    return url.startswith("etcd://")


def parse_etcd_url(url: str) -> EtcdSettings:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX][?lease_ttl_s=3&max_txn_ops=128&timeout_s=5]``.

    Raises ValueError with a message an operator can act on.
    """
    if not is_etcd_url(url):
        raise ValueError(f"--metadata {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    rest = url[len("etcd://"):]
    rest, _, query = rest.partition("?")
    hosts, slash, path = rest.partition("/")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            continue
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, str(DEFAULT_ETCD_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--metadata {url!r}: bad etcd endpoint {part!r} (HOST:PORT)")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError(f"--metadata {url!r}: no etcd endpoint given")
    prefix = "/" + path.strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    opts = dict(urllib.parse.parse_qsl(query, strict_parsing=False))
    known = {"lease_ttl_s", "max_txn_ops", "timeout_s"}
    unknown = set(opts) - known
    if unknown:
        raise ValueError(f"--metadata {url!r}: unknown option(s) {sorted(unknown)}; "
                         f"known: {sorted(known)}")
    try:
        ttl = int(opts.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))
        ops = int(opts.get("max_txn_ops", DEFAULT_MAX_TXN_OPS))
        timeout = float(opts.get("timeout_s", DEFAULT_REQUEST_TIMEOUT_S))
    except ValueError as e:
        raise ValueError(f"--metadata {url!r}: {e}") from e
    if ttl < MIN_LEASE_TTL_S:
        raise ValueError(f"--metadata {url!r}: lease_ttl_s must be >= {MIN_LEASE_TTL_S}")
    if ops < 8:
        raise ValueError(f"--metadata {url!r}: max_txn_ops must be >= 8 (one item needs up to 6)")
    if timeout <= 0:
        raise ValueError(f"--metadata {url!r}: timeout_s must be > 0")
    return EtcdSettings(tuple(endpoints), prefix, ttl, ops, timeout)
