"""Throttr-style counters: one record per (quota key, window), expiring with its TTL.

A record holds Throttr's two fields: ``quota``, what is left to consume in the window (bytes or
requests), and a TTL. :meth:`CounterTable.consume` is Throttr's INSERT-or-UPDATE(DECREASE) in one
step: it finds the key's live record or creates one with the full quota and a TTL of one window,
takes the amount, and answers how long the key is to hold off (0 while the quota lasts). A record
overdrawn by D units has its TTL extended (Throttr's UPDATE TTL) by the time the quota's rate
needs to earn D back, and its quota set to 0: when it expires the key has consumed exactly the
rate times the time its window lasted, and the next request opens a fresh window.

TTLs carry Throttr's TTL types (nanoseconds ... hours, binary 0x01 ... 0x06); :meth:`query` is
Throttr's QUERY/LIST (quota left, TTL type, TTL left), :meth:`purge` its PURGE.

Memory is bounded: expired records are removed as time passes (oldest first, a few per call,
plus a full sweep when the table is full), and at most ``max_counters`` records exist. When the
table is full of live records, a new key is charged to one shared :data:`OVERFLOW_KEY` record
instead: a flood of distinct client ids cannot grow memory, nor escape its quota by inventing
ids. No I/O: the caller passes the time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

MAX_QUOTA_COUNTERS: Final = 10_000
"""Most counter records one data node keeps (about 200 bytes each: 2 MB at most). Three per
active client id (produce, fetch, requests) plus one per stream with a quota; beyond that, new
keys share :data:`OVERFLOW_KEY`."""

OVERFLOW_KEY: Final = "*overflow*"
"""The record new keys are charged to while the table is full of live records."""

PURGE_PER_CALL: Final = 8
"""Expired records removed from the front of the table per :meth:`CounterTable.consume`:
amortized O(1), and faster than one new record per call, so idle records do not pile up."""

SWEEP_INTERVAL_NS: Final = 100_000_000
"""A full table is swept for expired records at most this often (a sweep is O(records))."""


class TtlType(enum.IntEnum):
    """Throttr's TTL types, with Throttr's binary values."""

    NANOSECONDS = 0x01
    MICROSECONDS = 0x02
    MILLISECONDS = 0x03
    SECONDS = 0x04
    MINUTES = 0x05
    HOURS = 0x06

    @property
    def ns(self) -> int:
        return _NS_PER[self]


_NS_PER: Final = {TtlType.NANOSECONDS: 1, TtlType.MICROSECONDS: 1_000,
                  TtlType.MILLISECONDS: 1_000_000, TtlType.SECONDS: 1_000_000_000,
                  TtlType.MINUTES: 60_000_000_000, TtlType.HOURS: 3_600_000_000_000}


DEAD_NS: Final = -(1 << 62)
"""The expiry a purged record is given: whoever still holds it (an enforcer's meter caches its
record) sees it expired and goes back to the table."""


@dataclass(slots=True)
class Counter:
    key: str
    quota: int  # left to consume in this window (Throttr's QUOTA)
    expires_ns: int  # now + TTL at creation, moved by an overdraft


@dataclass(frozen=True, slots=True)
class CounterView:
    """One live record as Throttr's QUERY answers it."""

    key: str
    quota: int
    ttl_type: TtlType
    ttl: int  # left, in ttl_type units (rounded up)


class CounterTable:
    def __init__(self, max_counters: int = MAX_QUOTA_COUNTERS) -> None:
        if max_counters < 2:
            raise ValueError("max_counters must leave room for the overflow record")
        self.max_counters = max_counters
        self._records: dict[str, Counter] = {}
        self._last_sweep_ns = -SWEEP_INTERVAL_NS
        self.expired = 0  # records removed by their TTL
        self.overflowed = 0  # charges made to OVERFLOW_KEY because the table was full

    def __len__(self) -> int:
        return len(self._records)

    def consume(self, key: str, amount: int, quota: int, window_ns: int, now_ns: int) -> int:
        """Take ``amount`` from ``key``'s window of ``quota`` units per ``window_ns``; return
        the nanoseconds the key must hold off (0: still within its quota)."""
        rec = self._records.get(key)
        if rec is None or rec.expires_ns <= now_ns:
            rec = self.open(key, quota, window_ns, now_ns)
        rec.quota -= amount
        if rec.quota >= 0:
            return 0
        return self.overdraw(rec, quota, window_ns, now_ns)

    def open(self, key: str, quota: int, window_ns: int, now_ns: int) -> Counter:
        """``key``'s live record, created (Throttr's INSERT) with the full ``quota`` and a TTL
        of one window if it has none; the shared :data:`OVERFLOW_KEY` record instead when the
        table is full of live records (its ``key`` then says so)."""
        rec = self._live(key, now_ns)
        if rec is not None:
            return rec
        self._purge_front(now_ns)
        if len(self._records) >= self.max_counters - 1 and key != OVERFLOW_KEY:
            self._sweep(now_ns)
            if len(self._records) >= self.max_counters - 1:
                self.overflowed += 1
                key = OVERFLOW_KEY
                rec = self._live(key, now_ns)
                if rec is not None:
                    return rec
        rec = self._records[key] = Counter(key, quota, now_ns + window_ns)
        return rec

    def overdraw(self, rec: Counter, quota: int, window_ns: int, now_ns: int) -> int:
        """``rec`` went below 0 (by D units): extend its TTL by the time ``quota`` per
        ``window_ns`` needs to earn D back (Throttr's UPDATE TTL), set its quota to 0, and
        return the nanoseconds its key must hold off: until the extended TTL ends."""
        debt = -rec.quota
        rec.expires_ns += -(-debt * window_ns // quota)  # rounded up
        rec.quota = 0
        records = self._records
        if records.get(rec.key) is rec:  # keep the table roughly in expiry order (_purge_front)
            del records[rec.key]
            records[rec.key] = rec
        return rec.expires_ns - now_ns

    def _live(self, key: str, now_ns: int) -> Counter | None:
        rec = self._records.get(key)
        if rec is not None and rec.expires_ns <= now_ns:
            del self._records[key]
            self.expired += 1
            return None
        return rec

    def _purge_front(self, now_ns: int) -> None:
        records = self._records
        for _ in range(PURGE_PER_CALL):
            if not records:
                return
            key = next(iter(records))
            if records[key].expires_ns > now_ns:
                return
            del records[key]
            self.expired += 1

    def _sweep(self, now_ns: int) -> None:
        if now_ns - self._last_sweep_ns < SWEEP_INTERVAL_NS:
            return
        self._last_sweep_ns = now_ns
        dead = [k for k, r in self._records.items() if r.expires_ns <= now_ns]
        for k in dead:
            del self._records[k]
        self.expired += len(dead)

    def query(self, now_ns: int, ttl_type: TtlType = TtlType.MILLISECONDS) -> list[CounterView]:
        """Every live record with its quota left and TTL left (Throttr's QUERY, for all)."""
        unit = ttl_type.ns
        return [CounterView(k, r.quota, ttl_type, -(-(r.expires_ns - now_ns) // unit))
                for k, r in self._records.items() if r.expires_ns > now_ns]

    def purge(self, key: str) -> bool:
        """Remove one record (Throttr's PURGE); False when there was none."""
        rec = self._records.pop(key, None)
        if rec is None:
            return False
        rec.expires_ns = DEAD_NS
        return True

    def clear(self) -> None:
        for rec in self._records.values():
            rec.expires_ns = DEAD_NS
        self._records.clear()
