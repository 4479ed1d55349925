"""How a data node charges one request against its quotas (no I/O; the caller passes the time).

Which quota applies to a connection (Kafka's precedence, resolved per rate: the most specific
quota that sets the rate wins; an unset rate falls through to the next):

1. the user+client-id quota of the connection's principal and client id
   (``user/<principal>,client/<id>``); counter ``u/<principal>,c/<id>/<rate>``;
2. the user quota of its principal (``user/<principal>``), shared by all the principal's client
   ids; counter ``u/<principal>/<rate>``;
3. the client-id quota (``client/<id>``), shared by every principal using that client id;
   counter ``c/<id>/<rate>``;
4. the default quota, *per client id*: counter ``c/<id>/<rate>``.

A connection without a principal (auth off, or a node token) skips 1 and 2. Separately, each
stream named by the request is charged to its own quota, ``s/<stream id>/<rate>``, shared by all
clients. The throttle time of a request is the longest any of its counters asks for.

Each data node enforces every quota for the traffic it serves, independently of the others (Kafka
enforces its quotas per broker the same way): a client writing to N nodes may move up to N times
its quota in total.

The cost on requests that are not throttled is kept small: the counter keys and rates of one
(principal, client id) are resolved once per loaded quota set and remembered (:attr:`_plans`,
bounded by :data:`MAX_PLANS`), so a request makes one dictionary lookup and one counter update
per rate that applies, with no string built per request.
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

MAX_PLANS: Final = MAX_QUOTA_COUNTERS
"""Most (principal, client id) resolutions remembered; past it the memo is cleared and refilled
(a flood of client ids costs resolution time, never memory)."""

Plan = tuple["tuple[str, int] | None", "tuple[str, int] | None", "tuple[str, int] | None"]
"""Per rate (PRODUCE, FETCH, REQUESTS): the counter key and its quota, or None (not limited)."""


@dataclass(slots=True)
class QuotaBook:
    """The quotas a data node enforces, as last pulled from the PM."""

    default: QuotaSpec | None = None
    clients: dict[str, QuotaSpec] = field(default_factory=dict)
    streams: dict[int, QuotaSpec] = field(default_factory=dict)
    users: dict[str, QuotaSpec] = field(default_factory=dict)
    user_clients: dict[tuple[str, str], QuotaSpec] = field(default_factory=dict)

    @classmethod
    def of(cls, specs: Iterable[QuotaSpec]) -> QuotaBook:
        book = cls()
        for s in specs:
            if s.kind is QuotaKind.DEFAULT:
                book.default = s
            elif s.kind is QuotaKind.CLIENT and s.user:
                book.user_clients[(s.user, s.name)] = s
            elif s.kind is QuotaKind.CLIENT:
                book.clients[s.name] = s
            elif s.kind is QuotaKind.USER:
                book.users[s.user] = s
            else:
                book.streams[int(s.name)] = s
        return book

    @property
    def empty(self) -> bool:
        return (self.default is None and not self.clients and not self.streams
                and not self.users and not self.user_clients)

    def resolve(self, user: str, client_id: str, rate: int) -> tuple[str, int] | None:
        """The counter key and quota of ``rate`` for this principal and client id (the
        precedence in the module docstring), or None when no quota sets it."""
        name = _RATE_NAMES[rate]
        if user:
            spec = self.user_clients.get((user, client_id))
            if spec is not None and (q := spec.rates()[rate]) != UNLIMITED:
                return f"u/{user},c/{client_id}/{name}", q
            spec = self.users.get(user)
            if spec is not None and (q := spec.rates()[rate]) != UNLIMITED:
                return f"u/{user}/{name}", q
        for spec in (self.clients.get(client_id), self.default):
            if spec is not None and (q := spec.rates()[rate]) != UNLIMITED:
                return f"c/{client_id}/{name}", q
        return None

    def plan(self, user: str, client_id: str) -> Plan:
        return (self.resolve(user, client_id, PRODUCE), self.resolve(user, client_id, FETCH),
                self.resolve(user, client_id, REQUESTS))


class QuotaEnforcer:
    def __init__(self, window_ms: int = DEFAULT_QUOTA_WINDOW_MS,
                 max_counters: int = MAX_QUOTA_COUNTERS) -> None:
        if window_ms <= 0:
            raise ValueError("quota window must be positive")
        self.window_ns = window_ms * 1_000_000
        self.book = QuotaBook()
        self._plans: dict[tuple[str, str], Plan] = {}  # (principal, client id) -> its plan
        self._stream_plans: dict[int, Plan | None] = {}
        self.counters = CounterTable(max_counters)
        self.throttled = 0  # requests answered with a throttle time
        self.throttle_ms_total = 0

    def load(self, specs: Iterable[QuotaSpec]) -> None:
        self.book = QuotaBook.of(specs)
        self._plans = {}
        self._stream_plans = {}

    @property
    def has_stream_quotas(self) -> bool:
        """Whether any stream has a quota (else callers need not count bytes per stream)."""
        return bool(self.book.streams)

    def _plan(self, user: str, client_id: str) -> Plan:
        plans = self._plans
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[(user, client_id)] = self.book.plan(user, client_id)
        return plan

    def _stream_plan(self, sid: int) -> Plan | None:
        if sid in self._stream_plans:
            return self._stream_plans[sid]
        spec = self.book.streams.get(sid)
        plan: Plan | None = None
        if spec is not None:
            def entry(r: int, q: int) -> tuple[str, int] | None:
                return None if q == UNLIMITED else (f"s/{sid}/{_RATE_NAMES[r]}", q)
            plan = (entry(PRODUCE, spec.produce_bytes_per_s),
                    entry(FETCH, spec.fetch_bytes_per_s), entry(REQUESTS, spec.requests_per_s))
        if len(self._stream_plans) >= MAX_PLANS:
            self._stream_plans.clear()
        self._stream_plans[sid] = plan
        return plan

    def fetch_round_bytes(self, client_id: str, stream_ids: Iterable[int],
                          user: str = "") -> int | None:
        """The smallest fetch quota over one window for this client and these streams (what
        one push may send before it is charged); None when no fetch quota applies."""
        book = self.book
        if book.empty:
            return None
        own = book.resolve(user, client_id, FETCH)
        rates = [] if own is None else [own[1]]
        rates += [spec.rates()[FETCH] for sid in stream_ids
                  if (spec := book.streams.get(sid)) is not None]
        limited = [r for r in rates if r != UNLIMITED]
        if not limited:
            return None
        return max(1, min(limited) * self.window_ns // 1_000_000_000)

    def charge(self, client_id: str, rate: int, amount: int,
               per_stream: Mapping[int, int], now_ns: int, user: str = "") -> int:
        """Count one request (``amount`` units of ``rate``, by stream in ``per_stream``) and
        its one request, for the principal ``user`` ("" = none) and ``client_id``; return its
        throttle time in milliseconds (0 = under every quota)."""
        if self.book.empty:
            return 0
        plan = self._plans.get((user, client_id))
        if plan is None:
            plan = self._plan(user, client_id)
        throttle_ns = 0
        tab, window = self.counters, self.window_ns
        got = plan[rate]
        if got is not None and amount > 0:
            throttle_ns = tab.consume(got[0], amount, got[1], window, now_ns)
        got = plan[REQUESTS]
        if got is not None:
            ns = tab.consume(got[0], 1, got[1], window, now_ns)
            if ns > throttle_ns:
                throttle_ns = ns
        if per_stream and self.book.streams:
            for sid, n in per_stream.items():
                splan = self._stream_plan(sid)
                if splan is None:
                    continue
                for r, units in ((rate, n), (REQUESTS, 1)):
                    got = splan[r]
                    if got is not None and units > 0:
                        ns = tab.consume(got[0], units, got[1], window, now_ns)
                        if ns > throttle_ns:
                            throttle_ns = ns
        if throttle_ns <= 0:
            return 0
        ms = -(-throttle_ns // 1_000_000)
        self.throttled += 1
        self.throttle_ms_total += ms
        return ms
