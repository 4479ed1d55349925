"""The SBP frame (design.md section 2), sans I/O: bytes in, events out; frames in, bytes out.

Wire layout, all integers big-endian::

    offset size field
    0      4    frame_length   u32 = 16 + H + P   (bytes on the wire = frame_length + 4)
    4      1    magic          u8  = 23
    5      2    opcode         u16
    7      1    flags          u8  (0x01 response, 0x02 response end, 0x04 system error)
    8      4    request_id     u32 (top bit clear in a request; a response echoes its request's)
    12     1    header_format  u8  = 1 (FlatBuffers)
    13     3    header_length  u24 = H
    16     H    extended header
    16+H   P    payload
    16+H+P 4    payload_crc    u32 = zlib.crc32(payload); 0 when P = 0

The decoder never raises for a single bad frame whose length is sane: wrong magic and unknown
opcodes are discarded and counted (:class:`FrameDiscarded`), a CRC mismatch or a bad header format
is reported (:class:`FrameCorrupt`) so the caller answers with a system error frame. Only a length
that breaks the framing (nothing after it can be trusted) raises :class:`FramingError`.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from sbpstream.protocol.limits import MAX_FRAME_LENGTH, MAX_REQUEST_ID, MIN_FRAME_LENGTH
from sbpstream.protocol.opcodes import KNOWN_OPCODES

MAGIC: Final = 23
FLAG_RESPONSE: Final = 0x01
FLAG_END: Final = 0x02
FLAG_SYSTEM_ERROR: Final = 0x04
FLAGS_RESPONSE_END: Final = FLAG_RESPONSE | FLAG_END
FLAGS_SYSTEM_ERROR: Final = FLAG_RESPONSE | FLAG_END | FLAG_SYSTEM_ERROR
HEADER_FORMAT_FLATBUFFERS: Final = 1
MAX_U32: Final = (1 << 32) - 1

LENGTH_STRUCT: Final = struct.Struct(">I")
# everything from frame_length to header_length: 4+1+2+1+4+1+3 = 16 bytes
FIXED_STRUCT: Final = struct.Struct(">IBHBIB3s")
FIXED_SIZE: Final = 16
CRC_STRUCT: Final = struct.Struct(">I")
CRC_SIZE: Final = 4
assert FIXED_STRUCT.size == FIXED_SIZE
# frame_length counts the 12 bytes after itself plus the CRC: 16 + H + P = 12 + H + P + 4
_FIXED_AFTER_LENGTH: Final = FIXED_SIZE - LENGTH_STRUCT.size

Buffer = bytes | bytearray | memoryview


class FramingError(Exception):
    """The byte stream broke the framing: nothing after this point can be trusted."""


@dataclass(slots=True)
class Frame:
    opcode: int
    flags: int
    request_id: int
    header: Buffer = b""
    payload: Buffer = b""
    header_format: int = HEADER_FORMAT_FLATBUFFERS

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def is_end(self) -> bool:
        return bool(self.flags & FLAG_END)

    @property
    def is_system_error(self) -> bool:
        return bool(self.flags & FLAG_SYSTEM_ERROR) and bool(self.flags & FLAG_RESPONSE)


@dataclass(frozen=True, slots=True)
class FrameDiscarded:
    """A frame the spec says to drop: ``reason`` is ``"bad_magic"`` or ``"unknown_opcode"``."""

    reason: str
    opcode: int
    flags: int
    request_id: int
    magic: int


@dataclass(frozen=True, slots=True)
class FrameCorrupt:
    """A well-framed frame the receiver cannot use: answer with a system error on its request id.

    ``reason`` is ``"crc_mismatch"`` or ``"header_format"``.
    """

    reason: str
    opcode: int
    flags: int
    request_id: int
    detail: str


Event = Frame | FrameDiscarded | FrameCorrupt


def _load_crc32() -> Callable[[Buffer, int], int]:
    """The payload CRC's function: ISA-L's (``isal.isal_zlib.crc32``, a dependency: the same
    CRC-32 as ``zlib.crc32``, 4x faster at 1 KiB and 15-25x from 64 KiB, measured; a catch-up read
    spent half its data-node time in ``zlib.crc32``), else zlib's when isal is not installed or
    ``SBPSTREAM_PURE_PYTHON=1`` is set (the tests run both)."""
    if os.environ.get("SBPSTREAM_PURE_PYTHON"):
        return zlib.crc32
    try:
        from isal.isal_zlib import crc32
    except ImportError:  # pragma: no cover - isal is a declared dependency
        return zlib.crc32
    fast: Callable[[Buffer, int], int] = crc32
    return fast


crc32: Final = _load_crc32()

# Both CRC functions release the GIL for more than 5 KiB; a thread that releases it waits up to a
# switch interval (5 ms) to get it back while another thread runs (the sync client's
# loop thread behind the caller's sends): larger parts go in slices of this size, under the GIL
CRC_SLICE_BYTES = 5 * 1024


def _crc(parts: Iterable[Buffer]) -> int:
    crc = 0
    for p in parts:
        mv = memoryview(p)
        n = mv.nbytes
        if n <= CRC_SLICE_BYTES:
            crc = crc32(mv, crc)
        else:
            mv = mv.cast("B")
            for i in range(0, n, CRC_SLICE_BYTES):
                crc = crc32(mv[i : i + CRC_SLICE_BYTES], crc)
    return crc


class ChecksummedPayload(list[Buffer]):
    """A payload's non-empty parts with their CRC-32 computed once: a frame sent to several peers
    (a replication round to every secondary) is checksummed once, not once per peer. The parts
    must not change afterwards."""

    __slots__ = ("crc",)

    def __init__(self, parts: Iterable[Buffer]) -> None:
        super().__init__(p for p in parts if len(memoryview(p)))
        self.crc = _crc(self)


def encode_frame_parts(
    opcode: int,
    request_id: int,
    flags: int,
    header: Buffer = b"",
    payload: Buffer | Sequence[Buffer] = b"",
    header_format: int = HEADER_FORMAT_FLATBUFFERS,
    *,
    max_frame_length: int = MAX_FRAME_LENGTH,
) -> list[Buffer]:
    """Encode one frame as a list of buffers for ``transport.writelines`` (payload not copied)."""
    parts: Sequence[Buffer]
    known_crc: int | None = None
    if isinstance(payload, ChecksummedPayload):
        parts, known_crc = payload, payload.crc
    elif isinstance(payload, bytes | bytearray | memoryview):
        parts = (payload,) if len(payload) else ()
    else:
        parts = [p for p in payload if len(p)]
    payload_len = sum(len(p) for p in parts)
    header_len = len(header)
    frame_length = FIXED_SIZE + header_len + payload_len
    if frame_length > max_frame_length:
        raise ValueError(f"frame of {frame_length} bytes exceeds the limit of {max_frame_length}")
    # A request's id has the top bit clear; a response echoes whatever id its request carried,
    # so that a request with the top bit set can still be answered (with a system error).
    max_id = MAX_U32 if flags & FLAG_RESPONSE else MAX_REQUEST_ID
    if not 0 <= request_id <= max_id:
        raise ValueError(f"request id {request_id} outside [0, {max_id}]")
    fixed = FIXED_STRUCT.pack(
        frame_length, MAGIC, opcode, flags, request_id, header_format, header_len.to_bytes(3, "big")
    )
    crc = known_crc if known_crc is not None else _crc(parts) if payload_len else 0
    out: list[Buffer] = [fixed + bytes(header)] if header_len else [fixed]
    out.extend(parts)
    out.append(CRC_STRUCT.pack(crc))
    return out


def encode_frame(
    opcode: int,
    request_id: int,
    flags: int,
    header: Buffer = b"",
    payload: Buffer | Sequence[Buffer] = b"",
    header_format: int = HEADER_FORMAT_FLATBUFFERS,
) -> bytes:
    """Encode one frame into a single bytes object (copies the payload; see encode_frame_parts)."""
    return b"".join(encode_frame_parts(opcode, request_id, flags, header, payload, header_format))


LARGE_FRAME_BYTES: Final = 64 * 1024
"""A frame at least this long that is not whole in the decoder's buffer is gathered as the list
of chunks read and joined once it is whole: one copy of its bytes, where the buffer takes two
(appending each chunk, then cutting the frame out of it). A 1,000-stream catch-up receives
~100 MB in 1 MiB frames."""


class FrameDecoder:
    """Incremental decoder: ``feed()`` any chunking of bytes, then drain ``next_event()``.

    Memory is bounded by ``max_frame_length`` plus one read chunk: the length is checked as soon as
    its 4 bytes arrive, before any of the body is buffered. A frame of ``large_frame_bytes`` or
    more is gathered chunk by chunk (see LARGE_FRAME_BYTES); its header and payload are then
    views of the joined bytes.
    """

    __slots__ = (
        "_broken",
        "_buf",
        "_have",
        "_known_opcodes",
        "_need",
        "_parts",
        "_pos",
        "corrupt",
        "discarded_bad_magic",
        "discarded_unknown_opcode",
        "frames",
        "large_frame_bytes",
        "max_frame_length",
    )

    def __init__(
        self,
        max_frame_length: int = MAX_FRAME_LENGTH,
        known_opcodes: frozenset[int] = KNOWN_OPCODES,
        large_frame_bytes: int = LARGE_FRAME_BYTES,
    ) -> None:
        self.max_frame_length = max_frame_length
        self.large_frame_bytes = large_frame_bytes
        self._known_opcodes = known_opcodes
        self._buf = bytearray()
        self._pos = 0
        self._need = 0  # body length of the frame being read, 0 while reading its length
        self._parts: list[bytes] | None = None  # chunks of a large frame being gathered
        self._have = 0  # bytes in _parts (the frame's length prefix included)
        self._broken: FramingError | None = None
        self.frames = 0
        self.discarded_bad_magic = 0
        self.discarded_unknown_opcode = 0
        self.corrupt = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos + (self._have if self._parts is not None else 0)

    def feed(self, data: Buffer) -> None:
        if self._broken is not None:
            raise self._broken
        if self._parts is not None:  # gathering a large frame: keep the chunk as it is
            self._parts.append(data if type(data) is bytes else bytes(data))
            self._have += len(data)
            return
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > 65536 and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_event(self) -> Event | None:
        """The next complete event, or None when more bytes are needed. Raises FramingError."""
        if self._broken is not None:
            raise self._broken
        if self._parts is not None:
            if self._have < 4 + self._need:
                return None
            whole = b"".join(self._parts)  # the frame (from its length prefix), then the rest
            self._parts = None
            self._have = 0
            self._buf = bytearray(memoryview(whole)[4 + self._need :])  # at most one chunk
            self._pos = 0
            return self._event(whole, 0)
        buf = self._buf
        avail = len(buf) - self._pos
        if self._need == 0:
            if avail < 4:
                return None
            (frame_length,) = LENGTH_STRUCT.unpack_from(buf, self._pos)
            if not MIN_FRAME_LENGTH <= frame_length <= self.max_frame_length:
                self._broken = FramingError(
                    f"frame length {frame_length} outside [{MIN_FRAME_LENGTH}, "
                    f"{self.max_frame_length}]"
                )
                raise self._broken
            self._need = frame_length
        if avail < 4 + self._need:
            if self._need >= self.large_frame_bytes:  # gather the rest chunk by chunk
                self._parts = [bytes(memoryview(buf)[self._pos :])]
                self._have = avail
                buf.clear()
                self._pos = 0
            return None
        return self._event(buf, self._pos)

    def _event(self, buf: bytes | bytearray, start: int) -> Event:
        """The frame of body length ``self._need`` whose length prefix is at ``start`` of
        ``buf``: the decoder's buffer (its body is copied out) or a large frame's joined bytes
        (its parts are views of them)."""
        frame_length = self._need
        end = start + 4 + frame_length
        self._need = 0
        _, magic, opcode, flags, request_id, fmt, hlen_b = FIXED_STRUCT.unpack_from(buf, start)
        header_len = int.from_bytes(hlen_b, "big")
        if header_len > frame_length - FIXED_SIZE:
            self._broken = FramingError(
                f"header length {header_len} exceeds frame length {frame_length} - 16"
            )
            raise self._broken
        if buf is self._buf:
            self._pos = end
        if magic != MAGIC:
            self.discarded_bad_magic += 1
            return FrameDiscarded("bad_magic", opcode, flags, request_id, magic)
        if opcode not in self._known_opcodes:
            self.discarded_unknown_opcode += 1
            return FrameDiscarded("unknown_opcode", opcode, flags, request_id, magic)
        if isinstance(buf, bytes):  # a large frame's own bytes: views, no copy
            mv = memoryview(buf)[start + FIXED_SIZE : end]
        else:
            # One copy (a bytearray slice would copy twice); the view is released before the
            # buffer is resized again, and the frame outlives the buffer.
            with memoryview(buf) as view:
                mv = memoryview(bytes(view[start + FIXED_SIZE : end]))
        payload_len = len(mv) - header_len - CRC_SIZE
        header = mv[:header_len]
        payload = mv[header_len : header_len + payload_len]
        (crc,) = CRC_STRUCT.unpack_from(mv, header_len + payload_len)
        expected = _crc((payload,)) if payload_len else 0
        if crc != expected:
            self.corrupt += 1
            return FrameCorrupt(
                "crc_mismatch",
                opcode,
                flags,
                request_id,
                f"payload CRC 0x{crc:08x} does not match computed 0x{expected:08x}",
            )
        if fmt != HEADER_FORMAT_FLATBUFFERS:
            self.corrupt += 1
            return FrameCorrupt(
                "header_format", opcode, flags, request_id, f"unsupported header format {fmt}"
            )
        self.frames += 1
        return Frame(opcode, flags, request_id, header, payload, fmt)

    def events(self) -> list[Event]:
        """Drain every complete event now buffered."""
        out: list[Event] = []
        while (ev := self.next_event()) is not None:
            out.append(ev)
        return out
