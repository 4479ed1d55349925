"""Opening a store: load the index checkpoint, replay the log after it, repair a torn tail.

``recover`` runs once, from ``Store.open``. The checkpoint says which log position it covers;
every entry after that is CRC-checked and replayed: metadata entries are applied in order,
batch entries are collected per range and merged afterwards (a batch the index already holds
at an earlier location is a compaction copy: the index moves to it). A bad entry cuts the rest of
its segment aside (``<segment>.cut-<pos>``, never silently dropped); a missing or unusable
checkpoint means a rebuild from the start of the log. What was found goes to
``StoreState.recovery_findings`` and the log. See docs/storage.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from sbpstream.records.header import HEADER_STRUCT, BatchHeader
from sbpstream.store import producers
from sbpstream.store.format import Entry, EntryError, EntryKind, decode_entry
from sbpstream.store.index import StoredStream, pack_loc, read_checkpoint, unpack_loc
from sbpstream.store.segment import Segment
from sbpstream.store.state import StoreState

log = logging.getLogger(__name__)

# (base_offset, record_count, location, entry_length, append_time_ms, producer_id, epoch, seq)
_Pending = tuple[int, int, int, int, int, int, int, int]


def recover(state: StoreState) -> None:
    """Bring ``state`` (empty, over an unopened log) to what the directory holds."""
    state.log.open_segments()
    start = _load_checkpoint(state)
    pending = _replay(state, start)
    _merge(state, pending)
    for s in state.streams.values():
        state.normalize(s)
    state.log.recount_live(state.streams.values())
    state.log.open_active()
    if state.log.unindexed_bytes or (start == (0, 0) and state.log.segments):
        state.checkpoint()


def _finding(state: StoreState, msg: str) -> None:
    log.error(msg)
    state.recovery_findings.append(msg)


def _load_checkpoint(state: StoreState) -> tuple[int, int]:
    """Load the index checkpoint; returns where the replay starts. A missing or unusable
    checkpoint means a rebuild from the start of the log (logged loudly when corrupt)."""
    path = state.checkpoint_path
    if not path.exists():
        if state.log.segments:
            log.warning("%s: no index checkpoint; rebuilding the index from the log", path)
        return (0, 0)
    try:
        ck = read_checkpoint(path)
        _validate_checkpoint(state, ck.covered_segment, ck.covered_position, ck.streams)
    except ValueError as e:
        _finding(state, f"{path}: unusable index checkpoint ({e}); rebuilding the index "
                 "from the log")
        return (0, 0)
    state.streams = ck.streams
    return (ck.covered_segment, ck.covered_position)


def _validate_checkpoint(
    state: StoreState, seg_id: int, position: int, streams: dict[int, StoredStream]
) -> None:
    segments = state.log.segments
    seg = segments.get(seg_id)
    if segments and (seg is None or position > seg.file_size):
        raise ValueError(f"covers segment {seg_id}:{position} which the log does not hold")
    for s in streams.values():
        for r in s.ranges:
            for loc in r.cols[1::4]:
                sid, pos = unpack_loc(loc)
                if sid not in segments or pos > segments[sid].file_size:
                    raise ValueError(f"points at missing segment {sid}:{pos}")


def _replay(state: StoreState, start: tuple[int, int]) -> dict[tuple[int, int], list[_Pending]]:
    """Walk the log from ``start``: apply metadata entries in order, collect batch entries
    per range (merged afterwards, see _merge). Cuts a bad tail aside (never silently)."""
    pending: dict[tuple[int, int], list[_Pending]] = {}
    segments = state.log.segments
    ids = sorted(segments)
    for seg_id in ids:
        seg = segments[seg_id]
        if seg_id < start[0]:
            seg.end = seg.file_size
            continue
        first = start[1] if seg_id == start[0] else 0
        seg.end = first
        for entry in _walk(state, seg, first, last=seg_id == ids[-1]):
            state.log.unindexed_bytes += entry.length
            if entry.kind is EntryKind.BATCH:
                _collect_batch(seg, entry, pending)
            else:
                state.apply_meta(entry.kind, entry.stream_id, entry.range_index, entry.arg)
    return pending


def _walk(state: StoreState, seg: Segment, first: int, *, last: bool) -> Iterator[Entry]:
    position = first
    buf = seg.buffer() if seg.file_size else b""
    while position < seg.file_size:
        try:
            entry = decode_entry(buf, position, seg.file_size)
        except EntryError as e:
            _cut_tail(state, seg, position, str(e), last=last)
            return
        seg.end = entry.end
        yield entry
        position = entry.end
    seg.end = position


def _cut_tail(state: StoreState, seg: Segment, position: int, reason: str, *,
              last: bool) -> None:
    seg.end = position
    stop = seg.find_nonzero_end(position) if last else seg.file_size
    if stop <= position:
        return  # the zeroed, preallocated rest of the active segment: nothing was lost
    side = seg.copy_aside(position, stop)
    _finding(state, f"{seg.path}: invalid entry at {position} ({reason}); cut "
             f"{stop - position} bytes to {side}")
    if last:
        seg.zero_from(position)
    else:
        os.ftruncate(seg.fd, position)
        seg.file_size = position
    os.fsync(seg.fd)


def _collect_batch(
    seg: Segment, entry: Entry, pending: dict[tuple[int, int], list[_Pending]]
) -> None:
    h = BatchHeader(*HEADER_STRUCT.unpack_from(seg.buffer(), entry.body_position))
    item = (
        h.base_offset, h.record_count, pack_loc(seg.segment_id, entry.position), entry.length,
        entry.arg, h.producer_id, h.producer_epoch, h.base_sequence,
    )
    pending.setdefault((entry.stream_id, entry.range_index), []).append(item)


def _merge(state: StoreState, pending: dict[tuple[int, int], list[_Pending]]) -> None:
    """Fold replayed batches into the index: the next batch extends its range, a batch the
    index already holds at an earlier location (a compaction copy) moves it."""
    for (sid, ridx), items in pending.items():
        s = state.streams.get(sid)
        r = s.get(ridx) if s is not None and not s.deleted else None
        if s is None or r is None:
            continue  # deleted, or dropped below the trim point
        items.sort(key=lambda it: (it[0], it[2]))
        for base, count, loc, size, time_ms, pid, epoch, seq in items:
            if r.sealed and 0 <= r.end_offset <= base:
                continue
            if base < r.next_offset:
                i = r.find(base)
                if i >= 0 and r.base(i) == base and loc > r.loc(i):
                    r.set_loc(i, loc)
                continue
            if base > r.next_offset and not (len(r) == 0 and base <= s.start_offset):
                _finding(state, f"stream {sid} range {ridx}: gap in the log at "
                         f"{r.next_offset}..{base}")
                break
            r.append_row(base, loc, size, time_ms)
            r.next_offset = base + count
            if pid >= 0 and seq >= 0:
                producers.record(r, pid, epoch, seq, base, count)
        state.drop_trimmed(s, r)
