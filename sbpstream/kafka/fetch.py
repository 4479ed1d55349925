"""Kafka Fetch: each partition is read through an SDK consumer of its stream (long-poll mode),
cached per connection and partition; the records go out as Kafka record batches."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from sbpstream.kafka import errors as E
from sbpstream.kafka.connections import Conn, Reader
from sbpstream.kafka.records import (
    sbp_to_kafka,
)
from sbpstream.kafka.topics import TopicMap
from sbpstream.protocol.errors import (
    SbpError,
)

log = logging.getLogger("sbpstream.kafka")

MAX_READERS_PER_CONNECTION: Final = 1024
"""Partition readers (SDK consumers) cached per connection; the least recently used is closed."""
MAX_FETCH_WAIT_MS: Final = 30_000
"""A Fetch's max_wait_ms is capped at this."""
READ_BATCH_BYTES: Final = (64 * 1024, 8 * 1024 * 1024)
"""Bounds of the data-node fetch size asked per partition (from partition_max_bytes)."""


class FetchHandlers(TopicMap):
    """Fetch of :class:`~sbpstream.kafka.gateway.KafkaGateway`."""

    async def _fetch(self, conn: Conn, version: int, req: dict[str, Any]) -> dict[str, Any]:
        wait_ms = max(0, min(req["max_wait_ms"], MAX_FETCH_WAIT_MS))
        parts = [(t["topic"], p) for t in req["topics"] for p in t["partitions"]]
        got = await asyncio.gather(*(self._fetch_partition(conn, t, p, 0) for t, p in parts))
        if wait_ms and not any(len(g["records"] or b"") for g in got) and not any(
                g["error_code"] for g in got):
            got = await asyncio.gather(
                *(self._fetch_partition(conn, t, p, wait_ms) for t, p in parts))
        budget = req["max_bytes"] if req["max_bytes"] > 0 else 0x7FFFFFFF
        responses: dict[str, list[dict[str, Any]]] = {}
        used = 0
        for (topic, _), g in zip(parts, got, strict=True):
            n = len(g["records"] or b"")
            if used and used + n > budget:
                g["records"] = b""
            used += n
            responses.setdefault(topic, []).append(g)
        return {"throttle_time_ms": 0, "error_code": 0, "session_id": 0,
                "responses": [{"topic": t, "partitions": ps} for t, ps in responses.items()]}

    async def _fetch_partition(self, conn: Conn, topic: str, p: dict[str, Any],
                               wait_ms: int) -> dict[str, Any]:
        partition, offset = p["partition"], p["fetch_offset"]
        out: dict[str, Any] = {"partition_index": partition, "error_code": 0,
                               "high_watermark": -1, "last_stable_offset": -1,
                               "log_start_offset": -1, "aborted_transactions": None,
                               "preferred_read_replica": -1, "records": b""}
        client = self.client_of(conn)
        try:
            sid = await self._sid(client, topic, partition)
            if offset < 0:
                out["error_code"] = E.OFFSET_OUT_OF_RANGE
                return out
            rd = conn.readers.get(sid)
            limit = min(max(p["partition_max_bytes"], READ_BATCH_BYTES[0]), READ_BATCH_BYTES[1])
            if rd is None:
                rd = conn.readers[sid] = Reader(client.consumer(
                    sid, offset, subscribe=False, batch_max_bytes=limit))
                while len(conn.readers) > MAX_READERS_PER_CONNECTION:
                    _, old = conn.readers.popitem(last=False)
                    await old.consumer.close()
            conn.readers.move_to_end(sid)
            async with rd.lock:
                c = rd.consumer
                c.batch_max_bytes = limit
                if c.position != offset:
                    await c.seek(offset)
                batches = await c.fetch_batches(wait_ms)
                data, nxt = sbp_to_kafka(batches, offset, max(p["partition_max_bytes"], 1))
                hw = max(c.high_watermark, nxt)
        except SbpError as exc:
            out["error_code"] = E.kafka_code(exc)
            if out["error_code"] == E.UNKNOWN_TOPIC_OR_PARTITION:
                self._forget(topic, partition)
            return out
        out["records"] = data
        out["high_watermark"] = out["last_stable_offset"] = hw
        return out
