"""Hop trace: when each acknowledged APPEND item passed each step on this node (a benchmark's
per-hop latency breakdown, issue 34). Off by default; costs nothing then but one ``is None``
test per APPEND.

Set the environment variable ``SBPSTREAM_HOP_TRACE`` to a file path and the data node records,
for every item answered OK on the one-frame path (the common case: every range known, no
immediate failure), the CLOCK_MONOTONIC times (nanoseconds, comparable across processes on one
Linux host) of: the request frame read off the socket, its handler starting, the group commit
covering it returning (durable), and its answer written. The rows stay in memory (at most
MAX_HOP_TRACE_ROWS) and are written to the path, one JSON array per line
``[stream_id, base_offset, next_offset, read_ns, start_ns, durable_ns, acked_ns]``, when the
node shuts down (gracefully). ``bench.bench_subscribe --hops`` joins them with the producer's
send and ack times and the consumer's delivery times by offset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

HOP_TRACE_ENV: Final = "SBPSTREAM_HOP_TRACE"
"""The environment variable naming the trace file (unset or empty: no trace)."""

MAX_HOP_TRACE_ROWS: Final = 2_000_000
"""Rows kept (~150 B each in memory: ~300 MB at most, a benchmark's minutes at 2,000 records/s
many times over); later items are not traced (the dropped count is the file's last line)."""


class HopTrace:
    """The rows of one data node's APPEND items (loop thread only)."""

    __slots__ = ("dropped", "path", "rows")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[tuple[int, int, int, int, int, int, int]] = []
        self.dropped = 0

    def note(self, stream_id: int, base_offset: int, next_offset: int, read_s: float,
             start_s: float, durable_s: float, acked_s: float) -> None:
        """One item's times (``time.monotonic()`` seconds, stored as nanoseconds)."""
        if len(self.rows) >= MAX_HOP_TRACE_ROWS:
            self.dropped += 1
            return
        self.rows.append((stream_id, base_offset, next_offset, int(read_s * 1e9),
                          int(start_s * 1e9), int(durable_s * 1e9), int(acked_s * 1e9)))

    def dump(self) -> None:
        """Write the rows to the trace file (at shutdown)."""
        with open(self.path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
            f.write(json.dumps({"dropped": self.dropped}) + "\n")


def hop_trace_from_env() -> HopTrace | None:
    """The trace the environment asks for, or None (the default: off)."""
    path = os.environ.get(HOP_TRACE_ENV, "")
    return HopTrace(Path(path)) if path else None
