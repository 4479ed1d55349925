"""A sans-I/O codec of the Kafka binary protocol, driven by message schemas. No I/O.

Written from Kafka's protocol guide and its message JSON schemas
(``clients/src/main/resources/common/message/*.json``): a message is a list of fields, each present
in a range of versions; versions at or above a message's first *flexible* version use compact
strings/arrays/bytes (unsigned varint length + 1) and end every struct with a tagged-field buffer.
Tagged fields are skipped on decode and none are written on encode (every tagged field of the
messages served is ignorable with a default).

Every malformation (truncation, a negative or oversized length, an array longer than the bytes
left could hold, bad UTF-8) raises :class:`KafkaDecodeError`, nothing else; sizes
are bounded by the named limits below before anything is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# ------------------------------------------------------------------------------------- limits

MAX_REQUEST_BYTES: Final = 32 * 1024 * 1024
"""A request frame larger than this closes the connection (Kafka's socket.request.max.bytes is
100 MB; the gateway forwards at most a few MiB per partition, so 32 MiB is plenty)."""
MAX_ARRAY_ITEMS: Final = 1_000_000
"""An array longer than this is refused even when the bytes left could hold it."""
MAX_TAGGED_FIELDS: Final = 1024
"""Tagged fields per struct before the request is called malformed."""
MAX_CLIENT_ID_BYTES: Final = 32767  # an int16 length

INT16: Final = struct.Struct(">h")
INT32: Final = struct.Struct(">i")
INT64: Final = struct.Struct(">q")
UINT32: Final = struct.Struct(">I")
HEADER_PREFIX: Final = struct.Struct(">hhi")  # api_key, api_version, correlation_id


class KafkaDecodeError(ValueError):
    """A request (or record batch) is malformed: Kafka closes the connection."""


# ----------------------------------------------------------------------------------- schemas

ANY: Final = (0, 32767)


def v(spec: str) -> tuple[int, int]:
    """Kafka's version range notation: ``"3+"``, ``"0-5"``, ``"4"``, ``"none"``."""
    if spec == "none":
        return (1, 0)
    if spec.endswith("+"):
        return (int(spec[:-1]), ANY[1])
    if "-" in spec:
        lo, hi = spec.split("-")
        return (int(lo), int(hi))
    return (int(spec), int(spec))


@dataclass(frozen=True, slots=True)
class F:
    """One field: ``type`` is a primitive name, ``[]<primitive>`` or ``[]`` (array of structs
    described by ``fields``); ``nullable`` is the version range where it may be null."""

    name: str
    type: str
    versions: str = "0+"
    nullable: str = "none"
    default: Any = None
    fields: tuple[F, ...] = ()
    vr: tuple[int, int] = field(init=False)
    nr: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "vr", v(self.versions))
        object.__setattr__(self, "nr", v(self.nullable))


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    fields: tuple[F, ...]
    flexible: int  # first flexible version (32767: never)


def _in(r: tuple[int, int], version: int) -> bool:
    return r[0] <= version <= r[1]


_PRIMITIVE_DEFAULTS: Final[dict[str, Any]] = {
    "int8": 0, "int16": 0, "int32": 0, "int64": 0, "bool": False, "string": "",
    "bytes": b"", "records": None, "uuid": b"\x00" * 16, "float64": 0.0,
}


def default_of(f: F) -> Any:
    if f.default is not None:
        return f.default
    if f.type.startswith("[]"):
        return []
    return _PRIMITIVE_DEFAULTS[f.type]


# ----------------------------------------------------------------------------------- reading


