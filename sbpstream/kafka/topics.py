"""Kafka topics over named streams: topic ``T`` with ``P`` partitions is the streams ``T.0`` ..
``T.<P-1>`` (:func:`stream_name`), and :class:`TopicMap` finds a topic's partitions and their
stream ids (cached per gateway) through the client acting for a connection."""

from __future__ import annotations

import logging
import re
from typing import Final

from sbpstream.client.aclient import AsyncClient
from sbpstream.kafka.connections import Conn
from sbpstream.protocol.errors import (
    StreamNotFoundError,
)
from sbpstream.protocol.names import MAX_STREAM_NAME_LEN

log = logging.getLogger("sbpstream.kafka")

_TOPIC_CHARS: Final = re.compile(r"[a-zA-Z0-9._-]+")
_PARTITION_NAME: Final = re.compile(r"(.+)\.(0|[1-9][0-9]{0,8})")


def stream_name(topic: str, partition: int) -> str:
    """The stream holding ``partition`` of ``topic``: ``<topic>.<partition>``."""
    return f"{topic}.{partition}"


def parse_stream_name(name: str) -> tuple[str, int] | None:
    """(topic, partition) of a stream named by the rule; None for another name."""
    m = _PARTITION_NAME.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


def topic_problem(topic: str, partitions: int = 1) -> str | None:
    """Why ``topic`` cannot be a topic (its stream names must be valid), or None."""
    if not topic or _TOPIC_CHARS.fullmatch(topic) is None or topic in (".", ".."):
        return f"topic name {topic[:60]!r} must be 1+ characters of a-z A-Z 0-9 . _ -"
    if len(stream_name(topic, partitions - 1)) > MAX_STREAM_NAME_LEN:
        return f"topic name is too long: its streams' names exceed {MAX_STREAM_NAME_LEN}"
    return None


class TopicMap:
    """Partition -> stream id lookups of :class:`~sbpstream.kafka.gateway.KafkaGateway` (a
    base class of each request family)."""

    client: AsyncClient
    _sids: dict[tuple[str, int], int]

    def client_of(self, conn: Conn) -> AsyncClient:
        """The SBP client acting for ``conn``: its principal's, else the gateway's own (a
        cluster without auth)."""
        return conn.session.client if conn.session is not None else self.client

    async def _sid(self, client: AsyncClient, topic: str, partition: int) -> int:
        """The stream id of a partition (ids are shared: what a principal may do with the
        stream is checked by the servers under its own token)."""
        key = (topic, partition)
        sid = self._sids.get(key)
        if sid is None:
            if partition < 0 or topic_problem(topic, partition + 1):
                raise StreamNotFoundError(f"no partition {partition} of topic {topic!r}")
            sid = await client.resolve_stream(stream_name(topic, partition), refresh=True)
            self._sids[key] = sid
        return sid

    def _forget(self, topic: str, partition: int | None = None) -> None:
        for key in [k for k in self._sids if k[0] == topic and partition in (None, k[1])]:
            del self._sids[key]

    async def _partitions(self, client: AsyncClient, topic: str) -> dict[int, int]:
        """partition -> stream id of ``topic`` (the partitions 0..P-1 that exist and the
        client's principal may describe: the PM lists no other)."""
        if topic_problem(topic):
            return {}
        found: dict[int, int] = {}
        for st in await client.find_streams(prefix=topic + "."):
            parsed = parse_stream_name(st.name)
            if parsed is not None and parsed[0] == topic:
                found[parsed[1]] = st.stream_id
        out: dict[int, int] = {}
        while len(out) in found:
            out[len(out)] = found[len(out)]
        for p, sid in out.items():
            self._sids[(topic, p)] = sid
        return out

    async def _all_topics(self, client: AsyncClient) -> dict[str, dict[int, int]]:
        topics: dict[str, dict[int, int]] = {}
        for st in await client.find_streams(prefix=""):
            parsed = parse_stream_name(st.name)
            if parsed is not None:
                topics.setdefault(parsed[0], {})[parsed[1]] = st.stream_id
        out: dict[str, dict[int, int]] = {}
        for t, parts in topics.items():
            if 0 in parts:
                out[t] = {}
                while len(out[t]) in parts:
                    out[t][len(out[t])] = parts[len(out[t])]
        return out
