"""One process's figures and the wire handlers of INFO, STATS, CONNECTIONS and WHOAMI.

:class:`Introspector` is built by the PM and the data node around their :class:`Server`. It reads
the counters the connection layer keeps (per opcode: requests, bytes in and out, errors; per
connection: id, peer, age, bytes, requests), ticks a :class:`~.rates.RateWindow` for the
per-minute figures, and asks a :class:`StreamSource` for STATS (a data node's own streams, or the
PM's cluster-wide view). Every figure is a JSON-ready ``dict``: the same object goes out as the
payload of the opcode's response and as the body of the ``/v1/...`` HTTP route.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol

from sbpstream.introspect.counters import peek_connection_counters
from sbpstream.introspect.rates import SAMPLE_EVERY_S, RateWindow
from sbpstream.net.server import Handler, Request, Responder, Server, ServerConnection
from sbpstream.protocol.messages import (
    MAX_ITEMS_PER_REQUEST,
    ClientRole,
    ConnectionsRequest,
    ConnectionsResponse,
    InfoResponse,
    StatsRequest,
    StatsResponse,
    WhoamiResponse,
)
from sbpstream.protocol.opcodes import Opcode

JSON = dict[str, Any]

DEFAULT_TOP: Final = 20
"""STATS without stream ids: this many streams, highest rates first."""
MAX_TOP: Final = MAX_ITEMS_PER_REQUEST
"""At most this many streams in one STATS answer (a few hundred bytes of JSON each: MiBs)."""
DEFAULT_CONNECTIONS: Final = 1000
"""CONNECTIONS without a limit lists this many; the count in the header is always exact."""

ATTR_ROLE: Final = "role"
ATTR_CLIENT_ID: Final = "client_id"
"""Keys of ``ServerConnection.attributes`` that a HEARTBEAT sets on the PM (pm/server.py)."""


def package_version() -> str:
    try:
        return version("sbpstream")
    except PackageNotFoundError:
        return "0+unknown"


def dumps(obj: JSON) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


Visible = Callable[[Sequence[tuple[int, str | None]]], Awaitable[list[bool]]]
"""Which of these (stream id, name; None: not at hand) the asker may see, in order."""


class StreamSource(Protocol):
    """Where STATS comes from: a data node's own streams, or the PM's cluster view."""

    def tick(self, now: float) -> None: ...

    async def stats(self, stream_ids: Sequence[int], top: int) -> list[JSON]: ...

    def totals(self) -> JSON:
        """Figures of the whole source for INFO ({} when it has none of its own)."""
        ...


def connection_figures(conn: ServerConnection, now: float) -> JSON:
    role = conn.attributes.get(ATTR_ROLE)
    counted = peek_connection_counters(conn.attributes)
    return {
        "id": conn.connection_id,
        "peer": conn.peer,
        "client_id": str(conn.attributes.get(ATTR_CLIENT_ID, "")),
        "client_role": ClientRole(role).name if isinstance(role, int) else "UNSPECIFIED",
        "connected_at_ms": conn.connected_at_ms,
        "age_s": round(now - conn.connected_mono, 3),
        "bytes_in": conn.bytes_in,
        "bytes_out": conn.bytes_out,
        "requests": conn.requests,
        "requests_in_flight": len(conn.tasks),
        # counted where they happen: a data node's subscribe.py and sessions.py, the quota
        # charge (datanode/quota.py); a PM holds none (0)
        "subscriptions": counted.subscriptions,
        "sessions": counted.sessions,
        "throttle_time_ms": counted.throttle_time_ms,
    }


class Introspector:
    """The four opcodes' figures for one server; ``handlers()`` registers them."""

    def __init__(
        self,
        server: Server,
        role: str,
        *,
        streams: StreamSource | None = None,
        node_id: Callable[[], int] = lambda: -1,
        extra_info: Callable[[], Awaitable[JSON]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server = server
        self.role = role
        self.streams = streams
        self.node_id = node_id
        self.extra_info = extra_info
        self.clock = clock
        self.version = package_version()
        self.opcode_rates: RateWindow[int] = RateWindow(clock())
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._ticks())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            self.tick()

    def tick(self) -> None:
        now = self.clock()
        self.opcode_rates.take(now, {
            op: (c.requests, c.bytes_in, c.bytes_out, c.errors)
            for op, c in self.server.stats.by_opcode.items()
        })
        if self.streams is not None:
            self.streams.tick(now)

    # ------------------------------------------------------------------ figures
    def uptime_ms(self) -> int:
        return int((self.clock() - self.server.started_mono) * 1000)

    async def info(self) -> JSON:
        now = self.clock()
        st = self.server.stats
        ops: JSON = {}
        total = [0, 0, 0, 0]
        total_pm = [0, 0, 0, 0]
        for op, c in sorted(st.by_opcode.items()):
            cur = (c.requests, c.bytes_in, c.bytes_out, c.errors)
            pm = self.opcode_rates.per_minute(now, op, cur)
            ops[Opcode(op).name] = _four(cur, pm)
            total = [a + b for a, b in zip(total, cur, strict=True)]
            total_pm = [a + b for a, b in zip(total_pm, pm, strict=True)]
        out: JSON = {
            "role": self.role,
            "version": self.version,
            "node_id": self.node_id(),
            "address": self.server.address,
            "uptime_ms": self.uptime_ms(),
            "now_ms": int(time.time() * 1000),
            "connections_open": len(self.server.connections),
            "connections_accepted": st.connections_accepted,
            "connections_rejected": st.connections_rejected,
            "totals": _four(tuple(total), tuple(total_pm)),
            "opcodes": ops,
            "frames_discarded": st.frames_discarded_bad_magic + st.frames_discarded_unknown_opcode,
            "frames_corrupt": st.frames_corrupt,
            "framing_errors": st.framing_errors,
        }
        if self.streams is not None:  # a data node: what it served, in all
            out.update(self.streams.totals())
        if self.extra_info is not None:
            out.update(await self.extra_info())
        return out

    def connections(self, limit: int = 0) -> JSON:
        limit = limit if limit > 0 else DEFAULT_CONNECTIONS
        now = self.clock()
        conns = sorted(self.server.connections, key=lambda c: c.connection_id)
        return {
            "connection_count": len(conns),
            "connections": [connection_figures(c, now) for c in conns[:limit]],
        }

    async def stats(self, stream_ids: Sequence[int] = (), top: int = 0) -> JSON:
        if self.streams is None:
            return {"streams": []}
        top = min(top if top > 0 else DEFAULT_TOP, MAX_TOP)
        return {"streams": await self.streams.stats(stream_ids, top)}

    # ------------------------------------------------------------------ wire
    def handlers(self) -> dict[int, Handler]:
        return {Opcode.INFO: self._info, Opcode.STATS: self._stats,
                Opcode.CONNECTIONS: self._connections, Opcode.WHOAMI: self._whoami}

    async def _info(self, req: Request, resp: Responder) -> None:
        body = await self.info()
        hdr = InfoResponse(role=self.role, version=self.version, uptime_ms=body["uptime_ms"],
                           node_id=self.node_id())
        await resp.send(hdr.encode(), dumps(body))

    async def _stats(self, req: Request, resp: Responder) -> None:
        r = StatsRequest.decode(req.header)
        body = await self.stats(r.stream_ids, r.top)
        await resp.send(StatsResponse(stream_count=len(body["streams"])).encode(), dumps(body))

    async def _connections(self, req: Request, resp: Responder) -> None:
        r = ConnectionsRequest.decode(req.header)
        body = self.connections(r.limit)
        hdr = ConnectionsResponse(connection_count=body["connection_count"])
        await resp.send(hdr.encode(), dumps(body))

    async def _whoami(self, req: Request, resp: Responder) -> None:
        me = connection_figures(req.conn, self.clock())
        hdr = WhoamiResponse(connection_id=me["id"], peer=me["peer"], client_id=me["client_id"],
                             client_role=ClientRole[me["client_role"]])
        await resp.send(hdr.encode(), dumps(me))


def _four(cur: Sequence[int], pm: Sequence[int]) -> JSON:
    names = ("requests", "bytes_in", "bytes_out", "errors")
    out: JSON = dict(zip(names, cur, strict=True))
    out["per_minute"] = dict(zip(names, pm, strict=True))
    return out


def rate_key(row: JSON) -> int:
    """A STATS row's sort key for ``top``: its bytes appended and fetched per minute."""
    pm = row["per_minute"]
    return int(pm["bytes_appended"]) + int(pm["bytes_fetched"])
