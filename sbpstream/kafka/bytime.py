"""ListOffsets by timestamp: the earliest offset whose record timestamp is >= a target.

sbpstream keeps no time index (the data nodes index batches by offset only), but every batch
header carries its records' first and largest timestamp. So the lookup is a binary search over
the stream's offsets in which each probe is one FETCH from that offset (the batches it returns
are all looked at, not only the first): a batch whose largest timestamp is below the target
moves the low bound past it, one at or above it moves the high bound to its base. The answer is
in the batch at the final bound, whose records are decoded to find the first at or above the
target. Cost: at most ``ceil(log2(records)) + 2`` fetches (bounded by :data:`MAX_PROBES`).

This is exact when batch timestamps do not decrease along the offsets (LogAppendTime, and
CreateTime from producers whose clocks agree); Kafka's own answer is defined over its time index
of the *running maximum* timestamp, which out-of-order timestamps also make differ from the
first matching record only inside that index's granularity. When timestamps go back in time the
search still answers an offset whose record has a timestamp >= the target and whose earlier
probed batches are all below it, but an unprobed earlier batch may also hold one. No I/O here:
the caller passes ``probe``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from sbpstream.records.header import read_header
from sbpstream.records.reader import iter_records

MAX_PROBES: Final = 80
"""Fetches one lookup may do (2 + log2 of 2**63 offsets, with room)."""

Probe = Callable[[int], Awaitable[list[memoryview]]]
"""``probe(offset)``: the batches a FETCH at ``offset`` returns (the first holds ``offset``)."""


class ProbeLimitError(RuntimeError):
    """The search did not converge in :data:`MAX_PROBES` fetches (the stream kept changing)."""


async def offset_for_time(probe: Probe, start: int, end: int, target_ms: int
                          ) -> tuple[int, int] | None:
    """(offset, timestamp) of the first record in ``[start, end)`` whose timestamp is >=
    ``target_ms``, or None when there is none."""
    lo, hi = start, end
    found: memoryview | None = None  # a batch based at hi whose largest timestamp is >= target
    for _ in range(MAX_PROBES):
        if lo >= hi:
            break
        mid = lo + (hi - lo) // 2
        batches = await probe(mid)
        if not batches:  # nothing readable at mid (end moved, or trimmed): search below it
            hi = mid
            continue
        for b in batches:
            h = read_header(b)
            nxt = h.base_offset + h.record_count
            if nxt <= mid:
                continue
            if h.base_offset >= hi:
                break
            if h.max_timestamp >= target_ms:
                hi, found = max(h.base_offset, lo), b
                break
            lo = nxt
    else:
        raise ProbeLimitError(f"no answer after {MAX_PROBES} fetches")
    if found is None:
        return None
    for rec in iter_records(found):
        if rec.offset >= hi and rec.timestamp_ms >= target_ms:
            return rec.offset, rec.timestamp_ms
    return None


__all__ = ["MAX_PROBES", "Probe", "ProbeLimitError", "offset_for_time"]
