"""Fast writer for vectors of ``ListRangesResult``: the FlatBuffers builder's bytes, fewer calls.

A data node's whole LIST_RANGES is hundreds of thousands of ``ListRangesResult -> Range ->
ReplicaNode -> DataNode -> string`` trees. The flatbuffers ``Builder`` spends about ten Python
calls per field on them (37 s for 333,000 ranges). :func:`put_results` makes the same decisions as
the builder, in the same order (children first, fields in slot order, ``Prep`` alignment, zero
padding, vtables deduplicated through the builder's own ``vtables`` dict), with plain integer
arithmetic, and writes the whole vector into the builder as one block. The bytes are the
builder's, byte for byte: ``tests/test_messages_fast_ranges.py`` compares the two on random
trees, and the golden file pins them.

A result whose status is not OK falls back to the builder for the whole vector (such results
answer LIST_RANGES by stream, never the hot whole-node listing). SYNC_RANGES uses the same
writer: ``SyncResult`` has ``ListRangesResult``'s layout, and ``StreamRanges`` is written with
``status=False`` (no status slot; pure Python). No I/O.
"""

from __future__ import annotations

import operator
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

from sbpstream.protocol.errors import BadHeaderError
from sbpstream.protocol.fbtable import maker

_Written = tuple[bytes, int, bool]
_compiled: Callable[..., tuple[Any, ...] | None] | None
_compiled_writer: Callable[[Sequence[Any], int, dict[tuple[int, ...], int]], _Written] | None
try:  # the compiled reader and writer (_rangelist.pyx), when they were built
    from sbpstream.protocol import _rangelist

    _compiled, _compiled_writer = _rangelist.read_results, _rangelist.write_results
except ImportError:  # pragma: no cover - a build without a C compiler
    _compiled = _compiled_writer = None
_PURE: Final = bool(os.environ.get("SBPSTREAM_PURE_PYTHON"))
_accelerated: Callable[..., tuple[Any, ...] | None] | None = None if _PURE else _compiled
"""The compiled reader used by :class:`ResultsReader`, or None: the pure-Python one (no C
compiler at install time, or ``SBPSTREAM_PURE_PYTHON=1``). Both give the same objects; on a
malformed buffer the compiled one gives up and the pure one raises the error."""
WRITER: dict[str, Any] = {"compiled": None if _PURE else _compiled_writer}
"""``WRITER["compiled"]``: the compiled writer :func:`put_results` uses, or None (the
pure-Python one; same conditions as the reader). Both write the same bytes."""

__all__ = ["ResultsReader", "insert_block", "put_create_results", "put_results",
           "put_stream_owners", "put_stream_results"]

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
                fallback: Callable[[Any, Sequence[Any]], int], *, status: bool = True) -> int:
    """Write the vector of ListRangesResult ``items`` into builder ``b``; returns its offset.

    ``is_ok(status)`` says that a status is left out (the codec's own test); if one is not,
    ``fallback(b, items)`` (the builder path) writes the vector instead.

    ``status=False``: the items are ``StreamRanges`` (SYNC_RANGES: ``stream_id``, ``ranges``, no
    status field), written by the pure-Python writer (the compiled one writes results only).
    """
    if status and not all(is_ok(it.status) for it in items):
        return fallback(b, items)
    b.assertNotNested()
    vtables: dict[tuple[int, ...], int] = b.vtables
    off0 = b.Offset()
    compiled = WRITER["compiled"] if status else None
    if compiled is not None:
        block, off, wrote_int64 = compiled(items, off0, vtables)
    else:
        block, off, wrote_int64 = _write(items, off0, vtables, status)
    return insert_block(b, block, off0, off, wrote_int64)


def insert_block(b: Any, block: bytes, off0: int, off: int, wrote_int64: bool) -> int:
    """Drop ``block``, written for builder offset ``off0`` and ending at offset ``off`` (a
    vector's), into builder ``b`` as the builder would have written it; returns ``off``."""
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
    b.minalign = max(b.minalign, 8 if wrote_int64 else 4)
    return int(off)


