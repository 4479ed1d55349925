"""The runtime of the generated message code, and the schema reader its generator uses.

:func:`parse_schema` reads the subset of the ``.fbs`` language that ``schema/sbp.fbs`` uses
(``namespace``, ``attribute``, ``enum``, ``union``, ``table``; scalar, string, table, enum and
vector fields with defaults; the attributes the schema declares) and refuses anything else.
``python -m sbpstream.protocol.codegen`` turns it into ``generated.py``: a frozen, slotted
dataclass per table, with a named writer ``build_<Table>(builder, obj)`` and reader
``read_<Table>(buf, pos)`` each, straight-line code as one would write by hand for the table (a
loop over field descriptors would add a Python call per field, which the hundred items of an
APPEND or FETCH header pay a hundred times). This module holds what that code calls: the read
helpers, the vector writers, :class:`FixedLayout`, the :class:`Table` base (``encode`` /
``decode``) and :class:`Codec`, which binds each generated class to its schema table at import and
checks that the class agrees with the schema (names, order, defaults). Nothing here compiles code.

The writers make exactly the builder calls flatc's generated code makes (children first, in field
order, then the fields in slot order; a field at its default is skipped without a call), so the
bytes are those of flatc's code. The builder is :class:`.fbbuilder.Builder`, which writes the
Google builder's bytes with a fraction of its Python calls. The readers do not use flatc's
accessors: they read a table's vtable once and unpack each present field with :mod:`struct`.

Fast path: a vector of a table marked ``(py_fixed)`` (scalars and at most one status) is written
as one block, every scalar present, in a layout derived from the field table: 8-byte fields
first, then 4-byte ones, in slot order, then the status offset (see :class:`FixedLayout`).

Every decode error is an exception the caller turns into BadHeaderError: ``struct.error``,
``IndexError``, ``ValueError`` (bad UTF-8), or :class:`BadHeaderError` itself for lengths that
cannot fit the buffer. No I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, Self, TypeVar, dataclass_transform

from sbpstream.protocol.errors import BadHeaderError
from sbpstream.protocol.fbbuilder import Builder
from sbpstream.protocol.makers import MAKERS

__all__ = [
    "ATTRIBUTES", "Bound", "Codec", "Field", "FixedCode", "FixedLayout", "Kind", "Schema", "Table",
    "TableDef", "fixed_order", "frozen_dataclass", "maker", "parse_schema", "put_scalars",
    "put_tables", "read_raw", "read_scalars", "read_tables", "read_text", "setters", "slots",
]  # fmt: skip

_T = TypeVar("_T")

REGENERATE: Final = "python -m sbpstream.protocol.codegen"
"""The command that rewrites the generated code (named by every error about it)."""


@dataclass_transform(frozen_default=True)
def frozen_dataclass(cls: type[_T]) -> type[_T]:
    """Finish a generated class as ``dataclass(frozen=True, slots=True)`` would make it.

    :mod:`dataclasses` compiles six methods per class (``exec``), 0.18 s for the hundred message
    classes, in every process that imports them. Here :func:`dataclasses.dataclass` only collects
    the fields and makes the slotted class (``init``, ``repr``, ``eq`` off, so it compiles
    nothing); ``__init__``, ``__repr__``, ``__eq__`` and ``__hash__`` are written in the class by
    the generator, and :class:`Table` has the frozen ``__setattr__``/``__delattr__`` and the
    pickling pair. :func:`dataclasses.fields`, :func:`dataclasses.replace` and
    :func:`dataclasses.is_dataclass` work, and ``__dataclass_params__`` says what the class is.
    """
    missing = [m for m in ("__init__", "__repr__", "__eq__", "__hash__") if m not in vars(cls)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks {missing}: run {REGENERATE}")
    cls = dataclasses.dataclass(init=False, repr=False, eq=False, slots=True)(cls)
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    for attr in ("init", "repr", "eq", "frozen"):  # what the class now is
        setattr(params, attr, True)
    return cls


def setters(cls: type[Any]) -> tuple[Callable[[Any, Any], None], ...]:
    """The ``__set__`` of each field's slot descriptor, in field order: what ``__init__`` of a
    frozen, slotted class sets its fields with (``object.__setattr__`` is several times slower)."""
    return tuple(getattr(cls, f.name).__set__ for f in dataclasses.fields(cls))


# struct format of each scalar type, and the builder method that writes it into a slot.
_SCALARS: Final = {
    "bool": "?", "byte": "b", "int8": "b", "ubyte": "B", "uint8": "B", "short": "h", "int16": "h",
    "ushort": "H", "uint16": "H", "int": "i", "int32": "i", "uint": "I", "uint32": "I",
    "long": "q", "int64": "q", "ulong": "Q", "uint64": "Q", "float": "f", "double": "d",
}  # fmt: skip
_SLOT_WRITER: Final = {
    "?": "PrependBoolSlot", "b": "PrependInt8Slot", "B": "PrependUint8Slot",
    "h": "PrependInt16Slot", "H": "PrependUint16Slot", "i": "PrependInt32Slot",
    "I": "PrependUint32Slot", "q": "PrependInt64Slot", "Q": "PrependUint64Slot",
    "f": "PrependFloat32Slot", "d": "PrependFloat64Slot",
}  # fmt: skip
_ELEMENT_WRITER: Final = {fmt: name.removesuffix("Slot") for fmt, name in _SLOT_WRITER.items()}
_PACKED_FORMATS: Final = frozenset("bBhHiIqQ")  # vectors of these are packed in one call


class Kind(enum.Enum):
    SCALAR = "scalar"
    ENUM = "enum"  # a scalar read into a Python IntEnum
    STRING = "string"
    BYTES = "bytes"  # [ubyte]
    TABLE = "table"
    SCALARS = "scalars"  # a vector of scalars
    TABLES = "tables"  # a vector of tables
    UNION = "union"  # two slots: the member's type (ubyte), then the member


class Field:
    """One field of a table: ``slot`` is its vtable index (a union's value is at ``slot + 1``);
    ``attrs`` are its schema attributes (``py_name``...)."""

    __slots__ = ("attrs", "default", "fmt", "kind", "name", "ref", "slot")

    def __init__(self, name: str, kind: Kind, slot: int, fmt: str = "",
                 default: int | float | bool = 0, ref: str = "",
                 attrs: tuple[tuple[str, str], ...] = ()) -> None:
        self.name, self.kind, self.slot, self.fmt = name, kind, slot, fmt
        self.default, self.ref, self.attrs = default, ref, attrs

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.kind, self.slot, self.fmt, self.default, self.ref, self.attrs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Field) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Field{self._key()!r}"

    def attr(self, name: str) -> str | None:
        return dict(self.attrs).get(name)


class TableDef:
    __slots__ = ("attrs", "fields", "name")

    def __init__(self, name: str, fields: tuple[Field, ...],
                 attrs: tuple[tuple[str, str], ...] = ()) -> None:
        self.name, self.fields, self.attrs = name, fields, attrs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TableDef) and (self.name, self.fields, self.attrs) == (
            other.name, other.fields, other.attrs)

    def __hash__(self) -> int:
        return hash((self.name, self.fields, self.attrs))

    def __repr__(self) -> str:
        return f"TableDef({self.name!r}, {self.fields!r}, {self.attrs!r})"

    def attr(self, name: str) -> str | None:
        return dict(self.attrs).get(name)

    @property
    def slots(self) -> int:
        return sum(2 if f.kind is Kind.UNION else 1 for f in self.fields)


class Schema:
    __slots__ = ("enums", "tables", "unions")

    def __init__(self, tables: dict[str, TableDef], enums: dict[str, dict[str, int]],
                 unions: dict[str, tuple[str, ...]]) -> None:
        self.tables = tables
        self.enums = enums  # name -> {member: value}
        self.unions = unions  # name -> member tables, type index 1, 2, ...


ATTRIBUTES: Final = frozenset({
    "py_name", "py_fixed", "py_omit_default", "py_always", "sbp_request", "sbp_response",
    "sbp_header",
})
"""The attributes the parser accepts (the schema declares them: ``attribute "py_name";``);
docs/protocol.md says what each means to the generator. Any other is refused."""

_BLOCK = re.compile(r"(table|enum|union)\s+(\w+)\s*(?::\s*(\w+)\s*)?(\([^()]*\))?\s*\{([^{}]*)\}")
_FIELD = re.compile(r"(\w+)\s*:\s*(\[\s*\w+\s*\]|\w+)\s*(?:=\s*([\w.+-]+))?\s*(\([^()]*\))?")
_ATTRIBUTE = re.compile(r'attribute\s+"(\w+)"\s*;')
_ATTR = re.compile(r'(\w+)(?:\s*:\s*"([^"]*)")?')


def _attrs(text: str | None, declared: set[str], where: str) -> tuple[tuple[str, str], ...]:
    """``(a, b: "x")`` -> (("a", ""), ("b", "x")); an undeclared or unknown one: ValueError."""
    if not text:
        return ()
    out = []
    for item in (x.strip() for x in text.strip()[1:-1].split(",") if x.strip()):
        match = _ATTR.fullmatch(item)
        if match is None or match.group(1) not in declared or match.group(1) not in ATTRIBUTES:
            raise ValueError(f"unsupported attribute in {where}: {item!r}")
        out.append((match.group(1), match.group(2) or ""))
    return tuple(out)


def parse_schema(text: str) -> Schema:
    """The tables, enums and unions of a schema; unsupported syntax raises ValueError."""
    text = re.sub(r"//[^\n]*", "", text)
    declared = set(_ATTRIBUTE.findall(text))
    text = _ATTRIBUTE.sub("", text)
    blocks = list(_BLOCK.finditer(text))
    rest = _BLOCK.sub("", text)
    rest = re.sub(r"namespace\s+[\w.]+\s*;", "", rest).strip()
    if rest:
        raise ValueError(f"unsupported schema syntax: {rest[:60]!r}")
    enums: dict[str, dict[str, int]] = {}
    enum_fmt: dict[str, str] = {}
    unions: dict[str, tuple[str, ...]] = {}
    bodies: dict[str, str] = {}
    table_attrs: dict[str, tuple[tuple[str, str], ...]] = {}
    for block in blocks:
        keyword, name, base, block_attrs, body = block.groups()
        if block_attrs and keyword != "table":
            raise ValueError(f"unsupported attributes on {keyword} {name}")
        if keyword == "enum":
            values: dict[str, int] = {}
            value = -1
            for item in (x.strip() for x in body.split(",") if x.strip()):
                member, _, number = item.partition("=")
                value = int(number) if number else value + 1  # as flatc numbers them
                values[member.strip()] = value
            if 0 not in values.values():
                raise ValueError(f"enum {name}: 0, the default, must be a member")
            enums[name], enum_fmt[name] = values, _SCALARS[base]
        elif keyword == "union":
            unions[name] = tuple(x.strip() for x in body.split(",") if x.strip())
        else:
            bodies[name] = body
            table_attrs[name] = _attrs(block_attrs, declared, f"table {name}")
    tables = {}
    for name, body in bodies.items():
        fields: list[Field] = []
        slot = 0
        for decl in (d.strip() for d in body.split(";")):
            if not decl:
                continue
            match = _FIELD.fullmatch(decl)
            if match is None:
                raise ValueError(f"unsupported field in table {name}: {decl!r}")
            fname, ftype, default, field_attrs = match.groups()
            field = _field(fname, ftype.replace(" ", ""), slot, default, enums, enum_fmt, unions)
            field.attrs = _attrs(field_attrs, declared, f"{name}.{fname}")
            if field.kind in (Kind.TABLE, Kind.TABLES) and field.ref not in bodies:
                raise ValueError(f"{name}.{fname}: unknown type {ftype}")
            fields.append(field)
            slot += 2 if field.kind is Kind.UNION else 1
        tables[name] = TableDef(name, tuple(fields), table_attrs[name])
    for name, members in unions.items():
        if any(m not in tables for m in members):
            raise ValueError(f"union {name}: members must be tables")
    return Schema(tables, enums, unions)


def _field(
    name: str,
    ftype: str,
    slot: int,
    default: str | None,
    enums: dict[str, dict[str, int]],
    enum_fmt: dict[str, str],
    unions: dict[str, tuple[str, ...]],
) -> Field:
    if ftype.startswith("["):
        element = ftype[1:-1]
        if default is not None:
            raise ValueError(f"{name}: a vector has no default")
        if element == "ubyte":
            return Field(name, Kind.BYTES, slot, "B")
        if element in _SCALARS:
            return Field(name, Kind.SCALARS, slot, _SCALARS[element])
        return Field(name, Kind.TABLES, slot, ref=element)
    if ftype in _SCALARS:
        fmt = _SCALARS[ftype]
        value: int | float | bool = 0
        if default is not None:
            value = default == "true" if fmt == "?" else (float if fmt in "fd" else int)(default)
        return Field(name, Kind.SCALAR, slot, fmt, value if fmt != "?" else bool(value))
    if ftype in enums:
        value = enums[ftype][default] if default else 0
        return Field(name, Kind.ENUM, slot, enum_fmt[ftype], value, ftype)
    if default is not None:
        raise ValueError(f"{name}: only scalars and enums have defaults")
    if ftype == "string":
        return Field(name, Kind.STRING, slot)
    return Field(name, Kind.UNION if ftype in unions else Kind.TABLE, slot, ref=ftype)


# ------------------------------------------------------------------------------- reading helpers

_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
U32: Final = struct.Struct("<I").unpack_from
"""Reads a uoffset: ``U32(buf, at)[0]``."""
_U32 = struct.Struct("<I").unpack_from
_VTABLE: Final = tuple(struct.Struct(f"<{n}H") for n in range(64))


def slots(buf: Any, pos: int, count: int) -> tuple[int, ...]:
    """Offsets (0 = absent) of the ``count`` slots of the table at ``pos``."""
    vtable = pos - _I32(buf, pos)[0]
    if vtable < 0:  # struct would read from the end of the buffer
        raise BadHeaderError(f"a vtable at {vtable} lies before the header")
    n: int = min(count, (_U16(buf, vtable)[0] - 4) >> 1)
    if n == count:
        full: tuple[int, ...] = _VTABLE[count].unpack_from(buf, vtable + 4)
        return full
    if n <= 0:
        return (0,) * count
    entries: tuple[int, ...] = _VTABLE[n].unpack_from(buf, vtable + 4)
    return entries + (0,) * (count - n)


def _vector(buf: Any, at: int, width: int, limit: Callable[[int], None] | None) -> range:
    """Start positions of the elements of the vector whose uoffset is at ``at``."""
    start = at + _U32(buf, at)[0]
    n = _U32(buf, start)[0]
    if n * width > len(buf):  # cheap; keeps garbage lengths (up to 2**32) from a long loop
        raise BadHeaderError(f"a vector of {n} elements does not fit in the {len(buf)}-byte header")
    if limit is not None:
        limit(n)
    return range(start + 4, start + 4 + n * width, width)


def read_raw(buf: Any, at: int) -> bytes:
    start = at + _U32(buf, at)[0]
    n = _U32(buf, start)[0]
    if start + 4 + n > len(buf):
        raise BadHeaderError(f"a vector of {n} bytes overruns the {len(buf)}-byte header")
    return bytes(buf[start + 4 : start + 4 + n])


def read_text(buf: Any, at: int) -> str:
    return read_raw(buf, at).decode("utf-8")


def read_tables(
    buf: Any, at: int, read: Callable[[Any, int], Any], limit: Callable[[int], None] | None
) -> tuple[Any, ...]:
    return tuple([read(buf, e + _U32(buf, e)[0]) for e in _vector(buf, at, 4, limit)])


def read_scalars(
    buf: Any, at: int, fmt: str, limit: Callable[[int], None] | None
) -> tuple[Any, ...]:
    positions = _vector(buf, at, struct.calcsize(fmt), limit)
    return struct.unpack_from(f"<{len(positions)}{fmt}", buf, positions.start)


# ------------------------------------------------------------------------------- writing helpers


def put_tables(b: Any, items: Sequence[Any], build: Callable[[Any, Any], int]) -> int:
    """A vector of tables, each written by ``build``, the builder's way."""
    offsets = [build(b, item) for item in items]
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def put_scalars(b: Any, values: Sequence[Any], fmt: str) -> int:
    """A vector of scalars. Integers are packed in one ``struct.pack`` into the room
    ``StartVector`` made (the bytes the builder's per-element prepends write: it has aligned
    the block already); the 1,000 ids of a DESCRIBE_STREAMS cost one call, not 1,000."""
    width = struct.calcsize(fmt)
    n = len(values)
    b.StartVector(width, n, width)
    if fmt in _PACKED_FORMATS:
        head = b.head - n * width
        b.Bytes[head : b.head] = struct.pack(f"<{n}{fmt}", *values)
        b.head = head
    else:
        prepend = getattr(b, _ELEMENT_WRITER[fmt])
        for v in reversed(values):
            prepend(v)
    return int(b.EndVector())


class FixedCode:
    """The generated functions of a fixed layout, over the scalar fields in layout order:
    ``rows(items)``: each item's scalars; ``one(item, at, pack)``: one item's row packed (soffset
    ``at``, then a zero status uoffset if the table has a status); ``packed(items, at, size,
    pack)``: the rows of items whose statuses are all OK (row k's soffset is ``at + k * size``);
    ``errors(b, items)``: None if every item's status is OK, else each item's status written (its
    offset), or 0 if it is OK; None for a table without a status."""

    __slots__ = ("errors", "one", "packed", "rows")

    def __init__(self, rows: Callable[[Sequence[Any]], list[tuple[Any, ...]]],
                 one: Callable[[Any, int, Callable[..., bytes]], bytes],
                 packed: Callable[[Sequence[Any], int, int, Callable[..., bytes]], list[bytes]],
                 errors: Callable[[Any, Sequence[Any]], list[int] | None] | None = None) -> None:
        self.rows, self.one, self.packed, self.errors = rows, one, packed, errors


def fixed_order(table: TableDef) -> tuple[list[Field], list[Field]]:
    """A fixed layout's fields in layout order (8-byte scalars, then 4-byte ones, each in slot
    order, then the status), and the status field alone; TypeError if the table cannot have one."""
    scalars = [f for f in table.fields if f.kind is Kind.SCALAR and f.fmt in "qQiI"]
    tables = [f for f in table.fields if f.kind is Kind.TABLE]
    if len(scalars) + len(tables) != len(table.fields) or len(tables) > 1:
        raise TypeError(f"{table.name}: a fixed layout holds 4/8-byte scalars, one status")
    return sorted(scalars, key=lambda f: (-struct.calcsize(f.fmt), f.slot)) + tables, tables


class FixedLayout:
    """The layout of a scalar item table written whole: one ``struct.pack`` per item.

    The builder spends about ten Python calls per field; for the hundred items of an APPEND or
    FETCH header, :meth:`put` instead writes the vector, a vtable shared by every item and the
    items, every scalar field present (defaults included), as one block.

    ``row`` is the table's struct format: the soffset to the vtable, then the scalars in layout
    order (8-byte ones first, so that a table starting at 4 mod 8 has them 8-aligned, then 4-byte
    ones, each group in slot order), then, for result items, the status's uoffset. Items whose
    status is OK use a vtable without the status field (it reads as absent, so as OK); the others
    use a second vtable with it.
    """

    __slots__ = ("errors", "one", "packed", "plans", "row", "rows", "size", "status_at", "vtable",
                 "vtable_status")

    def __init__(self, table: TableDef, code: FixedCode) -> None:
        """``code``: the table's generated row functions (see :class:`FixedCode`)."""
        order, tables = fixed_order(table)
        at: dict[int, int] = {}  # slot -> offset in the table
        inline = 4
        for f in order:
            at[f.slot] = inline
            inline += 4 if f in tables else struct.calcsize(f.fmt)
        row = "<i" + "".join("I" if f in tables else f.fmt for f in order)
        self.row = struct.Struct(f"{row}{-inline % 8}x")  # pad: the next table at 4 mod 8 too
        self.size = self.row.size
        self.rows, self.one, self.packed = code.rows, code.one, code.packed
        self.errors = code.errors
        if (self.errors is None) != (not tables):
            raise TypeError(f"{table.name}: a status needs its errors function: run {REGENERATE}")
        self.status_at = at[tables[0].slot] if tables else 0
        head = (4 + 2 * len(at), inline)
        every = [at[f.slot] for f in table.fields]
        no_status = [0 if f in tables else at[f.slot] for f in table.fields]
        self.vtable = struct.pack(f"<{len(at) + 2}H", *head, *no_status)
        self.vtable_status = struct.pack(f"<{len(at) + 2}H", *head, *every)
        self.plans: dict[int, tuple[int, bytes, int]] = {}  # n -> _plan(n, False)

    def put(self, b: Any, items: Sequence[Any]) -> int:
        """Write a vector of ``items``; returns its builder offset.

        The statuses that are not OK are built first, so that they lie after the block, where
        uoffsets can reach them.
        """
        n = len(items)
        errors = None if self.errors is None else self.errors(b, items)
        if errors is None:  # every status OK: the block's head is the same for every n items
            plan = self.plans.get(n)
            if plan is None:
                plan = self._plan(n, False)
                if n <= _MAX_PLANS:
                    self.plans[n] = plan
            total, prefix, at = plan
            if b.nested:
                b.assertNotNested()  # raises
            b.Prep(8, total)  # aligns the block's end, hence its start
            if n == 1:  # the common case of a latency-bound client: one stream per request
                block = prefix + self.one(items[0], at, self.row.pack)
            else:
                block = prefix + b"".join(self.packed(items, at, self.size, self.row.pack))
        else:
            block = self._block_with_errors(b, items, errors)
            total = len(block)
        head: int = b.head - total
        b.Bytes[head : b.head] = block
        b.head = head
        return len(b.Bytes) - head

    def _plan(self, n: int, errors: bool) -> tuple[int, bytes, int]:
        """The block of ``n`` items: (its size, its head up to the first table, the soffset of
        the first table to the first vtable).

        The block starts 8-aligned: [n][n uoffsets][vtable][vtable with status, if needed][pad]
        [table 0 (at 4 mod 8)][table 1]...
        """
        vtable_at = 4 + 4 * n
        vtables = self.vtable + self.vtable_status if errors else self.vtable
        first = vtable_at + len(vtables)
        first += (4 - first) % 8
        size = self.size
        uoffsets = range(first - 4, first - 4 + n * (size - 4), size - 4)
        head = struct.pack(f"<{n + 1}I", n, *uoffsets) + vtables
        return first + n * size, head + bytes(first - len(head)), first - vtable_at

    def _block_with_errors(self, b: Any, items: Sequence[Any], errors: list[int]) -> bytes:
        """The block of ``items`` when some statuses are not OK (``errors``: their offsets)."""
        n = len(items)
        total, prefix, _ = self._plan(n, True)
        if b.nested:
            b.assertNotNested()  # raises
        b.Prep(8, total)  # aligns the block's end, hence its start
        size, pack = self.size, self.row.pack
        base = len(b.Bytes) - b.head + total  # the block's start, as a builder offset
        vtable_at = 4 + 4 * n
        vtable_status_at = vtable_at + len(self.vtable)
        parts = [prefix]
        pos = len(prefix)
        for row, error in zip(self.rows(items), errors, strict=True):
            if error:  # a uoffset to the status built above: from base - field to error
                uoffset = base - pos - self.status_at - error
                parts.append(pack(pos - vtable_status_at, *row, uoffset))
            else:
                parts.append(pack(pos - vtable_at, *row, 0))
            pos += size
        return b"".join(parts)


_MAX_PLANS: Final = 256  # FixedLayout.put keeps the head of blocks of up to this many items


def maker(cls: type[_T]) -> Callable[..., _T]:
    """``make(*values)``: an instance of the frozen, slotted dataclass ``cls``, every field given
    in order, equal to ``cls(*values)`` but made without its ``__init__``: ``object.__new__``,
    then each slot set through its member descriptor. A frozen dataclass's ``__init__`` sets each
    field through ``object.__setattr__``, several times slower; this is for hot paths that make
    hundreds of thousands (a node's LIST_RANGES). No check is skipped: the dataclasses here have
    no ``__post_init__``. The makers, one per number of fields, are generated code."""
    if getattr(cls, "__post_init__", None) is not None:
        raise TypeError(f"{cls.__name__} has a __post_init__: make it with its __init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if len(fields) >= len(MAKERS):
        raise TypeError(f"{cls.__name__}: at most {len(MAKERS) - 1} fields have a maker")
    make: Callable[..., _T] = MAKERS[len(fields)](cls, *setters(cls))
    return make


# ------------------------------------------------------------------------------------ the codec

_INITIAL_BUILDER_BYTES: Final = 1024  # most headers fit; the builder doubles when they do not
# What reading a truncated or malformed buffer raises (out of bounds, bad UTF-8, ...).
_DECODE_ERRORS: Final = (struct.error, IndexError, ValueError, TypeError, OverflowError)
# What the builder raises when a value does not fit its field (an int16 above 32767, ...).
_ENCODE_ERRORS: Final = (struct.error, TypeError, OverflowError)

Build = Callable[[Any, Any], int]
Read = Callable[[Any, int], Any]
VectorRead = Callable[[Any, int, Callable[[int], None] | None], tuple[Any, ...]]


class Bound:
    """A class bound to its schema table: ``build(builder, obj) -> offset`` and
    ``read(buf, pos) -> obj``; ``omit`` is the value not written at all (None: any is written).

    ``names`` are the Python fields, in order; ``omit_values`` the tuple of ``omit``'s fields;
    ``put``/``get`` a fast writer/reader of vectors of the table (see :meth:`Codec.vector_writer`).
    """

    __slots__ = ("build", "cls", "fixed", "get", "names", "omit", "omit_values", "put", "read",
                 "table")

    def __init__(self, cls: type[Any], table: TableDef, build: Build, read: Read,
                 names: tuple[str, ...], omit: Any = None, fixed: FixedLayout | None = None
                 ) -> None:
        self.cls, self.table, self.build, self.read, self.names = cls, table, build, read, names
        self.omit, self.fixed = omit, fixed
        self.omit_values = None if omit is None else tuple(getattr(omit, n) for n in names)
        self.put: Callable[[Any, Sequence[Any]], int] | None = (
            None if fixed is None else fixed.put)
        self.get: VectorRead | None = None

    def __repr__(self) -> str:
        return f"Bound({self.cls.__name__}, {self.table.name})"

    @property
    def fixed_put(self) -> Callable[[Any, Sequence[Any]], int]:
        """The writer of vectors of a fixed-layout table (:meth:`FixedLayout.put`)."""
        if self.fixed is None:
            raise TypeError(f"{self.table.name} has no fixed layout")
        return self.fixed.put


class Table:
    """Base of the generated classes: any table encodes to and decodes from a root table.

    Frozen: ``__setattr__``/``__delattr__`` raise :class:`dataclasses.FrozenInstanceError` (the
    classes are slotted: ``__init__`` sets the slots through their descriptors)."""

    __slots__ = ()
    SCHEMA: ClassVar[Bound]  # the class's binding: its schema table, codec and field names
    __match_args__: ClassVar[tuple[str, ...]]

    def encode(self) -> bytes:
        b = Builder(_INITIAL_BUILDER_BYTES)
        try:
            return b.finish(self.SCHEMA.build(b, self))
        except _ENCODE_ERRORS as exc:
            raise ValueError(f"cannot encode {type(self).__name__}: {exc}") from exc

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> Self:
        if len(buf) == 0:  # header_length = 0: every field at its default
            return cls()
        try:
            obj: Self = cls.SCHEMA.read(buf, U32(buf, 0)[0])
        except _DECODE_ERRORS as exc:
            raise BadHeaderError(f"undecodable {cls.__name__} header: {exc!r}") from exc
        return obj

    def __setattr__(self, attr: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {attr!r}")

    def __delattr__(self, attr: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {attr!r}")

    def __getstate__(self) -> list[Any]:
        return [getattr(self, n) for n in self.__match_args__]

    def __setstate__(self, state: list[Any]) -> None:
        for name, value in zip(self.__match_args__, state, strict=True):
            object.__setattr__(self, name, value)


class Codec:
    """Binds the generated classes to the tables of one schema (a table's children first),
    checking each class against its table, and keeps the vector fast paths."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.bound: dict[str, Bound] = {}
        #: fast writers of vectors of unbound union-entry tables (see union_vector_writer)
        self.union_puts: dict[str, Callable[[Any, Sequence[Any]], int]] = {}
        #: writer and reader of each union-entry table (see union_entry)
        self.entries: dict[str, tuple[Build, Read]] = {}

    def bind(
        self,
        cls: type[Any],
        build: Build | None = None,
        read: Read | None = None,
        *,
        renames: dict[str, str] | None = None,
        fixed: FixedCode | None = None,
        omit_default: bool = False,
    ) -> Bound:
        """Check ``cls`` against the table of its name and bind its generated ``build`` and
        ``read`` (a class without them cannot be encoded: regenerate).

        ``renames`` maps Python field names to schema names; ``fixed``: vectors of this table are
        written with :class:`FixedLayout`; ``omit_default``: a value equal to ``cls()`` is not
        written.
        """
        table = self.schema.tables.get(cls.__name__)
        if table is None or table.name in self.bound or table.slots >= len(_VTABLE):
            raise TypeError(f"{cls.__name__}: no table of that name, or bound twice")
        names = self._check(cls, table, renames or {})
        py_names = tuple(names[f.name] for f in table.fields)
        bound = Bound(cls, table, build or _not_generated(cls), read or _not_generated(cls),
                      py_names, cls() if omit_default else None,
                      None if fixed is None else FixedLayout(table, fixed))
        cls.SCHEMA = bound
        self.bound[table.name] = bound
        return bound

    def vector_writer(self, cls: type[Table], put: Callable[[Any, Sequence[Any]], int]) -> None:
        """Have vectors of ``cls`` written by ``put(builder, items) -> offset``: a hand-written
        fast path, which must write the builder's bytes (the generated code calls it)."""
        cls.SCHEMA.put = put

    def vector_reader(self, cls: type[Table], get: VectorRead) -> None:
        """Have vectors of ``cls`` read by ``get(buf, at, limit) -> items`` (``at``: the
        position of the vector's uoffset): a hand-written fast path, which must give what the
        generic reader gives and raise where it raises (the generated code calls it)."""
        cls.SCHEMA.get = get

    def union_entry(self, name: str, build: Build, read: Read) -> None:
        """Register the generated writer and reader of the union-entry table ``name``: a table
        whose one field is a union (flatc's Python has no vectors of unions), standing for its
        member."""
        table = self.schema.tables[name]
        if name in self.bound or [f.kind for f in table.fields] != [Kind.UNION]:
            raise TypeError(f"{name} is not a union-entry table")
        self.entries[name] = (build, read)

    def union_vector_writer(self, name: str, put: Callable[[Any, Sequence[Any]], int]) -> None:
        """Have vectors of the union-entry table ``name`` written by ``put(builder, items) ->
        offset``: a hand-written fast path, which must write the builder's bytes."""
        if name not in self.entries:
            raise TypeError(f"{name} is not a union-entry table")
        self.union_puts[name] = put

    def builder_vector_writer(self, name: str) -> Callable[[Any, Sequence[Any]], int]:
        """The builder's own writer of a vector of ``name`` tables (bound or union entries): the
        fallback of a fast path."""
        build = self.bound[name].build if name in self.bound else self.entries[name][0]
        return functools.partial(put_tables, build=build)

    def _check(self, cls: type[Any], table: TableDef, renames: dict[str, str]) -> dict[str, str]:
        """Schema name -> Python name; refuses other names, another order or other defaults."""
        fields = dataclasses.fields(cls)
        schema_names = [renames.get(f.name, f.name) for f in fields]
        if schema_names != [f.name for f in table.fields]:
            raise TypeError(
                f"{cls.__name__} declares {schema_names}; the schema's {table.name} has "
                f"{[f.name for f in table.fields]} (in that order)"
            )
        for field, py in zip(table.fields, fields, strict=True):
            if not self._default_ok(field, py.default):
                raise TypeError(f"{cls.__name__}.{py.name}: default {py.default!r} is not the "
                                f"schema's ({field.kind.value} {field.default!r})")  # fmt: skip
        return {s: p.name for s, p in zip(schema_names, fields, strict=True)}

    def _default_ok(self, field: Field, default: Any) -> bool:
        kind = field.kind
        if kind is Kind.SCALAR:
            want = bool if field.fmt == "?" else float if field.fmt in "fd" else int
            return type(default) is want and default == field.default
        if kind is Kind.ENUM:
            if not isinstance(default, enum.IntEnum):
                return False
            members = {m.name: m.value for m in type(default)}
            return members == self.schema.enums[field.ref] and default == field.default
        if kind is Kind.TABLE:  # absent reads as the default: None, or the table's own default
            ref = self.bound.get(field.ref)
            if ref is None:
                raise TypeError(f"{field.name}: bind {field.ref} first")
            return (default is None and ref.omit is None) or bool(default == ref.cls())
        return bool(default == {Kind.STRING: "", Kind.BYTES: b""}.get(kind, ()))


def _not_generated(cls: type[Any]) -> Callable[..., Any]:
    def missing(*args: Any) -> Any:
        raise TypeError(f"{cls.__name__} has no generated codec: run {REGENERATE}")

    return missing
