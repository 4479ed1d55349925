"""The data node's local storage engine: one shared log of segments, an index, group commit."""

from sbpstream.store.engine import Store
from sbpstream.store.types import (
    AppendOutcome,
    CompactionReport,
    FsyncPolicy,
    RangeState,
    ReadResult,
    StoreConfig,
    StoredProducerState,
    StoreStats,
)

__all__ = [
    "AppendOutcome",
    "CompactionReport",
    "FsyncPolicy",
    "RangeState",
    "ReadResult",
    "Store",
    "StoreConfig",
    "StoreStats",
    "StoredProducerState",
]