def _write(items: Sequence[Any], off0: int, vtables: dict[tuple[int, ...], int],
           status: bool = True) -> _Written:
    """The block of ``items`` written at builder offset ``off0``: (its bytes, the vector's
    offset, whether an int64 field was written). Pure Python. ``status``: the items' table has
    the status slot between ``stream_id`` and ``ranges`` (ListRangesResult; StreamRanges has
    not)."""
    off = off0
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
        o, off = _end(parts, off, vtables, (s0, 0, s2) if status else (s0, s2), start)
        results.append(o)
    off = _vector(parts, off, results)
    return b"".join(reversed(parts)), off, _wrote_int64(items)


def put_create_results(b: Any, items: Sequence[Any], is_ok: Callable[[Any], bool],
                       fallback: Callable[[Any, Sequence[Any]], int]) -> int:
    """Write the vector of CreateStreamResult ``items`` (a CREATE_STREAMS answer: ``stream``, a
    Stream or None, ``replica_nums``, ``retention_period_ms``, ``status``) into builder ``b``;
    returns its offset. A status that is not OK (``is_ok``) has ``fallback(b, items)`` (the
    builder path) write the whole vector instead."""
    return _put_stream_tables(b, items, is_ok, fallback, _create_fields)


def _create_fields(parts: list[bytes], off: int, it: Any) -> tuple[tuple[int, ...], int, bool]:
    s1 = s2 = 0
    if it.replica_nums != 0:
        parts.append(_I8(it.replica_nums))
        off = s1 = off + 1
    if it.retention_period_ms != 0:
        off = s2 = _int64_slot(parts, off, it.retention_period_ms)
    return (s1, s2, 0), off, bool(s2)


def _wrote_int64(items: Sequence[Any]) -> bool:
    return any(
        it.stream_id != 0 or any(
            r.stream_id != 0 or r.start_offset != 0 or r.next_offset != 0 or r.end_offset != -1
            for r in it.ranges)
        for it in items)


def _commit(b: Any, parts: list[bytes], off0: int, off: int, wide: bool) -> int:
    """Write ``parts`` (last first) into builder ``b`` as one block ending at ``off0``; returns
    ``off``, the vector's offset. ``wide``: an int64 was written."""
    return insert_block(b, b"".join(reversed(parts)), off0, off, wide)


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
    return _put_stream_tables(b, items, is_ok, fallback, _status_only)


def _status_only(parts: list[bytes], off: int, it: Any) -> tuple[tuple[int, ...], int, bool]:
    return (0,), off, False  # the status slot, left out (OK)


def _put_stream_tables(
    b: Any, items: Sequence[Any], is_ok: Callable[[Any], bool],
    fallback: Callable[[Any, Sequence[Any]], int],
    fields: Callable[[list[bytes], int, Any], tuple[tuple[int, ...], int, bool]],
) -> int:
    """The vector of tables whose first slot is a ``stream`` (a Stream or None); ``fields``
    writes the rest of an item's table in slot order and gives (their slot offsets, the offset
    after them, whether an int64 was written)."""
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
        rest, off, w = fields(parts, off, it)
        wide |= w
        o, off = _end(parts, off, vtables, (s0, *rest), start)
        results.append(o)
    off = _vector(parts, off, results)
    return _commit(b, parts, off0, off, wide)


# ------------------------------------------------------------------------------------- reading
#
# The generic reader (fbtable) spends, per range of a node's listing, five compiled readers, a
# vtable parse per table, a struct call per field and five dataclass constructions (a frozen
# dataclass's __init__ sets each field through object.__setattr__: microseconds). This reader
# reads the same bytes with the same checks and raises what the generic one raises, but: each
# vtable is parsed once per buffer (tables of one shape share it) into one struct that reads all
# of a table's inline fields at once; objects are made by setting their slots directly (what the
# dataclass's __init__ ends up doing, without its per-field indirection); and a listing repeats
# a few replica sets, so equal replica tuples are made once per vector and shared.

