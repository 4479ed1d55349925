"""Fast writer for vectors of ``CreateStreamResult``: the FlatBuffers builder's bytes.

A CREATE_STREAMS response answers up to thousands of items, each a ``CreateStreamResult ->
Stream -> name`` tree; the generic builder spent most of a PM create's CPU on them (about ten
Python calls per field). :func:`put_create_results` makes the builder's decisions with the
integer arithmetic of :mod:`sbpstream.protocol.rangelist` (children first, fields in slot order,
``Prep`` alignment, vtables deduplicated through the builder's ``vtables`` dict) and writes the
whole vector as one block: ``tests/test_messages_fast_ranges.py`` compares the two on random
trees. A result whose status is not OK falls back to the builder for the whole vector. No I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

from sbpstream.protocol import rangelist as rl

__all__ = ["put_create_results"]

_I8: Final = struct.Struct("<b").pack


def _int8_slot(parts: list[bytes], off: int, value: int) -> int:
    parts.append(_I8(value))
    return off + 1


def _stream(parts: list[bytes], off: int, vtables: dict[tuple[int, ...], int],
            s: Any) -> tuple[int, int, bool]:
    """A ``Stream`` table: (its offset, the offset after it, whether an int64 was written)."""
    name = 0
    if s.name:  # CreateString: Prep(4, n + 1), the NUL, the bytes, the length
        x = s.name.encode("utf-8")
        n = len(x)
        pad = -(off + n + 1) & 3
        if pad:
            parts.append(rl._ZEROS[pad])
            off += pad
        parts.append(x + b"\x00")
        parts.append(rl._U32(n))
        off += n + 5
        name = off
    start = off
    s0 = s1 = s2 = s3 = s4 = 0
    if s.stream_id != 0:
        off = s0 = rl._int64_slot(parts, off, s.stream_id)
    if s.replica_nums != 0:
        off = s1 = _int8_slot(parts, off, s.replica_nums)
    if s.retention_period_ms != 0:
        off = s2 = rl._int64_slot(parts, off, s.retention_period_ms)
    if s.start_offset != 0:
        off = s3 = rl._int64_slot(parts, off, s.start_offset)
    if name:
        off = s4 = rl._uoffset_slot(parts, off, name)
    obj, off = rl._end(parts, off, vtables, (s0, s1, s2, s3, s4), start)
    return obj, off, bool(s0 or s2 or s3)


def put_create_results(b: Any, items: Sequence[Any], is_ok: Callable[[Any], bool],
                       fallback: Callable[[Any, Sequence[Any]], int]) -> int:
    """Write the vector of CreateStreamResult ``items`` into builder ``b``; returns its offset.

    ``is_ok(status)`` says that a status is left out; if one is not, ``fallback(b, items)``
    (the builder path) writes the vector instead."""
    if not all(is_ok(it.status) for it in items):
        return fallback(b, items)
    b.assertNotNested()
    vtables: dict[tuple[int, ...], int] = b.vtables
    off0 = off = b.Offset()
    parts: list[bytes] = []
    results: list[int] = []
    wide = False
    for it in items:
        stream = 0
        if it.stream is not None:
            stream, off, w = _stream(parts, off, vtables, it.stream)
            wide = wide or w
        start = off
        s0 = s1 = s2 = 0
        if stream:
            off = s0 = rl._uoffset_slot(parts, off, stream)
        if it.replica_nums != 0:
            off = s1 = _int8_slot(parts, off, it.replica_nums)
        if it.retention_period_ms != 0:
            off = s2 = rl._int64_slot(parts, off, it.retention_period_ms)
            wide = True
        o, off = rl._end(parts, off, vtables, (s0, s1, s2, 0), start)
        results.append(o)
    off = rl._vector(parts, off, results)
    return rl.insert_block(b, b"".join(reversed(parts)), off0, off, wide)
