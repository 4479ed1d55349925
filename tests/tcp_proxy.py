"""A TCP proxy a test controls, for fault injection between a client and a real server.

Runs on the test's event loop. ``cut()`` closes every open connection and closes each new one
at once (a partition); ``heal()`` lets new connections through again.

Besides the partition, each direction of a connection can carry a :class:`Fault`, set with
``set_faults(up=..., down=...)`` (``up`` is client to server, ``down`` server to client) and
taken by every connection accepted afterwards (connections already open keep theirs):

* ``delay_s``: every chunk is held that long before it is forwarded (added latency, order kept);
* ``truncate_after``: after that many bytes the proxy forwards nothing more and closes both
  sides (a peer dying mid-frame);
* ``flip_at``: the byte at that position of the direction's byte stream is inverted (XOR 0xFF)
  once, everything else passes unchanged (corruption on the wire).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from sbpstream.net.ports import free_port

CHUNK_BYTES = 65536


@dataclass(frozen=True, slots=True)
class Fault:
    delay_s: float = 0.0
    truncate_after: int | None = None
    flip_at: int | None = None


NO_FAULT = Fault()


class TcpProxy:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.cut_off = False
        self.up = NO_FAULT
        self.down = NO_FAULT
        self.truncated = 0
        """Connections closed by a ``truncate_after`` fault."""
        self.flipped = 0
        """Bytes inverted by a ``flip_at`` fault."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    def set_faults(self, *, up: Fault = NO_FAULT, down: Fault = NO_FAULT) -> None:
        """Faults of the connections accepted from now on (``set_faults()`` clears them)."""
        self.up, self.down = up, down

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.cut_off:
            w.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self._writers.update((w, uw))
        both = (w, uw)
        for src, dst, fault in ((r, uw, self.up), (ur, w, self.down)):
            t = asyncio.ensure_future(self._pipe(src, dst, fault, both))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, fault: Fault,
                    both: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        passed = 0
        try:
            while not self.cut_off:
                data = await src.read(CHUNK_BYTES)
                if not data:
                    break
                if fault.delay_s > 0:
                    await asyncio.sleep(fault.delay_s)
                if fault.flip_at is not None and passed <= fault.flip_at < passed + len(data):
                    buf = bytearray(data)
                    buf[fault.flip_at - passed] ^= 0xFF
                    data = bytes(buf)
                    self.flipped += 1
                if fault.truncate_after is not None and passed + len(data) >= fault.truncate_after:
                    dst.write(data[: fault.truncate_after - passed])
                    with contextlib.suppress(ConnectionError, OSError):
                        await dst.drain()
                    self.truncated += 1
                    for writer in both:  # the peer died mid-stream: both sides see EOF
                        writer.close()
                    break
                passed += len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    def cut(self) -> None:
        self.cut_off = True
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def heal(self) -> None:
        self.cut_off = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