_U32_AT: Final = struct.Struct("<I").unpack_from
_I32_AT: Final = struct.Struct("<i").unpack_from
_U16_AT: Final = struct.Struct("<H").unpack_from
_VT: Final = tuple(struct.Struct(f"<{n}H").unpack_from for n in range(8))


class _Reader:
    """How to read one table with one vtable: ``read(buf, pos)`` gives its fields' values, the
    absent ones at their defaults. Built once per vtable; fields in slot order."""

    __slots__ = ("read",)

    def __init__(self, offsets: tuple[int, ...], fmts: str, defaults: tuple[Any, ...]) -> None:
        present = sorted((o, i) for i, o in enumerate(offsets) if o)
        end = 0
        fmt = "<"
        disjoint = True
        for o, i in present:
            if o < end:
                disjoint = False
                break
            fmt += f"{o - end}x{fmts[i]}" if o > end else fmts[i]
            end = o + struct.calcsize("<" + fmts[i])
        if not present:
            values = defaults
            self.read: Callable[[Any, int], tuple[Any, ...]] = lambda buf, pos: values
            return
        if not disjoint:  # overlapping fields (a hand-made buffer): one read per field
            getters = [(i, offsets[i], struct.Struct("<" + fmts[i]).unpack_from)
                       for i in range(len(offsets)) if offsets[i]]

            def each(buf: Any, pos: int) -> tuple[Any, ...]:
                out = list(defaults)
                for i, o, get in getters:
                    out[i] = get(buf, pos + o)[0]
                return tuple(out)

            self.read = each
            return
        unpack = struct.Struct(fmt).unpack_from
        order = [i for _, i in present]
        if order == list(range(len(offsets))):  # every field, in slot order: the common case
            self.read = unpack
            return
        # a tuple of the defaults with the present values placed: one C-level pick from the
        # values followed by the defaults (at least two fields here, so a tuple)
        slots = {i: k for k, i in enumerate(order)}
        pick = operator.itemgetter(*(slots[i] if i in slots else len(order) + i
                                     for i in range(len(offsets))))

        def placed(buf: Any, pos: int) -> tuple[Any, ...]:
            got: tuple[Any, ...] = pick(unpack(buf, pos) + defaults)
            return got

        self.read = placed


_Layout = tuple[Callable[[Any, int], tuple[Any, ...]], tuple[int, ...]]


def _layouts(count: int, fmts: str, defaults: tuple[Any, ...]
             ) -> Callable[[Any, int], _Layout]:
    """``layout_at(buf, pos)``: (the field reader, the slot offsets) of the table at ``pos``,
    from its vtable, parsed once per vtable position (a cache per returned function)."""
    cache: dict[int, _Layout] = {}

    def layout_at(buf: Any, pos: int) -> _Layout:
        vt = pos - _I32_AT(buf, pos)[0]
        got = cache.get(vt)
        if got is None:
            if vt < 0:  # struct would read from the end of the buffer
                raise BadHeaderError(f"a vtable at {vt} lies before the header")
            n = min(count, (_U16_AT(buf, vt)[0] - 4) >> 1)
            offsets = (_VT[n](buf, vt + 4) if n > 0 else ()) + (0,) * (count - max(n, 0))
            got = cache[vt] = (_Reader(offsets, fmts, defaults).read, offsets)
        return got

    return layout_at


