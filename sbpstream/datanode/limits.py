"""Every limit of the data node server, each with its reason (design.md section 9)."""

from __future__ import annotations

from typing import Final

from sbpstream.protocol.limits import MAX_FRAME_LENGTH, MiB
from sbpstream.protocol.messages import MAX_ITEMS_PER_REQUEST

MAX_APPEND_ITEMS: Final = 4096
"""Batches one APPEND may carry. Each item costs a store write, an index row and a result in the
response header; 4096 results (~60 bytes each) keep the response header under 256 KiB, and a
16 MiB frame of useful batches rarely holds more than a few hundred."""

MAX_FETCH_ITEMS: Final = MAX_ITEMS_PER_REQUEST
"""Streams one FETCH may name: the codec's bound (10,000). A consumer of more streams splits its
fetches; each item costs a read and a waiter registration per poll round."""

FETCH_HEADER_RESERVE: Final = 1 * MiB
"""Room kept in each FETCH response frame for its header (one FetchResult per batch)."""

MAX_BATCHES_PER_FETCH_FRAME: Final = 4096
"""Batches listed in one FETCH response frame: 4096 results of ~80 bytes stay far below
FETCH_HEADER_RESERVE, so a frame never outgrows MAX_FRAME_LENGTH however small the batches."""

MAX_FETCH_FRAME_BYTES: Final = MAX_FRAME_LENGTH - FETCH_HEADER_RESERVE
"""Most payload bytes one FETCH response frame carries (a frame is at most 16 MiB)."""

DEFAULT_FETCH_FRAME_BYTES: Final = 1 * MiB
"""Payload a FETCH response frame aims for. Smaller than the frame limit so a consumer starts
decoding while the rest is in flight, and under the 4 MiB write-buffer high-water mark so one
frame never stalls a connection. A single batch larger than this goes alone in its frame."""

DEFAULT_FETCH_ITEM_BYTES: Final = 1 * MiB
"""A FETCH item's byte budget when it asks for batch_max_bytes <= 0."""

MAX_FETCH_ITEM_BYTES: Final = 256 * MiB
"""The most one FETCH item may return in one response, whatever it asks: bounds the work and the
socket time one request takes (a consumer fetches again for more)."""

MAX_FETCH_WAIT_MS: Final = 60_000
"""Longest long-poll: a FETCH asking for more waits this long at most, so a forgotten request
cannot pin a handler (and its waiter registrations) for ever."""

DEFAULT_APPEND_TIMEOUT_MS: Final = 30_000
"""An APPEND's deadline (durability and replication, see append.py) when it sets timeout_ms <= 0.
"""

MAX_APPEND_TIMEOUT_MS: Final = 120_000
"""The longest deadline an APPEND gets, whatever its timeout_ms: how long a handler may hold its
batches, futures and a slot of the connection. A writer waiting longer retries (idempotently)."""

DEFAULT_SYNC_TIMEOUT_MS: Final = 30_000
"""SYNC_RANGES without timeout_ms: how long it waits for the copy of a sealed range it lacks.
At most MAX_SYNC_TIMEOUT_MS; past the deadline the item answers TIMEOUT and the copy goes on in
the background (it is the range's convergence, not the caller's work)."""

MAX_SYNC_TIMEOUT_MS: Final = 120_000

DEFAULT_DIGEST_TIMEOUT_MS: Final = 30_000
"""DESCRIBE_RANGES asking for digests (sbpstream check) without timeout_ms: how long it may read.
At most MAX_DIGEST_TIMEOUT_MS; the items not digested by the deadline answer TIMEOUT."""

MAX_DIGEST_TIMEOUT_MS: Final = 120_000

PM_CALL_TIMEOUT_S: Final = 5.0
"""One request to the PM (heartbeat, metrics, list, trim report). A PM slower than this is
treated as unreachable and the next address in --pm is tried."""

PM_RETRY_BACKOFF_MIN_S: Final = 0.05
PM_RETRY_BACKOFF_MAX_S: Final = 2.0
"""Backoff between registration attempts while the PM is unreachable (doubling, capped)."""

PM_LOOKUP_TTL_S: Final = 1.0
"""An APPEND for a range this node does not hold asks the PM (LIST_RANGES) at most once per
stream per this interval, so a client hammering an unknown stream cannot flood the PM."""

PM_LOOKUP_WAIT_S: Final = 2.0
"""How long an APPEND for an unknown range waits for that lookup before answering
RANGE_NOT_FOUND: a slow PM must not hold writes for the PM client's full retry budget."""

METRICS_WINDOW_S: Final = 60.0
"""Window of the averaged latencies and of "active ranges" in REPORT_METRICS (the spec's "past
minute")."""

DEFAULT_RETENTION_INTERVAL_MS: Final = 30_000
"""How often retention runs (it walks every stream's oldest batches) and stream configs
(retention periods) are refreshed from the PM."""

DEFAULT_COMPACTION_INTERVAL_MS: Final = 60_000
"""How often compaction looks for mostly-dead segments to reclaim."""

DRAIN_TIMEOUT_S: Final = 5.0
"""Graceful shutdown: how long in-flight requests may finish after GOAWAY. Below the 10 s a
supervisor (LocalCluster) waits before SIGKILL, so the store is always closed cleanly."""

INT16_MAX: Final = (1 << 15) - 1
INT32_MAX: Final = (1 << 31) - 1
INT64_MAX: Final = (1 << 63) - 1
