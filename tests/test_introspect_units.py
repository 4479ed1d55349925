"""Per-minute figures from snapshots (introspect.rates) and per-stream counters. Pure."""

from __future__ import annotations

from sbpstream.introspect.counters import StreamCounterTable
from sbpstream.introspect.rates import RateWindow


def test_young_process_counts_everything_since_start() -> None:
    w: RateWindow[str] = RateWindow(start=100.0)
    w.take(105.0, {"a": (3, 30)})
    assert w.per_minute(107.0, "a", (5, 50)) == (5, 50)
    assert w.per_minute(107.0, "new", (1, 2)) == (1, 2)


def test_per_minute_subtracts_the_snapshot_a_minute_old() -> None:
    w: RateWindow[str] = RateWindow(start=0.0)
    for t in range(5, 200, 5):
        w.take(float(t), {"a": (t * 10,)})  # 10 per second
    # at 197 the newest snapshot at least 60 s old is the one taken at 135
    assert w.per_minute(197.0, "a", (1970,)) == (1970 - 1350,)
    # history stays bounded: one snapshot older than the window, the rest inside it
    assert len(w._snaps) <= 60 / 5 + 2


def test_counters_never_go_negative_and_forget_dropped_streams() -> None:
    w: RateWindow[int] = RateWindow(start=0.0)
    w.take(61.0, {1: (10,)})
    assert w.per_minute(130.0, 1, (4,)) == (0,)  # a counter reset reads as no traffic
    t = StreamCounterTable()
    t.of(1).records_appended += 5
    t.of(2).bytes_fetched += 7
    t.retain({2})
    assert set(t.by_stream) == {2} and t.of(2).bytes_fetched == 7
