"""The client side of INFO, STATS, CONNECTIONS and WHOAMI: one request on its own connection.

Used by the CLI (``sbpstream info|stats|connections|whoami|nodes|top``). The response header is
checked (a non-OK status raises) and the JSON payload is returned with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final, TypeVar

from sbpstream.introspect.figures import JSON
from sbpstream.net.client import Connection
from sbpstream.protocol.messages import (
    ConnectionsRequest,
    ConnectionsResponse,
    InfoRequest,
    InfoResponse,
    Message,
    StatsRequest,
    StatsResponse,
    Status,
    WhoamiRequest,
    WhoamiResponse,
)

CALL_TIMEOUT_S: Final = 10.0
"""A PM's cluster view asks every data node (2 s each, in parallel): 10 s is ample."""

R = TypeVar("R", bound=Message)


class Introspection:
    """One connection to a PM or data node; ``async with Introspection(addr) as i: ...``."""

    def __init__(self, address: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._conn: Connection | None = None

    async def __aenter__(self) -> Introspection:
        self._conn = await Connection.open(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._conn.aclose()

    async def _call(self, req: Message, resp_cls: type[R]) -> tuple[R, JSON]:
        assert self._conn is not None, "use `async with`"
        frame = await self._conn.request_one(req.OPCODE, req.encode(), timeout_s=self.timeout_s)
        resp = resp_cls.decode(frame.header)
        status = getattr(resp, "status", None)
        if isinstance(status, Status):
            status.raise_for_error()
        body: JSON = json.loads(bytes(frame.payload)) if len(frame.payload) else {}
        return resp, body

    async def info(self) -> tuple[InfoResponse, JSON]:
        return await self._call(InfoRequest(), InfoResponse)

    async def stats(self, stream_ids: Sequence[int] = (), top: int = 0
                    ) -> tuple[StatsResponse, JSON]:
        return await self._call(StatsRequest(stream_ids=tuple(stream_ids), top=top),
                                StatsResponse)

    async def connections(self, limit: int = 0) -> tuple[ConnectionsResponse, JSON]:
        return await self._call(ConnectionsRequest(limit=limit), ConnectionsResponse)

    async def whoami(self) -> tuple[WhoamiResponse, JSON]:
        return await self._call(WhoamiRequest(), WhoamiResponse)
