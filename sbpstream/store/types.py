"""Public value types of the storage engine: configuration, results, snapshots. No I/O."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from sbpstream.store.limits import (
    DEFAULT_CHECKPOINT_INTERVAL_BYTES,
    DEFAULT_FSYNC_INTERVAL_MS,
    DEFAULT_SEGMENT_BYTES_MAX,
    MAX_SEGMENT_BYTES,
    MIN_SEGMENT_BYTES,
)


class FsyncPolicy(enum.Enum):
    """When appended bytes are made durable.

    ALWAYS: ``sync()`` returns only after an fsync covering the position (group commit: concurrent
    callers share one fsync). INTERVAL: a background thread fsyncs every ``fsync_interval_ms``;
    ``sync()`` returns at once, so a crash may lose the last interval of acknowledged writes.
    NONE: never fsync appends (tests and benchmarks only; checkpoints are still fsynced).
    """

    ALWAYS = "always"
    INTERVAL = "interval"
    NONE = "none"


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class StoreConfig:
    fsync_policy: FsyncPolicy = FsyncPolicy.ALWAYS
    fsync_interval_ms: int = DEFAULT_FSYNC_INTERVAL_MS
    segment_bytes_max: int = DEFAULT_SEGMENT_BYTES_MAX
    # Write an index checkpoint once this many log bytes are not covered by one (bounds replay
    # time on open: replay reads and CRCs these bytes).
    index_checkpoint_interval_bytes: int = DEFAULT_CHECKPOINT_INTERVAL_BYTES
    # A sealed segment whose live bytes fall below this share of its size is compacted.
    compaction_live_ratio: float = 0.5
    # Append time source (ms since the epoch); retention compares against it. Injectable for tests.
    clock_ms: Callable[[], int] = field(default=wall_clock_ms)

    def __post_init__(self) -> None:
        if not MIN_SEGMENT_BYTES <= self.segment_bytes_max <= MAX_SEGMENT_BYTES:
            raise ValueError(
                f"segment_bytes_max {self.segment_bytes_max} outside "
                f"[{MIN_SEGMENT_BYTES}, {MAX_SEGMENT_BYTES}]"
            )
        if self.fsync_interval_ms <= 0:
            raise ValueError("fsync_interval_ms must be positive")
        if not 0.0 <= self.compaction_live_ratio <= 1.0:
            raise ValueError("compaction_live_ratio must be within [0, 1]")
        if self.index_checkpoint_interval_bytes <= 0:
            raise ValueError("index_checkpoint_interval_bytes must be positive")


@dataclass(frozen=True, slots=True)
class RangeState:
    """A snapshot of one range as this node holds it.

    ``end_offset`` is -1 while the final end is unknown (open, or sealed with ``seal_range(None)``
    and not yet told the end). ``sealed`` is True once the range stops accepting client writes.
    """

    stream_id: int
    range_index: int
    start_offset: int
    next_offset: int
    end_offset: int
    sealed: bool


@dataclass(frozen=True, slots=True)
class AppendOutcome:
    base_offset: int
    next_offset: int
    # Pass to ``Store.sync`` to wait until this batch is durable.
    log_position: int
    duplicate: bool = False


class StoredProducerState(NamedTuple):
    producer_id: int
    epoch: int
    last_sequence: int
    last_base_offset: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Whole batches from the one containing the requested offset, as views over mmaps.

    ``next_offset``: where the next read starts (after the last returned batch).
    ``start_offset``: the stream's lowest readable offset here (its trim point or first local).
    ``end_offset``: the stream's local end (next offset of its last local range).
    ``range_end``: True when the read stopped at the end of a sealed range whose successor is not
    held here (the reader should ask the PM where the next range lives).
    """

    batches: list[memoryview]
    next_offset: int
    start_offset: int
    end_offset: int
    range_end: bool = False

    @property
    def byte_count(self) -> int:
        return sum(len(b) for b in self.batches)


@dataclass(frozen=True, slots=True)
class CompactionReport:
    segments_deleted: list[int]
    segments_compacted: list[int]
    bytes_copied: int
    bytes_reclaimed: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    unindexed_bytes: int  # log bytes not yet covered by an index checkpoint
    bytes_written: int
    bytes_read: int
    appends: int
    reads: int
    fsyncs: int
    segment_count: int
    log_bytes: int
    live_bytes: int
    streams: int
    ranges: int
    indexed_batches: int
    disk_free_bytes: int
