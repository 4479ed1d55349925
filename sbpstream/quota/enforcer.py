"""How a data node charges one request against its quotas (no I/O; the caller passes the time).

Which quotas apply (resolved per rate, like Kafka's most specific match):

- the client's: its own quota's rate when it sets that rate, else the default quota's; the
  counter is the client's own (``c/<client id>/<rate>``), so the default is *per client*;
- each stream's named by the request: ``s/<stream id>/<rate>``, shared by all clients.

Each data node enforces every quota for the traffic it serves, independently of the others (Kafka
enforces its quotas per broker the same way): a client writing to N nodes may move up to N times
its quota in total. The throttle time of a request is the longest any of its counters asks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from sbpstream.quota.counters import MAX_QUOTA_COUNTERS, CounterTable
from sbpstream.quota.model import UNLIMITED, QuotaKind, QuotaSpec

DEFAULT_QUOTA_WINDOW_MS: Final = 1000
"""A counter's TTL: the rate window. Long enough that one window holds many requests (a burst
is at most one window's quota), short enough that a client over its quota waits about a second."""

PRODUCE: Final = 0
FETCH: Final = 1
REQUESTS: Final = 2
_RATE_NAMES: Final = ("produce", "fetch", "requests")


@dataclass(slots=True)
class QuotaBook:
    """The quotas a data node enforces, as last pulled from the PM."""

    default: QuotaSpec | None = None
    clients: dict[str, QuotaSpec] = field(default_factory=dict)
    streams: dict[int, QuotaSpec] = field(default_factory=dict)

    @classmethod
    def of(cls, specs: Iterable[QuotaSpec]) -> QuotaBook:
        book = cls()
        for s in specs:
            if s.kind is QuotaKind.DEFAULT:
                book.default = s
            elif s.kind is QuotaKind.CLIENT:
                book.clients[s.name] = s
            else:
                book.streams[int(s.name)] = s
        return book

    @property
    def empty(self) -> bool:
        return self.default is None and not self.clients and not self.streams

    def client_rate(self, client_id: str, rate: int) -> int:
        own = self.clients.get(client_id)
        if own is not None and own.rates()[rate] != UNLIMITED:
            return own.rates()[rate]
        return UNLIMITED if self.default is None else self.default.rates()[rate]


class QuotaEnforcer:
    def __init__(self, window_ms: int = DEFAULT_QUOTA_WINDOW_MS,
                 max_counters: int = MAX_QUOTA_COUNTERS) -> None:
        if window_ms <= 0:
            raise ValueError("quota window must be positive")
        self.window_ns = window_ms * 1_000_000
        self.book = QuotaBook()
        self.counters = CounterTable(max_counters)
        self.throttled = 0  # requests answered with a throttle time
        self.throttle_ms_total = 0

    def load(self, specs: Iterable[QuotaSpec]) -> None:
        self.book = QuotaBook.of(specs)

    def fetch_round_bytes(self, client_id: str, stream_ids: Iterable[int]) -> int | None:
        """The smallest fetch quota over one window for this client and these streams (what
        one push may send before it is charged); None when no fetch quota applies."""
        book = self.book
        if book.empty:
            return None
        rates = [book.client_rate(client_id, FETCH)]
        rates += [spec.rates()[FETCH] for sid in stream_ids
                  if (spec := book.streams.get(sid)) is not None]
        limited = [r for r in rates if r != UNLIMITED]
        if not limited:
            return None
        return max(1, min(limited) * self.window_ns // 1_000_000_000)

    def charge(self, client_id: str, rate: int, amount: int,
               per_stream: Mapping[int, int], now_ns: int) -> int:
        """Count one request (``amount`` units of ``rate``, by stream in ``per_stream``) and
        its one request; return its throttle time in milliseconds (0 = under every quota)."""
        book = self.book
        if book.empty:
            return 0
        throttle_ns = 0
        tab, window = self.counters, self.window_ns
        name = _RATE_NAMES[rate]
        q = book.client_rate(client_id, rate)
        if q != UNLIMITED and amount > 0:
            throttle_ns = tab.consume(f"c/{client_id}/{name}", amount, q, window, now_ns)
        q = book.client_rate(client_id, REQUESTS)
        if q != UNLIMITED:
            throttle_ns = max(throttle_ns,
                              tab.consume(f"c/{client_id}/requests", 1, q, window, now_ns))
        if book.streams:
            for sid, n in per_stream.items():
                spec = book.streams.get(sid)
                if spec is None:
                    continue
                for r, units in ((rate, n), (REQUESTS, 1)):
                    q = spec.rates()[r]
                    if q != UNLIMITED and units > 0:
                        throttle_ns = max(throttle_ns, tab.consume(
                            f"s/{sid}/{_RATE_NAMES[r]}", units, q, window, now_ns))
        if throttle_ns <= 0:
            return 0
        ms = -(-throttle_ns // 1_000_000)
        self.throttled += 1
        self.throttle_ms_total += ms
        return ms
