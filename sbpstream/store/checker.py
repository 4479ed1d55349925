"""``Store.check()``: cross-check the index against the segments, every entry and batch CRC.

Reads the whole log (O(log size)); meant for tests, tools and after recovery, not the hot path.
Works on the engine's internal interface, ``StoreState`` (state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sbpstream.records.header import BatchError, validate_batch
from sbpstream.store.format import EntryError, EntryKind, decode_entry
from sbpstream.store.index import StoredRange, StoredStream, pack_loc, unpack_loc
from sbpstream.store.segment import Segment
from sbpstream.store.state import StoreState


@dataclass(frozen=True, slots=True)
class _Stored:
    stream_id: int
    range_index: int
    base_offset: int
    record_count: int
    length: int


def check(state: StoreState) -> list[str]:
    findings: list[str] = []
    stored: dict[int, _Stored] = {}
    segments = state.log.segments
    for seg in sorted(segments.values(), key=lambda s: s.segment_id):
        _check_segment(seg, seg is state.log.active, stored, findings)
    live: dict[int, int] = {}
    for s in state.streams.values():
        if s.deleted and s.ranges:
            findings.append(f"stream {s.stream_id}: deleted but still has ranges")
        for r in s.ranges:
            _check_range(s, r, stored, live, findings)
    for seg in segments.values():
        if seg.live_bytes != live.get(seg.segment_id, 0):
            findings.append(
                f"segment {seg.segment_id}: live_bytes {seg.live_bytes}, index says "
                f"{live.get(seg.segment_id, 0)}"
            )
    return findings


def _check_segment(
    seg: Segment, active: bool, stored: dict[int, _Stored], findings: list[str]
) -> None:
    if seg.end == 0:
        return
    buf = seg.buffer()
    position = 0
    while position < seg.end:
        try:
            entry = decode_entry(buf, position, seg.end)
        except EntryError as e:
            findings.append(f"segment {seg.segment_id}: corrupt entry at {position}: {e}")
            return
        if entry.kind is EntryKind.BATCH:
            body = memoryview(buf)[entry.body_position : entry.end]
            try:
                h = validate_batch(body)
            except BatchError as e:
                findings.append(f"segment {seg.segment_id}: bad batch at {position}: {e}")
            else:
                stored[pack_loc(seg.segment_id, position)] = _Stored(
                    entry.stream_id, entry.range_index, h.base_offset, h.record_count,
                    entry.length,
                )
            body.release()
        position = entry.end
    if active:
        if seg.find_nonzero_end(seg.end) != seg.end:
            findings.append(f"segment {seg.segment_id}: non-zero bytes after its end {seg.end}")
    elif seg.end != seg.file_size:
        findings.append(
            f"segment {seg.segment_id}: valid entries end at {seg.end}, file at {seg.file_size}"
        )


def _check_range(
    s: StoredStream, r: StoredRange, stored: dict[int, _Stored], live: dict[int, int],
    findings: list[str],
) -> None:
    name = f"range {s.stream_id}/{r.range_index}"
    expected = None
    for i in range(len(r)):
        loc, base, size = r.loc(i), r.base(i), r.size(i)
        e = stored.get(loc)
        if e is None:
            findings.append(f"{name}: batch {base} points at no valid entry {unpack_loc(loc)}")
            expected = None
            continue
        if (e.stream_id, e.range_index, e.base_offset, e.length) != (
            s.stream_id, r.range_index, base, size
        ):
            findings.append(f"{name}: batch {base} index row disagrees with the log: {e}")
        if expected is not None and base != expected:
            findings.append(f"{name}: offsets not dense: batch at {base}, expected {expected}")
        expected = base + e.record_count
        live[loc >> 32] = live.get(loc >> 32, 0) + size
    if expected is not None and expected != r.next_offset:
        findings.append(f"{name}: last batch ends at {expected}, next_offset {r.next_offset}")
    if len(r) and r.base(0) < r.start_offset:
        findings.append(f"{name}: batch {r.base(0)} below range start {r.start_offset}")
    if len(r) and r.batch_next(0) <= s.start_offset:
        findings.append(f"{name}: keeps batch {r.base(0)} below the trim point {s.start_offset}")
    if r.end_offset >= 0 and (not r.sealed or r.next_offset > r.end_offset):
        findings.append(f"{name}: end {r.end_offset}, next {r.next_offset}, sealed {r.sealed}")
    for pid, p in (r.producers or {}).items():
        if p.last_base_offset >= r.next_offset:
            findings.append(f"{name}: producer {pid} last batch {p.last_base_offset} past end")
