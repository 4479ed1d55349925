"""STATS on a data node: the streams it holds, with their traffic and offsets (the data node's
:class:`~sbpstream.introspect.figures.StreamSource`; the PM's is
:class:`~sbpstream.pm.overview.ClusterOverview`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sbpstream.datanode.context import NodeContext
from sbpstream.introspect.counters import RATED, StreamCounterTable
from sbpstream.introspect.figures import JSON, rate_key
from sbpstream.introspect.rates import RateWindow
from sbpstream.protocol.errors import SbpError


class DataNodeStreams:
    """STATS on a data node: the streams it holds, with their traffic and offsets."""

    def __init__(self, ctx: NodeContext, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.counters: StreamCounterTable = ctx.stream_stats
        self.rates: RateWindow[int] = RateWindow(clock())
        self.clock = clock

    def tick(self, now: float) -> None:
        self.counters.retain(set(self.ctx.table.streams))
        self.rates.take(now, {sid: c.rated() for sid, c in self.counters.by_stream.items()})

    def totals(self) -> JSON:
        """The node's "records out": what it served to readers (pull, session and push alike,
        counted by datanode/reader.py), all streams, since it started."""
        return {"records_fetched": self.counters.records_fetched,
                "bytes_fetched": self.counters.bytes_fetched}

    async def stats(self, stream_ids: Sequence[int], top: int) -> list[JSON]:
        now = self.clock()
        held = self.ctx.table.streams
        ids = [s for s in stream_ids if s in held] if stream_ids else list(held)
        rows = [self._one(sid, now) for sid in ids]
        if not stream_ids:
            rows.sort(key=lambda r: (-rate_key(r), r["stream_id"]))
            rows = rows[:top]
        return rows

    def _one(self, sid: int, now: float) -> JSON:
        ctx = self.ctx
        c = self.counters.of(sid)
        pm = self.rates.per_minute(now, sid, c.rated())
        ranges: list[JSON] = []
        for idx, info in sorted(ctx.table.streams[sid].ranges.items()):
            try:
                d = ctx.store.describe_range(sid, idx)
            except SbpError:
                continue
            ranges.append({"range_index": idx, "start_offset": d.start_offset,
                           "next_offset": d.next_offset,
                           "end_offset": d.end_offset if d.sealed else -1,
                           "bytes": ctx.store.range_bytes(sid, idx),
                           "primary": info.is_primary})
        return {
            "stream_id": sid,
            "records_appended": c.records_appended,
            "bytes_appended": c.bytes_appended,
            "records_fetched": c.records_fetched,
            "bytes_fetched": c.bytes_fetched,
            "records_replicated": c.records_replicated,
            "bytes_replicated": c.bytes_replicated,
            "per_minute": dict(zip(RATED, pm, strict=True)),
            "start_offset": ctx.stream_start(sid),
            "next_offset": ctx.table.high_watermark(sid),
            "ranges": ranges,
            "bytes_stored": sum(int(r["bytes"]) for r in ranges),
            "last_append_ms": c.last_append_ms,
        }