class ResultsReader:
    """Reads vectors of ``ListRangesResult``: :meth:`read` is what the generic reader of the
    vector gives, faster. Built from the bound classes (their fields in schema order)."""

    def __init__(self, result: type[Any], rng: type[Any], replica: type[Any], node: type[Any],
                 read_status: Callable[[Any, int], Any]) -> None:
        self._result, self._range = maker(result), maker(rng)
        self._replica, self._node = maker(replica), maker(node)
        self._default_node = node()
        self._read_status = read_status
        self._ok = result().status
        self._result_cls, self._range_cls, self._replica_cls, self._node_cls = (
            result, rng, replica, node)
        self.compiled = _accelerated
        """The compiled reader :meth:`read` tries first (None: the pure-Python one only)."""

    def read(self, buf: Any, at: int, limit: Callable[[int], None] | None) -> tuple[Any, ...]:
        """The vector whose uoffset is at ``at`` (``limit(n)`` for each vector's length)."""
        if self.compiled is not None and limit is None:
            got = self.compiled(buf, at, self._result_cls, self._range_cls, self._replica_cls,
                                self._node_cls, self._default_node, self._read_status, buf,
                                self._ok)
            if got is not None:
                return got
        return self.read_python(buf, at, limit)

    def read_python(self, buf: Any, at: int, limit: Callable[[int], None] | None
                    ) -> tuple[Any, ...]:
        """:meth:`read` without the compiled reader."""
        result_at = _layouts(3, "qII", (0, 0, 0))
        range_at = _layouts(6, "qiqqqI", (0, 0, 0, 0, -1, 0))
        replica_at = _layouts(2, "I?", (0, False))
        node_at = _layouts(2, "iI", (0, 0))
        replica_sets: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        make_result, make_range, make_replica, make_node = (
            self._result, self._range, self._replica, self._node)
        default_node, read_status, ok = self._default_node, self._read_status, self._ok
        size = len(buf)
        out = []
        for e in _elements(buf, at, size, limit):
            pos = e + _U32_AT(buf, e)[0]
            read, offs = result_at(buf, pos)
            sid, status_off, ranges_off = read(buf, pos)
            status = ok
            if status_off:
                status = read_status(buf, pos + offs[1] + status_off)
            ranges: tuple[Any, ...] = ()
            if ranges_off:
                items = []
                for re_ in _elements(buf, pos + offs[2], size, limit):
                    rp = re_ + _U32_AT(buf, re_)[0]
                    read, offs = range_at(buf, rp)
                    rsid, idx, start, nxt, end, reps_off = read(buf, rp)
                    reps: tuple[Any, ...] = ()
                    if reps_off:
                        key = []
                        for pe in _elements(buf, rp + offs[5], size, limit):
                            pp = pe + _U32_AT(buf, pe)[0]
                            read, offs = replica_at(buf, pp)
                            node_off, primary = read(buf, pp)
                            if node_off:
                                npos = pp + offs[0] + node_off
                                read, offs = node_at(buf, npos)
                                node_id, addr_off = read(buf, npos)
                                addr = (_raw(buf, npos + offs[1] + addr_off, size)
                                        if addr_off else b"")
                                key.append((node_id, addr, primary))
                            else:
                                key.append((None, b"", primary))
                        k = tuple(key)
                        got = replica_sets.get(k)
                        if got is None:
                            got = replica_sets[k] = tuple(
                                make_replica(default_node if nid is None
                                             else make_node(nid, addr.decode("utf-8")), primary)
                                for nid, addr, primary in k)
                        reps = got
                    items.append(make_range(rsid, idx, start, nxt, end, reps))
                ranges = tuple(items)
            out.append(make_result(sid, status, ranges))
        return tuple(out)


def _elements(buf: Any, at: int, size: int, limit: Callable[[int], None] | None) -> range:
    """Positions of the uoffsets of the table vector whose uoffset is at ``at``."""
    start = at + _U32_AT(buf, at)[0]
    n = _U32_AT(buf, start)[0]
    if n * 4 > size:  # as fbtable's: garbage lengths fail fast
        raise BadHeaderError(f"a vector of {n} elements does not fit in the {size}-byte header")
    if limit is not None:
        limit(n)
    return range(start + 4, start + 4 + n * 4, 4)


def _raw(buf: Any, start: int, size: int) -> bytes:
    """The bytes of the [ubyte] or string at ``start`` (its length, then the bytes)."""
    n = _U32_AT(buf, start)[0]
    if start + 4 + n > size:
        raise BadHeaderError(f"a vector of {n} bytes overruns the {size}-byte header")
    return bytes(buf[start + 4 : start + 4 + n])
