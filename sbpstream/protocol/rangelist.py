"""Fast writers for the vectors a many-stream reader's setup moves: ``ListRangesResult`` (the
answer to LIST_RANGES), ``StreamOwner`` entries (LIST_RANGES by stream) and ``StreamResult`` (the
answer to DESCRIBE_STREAMS). The FlatBuffers builder's bytes, fewer calls.

A data node's whole LIST_RANGES is hundreds of thousands of ``ListRangesResult -> Range ->
ReplicaNode -> DataNode -> string`` trees. The flatbuffers ``Builder`` spends about ten Python
calls per field on them (37 s for 333,000 ranges). :func:`put_results` makes the same decisions as
the builder, in the same order (children first, fields in slot order, ``Prep`` alignment, zero
padding, vtables deduplicated through the builder's own ``vtables`` dict), with plain integer
arithmetic, and writes the whole vector into the builder as one block. The bytes are the
builder's, byte for byte: ``tests/test_messages_fast_ranges.py`` compares the two on random
trees, and the golden file pins them.

A result whose status is not OK falls back to the builder for the whole vector (such results
answer LIST_RANGES by stream, never the hot whole-node listing), as does a LIST_RANGES owner
vector holding a data node. :func:`put_stream_owners` and :func:`put_stream_results` do the same
for a consumer of 1,000 streams, whose start-up asks LIST_RANGES and DESCRIBE_STREAMS of all of
them at once (the builder took ~20 ms for each of those vectors of 1,000; a few ms here). No I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = ["put_results", "put_stream_owners", "put_stream_results"]

_ZEROS: Final = tuple(bytes(n) for n in range(8))
_I32: Final = struct.Struct("<i").pack
_U32: Final = struct.Struct("<I").pack
_I64: Final = struct.Struct("<q").pack
_I8: Final = struct.Struct("<b").pack
_VTABLES: Final = tuple(struct.Struct(f"<{n}H").pack for n in range(16))


def _end(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
         slots: tuple[int, ...], object_end: int) -> tuple[int, int]:
    """``Builder.EndObject``: the soffset to the vtable, and the vtable unless an equal one was
    written before. Returns (the object's offset, the offset after it and its vtable)."""
    pad = -off & 3
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    obj = off + 4
    key_list: list[int] = []
    trim = True
    for e in reversed(slots):
        if e == 0:
            if trim:
                continue
        else:
            e = obj - e
            trim = False
        key_list.append(e)
    key_list.append(obj - object_end)
    key = tuple(key_list)
    found = vtables.get(key)
    if found is not None:
        parts.append(_I32(found - obj))
        return obj, obj
    size = 2 * (len(key) + 1)
    parts.append(_I32(size))
    parts.append(_VTABLES[len(key) + 1](size, *reversed(key)))
    off = obj + size
    vtables[key] = off
    return obj, off


def _vector(parts: list[bytes], off: int, offsets: list[int]) -> int:
    """``StartVector(4, n, 4)``, the uoffsets to ``offsets`` (last first), ``EndVector``."""
    n = len(offsets)
    pad = -(off + 4 * n) & 3
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    for o in reversed(offsets):
        off += 4
        parts.append(_U32(off - o))
    parts.append(_U32(n))
    return off + 4


def _uoffset_slot(parts: list[bytes], off: int, target: int) -> int:
    """``PrependUOffsetTRelativeSlot``: aligned to 4, then the forward offset; returns the new
    offset (which is the slot's vtable entry)."""
    pad = -off & 3
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    off += 4
    parts.append(_U32(off - target))
    return off


def _int64_slot(parts: list[bytes], off: int, value: int) -> int:
    pad = -off & 7
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    parts.append(_I64(value))
    return off + 8


def _int32_slot(parts: list[bytes], off: int, value: int) -> int:
    pad = -off & 3
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    parts.append(_I32(value))
    return off + 4


def _string(parts: list[bytes], off: int, text: str) -> int:
    """``CreateString``: Prep(4, n + 1), the NUL, the bytes, the length; returns its offset."""
    x = text.encode("utf-8")
    n = len(x)
    pad = -(off + n + 1) & 3
    if pad:
        parts.append(_ZEROS[pad])
        off += pad
    parts.append(x + b"\x00")
    parts.append(_U32(n))
    return off + n + 5


def _data_node(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
               node: Any) -> tuple[int, int]:
    addr = 0
    if node.advertise_addr:
        off = addr = _string(parts, off, node.advertise_addr)
    start = off
    s0 = s1 = 0
    if node.node_id != 0:
        off = s0 = _int32_slot(parts, off, node.node_id)
    if addr:
        off = s1 = _uoffset_slot(parts, off, addr)
    return _end(parts, off, vtables, (s0, s1), start)


def _replica(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
             rep: Any) -> tuple[int, int]:
    node = 0
    if rep.data_node is not None:
        node, off = _data_node(parts, off, vtables, rep.data_node)
    start = off
    s0 = s1 = 0
    if node:
        off = s0 = _uoffset_slot(parts, off, node)
    if rep.is_primary:
        parts.append(b"\x01")
        off = s1 = off + 1
    return _end(parts, off, vtables, (s0, s1), start)


def _range(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
           r: Any) -> tuple[int, int]:
    reps = 0
    if r.replica_nodes:
        offsets = []
        for rep in r.replica_nodes:
            o, off = _replica(parts, off, vtables, rep)
            offsets.append(o)
        off = reps = _vector(parts, off, offsets)
    start = off
    s0 = s1 = s2 = s3 = s4 = s5 = 0
    if r.stream_id != 0:
        off = s0 = _int64_slot(parts, off, r.stream_id)
    if r.range_index != 0:
        off = s1 = _int32_slot(parts, off, r.range_index)
    if r.start_offset != 0:
        off = s2 = _int64_slot(parts, off, r.start_offset)
    if r.next_offset != 0:
        off = s3 = _int64_slot(parts, off, r.next_offset)
    if r.end_offset != -1:
        off = s4 = _int64_slot(parts, off, r.end_offset)
    if reps:
        off = s5 = _uoffset_slot(parts, off, reps)
    return _end(parts, off, vtables, (s0, s1, s2, s3, s4, s5), start)


def put_results(b: Any, items: Sequence[Any], is_ok: Callable[[Any], bool],
                fallback: Callable[[Any, Sequence[Any]], int]) -> int:
    """Write the vector of ListRangesResult ``items`` into builder ``b``; returns its offset.

    ``is_ok(status)`` says that a status is left out (the codec's own test); if one is not,
    ``fallback(b, items)`` (the builder path) writes the vector instead.
    """
    if not all(is_ok(it.status) for it in items):
        return fallback(b, items)
    b.assertNotNested()
    vtables: dict[tuple[int, ...], int] = b.vtables
    off0 = off = b.Offset()
    parts: list[bytes] = []
    results: list[int] = []
    for it in items:
        ranges = 0
        if it.ranges:
            offsets = []
            for r in it.ranges:
                o, off = _range(parts, off, vtables, r)
                offsets.append(o)
            off = ranges = _vector(parts, off, offsets)
        start = off
        s0 = s2 = 0
        if it.stream_id != 0:
            off = s0 = _int64_slot(parts, off, it.stream_id)
        if ranges:
            off = s2 = _uoffset_slot(parts, off, ranges)
        o, off = _end(parts, off, vtables, (s0, 0, s2), start)
        results.append(o)
    off = _vector(parts, off, results)
    return _commit(b, parts, off0, off, _wrote_int64(items))


def _commit(b: Any, parts: list[bytes], off0: int, off: int, wide: bool) -> int:
    """Write ``parts`` (last first) into builder ``b`` as one block ending at ``off0``; returns
    ``off``, the vector's offset. ``wide``: an int64 was written."""
    block = b"".join(reversed(parts))
    total = off - off0
    assert len(block) == total
    while b.head < total:
        size = len(b.Bytes)
        b.GrowByteBuffer()
        b.head += len(b.Bytes) - size
    b.Bytes[b.head - total : b.head] = block
    b.head -= total
    # Prep's record of the widest alignment: 8 if any int64 was written (the block's padding
    # then follows it), else 4 (every table ends 4-aligned)
    b.minalign = max(b.minalign, 8 if wide else 4)
    return off


def put_stream_owners(b: Any, items: Sequence[Any], owner: type[Any], kind: int,
                      fallback: Callable[[Any, Sequence[Any]], int]) -> int:
    """Write LIST_RANGES's vector of RangeOwnerEntry tables into builder ``b`` when every item
    is an ``owner`` (StreamOwner: ``stream_id``, union type ``kind``); otherwise
    ``fallback(b, items)`` writes it. Returns the vector's offset."""
    if not all(type(it) is owner for it in items):
        return fallback(b, items)
    b.assertNotNested()
    vtables: dict[tuple[int, ...], int] = b.vtables
    off0 = off = b.Offset()
    parts: list[bytes] = []
    entries: list[int] = []
    kind_byte = bytes((kind,))
    wide = False
    for it in items:
        start = off
        s0 = 0
        if it.stream_id != 0:
            off = s0 = _int64_slot(parts, off, it.stream_id)
            wide = True
        target, off = _end(parts, off, vtables, (s0,), start)
        start = off  # the entry: the union's type (uint8), then its uoffset
        parts.append(kind_byte)
        off = s0 = off + 1
        off = s1 = _uoffset_slot(parts, off, target)
        o, off = _end(parts, off, vtables, (s0, s1), start)
        entries.append(o)
    off = _vector(parts, off, entries)
    return _commit(b, parts, off0, off, wide)


def _stream(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
            s: Any) -> tuple[int, int, bool]:
    """A Stream table; returns (its offset, the offset after it, whether an int64 was written)."""
    name = 0
    if s.name:
        off = name = _string(parts, off, s.name)
    start = off
    s0 = s1 = s2 = s3 = s4 = 0
    if s.stream_id != 0:
        off = s0 = _int64_slot(parts, off, s.stream_id)
    if s.replica_nums != 0:
        parts.append(_I8(s.replica_nums))
        off = s1 = off + 1
    if s.retention_period_ms != 0:
        off = s2 = _int64_slot(parts, off, s.retention_period_ms)
    if s.start_offset != 0:
        off = s3 = _int64_slot(parts, off, s.start_offset)
    if name:
        off = s4 = _uoffset_slot(parts, off, name)
    obj, off = _end(parts, off, vtables, (s0, s1, s2, s3, s4), start)
    return obj, off, bool(s0 or s2 or s3)


def put_stream_results(b: Any, items: Sequence[Any], is_ok: Callable[[Any], bool],
                       fallback: Callable[[Any, Sequence[Any]], int]) -> int:
    """Write a vector of StreamResult ``items`` (``stream``: a Stream or None, ``status``) into
    builder ``b``; a status that is not OK (``is_ok``) has ``fallback(b, items)`` write it.
    Returns the vector's offset."""
    if not all(is_ok(it.status) for it in items):
        return fallback(b, items)
    b.assertNotNested()
    vtables: dict[tuple[int, ...], int] = b.vtables
    off0 = off = b.Offset()
    parts: list[bytes] = []
    results: list[int] = []
    wide = False
    for it in items:
        st = 0
        if it.stream is not None:
            st, off, w = _stream(parts, off, vtables, it.stream)
            wide |= w
        start = off
        s0 = 0
        if st:
            off = s0 = _uoffset_slot(parts, off, st)
        o, off = _end(parts, off, vtables, (s0, 0), start)
        results.append(o)
    off = _vector(parts, off, results)
    return _commit(b, parts, off0, off, wide)


def _wrote_int64(items: Sequence[Any]) -> bool:
    return any(
        it.stream_id != 0 or any(
            r.stream_id != 0 or r.start_offset != 0 or r.next_offset != 0 or r.end_offset != -1
            for r in it.ranges)
        for it in items)
