"""A lean FlatBuffers builder: the bytes of ``flatbuffers.Builder``, a few Python calls per field.

The Google builder spends about ten Python calls on every field it writes (``Prepend*Slot`` ->
``PrependSlot`` -> ``enforce_number`` twice -> ``Prepend`` -> ``Prep`` -> ``Pad`` -> ``Place`` ->
``enforce_number`` -> ``encode.Write``, then ``Slot`` -> ``assertNested`` -> ``Offset``), and
its ``WriteVtable`` one ``Prepend`` per vtable entry: about 25% of a data node's CPU at 2,000
small appends/s. :class:`Builder` subclasses it and redoes the methods the codec (:mod:`.fbtable`,
:mod:`.rangelist`) calls, each as one function with plain integer arithmetic and one
``struct.pack_into``: the same decisions in the same order (alignment from the end of the buffer,
children before parents, vtables deduplicated through the same ``vtables`` dict and keys, the
buffer doubled when full), so the same bytes, which ``tests/test_messages.py`` checks
against the Google builder for every message, and the golden file pins.

What the Google builder checks, this one checks too, only more cheaply: a value out of its field's
range raises ``struct.error`` (``enforce_number`` raised ``TypeError``; the codec turns both into
``ValueError("cannot encode ...")``), a bool slot refuses anything but 0/1, and starting an
object, a vector or a string inside another raises the same exceptions (a slot written outside an
object raises ``TypeError``, not ``IsNotNestedError``: only the generated writers write slots).
Padding is not written: the buffer is filled from its end towards its start (``head`` only goes
down) and starts zeroed (a grown buffer too; ``Clear`` zeroes it), so the bytes a pad skips are
zeros already. ``ForceDefaults`` is refused (the codec never writes defaults). No I/O.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import struct
import sys
from collections.abc import Callable
from typing import Any, Final

__all__ = ["Builder"]


def _import_flatbuffers() -> Any:
    """Import the flatbuffers runtime without numpy.

    flatbuffers imports numpy whenever it can find it (it can, beside PySpark), only for its
    numpy helpers (``CreateNumpyVector``, ``GetVectorAsNumpy``), which this codec never calls.
    That import took 0.3 s, more than the rest of the protocol layer, in every CLI command and
    every Spark stream reader process. flatbuffers asks ``PathFinder.find_spec("numpy")`` whether
    numpy exists (``flatbuffers.compat.import_numpy``); while flatbuffers is imported here, that
    one question, asked from that one module, is answered "no". Every other lookup, and every
    later one, is untouched. If numpy is already loaded, flatbuffers takes it as usual.
    """
    if "numpy" in sys.modules:
        import flatbuffers

        return flatbuffers
    finder = importlib.machinery.PathFinder
    real = finder.find_spec
    descriptor = vars(finder)["find_spec"]  # the classmethod itself, put back as it was

    def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
        here = inspect.currentframe()
        caller = here.f_back if here is not None else None
        if name == "numpy" and caller is not None and \
                caller.f_globals.get("__name__") == "flatbuffers.compat":
            return None
        return real(name, path, target)

    setattr(finder, "find_spec", find_spec)  # noqa: B010 (mypy refuses a plain assignment)
    try:
        import flatbuffers
    finally:
        setattr(finder, "find_spec", descriptor)  # noqa: B010
    return flatbuffers


_flatbuffers: Final = _import_flatbuffers()
_google: Final = _flatbuffers.builder

_GoogleBuilder: Any = _google.Builder
_MAX: Final = _GoogleBuilder.MAX_BUFFER_SIZE
_U16S: Final = tuple(struct.Struct(f"<{n}H").pack_into for n in range(66))
_PUT_I32: Final = struct.Struct("<i").pack_into
_PUT_U32: Final = struct.Struct("<I").pack_into

# The struct format of each scalar slot writer (its width is its alignment)
_SLOT_FORMATS: Final = {
    "PrependInt8Slot": "b", "PrependUint8Slot": "B", "PrependByteSlot": "B",
    "PrependInt16Slot": "h", "PrependUint16Slot": "H", "PrependInt32Slot": "i",
    "PrependUint32Slot": "I", "PrependInt64Slot": "q", "PrependUint64Slot": "Q",
    "PrependFloat32Slot": "f", "PrependFloat64Slot": "d",
}  # fmt: skip


def _grow(b: Builder, need: int) -> int:
    """Double the buffer until ``need`` bytes fit below ``head``; returns the new ``head``."""
    buf = b.Bytes
    size = len(buf)
    head = b.head
    new = size
    while head + new - size < need:
        if new >= _MAX:
            raise _google.BuilderSizeError("flatbuffers: cannot grow buffer beyond 2 gigabytes")
        new = min(max(new * 2, 1), _MAX)
    grown = bytearray(new)
    grown[new - size :] = buf
    b.Bytes = grown
    b.head = head = head + new - size
    return head


def _scalar_slot(fmt: str) -> Callable[[Builder, int, Any, Any], None]:
    """``Prepend<T>Slot(slot, x, default)``: ``x`` written, aligned to its width, unless it is
    the default."""
    put = struct.Struct("<" + fmt).pack_into
    width = struct.calcsize(fmt)
    mask = width - 1

    def prepend_slot(self: Builder, slot: int, x: Any, d: Any) -> None:
        if x != d:
            buf = self.Bytes
            size = len(buf)
            head = self.head
            pad = (head - size) & mask
            if head < pad + width:
                head = _grow(self, pad + width)
                buf = self.Bytes
                size = len(buf)
            head -= pad + width
            put(buf, head, x)
            self.head = head
            if width > self.minalign:
                self.minalign = width
            self.current_vtable[slot] = size - head  # type: ignore[index]  # in an object

    prepend_slot.__name__ = prepend_slot.__qualname__ = f"prepend_slot_{fmt}"
    return prepend_slot


class Builder(_GoogleBuilder):  # type: ignore[misc]
    """``flatbuffers.Builder`` with cheap versions of the methods the codec calls (same bytes).

    The attributes are the base's (its ``__slots__``), so that its other methods still work.
    """

    def __init__(self, initialSize: int = 1024) -> None:
        if not 0 <= initialSize <= _MAX:
            raise _google.BuilderSizeError("flatbuffers: Cannot create Builder larger than 2 GB")
        self.Bytes = bytearray(initialSize)
        self.current_vtable: list[int] | None = None
        self.head = initialSize
        self.minalign = 1
        self.objectEnd: int | None = None
        self.vtables: dict[tuple[int, ...], int] = {}
        self.nested = False
        self.forceDefaults = False
        self.sharedStrings = None
        self.finished = False
        self.vectorNumElems: int | None = None

    def Clear(self) -> None:
        super().Clear()
        self.Bytes = bytearray(len(self.Bytes))  # padding is not written: it must be zeros

    def ForceDefaults(self, forceDefaults: bool) -> None:
        if forceDefaults:
            raise NotImplementedError("this builder never writes default values")

    def Offset(self) -> int:
        return len(self.Bytes) - self.head

    def Pad(self, n: int) -> None:
        if n > 0:  # the bytes below head are zeros already (see the module's docstring)
            self.head -= n

    def Prep(self, size: int, additionalBytes: int) -> None:
        if size > self.minalign:
            self.minalign = size
        head = self.head
        pad = (head - len(self.Bytes) - additionalBytes) & (size - 1)
        need = pad + size + additionalBytes
        if head < need:
            head = _grow(self, need)
        self.head = head - pad

    def StartObject(self, numfields: int) -> None:
        if self.nested:
            raise _google.IsNestedError()
        self.current_vtable = [0] * numfields
        self.objectEnd = len(self.Bytes) - self.head
        self.nested = True

    def WriteVtable(self) -> int:
        self.nested = True  # EndObject's check passes: the base calls this from EndObject only
        return self.EndObject()

    def EndObject(self) -> int:
        """The object's soffset, then its vtable unless an equal one was written (the base's
        ``EndObject`` and ``WriteVtable``, in one pass)."""
        if not self.nested:
            raise _google.IsNotNestedError()
        self.nested = False
        vtable = self.current_vtable
        assert vtable is not None and self.objectEnd is not None
        head = self.head
        size = len(self.Bytes)
        pad = (head - size) & 3  # the soffset, aligned to 4, then at most the whole vtable
        if head < pad + 8 + 2 * len(vtable):
            head = _grow(self, pad + 8 + 2 * len(vtable))
            size = len(self.Bytes)
        head -= pad + 4
        if self.minalign < 4:
            self.minalign = 4
        obj = size - head
        n = len(vtable)
        while n and not vtable[n - 1]:  # trailing absent fields are left out
            n -= 1
        entries = [obj - e if e else 0 for e in vtable[:n]]  # slot order
        key = entries[::-1]  # the base's key: last slot first, then the object's size
        key.append(obj - self.objectEnd)
        vt_key = tuple(key)
        found = self.vtables.get(vt_key)
        buf = self.Bytes
        if found is None:
            at = head - 2 * n - 4
            _U16S[n + 2](buf, at, 2 * n + 4, key[-1], *entries)
            _PUT_I32(buf, head, size - at - obj)
            self.vtables[vt_key] = size - at
            self.head = at
        else:
            _PUT_I32(buf, head, found - obj)
            self.head = head
        self.current_vtable = None
        return obj

    def PrependUOffsetTRelative(self, off: int) -> None:
        head = self.head
        size = len(self.Bytes)
        pad = (head - size) & 3
        if head < pad + 4:
            head = _grow(self, pad + 4)
            size = len(self.Bytes)
        head -= pad + 4
        if self.minalign < 4:
            self.minalign = 4
        if off > size - head - 4:
            raise _google.OffsetArithmeticError("flatbuffers: Offset arithmetic error.")
        _PUT_U32(self.Bytes, head, size - head - off)
        self.head = head

    def PrependUOffsetTRelativeSlot(self, o: int, x: int, d: int) -> None:
        if x != d:
            self.PrependUOffsetTRelative(x)
            self.current_vtable[o] = len(self.Bytes) - self.head  # type: ignore[index]

    def PrependBoolSlot(self, o: int, x: Any, d: Any) -> None:
        if x.__class__ is not bool and not False <= x <= True:
            raise TypeError(f"bad number {x} for type bool")
        self.PrependUint8Slot(o, x, d)

    def StartVector(self, elemSize: int, numElems: int, alignment: int) -> int:
        if self.nested:
            raise _google.IsNestedError()
        self.nested = True
        self.vectorNumElems = numElems
        self.Prep(4, elemSize * numElems)
        self.Prep(alignment, elemSize * numElems)
        return len(self.Bytes) - self.head

    def EndVector(self, numElems: None = None) -> int:
        if not self.nested:
            raise _google.IsNotNestedError()
        self.nested = False
        head = self.head - 4  # StartVector made room for the length
        _PUT_U32(self.Bytes, head, self.vectorNumElems)
        self.head = head
        self.vectorNumElems = None
        return len(self.Bytes) - head

    def CreateString(self, s: Any, encoding: str = "utf-8", errors: str = "strict") -> int:
        x: bytes | bytearray
        if isinstance(s, str):
            x = s.encode(encoding, errors)
        elif isinstance(s, bytes | bytearray):
            x = s
        else:
            raise TypeError("non-string passed to CreateString")
        return self._vector_of_bytes(x, 1)

    def CreateByteVector(self, x: Any) -> int:
        if not isinstance(x, bytes | bytearray):
            raise TypeError("non-byte vector passed to CreateByteVector")
        return self._vector_of_bytes(x, 0)

    def _vector_of_bytes(self, x: bytes | bytearray, nul: int) -> int:
        """The length, ``x``, then ``nul`` zero bytes (a string's terminator), aligned so that
        the length is 4-aligned."""
        if self.nested:
            raise _google.IsNestedError()
        n = len(x)
        if self.minalign < 4:
            self.minalign = 4
        head = self.head
        size = len(self.Bytes)
        pad = (head - size - n - nul) & 3
        if head < pad + 4 + n + nul:
            head = _grow(self, pad + 4 + n + nul)
            size = len(self.Bytes)
        head -= pad + nul + n
        buf = self.Bytes
        buf[head : head + n] = x
        head -= 4
        _PUT_U32(buf, head, n)
        self.head = head
        return size - head

    def Finish(self, rootTable: int, file_identifier: bytes | None = None) -> int:
        if file_identifier is not None:
            return int(super().Finish(rootTable, file_identifier))
        self.Prep(self.minalign, 4)
        self.PrependUOffsetTRelative(rootTable)
        self.finished = True
        return int(self.head)

    def finish(self, root: int) -> bytes:
        """``Finish(root)``, then the buffer's bytes (``bytes(Output())``, one copy less)."""
        align = self.minalign
        if align < 4:
            align = self.minalign = 4
        head = self.head
        size = len(self.Bytes)
        pad = (head - size - 4) & (align - 1)  # Prep(minalign, 4), then the root's uoffset
        if head < pad + 4:
            head = _grow(self, pad + 4)
            size = len(self.Bytes)
        head -= pad + 4
        if root > size - head - 4:
            raise _google.OffsetArithmeticError("flatbuffers: Offset arithmetic error.")
        _PUT_U32(self.Bytes, head, size - head - root)
        self.head = head
        self.finished = True
        return bytes(memoryview(self.Bytes)[head:])


for _name, _fmt in _SLOT_FORMATS.items():
    setattr(Builder, _name, _scalar_slot(_fmt))