class Reader:
    """Reads primitives from a buffer; every failure is a KafkaDecodeError."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | memoryview, pos: int = 0) -> None:
        self.buf = memoryview(buf)
        self.pos = pos
        self.end = len(self.buf)

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise KafkaDecodeError(f"{n} bytes wanted at byte {self.pos}, {self.remaining} left")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def int8(self) -> int:
        return int.from_bytes(self.take(1), "big", signed=True)

    def int16(self) -> int:
        return int(INT16.unpack(self.take(2))[0])

    def int32(self) -> int:
        return int(INT32.unpack(self.take(4))[0])

    def int64(self) -> int:
        return int(INT64.unpack(self.take(8))[0])

    def uvarint(self) -> int:
        result = shift = 0
        while True:
            if self.pos >= self.end:
                raise KafkaDecodeError("truncated varint")
            b = self.buf[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise KafkaDecodeError("varint longer than 10 bytes")

    def varint(self) -> int:
        u = self.uvarint()
        return (u >> 1) ^ -(u & 1)

    def _length(self, flexible: bool, wide: bool = False) -> int:
        """A length prefix; -1 for null."""
        if flexible:
            return self.uvarint() - 1
        return self.int32() if wide else self.int16()

    def string(self, flexible: bool, nullable: bool) -> str | None:
        n = self._length(flexible)
        if n < 0:
            if n == -1 and nullable:
                return None
            raise KafkaDecodeError(f"bad string length {n}")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError as e:
            raise KafkaDecodeError(f"string is not UTF-8: {e}") from None

    def bytes_(self, flexible: bool, nullable: bool) -> bytes | None:
        n = self._length(flexible, wide=True)
        if n < 0:
            if n == -1 and nullable:
                return None
            raise KafkaDecodeError(f"bad bytes length {n}")
        return bytes(self.take(n))

    def array_len(self, flexible: bool, nullable: bool) -> int:
        n = self._length(flexible, wide=True)
        if n < -1 or (n == -1 and not nullable):
            raise KafkaDecodeError(f"bad array length {n}")
        if n > self.remaining or n > MAX_ARRAY_ITEMS:  # every item is at least a byte
            raise KafkaDecodeError(f"array of {n} items in {self.remaining} bytes")
        return n

    def skip_tagged(self) -> None:
        count = self.uvarint()
        if count > MAX_TAGGED_FIELDS:
            raise KafkaDecodeError(f"{count} tagged fields")
        for _ in range(count):
            self.uvarint()  # tag
            self.take(self.uvarint())


def _read_value(r: Reader, f: F, t: str, version: int, flexible: bool) -> Any:
    nullable = _in(f.nr, version)
    if t == "int8":
        return r.int8()
    if t == "int16":
        return r.int16()
    if t == "int32":
        return r.int32()
    if t == "int64":
        return r.int64()
    if t == "bool":
        return r.int8() != 0
    if t == "string":
        return r.string(flexible, nullable)
    if t in ("bytes", "records"):
        return r.bytes_(flexible, nullable or t == "records")
    if t == "uuid":
        return bytes(r.take(16))
    raise KafkaDecodeError(f"unknown type {t}")  # a schema bug, caught by tests


def _read_struct(r: Reader, fields: Sequence[F], version: int, flexible: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        if not _in(f.vr, version):
            out[f.name] = default_of(f)
            continue
        if f.type.startswith("[]"):
            n = r.array_len(flexible, _in(f.nr, version))
            if n < 0:
                out[f.name] = None
            elif f.type == "[]":
                out[f.name] = [_read_struct(r, f.fields, version, flexible) for _ in range(n)]
            else:
                t = f.type[2:]
                out[f.name] = [_read_value(r, f, t, version, flexible) for _ in range(n)]
        else:
            out[f.name] = _read_value(r, f, f.type, version, flexible)
    if flexible:
        r.skip_tagged()
    return out


def decode(schema: Schema, version: int, buf: bytes | memoryview, pos: int = 0,
           *, strict: bool = False) -> dict[str, Any]:
    """Decode a message body. Bytes after it are ignored, as Kafka's brokers do (librdkafka's
    flexible Metadata request for all topics carries some); ``strict`` refuses them."""
    r = Reader(buf, pos)
    out = _read_struct(r, schema.fields, version, version >= schema.flexible)
    if strict and r.remaining:
        raise KafkaDecodeError(f"{r.remaining} bytes after the {schema.name} body")
    return out


# ----------------------------------------------------------------------------------- writing


def uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varint(n: int) -> bytes:
    """Zig-zag varint (int32 and int64 alike)."""
    return uvarint((n << 1) ^ (n >> 63))


def _w_len(out: list[bytes], n: int, flexible: bool, wide: bool) -> None:
    if flexible:
        out.append(uvarint(n + 1))
    else:
        out.append(INT32.pack(n) if wide else INT16.pack(n))


def _write_value(out: list[bytes], t: str, value: Any, flexible: bool) -> None:
    if t == "int8":
        out.append(int(value).to_bytes(1, "big", signed=True))
    elif t == "int16":
        out.append(INT16.pack(value))
    elif t == "int32":
        out.append(INT32.pack(value))
    elif t == "int64":
        out.append(INT64.pack(value))
    elif t == "bool":
        out.append(b"\x01" if value else b"\x00")
    elif t == "string":
        if value is None:
            _w_len(out, -1, flexible, False)
        else:
            raw = value.encode("utf-8")
            _w_len(out, len(raw), flexible, False)
            out.append(raw)
    elif t in ("bytes", "records"):
        if value is None:
            _w_len(out, -1, flexible, True)
        else:
            _w_len(out, len(value), flexible, True)
            out.append(bytes(value) if isinstance(value, memoryview) else value)
    elif t == "uuid":
        out.append(bytes(value))
    else:
        raise ValueError(f"unknown type {t}")


def _write_struct(out: list[bytes], fields: Sequence[F], data: dict[str, Any], version: int,
                  flexible: bool) -> None:
    for f in fields:
        if not _in(f.vr, version):
            continue
        value = data.get(f.name, default_of(f))
        if f.type.startswith("[]"):
            if value is None:
                _w_len(out, -1, flexible, True)
                continue
            _w_len(out, len(value), flexible, True)
            if f.type == "[]":
                for item in value:
                    _write_struct(out, f.fields, item, version, flexible)
            else:
                t = f.type[2:]
                for item in value:
                    _write_value(out, t, item, flexible)
        else:
            _write_value(out, f.type, value, flexible)
    if flexible:
        out.append(b"\x00")  # no tagged fields


def encode(schema: Schema, version: int, data: dict[str, Any]) -> list[bytes]:
    """The body of a message as a list of byte strings (join or writelines them)."""
    out: list[bytes] = []
    _write_struct(out, schema.fields, data, version, version >= schema.flexible)
    return out


# ----------------------------------------------------------------------------- frame headers


@dataclass(frozen=True, slots=True)
class RequestHeader:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body_offset: int  # where the body starts in the frame


def peek_header(frame: bytes | memoryview) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id): the part every request header version shares."""
    if len(frame) < HEADER_PREFIX.size:
        raise KafkaDecodeError(f"request of {len(frame)} bytes has no header")
    k, ver, cid = HEADER_PREFIX.unpack_from(frame)
    return int(k), int(ver), int(cid)


def decode_header(frame: bytes | memoryview, flexible: bool) -> RequestHeader:
    """Request header v1 (client_id, a nullable int16-length string even in v2) and, for
    flexible request versions, v2 (plus tagged fields)."""
    k, ver, cid = peek_header(frame)
    r = Reader(frame, HEADER_PREFIX.size)
    client_id = r.string(False, True)
    if flexible:
        r.skip_tagged()
    return RequestHeader(k, ver, cid, client_id, r.pos)


def encode_response(correlation_id: int, flexible_header: bool, body: list[bytes]) -> bytes:
    """A whole response frame: size, correlation id, (tagged fields for header v1), body."""
    head = INT32.pack(correlation_id) + (b"\x00" if flexible_header else b"")
    size = len(head) + sum(len(b) for b in body)
    return b"".join([INT32.pack(size), head, *body])
