"""Figures the data node reports to the PM (REPORT_METRICS) and logs.

Rates are deltas over the report interval; averages are over the last minute (per-second
buckets, so memory stays constant whatever the request rate). The spec's ``uring_*`` fields are
this node's I/O executor figures: the fsync tasks the store runs in its fsync thread, as seen
from the append path (completed per second, in flight, waiting for one, average latency).
Every figure is clamped to its wire field's type.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from sbpstream.datanode.limits import INT16_MAX, INT32_MAX, INT64_MAX, METRICS_WINDOW_S
from sbpstream.protocol.messages import DataNode, ReportMetricsRequest
from sbpstream.store import StoreStats


def clamp(value: float, hi: int) -> int:
    return max(0, min(int(value), hi))


class WindowAverage:
    """Average of samples over the last ``window_s`` seconds, in one-second buckets."""

    def __init__(self, window_s: float = METRICS_WINDOW_S) -> None:
        self.window_s = window_s
        self._buckets: deque[list[float]] = deque()  # [second, sum, count]

    def add(self, value: float, now: float | None = None) -> None:
        sec = float(int(now if now is not None else time.monotonic()))
        if self._buckets and self._buckets[-1][0] == sec:
            b = self._buckets[-1]
            b[1] += value
            b[2] += 1
        else:
            self._buckets.append([sec, value, 1.0])
        self._prune(sec)

    def _prune(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self.window_s:
            self._buckets.popleft()

    def value(self, now: float | None = None) -> float:
        self._prune(now if now is not None else time.monotonic())
        n = sum(b[2] for b in self._buckets)
        return sum(b[1] for b in self._buckets) / n if n else 0.0


@dataclass(slots=True)
class Counters:
    append_requests: int = 0
    append_failed: int = 0
    fetch_requests: int = 0
    fetch_failed: int = 0
    append_items: int = 0
    fetch_items: int = 0
    syncs_done: int = 0
    syncs_in_flight: int = 0
    syncs_waiting: int = 0


def rss_bytes() -> int:
    """Resident set size from /proc (Linux); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Metrics:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.c = Counters()
        self.append_latency_ms = WindowAverage()
        self.fetch_latency_ms = WindowAverage()
        self.sync_latency_ms = WindowAverage()
        self._last_t = time.monotonic()
        self._last = Counters()
        self._last_written = 0
        self._last_read = 0

    def report(self, node: DataNode, stats: StoreStats, active_ranges: int,
               missing_replicas: int = 0) -> ReportMetricsRequest:
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-3)
        c, p = self.c, self._last

        def rate(cur: int, prev: int) -> float:
            return (cur - prev) / dt

        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = max(stats.disk_free_bytes, 0)
        req = ReportMetricsRequest(
            data_node=node,
            disk_in_rate=clamp(rate(stats.bytes_written, self._last_written), INT64_MAX),
            disk_out_rate=clamp(rate(stats.bytes_read, self._last_read), INT64_MAX),
            disk_free_space=clamp(free, INT64_MAX),
            disk_unindexed_data_size=clamp(stats.unindexed_bytes, INT64_MAX),
            memory_used=clamp(rss_bytes(), INT64_MAX),
            uring_task_rate=clamp(rate(c.syncs_done, p.syncs_done), INT16_MAX),
            uring_inflight_task_cnt=clamp(c.syncs_in_flight, INT16_MAX),
            uring_pending_task_cnt=clamp(c.syncs_waiting, INT32_MAX),
            uring_task_avg_latency=clamp(self.sync_latency_ms.value(now), INT16_MAX),
            network_append_rate=clamp(rate(c.append_requests, p.append_requests), INT16_MAX),
            network_fetch_rate=clamp(rate(c.fetch_requests, p.fetch_requests), INT16_MAX),
            network_failed_append_rate=clamp(rate(c.append_failed, p.append_failed), INT16_MAX),
            network_failed_fetch_rate=clamp(rate(c.fetch_failed, p.fetch_failed), INT16_MAX),
            network_append_avg_latency=clamp(self.append_latency_ms.value(now), INT16_MAX),
            network_fetch_avg_latency=clamp(self.fetch_latency_ms.value(now), INT16_MAX),
            range_missing_replica_cnt=clamp(missing_replicas, INT16_MAX),
            range_active_cnt=clamp(active_ranges, INT16_MAX),
        )
        self._last_t = now
        self._last = Counters(**{k: getattr(c, k) for k in Counters.__dataclass_fields__})
        self._last_written, self._last_read = stats.bytes_written, stats.bytes_read
        return req
