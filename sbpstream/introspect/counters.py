"""Counters the introspection figures read, kept where the events happen. No I/O.

- Per stream (a data node's STATS): the append path and the one read path (datanode/reader.py,
  for pull FETCHes, sessions and subscriptions alike) add to them, one dict lookup and a few
  integer adds per range written or per read sent; the read path also adds to the node's totals
  (:attr:`StreamCounterTable.records_fetched`, in the data node's INFO). Per-minute figures come
  from :mod:`.rates` snapshots.
- Per connection (CONNECTIONS, WHOAMI): open subscriptions and fetch sessions, and throttle time
  handed out (:class:`ConnectionCounters`, in the connection's ``attributes``), counted by the
  code that opens and closes them and by the quota charge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

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

    __slots__ = ("by_stream", "bytes_fetched", "records_fetched")

    def __init__(self) -> None:
        self.by_stream: dict[int, StreamCounters] = {}
        #: the node's totals of what it served to readers, all streams (kept when a stream's
        #: own counters are dropped: a node's "records out" never goes down)
        self.records_fetched = 0
        self.bytes_fetched = 0

    def of(self, stream_id: int) -> StreamCounters:
        c = self.by_stream.get(stream_id)
        if c is None:
            c = self.by_stream[stream_id] = StreamCounters()
        return c

    def retain(self, stream_ids: set[int]) -> None:
        """Forget the counters of streams no longer held (deleted, or moved away)."""
        for sid in [s for s in self.by_stream if s not in stream_ids]:
            del self.by_stream[sid]


CONN_COUNTERS: Final = "introspect.counters"
"""The key of a connection's :class:`ConnectionCounters` in its ``attributes``."""


@dataclass(slots=True)
class ConnectionCounters:
    """One connection's figures beyond what the connection layer counts."""

    subscriptions: int = 0  # open subscriptions (FETCH with a window) on it
    sessions: int = 0  # fetch sessions it holds, pulled or pushed (a subscription's too)
    throttle_time_ms: int = 0  # throttle time handed out to it over its quotas, added up


def connection_counters(attributes: dict[str, object]) -> ConnectionCounters:
    """The counters kept in a connection's ``attributes`` (made on first use)."""
    c = attributes.get(CONN_COUNTERS)
    if not isinstance(c, ConnectionCounters):
        c = attributes[CONN_COUNTERS] = ConnectionCounters()
    return c


def peek_connection_counters(attributes: dict[str, object]) -> ConnectionCounters:
    """The connection's counters, or zeros when nothing was counted on it yet."""
    c = attributes.get(CONN_COUNTERS)
    return c if isinstance(c, ConnectionCounters) else ConnectionCounters()
