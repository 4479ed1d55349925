"""Bytes on the wire, below every codec: frames built field by field (any field any value,
which ``encode_frame`` refuses) and a blocking socket peer that reads back decoded frames. One
copy for the tests that feed servers bad or hand-made input."""

from __future__ import annotations

import socket
import struct
import zlib
from collections.abc import Callable
from typing import Final

from sbpstream.protocol.frame import MAGIC, Frame, FrameDecoder, encode_frame
from sbpstream.protocol.messages import SystemErrorResponse
from sbpstream.protocol.opcodes import Opcode

SOCKET_TIMEOUT_S: Final = 10.0
"""Bound of each blocking connect and recv (a server answers in milliseconds)."""


def raw_frame(opcode: int, request_id: int, header: bytes = b"", payload: bytes = b"", *,
              flags: int = 0, magic: int = MAGIC, header_format: int = 1,
              header_length: int | None = None, crc: int | None = None,
              crc_ok: bool = True) -> bytes:
    """A frame built field by field: the length and CRC are right unless told (``crc`` a value,
    ``crc_ok=False`` a wrong one)."""
    hlen = len(header) if header_length is None else header_length
    c = (zlib.crc32(payload) if payload else 0) if crc is None else crc
    if not crc_ok:
        c ^= 0x5A5A5A5A
    fixed = struct.pack(">IBHBIB3s", 16 + len(header) + len(payload), magic, opcode, flags,
                        request_id, header_format, hlen.to_bytes(3, "big"))
    return fixed + header + payload + struct.pack(">I", c)


def system_error_code(frame: Frame) -> int:
    """The status code of a system-error response frame (asserted one)."""
    assert frame.is_system_error, frame
    return SystemErrorResponse.decode(frame.header).status.code


class RawPeer:
    """A blocking raw socket client: send any bytes, half-close, read decoded frames (each recv
    bounded by ``timeout_s``)."""

    def __init__(self, address: str, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.decoder = FrameDecoder()
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def half_close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def read_until(self, done: Callable[[list[Frame]], bool]) -> list[Frame]:
        """Frames until ``done(frames)`` holds or EOF."""
        out: list[Frame] = []
        while not done(out):
            ev = self.decoder.next_event()
            if ev is not None:
                assert isinstance(ev, Frame), ev
                out.append(ev)
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                self.eof = True
                break
            self.decoder.feed(chunk)
        return out

    def frames(self, n: int) -> list[Frame]:
        """The next ``n`` frames (fewer at EOF)."""
        return self.read_until(lambda out: len(out) >= n)

    def read_to_eof(self) -> list[Frame]:
        return self.read_until(lambda _frames: False)

    def ping_ok(self, request_id: int = 99) -> bool:
        """A PING is answered (the server still serves this connection)."""
        self.send(encode_frame(Opcode.PING, request_id, 0, b"", b"hi"))
        f = self.frames(1)
        return bool(f) and f[0].opcode == Opcode.PING and f[0].request_id == request_id

    def close(self) -> None:
        self.sock.close()
