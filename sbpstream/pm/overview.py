"""The PM's view of the cluster: nodes, streams with traffic, under-replicated ranges, clients.

Metadata and liveness are the PM's own (liveness as :meth:`PmService.node_liveness` tells it:
first hand at the leader, at an etcd follower from the heartbeat times the leader persisted);
traffic is the data nodes': STATS at every live node (one request each, in parallel, bounded
by :data:`DN_STATS_TIMEOUT_S`), summed per stream (each record is counted once, by the primary
that appended it; secondaries count it as replicated).
A node that does not answer in time is left out of the figures and named in ``unreachable``.

Everything here is read-only, walks at most :data:`VIEW_MAX_STREAMS` streams, and runs on demand
(a CLI call, an HTTP request, the console's refresh), never on a request path.

With auth on, the admin HTTP routes (:mod:`sbpstream.introspect.http`) decide who sees what
before calling here: :meth:`ClusterOverview.stats` keeps only the streams its ``visible`` filter
allows (the caller's ``describe``, checked by the SBP gate's code), and :meth:`ClusterOverview.tail`
reads the records with the caller's own token, so the data node's gate checks ``fetch`` too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from sbpstream.introspect.counters import RATED
from sbpstream.introspect.figures import ATTR_ROLE, JSON, MAX_TOP, Visible, connection_figures
from sbpstream.pm import metadata as md
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.messages import (
    ClientRole,
    FetchItem,
    FetchRequest,
    FetchResponse,
    StatsRequest,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import iter_records

if TYPE_CHECKING:
    from sbpstream.net.client import Connection, ConnectionPool
    from sbpstream.net.server import Server
    from sbpstream.pm.liveness import NodeLiveness
    from sbpstream.pm.service import PmService

VIEW_MAX_STREAMS: Final = 10_000
"""The cluster view walks at most this many streams (lowest ids first) for its totals and its
under-replicated ranges; ``streams_truncated`` says when there were more."""
DN_STATS_TIMEOUT_S: Final = 2.0
"""A data node's STATS answer: it is an in-memory walk; a node this slow is left out."""
TAIL_MAX_RECORDS: Final = 100
"""The latest records of a stream shown at most (the console shows a bounded tail)."""
TAIL_MAX_BYTES: Final = 1 << 20
"""Bytes fetched for a tail at most; a record value is cut to TAIL_VALUE_CHARS characters."""
TAIL_VALUE_CHARS: Final = 1000
_PAGE: Final = 1000



def _text(b: memoryview | None) -> str | None:
    if b is None:
        return None
    return bytes(b[: TAIL_VALUE_CHARS * 4]).decode("utf-8", "replace")[:TAIL_VALUE_CHARS]


