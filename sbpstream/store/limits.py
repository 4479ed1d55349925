"""Every limit of the storage engine, each with its reason."""

from __future__ import annotations

from typing import Final

from sbpstream.records.header import MAX_BATCH_BYTES

# Locations pack (segment_id << 32 | position) into one int64 index cell, so a position must fit
# in 32 bits. 4 GiB segments are also the most a 32-bit entry length could ever need.
MAX_SEGMENT_BYTES: Final = 1 << 32
# A segment must hold at least one maximal entry, or a big batch could never be written.
MIN_SEGMENT_BYTES: Final = MAX_BATCH_BYTES + 4096
# 256 MiB: large enough that one fsync/dir-entry per segment is noise, small enough that a
# compaction copies at most this much at a time.
DEFAULT_SEGMENT_BYTES_MAX: Final = 256 * 1024 * 1024
# Segment ids live in the top 31 bits of a location (the sign bit stays clear).
MAX_SEGMENT_ID: Final = (1 << 31) - 1
# Replaying 64 MiB on open takes well under a second; checkpoints more often than that would
# cost more (one is O(index size)) than the replay they save.
DEFAULT_CHECKPOINT_INTERVAL_BYTES: Final = 64 * 1024 * 1024
DEFAULT_FSYNC_INTERVAL_MS: Final = 10
# Per producer id and range, the last batches remembered to answer duplicates with their
# original offset (Kafka keeps 5: the most in-flight requests an idempotent producer may have).
PRODUCER_RECENT_BATCHES: Final = 5
# Offsets are int64 on the wire.
MAX_OFFSET: Final = (1 << 63) - 1
# Reading the zero tail of a preallocated active segment is done in chunks of this size, so a
# 256 MiB tail is checked without one giant allocation.
ZERO_SCAN_CHUNK_BYTES: Final = 4 * 1024 * 1024
# Index checkpoints are read whole into memory; 4 GiB is far beyond 1,000,000 streams (~100 MB).
MAX_CHECKPOINT_BYTES: Final = 4 << 30
