"""The part of a connection that server and client share: decoding, writing, back-pressure.

One :class:`FrameProtocol` per TCP connection. Reading: every chunk goes through the sans-I/O
:class:`~sbpstream.protocol.frame.FrameDecoder`; events are handed to ``on_event``. Writing:
``write_frame`` queues the frame on the transport and, when the transport's buffer is past its
high-water mark (the peer is not reading), awaits until it drains: a sender never buffers past
the cap. Unacknowledged payload is bounded per subscription, not per connection
(``datanode/subscribe.py``, BUFFER_ACK).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import cast

from sbpstream.protocol.frame import (
    Buffer,
    Event,
    FrameDecoder,
    FramingError,
    encode_frame_parts,
)
from sbpstream.protocol.limits import (
    MAX_FRAME_LENGTH,
    WRITE_BUFFER_HIGH_WATER,
    WRITE_BUFFER_LOW_WATER,
)

log = logging.getLogger("sbpstream.net")


class FrameProtocol(asyncio.Protocol):
    """Base protocol: subclasses implement ``on_event`` and ``on_close``."""

    def __init__(self, max_frame_length: int = MAX_FRAME_LENGTH) -> None:
        self.decoder = FrameDecoder(max_frame_length)
        self.max_frame_length = max_frame_length
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # set at the first framing error: nothing read after it can be trusted, so later bytes
        # are counted and dropped while the connection finishes what it already accepted
        self.input_broken = False
        self.close_reason: BaseException | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._read_pause_reasons: set[str] = set()
        self.bytes_in = 0
        self.bytes_out = 0
        self.peer = ""
        self.closed_event = asyncio.Event()

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the Transport interface without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(WRITE_BUFFER_HIGH_WATER, WRITE_BUFFER_LOW_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def data_received(self, data: bytes) -> None:
        self.bytes_in += len(data)
        if self.input_broken:
            return
        try:
            self.decoder.feed(data)
        except FramingError as exc:
            self._framing_error(exc)
            return
        self.process_events()

    def process_events(self) -> None:
        """Hand buffered events to ``on_event`` while ``can_accept_event()`` allows.

        While it does not, reading pauses (reason ``held``) with bytes left in the decoder, so
        what is held back is at most one read chunk: whoever made ``can_accept_event()`` false
        calls this again when it turns true, which resumes reading once the decoder is empty."""
        try:
            while not self.closed and not self.input_broken:
                if not self.can_accept_event():
                    if self.decoder.buffered_bytes:
                        self.pause_reading("held")
                    return
                ev = self.decoder.next_event()
                if ev is None:
                    self.resume_reading("held")
                    return
                self.on_event(ev)
        except FramingError as exc:
            self._framing_error(exc)

    def _framing_error(self, exc: FramingError) -> None:
        if self.input_broken:
            return
        self.input_broken = True
        self.on_framing_error(exc)

    def can_accept_event(self) -> bool:
        """False holds further events in the decoder (with reading paused) until called again."""
        return True

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drainers(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.close_reason is None:
            self.close_reason = exc or ConnectionResetError("connection closed")
        self._wake_drainers(self.close_reason)
        self.closed_event.set()
        self.on_close(self.close_reason)

    # ---- hooks
    def on_event(self, event: Event) -> None:
        raise NotImplementedError

    def on_close(self, exc: BaseException) -> None:
        raise NotImplementedError

    def on_framing_error(self, exc: FramingError) -> None:
        """Called once, at the first framing error; ``input_broken`` is already set."""
        log.warning("event=framing_error peer=%s error=%r", self.peer, str(exc))
        self.abort(exc)

    # ---- writing
    def _wake_drainers(self, exc: BaseException | None) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            if not w.done():
                if exc is None:
                    w.set_result(None)
                else:
                    w.set_exception(ConnectionResetError(str(exc)))

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError(f"connection to {self.peer} closed")
        if not self._write_paused:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        await fut

    def write_frame_nowait(
        self,
        opcode: int,
        request_id: int,
        flags: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
    ) -> int:
        """Queue one frame; returns its wire size. Raises if the connection is closed."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} closed")
        parts = encode_frame_parts(
            opcode, request_id, flags, header, payload, max_frame_length=self.max_frame_length
        )
        size = sum(len(p) for p in parts)
        self.transport.writelines(parts)
        self.bytes_out += size
        return size

    async def write_frame(
        self,
        opcode: int,
        request_id: int,
        flags: int,
        header: Buffer = b"",
        payload: Buffer | Sequence[Buffer] = b"",
    ) -> int:
        await self.drain()
        return self.write_frame_nowait(opcode, request_id, flags, header, payload)

    # ---- read back-pressure
    def pause_reading(self, reason: str) -> None:
        if not self._read_pause_reasons and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self._read_pause_reasons.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason not in self._read_pause_reasons:
            return
        self._read_pause_reasons.discard(reason)
        if not self._read_pause_reasons and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    @property
    def reading_paused(self) -> bool:
        return bool(self._read_pause_reasons)

    # ---- closing
    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self, exc: BaseException | None = None) -> None:
        if exc is not None and self.close_reason is None:
            self.close_reason = exc
        if self.transport is not None:
            self.transport.abort()
