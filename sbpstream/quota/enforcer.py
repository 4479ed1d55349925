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

The cost on requests that are not throttled is kept to a few integer operations per counter:
the counters of one (principal, client id) are resolved once per loaded quota set into a
:class:`Plan` (remembered in :attr:`QuotaEnforcer._plans`, bounded by :data:`MAX_PLANS`; the data
node also keeps it on the connection, :mod:`sbpstream.datanode.quota`), each stream's the same
way, and a plan's :class:`Meter` keeps a reference to its live counter record. Charging a
request walks the meters of its rate: while the record is live (its expiry is after now), it is
one subtraction and one comparison, with no string, tuple or dictionary lookup per request; only
a record that expired (or was purged) sends the meter back to the table, which expires lazily.
Loading a quota set that differs from the one held bumps :attr:`QuotaEnforcer.version`, which
invalidates every plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from sbpstream.quota.counters import MAX_QUOTA_COUNTERS, Counter, CounterTable
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


class Meter:
    """One counter a request may charge: its key, its quota (units per window), whether it
    counts requests (1 each) or the request's units, and the counter record last seen live
    (None until the first charge, and while the key is charged to the overflow record)."""

    __slots__ = ("key", "per_request", "quota", "rec")

    def __init__(self, key: str, quota: int, per_request: bool) -> None:
        self.key = key
        self.quota = quota
        self.per_request = per_request
        self.rec: Counter | None = None


Plan = tuple[tuple[Meter, ...], tuple[Meter, ...]]
"""Per charged rate (PRODUCE, FETCH): the meters one request of that rate charges, that rate's
byte counter and the requests counter, each only when a quota sets it."""

_UNRESOLVED: Final[Plan] = ((), ())
"""A miss in ``_stream_plans`` (compared by identity; a stream without a quota maps to None)."""


def _plan_of(entries: tuple[tuple[str, int] | None, ...]) -> Plan:
    """The plan of per-rate (key, quota) entries (PRODUCE, FETCH, REQUESTS; None: unset)."""
    req = entries[REQUESTS]
    req_meter = () if req is None else (Meter(req[0], req[1], True),)
    by_rate = tuple(req_meter if e is None else (Meter(e[0], e[1], False), *req_meter)
                    for e in entries[:REQUESTS])
    return by_rate[PRODUCE], by_rate[FETCH]


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
        return _plan_of((self.resolve(user, client_id, PRODUCE),
                         self.resolve(user, client_id, FETCH),
                         self.resolve(user, client_id, REQUESTS)))


class QuotaEnforcer:
    def __init__(self, window_ms: int = DEFAULT_QUOTA_WINDOW_MS,
                 max_counters: int = MAX_QUOTA_COUNTERS) -> None:
        if window_ms <= 0:
            raise ValueError("quota window must be positive")
        self.window_ns = window_ms * 1_000_000
        self.book = QuotaBook()
        self.empty = True  # no quota held: every charge is 0 at once
        self.has_stream_quotas = False  # else callers need not count bytes per stream
        self.version = 0  # bumped when a different quota set is loaded: plans are stale
        self._specs: tuple[QuotaSpec, ...] = ()
        self._plans: dict[tuple[str, str], Plan] = {}  # (principal, client id) -> its plan
        self._stream_plans: dict[int, Plan | None] = {}
        self.counters = CounterTable(max_counters)
        self.charged = [0, 0]  # requests charged, by rate (PRODUCE, FETCH)
        self.throttled = 0  # requests answered with a throttle time
        self.throttle_ms_total = 0

    def load(self, specs: Iterable[QuotaSpec]) -> None:
        """Enforce ``specs`` from now on. The same set as held changes nothing (the data node
        reloads every heartbeat); another drops every resolved plan. Counters carry over."""
        specs = tuple(specs)
        if specs == self._specs:
            return
        self._specs = specs
        self.book = QuotaBook.of(specs)
        self.empty = self.book.empty
        self.has_stream_quotas = bool(self.book.streams)
        self.version += 1
        self._plans = {}
        self._stream_plans = {}

    def plan(self, user: str, client_id: str) -> Plan:
        """The meters of this principal and client id under the quotas held (remembered)."""
        plans = self._plans
        plan = plans.get((user, client_id))
        if plan is None:
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plan = plans[(user, client_id)] = self.book.plan(user, client_id)
        return plan

    def _stream_plan(self, sid: int) -> Plan | None:
        spec = self.book.streams.get(sid)
        plan: Plan | None = None
        if spec is not None:
            plan = _plan_of(tuple(None if q == UNLIMITED else (f"s/{sid}/{_RATE_NAMES[r]}", q)
                                  for r, q in enumerate(spec.rates())))
        if len(self._stream_plans) >= MAX_PLANS:
            self._stream_plans.clear()
        self._stream_plans[sid] = plan
        return plan

    def fetch_round_bytes(self, client_id: str, stream_ids: Iterable[int],
                          user: str = "") -> int | None:
        """The smallest fetch quota over one window for this client and these streams (what
        one push may send before it is charged); None when no fetch quota applies."""
        if self.empty:
            return None
        book = self.book
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
        if self.empty:
            return 0
        return self.charge_plan(self.plan(user, client_id), rate, amount, per_stream, now_ns)

    def charge_plan(self, plan: Plan, rate: int, amount: int, per_stream: Mapping[int, int],
                    now_ns: int) -> int:
        """:meth:`charge` with the client's plan already resolved (by :meth:`plan`, under the
        current :attr:`version`)."""
        self.charged[rate] += 1
        throttle_ns = self._count(plan[rate], amount, now_ns, 0)
        if per_stream and self.has_stream_quotas:
            stream_plans = self._stream_plans
            for sid, n in per_stream.items():
                splan = stream_plans.get(sid, _UNRESOLVED)
                if splan is _UNRESOLVED:
                    splan = self._stream_plan(sid)
                if splan is not None:
                    throttle_ns = self._count(splan[rate], n, now_ns, throttle_ns)
        if throttle_ns <= 0:
            return 0
        ms = -(-throttle_ns // 1_000_000)
        self.throttled += 1
        self.throttle_ms_total += ms
        return ms

    def _count(self, meters: Sequence[Meter], amount: int, now_ns: int,
               throttle_ns: int) -> int:
        """Check and count one request against ``meters`` (``amount`` units, or 1 for a
        per-request meter); returns the larger of ``throttle_ns`` and their overdraw waits."""
        for m in meters:
            units = 1 if m.per_request else amount
            if units <= 0:
                continue
            rec = m.rec
            if rec is None or rec.expires_ns <= now_ns:
                rec = self._open(m, now_ns)
            rec.quota -= units
            if rec.quota < 0:
                ns = self.counters.overdraw(rec, m.quota, self.window_ns, now_ns)
                if ns > throttle_ns:
                    throttle_ns = ns
        return throttle_ns

    def _open(self, m: Meter, now_ns: int) -> Counter:
        """The meter's live record from the table (created if none); kept on the meter unless
        it is the shared overflow record (the key then gets its own as soon as there is room)."""
        rec = self.counters.open(m.key, m.quota, self.window_ns, now_ns)
        m.rec = rec if rec.key == m.key else None
        return rec
