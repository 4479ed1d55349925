"""The data node's calls to the Placement Manager, following PM_NOT_LEADER redirects.

``--pm`` lists every PM address. A call goes to the current one; on a connection failure or a
timeout it moves to the next; on PM_NOT_LEADER (as a system error frame or as the response's
top-level status) it moves to the leader named in ``detail`` (or the next address when empty).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from sbpstream.datanode.limits import MAX_PM_REDIRECTS, PM_CALL_TIMEOUT_S
from sbpstream.net.client import ConnectionPool
from sbpstream.protocol.errors import (
    ClientTimeoutError,
    ConnectionClosedError,
    ErrorKind,
    NoPmReachableError,
    SbpError,
    ShuttingDownError,
    kind_of,
)
from sbpstream.protocol.messages import Message

log = logging.getLogger("sbpstream.datanode.pm")

R = TypeVar("R", bound=Message)


class PmClient:
    def __init__(self, addresses: tuple[str, ...], pool: ConnectionPool) -> None:
        self.addresses = list(addresses)
        self._current = 0
        self._pool = pool

    @property
    def current(self) -> str:
        return self.addresses[self._current % len(self.addresses)]

    def _move(self, leader: str) -> None:
        if leader:
            if leader not in self.addresses:
                self.addresses.append(leader)
            self._current = self.addresses.index(leader)
        else:
            self._current = (self._current + 1) % len(self.addresses)

    async def call(self, request: Message, response_cls: type[R],
                   timeout_s: float = PM_CALL_TIMEOUT_S) -> R:
        """Send ``request`` to the leader PM; return its decoded (last) response frame.

        A top-level error status other than PM_NOT_LEADER is returned as is (the caller reads
        per-item and top-level statuses); unreachable PMs raise NoPmReachableError."""
        return (await self.call_frames(request, response_cls, timeout_s))[-1]

    async def call_frames(self, request: Message, response_cls: type[R],
                          timeout_s: float = PM_CALL_TIMEOUT_S) -> list[R]:
        """Like :meth:`call`, for responses the PM may stream over several frames."""
        attempts = max(len(self.addresses), 1) + MAX_PM_REDIRECTS
        last: Exception | None = None
        for _ in range(attempts):
            addr = self.current
            try:
                conn = await self._pool.get(addr)
                frames = await conn.request(request.OPCODE, request.encode(),
                                            timeout_s=timeout_s)
                resps = []
                for f in frames:  # a node's whole listing: yield between frames
                    resps.append(response_cls.decode(f.header))
                    if len(frames) > 1:
                        await asyncio.sleep(0)
            except (ConnectionClosedError, ClientTimeoutError, ShuttingDownError, OSError) as exc:
                last = exc
                self._pool.discard(addr)
                self._move("")
                continue
            except SbpError as exc:
                if not exc.redirect:  # PM_NOT_LEADER, or FENCED_LEADER from a deposed leader
                    raise
                last = exc
                self._move(exc.detail.decode("utf-8", "replace"))
                continue
            status = getattr(resps[-1], "status", None) if resps else None
            if status is not None and status.code and kind_of(status.code) is ErrorKind.REDIRECT:
                last = status.error()
                self._move(status.detail.decode("utf-8", "replace"))
                continue
            if not resps:
                raise NoPmReachableError(f"empty response from PM {addr}")
            return resps
        raise NoPmReachableError(f"no leader PM reachable among {self.addresses}: {last}")
