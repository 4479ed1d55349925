"""A data node's per-stream traffic counters. No I/O.

The append and fetch handlers add to them (one dict lookup and a few integer adds per range
written or read); STATS reads them. Per-minute figures come from :mod:`.rates` snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

RATED = ("records_appended", "bytes_appended", "records_fetched", "bytes_fetched")
"""The counters that also get a per-minute figure, in :meth:`StreamCounters.rated` order."""


@dataclass(slots=True)
class StreamCounters:
    records_appended: int = 0  # by producers, at this node (the primary)
    bytes_appended: int = 0
    records_fetched: int = 0  # served to consumers (and to replicas re-copying a range)
    bytes_fetched: int = 0
    records_replicated: int = 0  # received from the primary (this node is a secondary)
    bytes_replicated: int = 0
    last_append_ms: int = 0  # wall clock of the last append or replicated write; 0 = never

    def rated(self) -> tuple[int, int, int, int]:
        return (self.records_appended, self.bytes_appended, self.records_fetched,
                self.bytes_fetched)


class StreamCounterTable:
    """``stream_id -> StreamCounters``, created on first use."""

    __slots__ = ("by_stream",)

    def __init__(self) -> None:
        self.by_stream: dict[int, StreamCounters] = {}

    def of(self, stream_id: int) -> StreamCounters:
        c = self.by_stream.get(stream_id)
        if c is None:
            c = self.by_stream[stream_id] = StreamCounters()
        return c

    def retain(self, stream_ids: set[int]) -> None:
        """Forget the counters of streams no longer held (deleted, or moved away)."""
        for sid in [s for s in self.by_stream if s not in stream_ids]:
            del self.by_stream[sid]
