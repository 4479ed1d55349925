"""A FlatBuffers table codec driven by the schema text: no generated code on the runtime path.

:func:`parse_schema` reads the subset of the ``.fbs`` language that ``schema/sbp.fbs`` uses
(``namespace``, ``enum``, ``union``, ``table``; scalar, string, table, enum and vector fields with
defaults) and refuses anything else. :class:`Codec` binds a frozen dataclass to the table of the
same name: the dataclass declares its fields, one line each, in schema order, and the codec
checks names, order and defaults against the schema and compiles a writer and a reader for it.

The writer makes exactly the builder calls flatc's generated code makes (children first, in field
order, then the fields in slot order; a field at its default is skipped without a call), so the
bytes are those of the generated code. The builder is :class:`.fbbuilder.Builder`, which writes
the Google builder's bytes with a fraction of its Python calls. The reader
does not use the generated accessors: it reads a table's vtable once and unpacks each present
field with :mod:`struct`. Both are written per table from the field table, as source (a few
lines, as :mod:`dataclasses` does): the code is what one would write by hand for the table,
whereas a loop over field descriptors adds a Python call per field, which the hundred items of
an APPEND or FETCH header would pay a hundred times. The source is not compiled at import:
:func:`compiled` takes its code from ``_precompiled.py``, written ahead of time by
``python -m sbpstream.protocol.codegen`` (see :mod:`.codegen`).

Fast path: a vector of a table bound with ``fixed=True`` (scalars and at most one status) is
written as one block, every scalar present, in a layout derived from the field table: 8-byte
fields first, then 4-byte ones, in slot order, then the status offset (see :class:`FixedLayout`).

Every decode error is an exception the caller turns into BadHeaderError: ``struct.error``,
``IndexError``, ``ValueError`` (bad UTF-8), or :class:`BadHeaderError` itself for lengths that
cannot fit the buffer. No I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, Self, TypeVar, dataclass_transform

from sbpstream.protocol import _precompiled
from sbpstream.protocol.errors import BadHeaderError
from sbpstream.protocol.fbbuilder import Builder

__all__ = [
    "MAX_PRECOMPILED_MAKER", "RUNTIME_COMPILED", "SOURCES", "Bound", "Codec", "Field",
    "FixedLayout", "Kind", "Schema", "Table", "TableDef", "compiled", "frozen_dataclass", "maker",
    "maker_source", "parse_schema", "put_tables",
]  # fmt: skip

_T = TypeVar("_T")

# ------------------------------------------------------------------------- compiled code, ahead

SOURCES: Final[dict[tuple[int, int], tuple[str, str, tuple[str, ...]]]] = {}
"""Every source :func:`compiled` was given in this process: key -> (label, source, env names).
``python -m sbpstream.protocol.codegen`` writes them to ``_precompiled.py``."""

RUNTIME_COMPILED: Final[list[str]] = []
"""Labels of the sources compiled in this process because ``_precompiled`` lacks them (stale or
new code). Empty after importing messages when the committed module is current (tested)."""


def _key(source: str) -> tuple[int, int]:
    return len(source), zlib.crc32(source.encode())


def compiled(label: str, source: str, env: dict[str, Any]) -> dict[str, Any]:
    """The functions that ``source`` (top-level ``def`` statements, annotated with ``Any``)
    defines, run with the names of ``env``.

    The code comes from ``_precompiled`` when it holds this exact source (keyed by its length and
    CRC-32): a factory taking ``env``, compiled into the package's bytecode ahead of time, so
    that importing the messages compiles nothing. A source it lacks is compiled here, as
    :mod:`dataclasses` does, and listed in :data:`RUNTIME_COMPILED`: the behaviour is the same,
    only the import is slower (``tests/test_precompiled.py`` fails until the module is rewritten).
    """
    key = _key(source)
    if key not in SOURCES:
        SOURCES[key] = (label, source, tuple(env))
    factory = _precompiled.CODE.get(key)
    if factory is not None:
        return factory(env)
    namespace = dict(env, Any=Any)
    exec(compile(source, f"<{label}>", "exec"), namespace)
    RUNTIME_COMPILED.append(label)
    return namespace


_DATACLASS_METHODS: Final = (
    "__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__getstate__",
    "__setstate__",
)  # fmt: skip


@dataclass_transform(frozen_default=True)
def frozen_dataclass(cls: type[_T]) -> type[_T]:
    """``dataclass(frozen=True, slots=True)(cls)``, its methods taken from :func:`compiled`.

    :mod:`dataclasses` compiles six methods per class (``exec``), 0.18 s for the hundred message
    classes, in every process that imports them. Here :func:`dataclasses.dataclass` only collects
    the fields and makes the slotted class (``init``, ``repr``, ``eq`` off, so it compiles
    nothing), and the methods, the ones a frozen dataclass has, come precompiled: ``__init__``
    (every field with its default; set through the slots' descriptors), ``__repr__``, ``__eq__``
    and ``__hash__`` over the fields' tuple, ``__setattr__``/``__delattr__`` raising
    :class:`dataclasses.FrozenInstanceError`, and the pickling pair. :func:`dataclasses.fields`,
    :func:`dataclasses.replace` and :func:`dataclasses.is_dataclass` work as before, and
    ``__dataclass_params__`` is set to what the class is (``frozen``, ``eq``...). No field may
    have a ``default_factory``.
    """
    if not cls.__doc__:  # else dataclass() writes one, through a costly inspect.signature
        cls.__doc__ = f"{cls.__name__}({', '.join(inspect.get_annotations(cls))})"
    cls = dataclasses.dataclass(init=False, repr=False, eq=False, slots=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [f.name for f in fields]
    env: dict[str, Any] = {"cls_": cls, "frozen_": dataclasses.FrozenInstanceError}
    for k, f in enumerate(fields):
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a default_factory is not supported")
        env[f"d{k}"], env[f"s{k}"] = f.default, getattr(cls, f.name).__set__
    env["setters_"] = tuple(env[f"s{k}"] for k in range(len(names)))
    if set(names) & {*env, "self", "other_", "attr_", "value_", "state_", "set_", "Any"}:
        raise TypeError(f"{cls.__name__}: a field name is one of the generated code's names")
    mine = "".join(f"self.{n}, " for n in names)
    theirs = "".join(f"other_.{n}, " for n in names)
    shown = f'f"({", ".join(f"{n}={{self.{n}!r}}" for n in names)})"' if names else '"()"'
    frozen = f"type(self) is cls_ or attr_ in {tuple(names)!r}" if names else "type(self) is cls_"
    init_body = "".join(f"    s{k}(self, {n})\n" for k, n in enumerate(names)) or "    pass\n"
    params = "".join(f", {f.name}: Any" + ("" if f.default is dataclasses.MISSING else f" = d{k}")
                     for k, f in enumerate(fields))
    source = (
        f"def __init__(self: Any{params}) -> None:\n{init_body}"
        "def __repr__(self: Any) -> Any:\n"
        f"    return self.__class__.__qualname__ + {shown}\n"
        "def __eq__(self: Any, other_: Any) -> Any:\n"
        "    if other_.__class__ is self.__class__:\n"
        f"        return ({mine}) == ({theirs})\n"
        "    return NotImplemented\n"
        "def __hash__(self: Any) -> Any:\n"
        f"    return hash(({mine}))\n"
        "def __setattr__(self: Any, attr_: Any, value_: Any) -> None:\n"
        f"    if {frozen}:\n"
        "        raise frozen_(f\"cannot assign to field {attr_!r}\")\n"
        "    super(cls_, self).__setattr__(attr_, value_)\n"
        "def __delattr__(self: Any, attr_: Any) -> None:\n"
        f"    if {frozen}:\n"
        "        raise frozen_(f\"cannot delete field {attr_!r}\")\n"
        "    super(cls_, self).__delattr__(attr_)\n"
        "def __getstate__(self: Any) -> Any:\n"
        f"    return [{mine}]\n"
        "def __setstate__(self: Any, state_: Any) -> None:\n"
        "    for set_, value_ in zip(setters_, state_, strict=True):\n"
        "        set_(self, value_)\n"
    )
    namespace = compiled(f"dataclass {cls.__name__}", source, env)
    for method in _DATACLASS_METHODS:
        fn = namespace[method]
        fn.__qualname__ = f"{cls.__qualname__}.{method}"
        setattr(cls, method, fn)
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    for attr in ("init", "repr", "eq", "frozen"):  # what the class now is
        setattr(params, attr, True)
    return cls

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


@frozen_dataclass
class Field:
    """One field of a table: ``slot`` is its vtable index (a union's value is at ``slot + 1``)."""

    name: str
    kind: Kind
    slot: int
    fmt: str = ""  # struct format: of the scalar, or of a vector's elements
    default: int | float | bool = 0
    ref: str = ""  # the table, enum or union named by the type


@frozen_dataclass
class TableDef:
    name: str
    fields: tuple[Field, ...]

    @property
    def slots(self) -> int:
        return sum(2 if f.kind is Kind.UNION else 1 for f in self.fields)


@frozen_dataclass
class Schema:
    tables: dict[str, TableDef]
    enums: dict[str, dict[str, int]]  # name -> {member: value}
    unions: dict[str, tuple[str, ...]]  # name -> member tables, type index 1, 2, ...


_BLOCK = re.compile(r"(table|enum|union)\s+(\w+)\s*(?::\s*(\w+)\s*)?\{([^{}]*)\}")
_FIELD = re.compile(r"(\w+)\s*:\s*(\[\s*\w+\s*\]|\w+)\s*(?:=\s*([\w.+-]+))?")


def parse_schema(text: str) -> Schema:
    """The tables, enums and unions of a schema; unsupported syntax raises ValueError."""
    text = re.sub(r"//[^\n]*", "", text)
    blocks = list(_BLOCK.finditer(text))
    rest = _BLOCK.sub("", text)
    rest = re.sub(r"namespace\s+[\w.]+\s*;", "", rest).strip()
    if rest:
        raise ValueError(f"unsupported schema syntax: {rest[:60]!r}")
    enums: dict[str, dict[str, int]] = {}
    enum_fmt: dict[str, str] = {}
    unions: dict[str, tuple[str, ...]] = {}
    bodies: dict[str, str] = {}
    for block in blocks:
        keyword, name, base, body = block.groups()
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
            fname, ftype, default = match.groups()
            field = _field(fname, ftype.replace(" ", ""), slot, default, enums, enum_fmt, unions)
            if field.kind in (Kind.TABLE, Kind.TABLES) and field.ref not in bodies:
                raise ValueError(f"{name}.{fname}: unknown type {ftype}")
            fields.append(field)
            slot += 2 if field.kind is Kind.UNION else 1
        tables[name] = TableDef(name, tuple(fields))
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

_U8 = struct.Struct("<B").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_VTABLE: Final = tuple(struct.Struct(f"<{n}H") for n in range(64))


def _slots(buf: Any, pos: int, count: int) -> tuple[int, ...]:
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


def _raw(buf: Any, at: int) -> bytes:
    start = at + _U32(buf, at)[0]
    n = _U32(buf, start)[0]
    if start + 4 + n > len(buf):
        raise BadHeaderError(f"a vector of {n} bytes overruns the {len(buf)}-byte header")
    return bytes(buf[start + 4 : start + 4 + n])


def _text(buf: Any, at: int) -> str:
    return _raw(buf, at).decode("utf-8")


def _read_tables(
    buf: Any, at: int, read: Callable[[Any, int], Any], limit: Callable[[int], None] | None
) -> tuple[Any, ...]:
    return tuple([read(buf, e + _U32(buf, e)[0]) for e in _vector(buf, at, 4, limit)])


def _read_scalars(
    buf: Any, at: int, fmt: str, limit: Callable[[int], None] | None
) -> tuple[Any, ...]:
    positions = _vector(buf, at, struct.calcsize(fmt), limit)
    return struct.unpack_from(f"<{len(positions)}{fmt}", buf, positions.start)


# ------------------------------------------------------------------------------- writing helpers


def _omitted(v: str, ref: Bound, k: str, values: str) -> str:
    """Source of the test that ``v``, a ``ref`` table, is its omitted value ``k`` (whose fields
    are ``values``): several times cheaper than the dataclass's ``==``."""
    return f"{v} is {k} or ({''.join(f'{v}.{n}, ' for n in ref.names)}) == {values}"


def put_tables(b: Any, items: Sequence[Any], build: Callable[[Any, Any], int]) -> int:
    """A vector of tables, each written by ``build``, the builder's way."""
    offsets = [build(b, item) for item in items]
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _put_scalars(b: Any, values: Sequence[Any], fmt: str) -> int:
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

    def __init__(self, table: TableDef, names: dict[str, str], status: Bound | None,
                 shared: Any = None) -> None:
        """``shared``: the item class's default status, if it is the omitted value (then
        usually the very object items hold, which is the cheapest to recognise)."""
        scalars = [f for f in table.fields if f.kind is Kind.SCALAR and f.fmt in "qQiI"]
        tables = [f for f in table.fields if f.kind is Kind.TABLE]
        omitted = status is not None and status.omit is not None
        if len(scalars) + len(tables) != len(table.fields) or len(tables) > omitted:
            raise TypeError(f"{table.name}: a fixed layout holds 4/8-byte scalars, one status")
        order = sorted(scalars, key=lambda f: (-struct.calcsize(f.fmt), f.slot)) + tables
        at: dict[int, int] = {}  # slot -> offset in the table
        inline = 4
        for f in order:
            at[f.slot] = inline
            inline += struct.calcsize(f.fmt) if f in scalars else 4
        row = "<i" + "".join(f.fmt if f in scalars else "I" for f in order)
        self.row = struct.Struct(f"{row}{-inline % 8}x")  # pad: the next table at 4 mod 8 too
        self.size = self.row.size
        # rows(items): each item's scalars in layout order; errors(b, items): None if every
        # item's status is OK, else each item's status written (its offset), or 0 if it is OK;
        # one(item, at, pack): packed(...)'s row of one item;
        # packed(items, at, size, pack): the rows of items whose statuses are all OK, packed
        # (row k's soffset is at + k * size: the first vtable). Compiled: a listcomp reads a
        # slotted attribute about twice as fast as attrgetter does.
        values = ", ".join(f"i.{names[f.name]}" for f in order if f in scalars)
        status_value = ", 0" if tables else ""
        source = (
            f"def rows(items: Any) -> Any:\n    return [({values},) for i in items]\n"
            "def one(i: Any, at: Any, pack: Any) -> Any:\n"
            f"    return pack(at, {values}{status_value})\n"
            "def packed(items: Any, at: Any, size: Any, pack: Any) -> Any:\n"
            f"    return [pack(v, {values}{status_value}) for v, i in "
            "zip(range(at, at + len(items) * size, size), items, strict=True)]\n"
        )
        code = compiled(f"rows {table.name}", source, {})
        self.rows, self.one, self.packed = code["rows"], code["one"], code["packed"]
        self.errors: Callable[[Any, Sequence[Any]], list[int] | None] | None = None
        if status is not None and tables:
            k = shared if shared is not None and shared == status.omit else status.omit
            env = {"k": k, "K": status.omit_values, "build": status.build}
            ok = _omitted("s", status, "k", "K")
            # every status the shared OK value (or equal to it): list.count, in C, says so
            source = (
                "def errors(b: Any, items: Any) -> Any:\n"
                f"    statuses = [i.{names[tables[0].name]} for i in items]\n"
                "    if statuses.count(k) == len(statuses):\n"
                "        return None\n"
                "    out = None\n"
                "    for n, s in enumerate(statuses):\n"
                f"        if not ({ok}):\n"
                "            if out is None:\n"
                "                out = [0] * len(items)\n"
                "            out[n] = build(b, s)\n"
                "    return out\n"
            )
            self.errors = compiled(f"errors {table.name}", source, env)["errors"]
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
    no ``__post_init__``."""
    if getattr(cls, "__post_init__", None) is not None:
        raise TypeError(f"{cls.__name__} has a __post_init__: make it with its __init__")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    env: dict[str, Any] = {"new": object.__new__, "cls": cls}
    for k, name in enumerate(names):
        env[f"s{k}"] = getattr(cls, name).__set__  # the slot's member descriptor
    make: Callable[..., _T] = compiled(f"maker {len(names)}", maker_source(len(names)), env)["make"]
    return make


MAX_PRECOMPILED_MAKER: Final = 24
"""``_precompiled`` holds the :func:`maker` of every class of up to this many fields."""


def maker_source(n: int) -> str:
    """The source of :func:`maker`'s ``make`` for a class of ``n`` fields (it depends on ``n``
    only: the class and its slots' descriptors are the names ``cls`` and ``s0``... of its env)."""
    args = ", ".join(f"v{k}: Any" for k in range(n))
    body = "".join(f"    s{k}(o, v{k})\n" for k in range(n))
    return f"def make({args}) -> Any:\n    o = new(cls)\n{body}    return o\n"


# ------------------------------------------------------------------------------------ the codec

_INITIAL_BUILDER_BYTES: Final = 1024  # most headers fit; the builder doubles when they do not
# What reading a truncated or malformed buffer raises (out of bounds, bad UTF-8, ...).
_DECODE_ERRORS: Final = (struct.error, IndexError, ValueError, TypeError, OverflowError)
# What the builder raises when a value does not fit its field (an int16 above 32767, ...).
_ENCODE_ERRORS: Final = (struct.error, TypeError, OverflowError)


@frozen_dataclass
class Bound:
    """A dataclass bound to its schema table: ``build(builder, obj) -> offset`` and
    ``read(buf, pos) -> obj``; ``omit`` is the value not written at all (None: any is written).

    ``names`` are the Python fields, in order; ``omit_values`` the tuple of ``omit``'s fields.
    """

    cls: type[Any]
    table: TableDef
    build: Callable[[Any, Any], int]
    read: Callable[[Any, int], Any]
    names: tuple[str, ...]
    omit: Any = None
    omit_values: Any = None
    fixed: FixedLayout | None = None
    source: str = ""  # the compiled writer and reader, for a curious reader
    put: Callable[[Any, Sequence[Any]], int] | None = None  # see Codec.vector_writer
    get: Callable[[Any, int, Callable[[int], None] | None], tuple[Any, ...]] | None = None
    """See Codec.vector_reader."""


class Table:
    """Base of the bound dataclasses: any table encodes to and decodes from a root table."""

    __slots__ = ()
    SCHEMA: ClassVar[Bound]  # the class's binding: its schema table, codec and field names

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
            obj: Self = cls.SCHEMA.read(buf, _U32(buf, 0)[0])
        except _DECODE_ERRORS as exc:
            raise BadHeaderError(f"undecodable {cls.__name__} header: {exc!r}") from exc
        return obj


class Codec:
    """Binds dataclasses to the tables of one schema (a table's children are bound first)."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.bound: dict[str, Bound] = {}
        #: fast writers of vectors of unbound union-entry tables (see union_vector_writer)
        self.union_puts: dict[str, Callable[[Any, Sequence[Any]], int]] = {}

    def bind(
        self,
        cls: type[Table],
        *,
        renames: dict[str, str] | None = None,
        fixed: bool = False,
        omit_default: bool = False,
        limit: Callable[[int], None] | None = None,
    ) -> Bound:
        """Check ``cls`` against the table of its name and compile its codec.

        ``renames`` maps Python field names to schema names; ``fixed`` writes vectors of this
        table with :class:`FixedLayout`; ``omit_default``: a value equal to ``cls()`` is not
        written; ``limit(n)`` is called with the length of every vector field, on both sides.
        """
        table = self.schema.tables.get(cls.__name__)
        if table is None or table.name in self.bound or table.slots >= len(_VTABLE):
            raise TypeError(f"{cls.__name__}: no table of that name, or bound twice")
        names = self._check(cls, table, renames or {})
        source, env = self._source(cls, table, names, limit)
        env = compiled(f"codec {table.name}", source, env)
        layout = None
        if fixed:
            status = [self.bound[f.ref] for f in table.fields if f.kind is Kind.TABLE]
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            shared = next((defaults[names[f.name]] for f in table.fields
                           if f.kind is Kind.TABLE), None)
            layout = FixedLayout(table, names, status[0] if status else None, shared)
        py_names = tuple(names[f.name] for f in table.fields)
        omit = cls() if omit_default else None
        omit_values = None if omit is None else tuple(getattr(omit, n) for n in py_names)
        bound = Bound(cls, table, env["build"], env["read"], py_names, omit, omit_values, layout,
                      source)  # fmt: skip
        cls.SCHEMA = bound
        self.bound[table.name] = bound
        return bound

    def vector_writer(self, cls: type[Table], put: Callable[[Any, Sequence[Any]], int]) -> None:
        """Have vectors of ``cls`` written by ``put(builder, items) -> offset`` in the tables
        bound from now on: a hand-written fast path, which must write the builder's bytes."""
        bound = dataclasses.replace(cls.SCHEMA, put=put)
        cls.SCHEMA = bound
        self.bound[bound.table.name] = bound

    def vector_reader(
        self,
        cls: type[Table],
        get: Callable[[Any, int, Callable[[int], None] | None], tuple[Any, ...]],
    ) -> None:
        """Have vectors of ``cls`` read by ``get(buf, at, limit) -> items`` (``at``: the
        position of the vector's uoffset) in the tables bound from now on: a hand-written fast
        path, which must give what the generic reader gives and raise where it raises."""
        bound = dataclasses.replace(cls.SCHEMA, get=get)
        cls.SCHEMA = bound
        self.bound[bound.table.name] = bound
    def union_vector_writer(self, name: str, put: Callable[[Any, Sequence[Any]], int]) -> None:
        """Have vectors of the union-entry table ``name`` (one union field, see
        :meth:`_element`) written by ``put(builder, items) -> offset`` in the tables bound from
        now on: a hand-written fast path, which must write the builder's bytes."""
        table = self.schema.tables[name]
        if name in self.bound or [f.kind for f in table.fields] != [Kind.UNION]:
            raise TypeError(f"{name} is not a union-entry table")
        self.union_puts[name] = put

    def builder_vector_writer(self, name: str) -> Callable[[Any, Sequence[Any]], int]:
        """The builder's own writer of a vector of ``name`` tables (bound or union entries): the
        fallback of a fast path."""
        return functools.partial(put_tables, build=self._element(name)[0])

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

    def _source(
        self,
        cls: type[Any],
        table: TableDef,
        names: dict[str, str],
        limit: Callable[[int], None] | None,
    ) -> tuple[str, dict[str, Any]]:
        """The writer ``build(b, obj)`` and the reader ``read(buf, pos)`` of a table, as source,
        with the names it uses. Field ``i`` is ``v{i}`` in the writer, its vtable entry ``o{slot}``
        in the reader; ``d{i}`` is its default and ``r{i}``/``w{i}`` read/write its tables."""
        env: dict[str, Any] = {
            "cls": cls, "slots": _slots, "U32": _U32, "text": _text, "raw": _raw,
            "tables": _read_tables, "scalars": _read_scalars, "put_tables": put_tables,
            "put_scalars": _put_scalars, "limit": limit,
        }  # fmt: skip
        defaults = {p.name: p.default for p in dataclasses.fields(cls)}
        reads: list[str] = []
        checks: list[str] = []
        children: list[str] = []
        adds: list[str] = []
        for i, f in enumerate(table.fields):
            env[f"d{i}"] = defaults[names[f.name]]
            read, child = self._field_source(i, f, env)
            reads.append(f"{read} if o{f.slot} else d{i}")
            if child is None:
                test = "is not" if f.fmt == "?" else "!="  # the builder tests != again
                adds.append(f"if v{i} {test} {f.default!r}:\n        "  # a default: no call
                            f"b.{_SLOT_WRITER[f.fmt]}({f.slot}, v{i}, {f.default!r})")
                continue
            children.append(f"f{i} = {child}")
            adds.append(f"if f{i}:\n        b.PrependUOffsetTRelativeSlot({f.slot}, f{i}, 0)")
            if limit is not None and f.kind in (Kind.SCALARS, Kind.TABLES):
                checks.append(f"limit(len(v{i}))")
        values = ", ".join(f"v{i}" for i in range(len(table.fields)))
        get = ", ".join(f"obj.{names[f.name]}" for f in table.fields)
        offsets = ", ".join(f"o{s}" for s in range(table.slots))
        writer = [
            "def build(b: Any, obj: Any) -> Any:",
            *([f"{values} = {get}"] if values else []),
            *checks,
            *children,
            f"b.StartObject({table.slots})",
            *adds,
            "return b.EndObject()",
        ]
        reader = [
            "def read(buf: Any, pos: Any) -> Any:",
            *([f"{offsets}{',' * (table.slots == 1)} = slots(buf, pos, {table.slots})"]
              if offsets else []),
            f"return cls({', '.join(reads)})",
        ]
        return "\n    ".join(writer) + "\n" + "\n    ".join(reader) + "\n", env

    def _field_source(self, i: int, f: Field, env: dict[str, Any]) -> tuple[str, str | None]:
        """Field ``i``'s read expression and, unless it is inline, its child's write expression."""
        at, v = f"pos + o{f.slot}", f"v{i}"
        if f.kind in (Kind.SCALAR, Kind.ENUM):
            env[f"u{i}"] = struct.Struct("<" + f.fmt).unpack_from
            if f.kind is Kind.SCALAR:
                return f"u{i}(buf, {at})[0]", None
            # an unknown value (a newer peer's) reads as the default
            env[f"e{i}"] = {m.value: m for m in type(env[f"d{i}"])}.get
            return f"e{i}(u{i}(buf, {at})[0], d{i})", None
        if f.kind is Kind.STRING:
            return f"text(buf, {at})", f"b.CreateString({v}) if {v} else 0"
        if f.kind is Kind.BYTES:
            return f"raw(buf, {at})", f"b.CreateByteVector({v}) if {v} else 0"
        if f.kind is Kind.SCALARS:
            put = f"put_scalars(b, {v}, {f.fmt!r}) if {v} else 0"
            return f"scalars(buf, {at}, {f.fmt!r}, limit)", put
        if f.kind is Kind.TABLE:
            ref = self.bound[f.ref]
            env[f"r{i}"], env[f"w{i}"], env[f"k{i}"] = ref.read, ref.build, ref.omit
            if ref.omit is not None and env[f"d{i}"] == ref.omit:
                env[f"k{i}"] = env[f"d{i}"]  # the shared default (STATUS_OK): "is" finds it
            env[f"K{i}"] = ref.omit_values
            skip = f"{v} is None" if ref.omit is None else _omitted(v, ref, f"k{i}", f"K{i}")
            return f"r{i}(buf, {at} + U32(buf, {at})[0])", f"0 if {skip} else w{i}(b, {v})"
        if f.kind is Kind.TABLES:
            env[f"w{i}"], env[f"r{i}"] = self._element(f.ref)
            elem = self.bound.get(f.ref)
            fast = (self.union_puts.get(f.ref) if elem is None
                    else elem.put or (elem.fixed.put if elem.fixed else None))
            env[f"x{i}"] = fast
            put = f"x{i}(b, {v})" if fast is not None else f"put_tables(b, {v}, w{i})"
            env[f"g{i}"] = None if elem is None else elem.get
            get = f"tables(buf, {at}, r{i}, limit)" if env[f"g{i}"] is None else \
                f"g{i}(buf, {at}, limit)"
            return get, f"{put} if {v} else 0"
        raise TypeError(f"{f.name}: a {f.kind.value} field is supported only as a vector's element")

    def _element(self, name: str) -> tuple[Callable[[Any, Any], int], Callable[[Any, int], Any]]:
        """Writer and reader of a vector's element: a bound table, or an unbound table whose one
        field is a union (flatc's Python has no vectors of unions), standing for its member."""
        if name in self.bound:
            return self.bound[name].build, self.bound[name].read
        table = self.schema.tables[name]
        (field,) = table.fields
        if field.kind is not Kind.UNION:
            raise TypeError(f"{name} is not bound")
        members = [self.bound[m] for m in self.schema.unions[field.ref]]
        kinds = {m.cls: k for k, m in enumerate(members, 1)}
        slots, slot = table.slots, field.slot

        def build(b: Any, value: Any) -> int:
            kind = kinds.get(type(value))
            if kind is None:
                raise TypeError(f"{type(value).__name__} is not a {field.ref}")
            off = members[kind - 1].build(b, value)
            b.StartObject(slots)
            b.PrependUint8Slot(slot, kind, 0)
            b.PrependUOffsetTRelativeSlot(slot + 1, off, 0)
            return int(b.EndObject())

        def read(buf: Any, pos: int) -> Any:
            offsets = _slots(buf, pos, slots)
            if not offsets[slot + 1]:
                raise BadHeaderError(f"a {name} has no {field.name}")
            kind = _U8(buf, pos + offsets[slot])[0] if offsets[slot] else 0
            if not 0 < kind <= len(members):
                raise BadHeaderError(f"unknown {field.ref} type {kind}")
            at = pos + offsets[slot + 1]
            return members[kind - 1].read(buf, at + _U32(buf, at)[0])

        return build, read
