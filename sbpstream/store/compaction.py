"""Segment compaction (BookKeeper entry-log compaction) for the shared log.

For each sealed segment whose live share is below ``compaction_live_ratio`` (a segment with
nothing live included): walk it, copy every entry the index still points at forward into the
active segment (raw bytes, so CRC and append time travel unchanged) and repoint the index; for
each stream that had metadata entries there, write a fresh snapshot of that stream's current
metadata (so a rebuild from the log alone still knows its ranges, seals, trim and retention).
Then: fsync the log, write the index checkpoint (which covers the copies), and only then unlink
the old segments. A crash before the unlink leaves the old segment holding nothing live: the next
compaction deletes it. A segment that fails its walk (corruption) is left alone and reported.
Works on the engine's internal interface, ``StoreState`` (state.py).
"""

from __future__ import annotations

import logging

from sbpstream.records.header import HEADER_STRUCT
from sbpstream.store.format import EntryError, EntryKind, decode_entry
from sbpstream.store.index import StoredStream, pack_loc
from sbpstream.store.segment import Segment
from sbpstream.store.state import StoreState
from sbpstream.store.types import CompactionReport

log = logging.getLogger(__name__)


def compact(state: StoreState) -> CompactionReport:
    shared = state.log
    shared.retry_zombies()
    ratio = shared.config.compaction_live_ratio
    candidates = [
        seg for seg in shared.segments.values()
        if seg is not shared.active and seg.live_bytes < ratio * max(seg.end, 1)
    ]
    copied, done, emptied = 0, [], []
    for seg in sorted(candidates, key=lambda s: s.segment_id):
        live_before = seg.live_bytes
        try:
            copied += _copy_live(state, seg)
        except EntryError as e:
            log.error("compaction skips %s: %s (run check())", seg.path, e)
            continue
        done.append(seg)
        if live_before == 0:
            emptied.append(seg.segment_id)
    if not done:
        return CompactionReport([], [], 0, 0)
    state.checkpoint()  # fsyncs the copies, then the index that points at them
    reclaimed = sum(seg.end for seg in done)
    shared.remove(done)
    moved = [s.segment_id for s in done if s.segment_id not in emptied]
    return CompactionReport(emptied, moved, copied, reclaimed)


def _copy_live(state: StoreState, seg: Segment) -> int:
    """Copy the live entries of ``seg`` forward; returns bytes copied."""
    buf = seg.buffer()
    touched: set[int] = set()
    copied, position = 0, 0
    while position < seg.end:
        entry = decode_entry(buf, position, seg.end)
        position = entry.end
        if entry.kind is not EntryKind.BATCH:
            touched.add(entry.stream_id)
            continue
        s = state.streams.get(entry.stream_id)
        r = s.get(entry.range_index) if s is not None and not s.deleted else None
        if r is None:
            continue
        base = HEADER_STRUCT.unpack_from(buf, entry.body_position)[0]
        i = r.find(base)
        if i < 0 or r.base(i) != base or r.loc(i) != pack_loc(seg.segment_id, entry.position):
            continue
        raw = memoryview(buf)[entry.position : entry.end]
        try:
            dest, at = state.log.write([raw], entry.length)
        finally:
            raw.release()
        r.set_loc(i, pack_loc(dest.segment_id, at))
        dest.live_bytes += entry.length
        seg.live_bytes -= entry.length
        copied += entry.length
    for sid in sorted(touched):
        s = state.streams.get(sid)
        if s is not None:
            _write_snapshot(state, s)
    return copied


def _write_snapshot(state: StoreState, s: StoredStream) -> None:
    """The stream's current metadata as fresh entries (each idempotent on replay)."""
    write_meta = state.log.write_meta
    if s.deleted:
        write_meta(EntryKind.DELETE, s.stream_id, -1, 0)
        return
    for r in s.ranges:
        write_meta(EntryKind.CREATE_RANGE, s.stream_id, r.range_index, r.start_offset)
        if r.sealed:
            write_meta(EntryKind.SEAL, s.stream_id, r.range_index, r.end_offset)
    if s.start_offset:
        write_meta(EntryKind.TRIM, s.stream_id, -1, s.start_offset)
    if s.retention_ms:
        write_meta(EntryKind.RETENTION, s.stream_id, -1, s.retention_ms)