class ClusterOverview:
    def __init__(self, service: PmService, pool: ConnectionPool, server: Server) -> None:
        self.service = service
        self.pool = pool
        self.server = server

    # ------------------------------------------------------------------ metadata walks
    async def _streams(self) -> tuple[list[md.StreamMeta], bool]:
        out: list[md.StreamMeta] = []
        after = -1
        while len(out) < VIEW_MAX_STREAMS:
            page = await self.service.meta.list_streams(after, _PAGE)
            out.extend(page)
            if len(page) < _PAGE:
                return out[:VIEW_MAX_STREAMS], False
            after = page[-1].stream_id
        return out[:VIEW_MAX_STREAMS], True

    async def _ranges(self, ids: Sequence[int]) -> list[list[md.RangeMeta]]:
        out: list[list[md.RangeMeta]] = []
        for i in range(0, len(ids), _PAGE):
            out.extend(await self.service.meta.list_ranges(ids[i : i + _PAGE]))
        return out

    async def _nodes(self) -> dict[int, NodeLiveness]:
        return {n.node_id: n for n in await self.service.node_liveness()}

    # ------------------------------------------------------------------ nodes
    async def overview(self) -> JSON:
        """Nodes with liveness, last heartbeat, their REPORT_METRICS and range counts, whether
        they are draining and (draining ones) how many ranges still list them; under-replicated
        ranges; live clients."""
        liveness = await self.service.node_liveness()
        live_ids = {n.node_id for n in liveness if n.live}
        streams, truncated = await self._streams()
        want = {s.stream_id: s.replica_nums for s in streams}
        per_node: dict[int, list[int]] = {}  # node_id -> [ranges, writable, primary]
        under: list[JSON] = []
        for rs in await self._ranges(list(want)):
            for r in rs:
                for rep in r.replicas:
                    c = per_node.setdefault(rep.node_id, [0, 0, 0])
                    c[0] += 1
                    c[1] += r.writable
                    c[2] += rep.is_primary
                live = [rep.node_id for rep in r.replicas if rep.node_id in live_ids]
                if len(live) < want[r.stream_id]:
                    under.append({"stream_id": r.stream_id, "range_index": r.range_index,
                                  "replicas": list(r.node_ids), "live_replicas": live,
                                  "replica_nums": want[r.stream_id], "writable": r.writable})
        # draining nodes (pm/drain.py): the mark from the metadata (a follower's too), and
        # the ranges still listing the node, counted whole (not only the walked streams)
        draining = {n.node_id for n in await self.service.meta.list_nodes() if n.draining}
        left = {nid: len(await self.service.meta.list_node_ranges(nid))
                for nid in sorted(draining)}
        nodes: list[JSON] = []
        for st in liveness:
            c = per_node.get(st.node_id, [0, 0, 0])
            nodes.append({
                "node_id": st.node_id, "host": st.host, "address": st.advertise_addr,
                "live": st.live, "dead": st.dead,
                "last_heartbeat_s": None if st.heard_s_ago is None
                else round(st.heard_s_ago, 3),
                "metrics": None if st.metrics is None else st.metrics.to_dict(),
                "ranges": c[0], "writable_ranges": c[1], "primary_ranges": c[2],
                "draining": st.node_id in draining,
                "ranges_left": left.get(st.node_id),
            })
        mono = time.monotonic()
        clients = [connection_figures(c, mono) for c in
                   sorted(self.server.connections, key=lambda c: c.connection_id)
                   if c.attributes.get(ATTR_ROLE) == ClientRole.CLIENT]
        return {"nodes": nodes, "under_replicated": under, "clients": clients,
                "stream_count": len(streams), "streams_truncated": truncated}

    # ------------------------------------------------------------------ streams
    async def _node_stats(self, address: str, ids: Sequence[int]) -> list[JSON]:
        conn = await self.pool.get(address)
        req = StatsRequest(stream_ids=tuple(ids), top=MAX_TOP)
        frame = await conn.request_one(Opcode.STATS, req.encode(),
                                       timeout_s=DN_STATS_TIMEOUT_S)
        rows: list[JSON] = json.loads(bytes(frame.payload))["streams"]
        return rows

    async def _traffic(self, ids: Sequence[int]) -> tuple[dict[int, list[JSON]], list[int]]:
        """Every live node's STATS rows, by stream; and the nodes that did not answer."""
        nodes = [st for st in await self.service.node_liveness() if st.live]
        got = await asyncio.gather(*(self._node_stats(st.advertise_addr, ids) for st in nodes),
                                   return_exceptions=True)
        by_stream: dict[int, list[JSON]] = {}
        unreachable: list[int] = []
        for st, rows in zip(nodes, got, strict=True):
            if isinstance(rows, BaseException):
                if not isinstance(rows, SbpError | OSError | TimeoutError | ValueError):
                    raise rows
                unreachable.append(st.node_id)
                continue
            for row in rows:
                row["node_id"] = st.node_id
                by_stream.setdefault(int(row["stream_id"]), []).append(row)
        return by_stream, unreachable

    @staticmethod
    def _merge(s: md.StreamMeta, ranges: list[md.RangeMeta], rows: list[JSON]) -> JSON:
        total: dict[str, Any] = {k: sum(int(r[k]) for r in rows) for k in RATED}
        pm = {k: sum(int(r["per_minute"][k]) for r in rows) for k in RATED}
        meta_next = max((r.next_offset for r in ranges), default=s.start_offset)
        return {
            "stream_id": s.stream_id, "replica_nums": s.replica_nums,
            "retention_period_ms": s.retention_period_ms,
            **total, "per_minute": pm,
            "start_offset": s.start_offset,
            "next_offset": max([meta_next, *(int(r["next_offset"]) for r in rows)]),
            "ranges": len(ranges),
            "bytes_stored": _stored_bytes(rows),
            "last_append_ms": max((int(r["last_append_ms"]) for r in rows), default=0),
        }

    async def stats(self, stream_ids: Sequence[int], top: int,
                    visible: Visible | None = None) -> list[JSON]:
        """STATS on the PM: the named streams, or the ``top`` by rate, across the cluster;
        only those ``visible`` allows, when given."""
        if stream_ids:
            metas = [s for s in await self.service.meta.get_streams(list(stream_ids))
                     if s is not None and not s.deleted]
        else:
            metas, _ = await self._streams()
        if visible is not None:
            shown = await visible([(s.stream_id, s.name) for s in metas])
            metas = [s for s, ok in zip(metas, shown, strict=True) if ok]
            if not metas:
                return []
        ids = [s.stream_id for s in metas]
        ranges = await self._ranges(ids)
        traffic, _ = await self._traffic(ids if stream_ids else ())
        rows = [self._merge(s, rs, traffic.get(s.stream_id, []))
                for s, rs in zip(metas, ranges, strict=True)]
        if not stream_ids:
            rows.sort(key=lambda r: (-(r["per_minute"]["bytes_appended"]
                                       + r["per_minute"]["bytes_fetched"]), r["stream_id"]))
            rows = rows[:top]
        return rows

    def totals(self) -> JSON:
        return {}  # the cluster's figures are per node and per stream

    def tick(self, now: float) -> None:
        """Rates are the data nodes' (nothing to sample here)."""

    async def stream(self, stream_id: int) -> JSON | None:
        """One stream: its figures, its ranges with replicas and their liveness, per-node rows."""
        got = await self.service.meta.get_streams([stream_id])
        s = got[0]
        if s is None or s.deleted:
            return None
        (ranges,) = await self._ranges([stream_id])
        traffic, unreachable = await self._traffic([stream_id])
        rows = traffic.get(stream_id, [])
        nodes = await self._nodes()
        out = self._merge(s, ranges, rows)
        held_next: dict[int, int] = {}  # the data nodes' live next offsets (the PM's lag)
        for row in rows:
            for hr in row["ranges"]:
                idx = int(hr["range_index"])
                held_next[idx] = max(held_next.get(idx, -1), int(hr["next_offset"]))
        out["ranges"] = [{
            "range_index": r.range_index, "start_offset": r.start_offset,
            "next_offset": max(r.next_offset, held_next.get(r.range_index, -1)),
            "end_offset": r.end_offset, "writable": r.writable,
            "replicas": [{"node_id": rep.node_id, "primary": rep.is_primary,
                          "address": _address(nodes, rep.node_id),
                          "live": _live(nodes, rep.node_id)} for rep in r.replicas],
        } for r in ranges]
        out["nodes"] = rows
        out["unreachable"] = unreachable
        return out

    async def tail(self, stream_id: int, n: int, token: str | None = None) -> JSON | None:
        """The latest ``n`` records (at most TAIL_MAX_RECORDS) of the stream's last range, read
        from a live replica with one FETCH; keys and values as text (invalid UTF-8 replaced).
        ``token``: read on a connection of its own authenticated with it (the asker's), not
        with the PM's; an item the data node refuses raises its error."""
        n = max(1, min(n, TAIL_MAX_RECORDS))
        got = await self.service.meta.get_streams([stream_id])
        if got[0] is None or got[0].deleted:
            return None
        (ranges,) = await self._ranges([stream_id])
        nodes = await self._nodes()
        out: JSON = {"stream_id": stream_id, "records": []}
        if not ranges:
            return out
        last = ranges[-1]
        live = sorted((not rep.is_primary, rep.node_id) for rep in last.replicas
                      if _live(nodes, rep.node_id))
        if not live:
            out["error"] = "no live replica holds the stream's last range"
            return out
        address = _address(nodes, live[0][1])
        if token is None:
            conn = await self.pool.get(address)
            return await self._tail_from(conn, out, last, stream_id, n)
        from sbpstream.auth.client import Credentials
        from sbpstream.net.client import Connection

        own = await Connection.open(address, connect_timeout_s=DN_STATS_TIMEOUT_S,
                                    ssl_context=self.pool.ssl_context,
                                    authenticator=Credentials(token=token))
        try:
            return await self._tail_from(own, out, last, stream_id, n)
        finally:
            await own.aclose()

    @staticmethod
    async def _tail_from(conn: Connection, out: JSON, last: md.RangeMeta, stream_id: int,
                         n: int) -> JSON:
        frame = await conn.request_one(Opcode.STATS, StatsRequest(
            stream_ids=(stream_id,), top=MAX_TOP).encode(), timeout_s=DN_STATS_TIMEOUT_S)
        rows: list[JSON] = json.loads(bytes(frame.payload))["streams"]
        end = int(rows[0]["next_offset"]) if rows else last.next_offset
        start = max(last.start_offset, end - n)
        req = FetchRequest(max_wait_ms=0, items=(FetchItem(
            stream_id=stream_id, request_index=0, fetch_offset=start,
            batch_max_bytes=TAIL_MAX_BYTES, range_index=last.range_index),))
        frames = await conn.request(Opcode.FETCH, req.encode(), timeout_s=DN_STATS_TIMEOUT_S)
        records: list[JSON] = []
        for f in frames:
            for item, batch in FetchResponse.decode(f.header).chunks(f.payload):
                if item.status.code == ErrorCode.AUTHORIZATION_FAILED:
                    item.status.raise_for_error()  # the asker may not read it
                if not item.batch_length:
                    continue
                for rec in iter_records(batch):
                    if start <= rec.offset < end:
                        records.append({"offset": rec.offset, "timestamp_ms": rec.timestamp_ms,
                                        "key": _text(rec.key), "value": _text(rec.value)})
        out["records"] = records[-n:]
        out["next_offset"] = end
        return out


def _live(nodes: dict[int, NodeLiveness], node_id: int) -> bool:
    n = nodes.get(node_id)
    return n is not None and n.live


def _address(nodes: dict[int, NodeLiveness], node_id: int) -> str:
    n = nodes.get(node_id)
    return "" if n is None else n.advertise_addr


def _stored_bytes(rows: list[JSON]) -> int:
    """The stream's bytes, each range counted once (its largest copy among the nodes' rows:
    replicas of a range hold the same batches once converged)."""
    per_range: dict[int, int] = {}
    for row in rows:
        for r in row.get("ranges", ()):
            idx = int(r["range_index"])
            per_range[idx] = max(per_range.get(idx, 0), int(r.get("bytes", 0)))
    return sum(per_range.values())
