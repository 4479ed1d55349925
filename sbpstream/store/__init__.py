"""The data node's local storage engine: one shared log of segments, an index, group commit."""

from sbpstream.store.engine import Store
from sbpstream.store.types import (
    AppendOutcome,
    CompactionReport,
    FsyncPolicy,
    ProducerState,
    RangeState,
    ReadResult,
    StoreConfig,
    StoreStats,
)

__all__ = [
    "AppendOutcome",
    "CompactionReport",
    "FsyncPolicy",
    "ProducerState",
    "RangeState",
    "ReadResult",
    "Store",
    "StoreConfig",
    "StoreStats",
]
