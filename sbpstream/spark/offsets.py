"""Offset math and partition planning for the Spark source. Pure functions, no I/O.

A streaming offset is one JSON object ``{"<stream_id>": next_offset}``: offsets are dense per
stream across its ranges, so one number per stream is the whole position. Keys are strings in
sorted order, because Spark compares offsets as JSON text (a different key order would look like
new data and run an empty batch every trigger).

A stream whose value is ``LATEST`` (-1) has not been resolved yet: the query started at "latest"
and has not planned its first batch. The first ``latestOffset`` replaces it by the stream's end
at that moment and reads nothing from it in that batch; a replay of that batch reads the same
nothing. This is how "latest" stays stable across a restart without a checkpoint folder.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sbpstream.spark.options import LATEST

Offsets = dict[int, int]


def offsets_to_json(offsets: Mapping[int, int]) -> dict[str, int]:
    """The JSON-ready dict Spark gets: string keys inserted in sorted (string) order."""
    items = sorted((str(k), int(v)) for k, v in offsets.items())
    return dict(items)


def offsets_from_json(obj: Mapping[str, object], streams: Sequence[int] | None) -> Offsets:
    """Read back an offset dict from Spark (string keys), checked against the query's streams
    (``None``: not checked; a pattern's streams come and go)."""
    out: Offsets = {}
    for key, value in obj.items():
        try:
            sid = int(key)
        except ValueError:
            raise ValueError(f"bad offset key {key!r} in {dict(obj)}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"bad offset {value!r} for stream {sid}")
        out[sid] = value
    unknown = set(out) - set(streams) if streams is not None else set()
    if unknown:
        raise ValueError(
            f"the checkpoint names streams {sorted(unknown)} that option 'streams' does not list; "
            "a query's streams cannot change across restarts"
        )
    return out


def split_read_limit(backlogs: Mapping[int, int], max_rows: int) -> dict[int, int]:
    """Share ``max_rows`` among streams in proportion to each stream's backlog.

    Each share is at most the stream's backlog; the shares add up to ``min(max_rows, total)``.
    Rounding leftovers go to the largest fractional parts (ties by stream id), so even a limit
    smaller than the number of streams makes progress, and the split is deterministic.
    """
    if max_rows < 0:
        raise ValueError(f"max_rows must not be negative, not {max_rows}")
    total = sum(max(0, b) for b in backlogs.values())
    if total <= max_rows:
        return {s: max(0, b) for s, b in backlogs.items()}
    shares: dict[int, int] = {}
    remainders: list[tuple[int, int]] = []  # (-remainder numerator, stream)
    for s, b in backlogs.items():
        b = max(0, b)
        q, r = divmod(b * max_rows, total)
        shares[s] = q
        remainders.append((-r, s))
    left = max_rows - sum(shares.values())
    for _, s in sorted(remainders):
        if left <= 0:
            break
        if shares[s] < max(0, backlogs[s]):
            shares[s] += 1
            left -= 1
    return shares


@dataclass(frozen=True, slots=True)
class PlannedRange:
    """One range of a stream as the planner needs it."""

    range_index: int
    start_offset: int
    end_offset: int  # exclusive; -1 for the writable range (open-ended)
    replicas: tuple[str, ...]  # data node addresses, the primary first


@dataclass(frozen=True, slots=True)
class Span:
    """Records [from_offset, until_offset) of one range of one stream: one Spark partition."""

    stream_id: int
    range_index: int
    from_offset: int
    until_offset: int
    replicas: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.until_offset - self.from_offset


def spans_of_stream(
    stream_id: int, ranges: Sequence[PlannedRange], from_offset: int, until_offset: int
) -> list[Span]:
    """Cut [from, until) of a stream along its ranges; empty pieces are dropped.

    Offsets not covered by any range (below the first range: trimmed away) produce no span; the
    caller checks for data loss before planning. Ranges that do not follow each other (one
    ends where the next does not start, or a writable one has a successor: metadata that is not
    the PM's) are a ValueError, not a gap or an overlap in the plan.
    """
    out: list[Span] = []
    ordered = sorted(ranges, key=lambda r: r.range_index)
    for a, b in itertools.pairwise(ordered):
        if a.end_offset != b.start_offset:
            raise ValueError(
                f"stream {stream_id}: its ranges do not follow each other (range {a.range_index} "
                f"ends at {a.end_offset}, range {b.range_index} starts at {b.start_offset}); "
                "the PM's metadata is inconsistent")
    if until_offset <= from_offset:
        return out
    for r in ordered:
        end = until_offset if r.end_offset < 0 else r.end_offset
        lo = max(from_offset, r.start_offset)
        hi = min(until_offset, end)
        if lo < hi:
            out.append(Span(stream_id, r.range_index, lo, hi, r.replicas))
    return out


def split_spans(spans: Sequence[Span], min_partitions: int | None) -> list[Span]:
    """Split big spans so there are at least ``min_partitions`` (Kafka's minPartitions rule).

    Each span gets ``max(1, round(size / total * min_partitions))`` parts of near-equal size; a
    span never splits into parts smaller than one record.
    """
    spans = [s for s in spans if s.size > 0]
    if not min_partitions or len(spans) >= min_partitions:
        return list(spans)
    total = sum(s.size for s in spans)
    out: list[Span] = []
    for s in spans:
        parts = min(s.size, max(1, round(s.size * min_partitions / total)))
        for i in range(parts):
            lo = s.from_offset + s.size * i // parts
            hi = s.from_offset + s.size * (i + 1) // parts
            out.append(Span(s.stream_id, s.range_index, lo, hi, s.replicas))
    return out


def next_offsets(
    start: Mapping[int, int],
    readable_from: Mapping[int, int],
    ends: Mapping[int, int],
    max_rows: int | None,
) -> Offsets:
    """The end offsets of the next micro-batch.

    ``start``: the batch's start per stream (LATEST = unresolved "latest"); ``readable_from``:
    where reading really begins (start, or the trim point when records were lost and skipped);
    ``ends``: each stream's current (or availableNow-capped) end. Unresolved streams jump to
    their end and read nothing; the others share ``max_rows`` by backlog. An end never moves
    backwards.
    """
    out: Offsets = {}
    backlogs: dict[int, int] = {}
    for s, st in start.items():
        if st == LATEST:
            out[s] = max(0, ends[s])
        else:
            backlogs[s] = max(0, ends[s] - readable_from[s])
    shares = backlogs if max_rows is None else split_read_limit(backlogs, max_rows)
    for s, share in shares.items():
        out[s] = max(start[s], readable_from[s] + share)
    return {s: out[s] for s in start}
