"""Kafka's topic administration: Metadata (with the authorized-operation bitfields, and topic
auto-creation), CreateTopics, DeleteTopics and ListOffsets (earliest, latest, and by time:
:mod:`sbpstream.kafka.bytime`)."""

from __future__ import annotations

import logging
from typing import Any, Final

from sbpstream.auth.acl import Op
from sbpstream.client.aclient import AsyncClient
from sbpstream.kafka import errors as E
from sbpstream.kafka.bytime import ProbeLimitError, offset_for_time
from sbpstream.kafka.connections import Conn
from sbpstream.kafka.topics import TopicMap, stream_name, topic_problem
from sbpstream.protocol.errors import (
    RequestTimeoutError,
    SbpError,
)

log = logging.getLogger("sbpstream.kafka")

MAX_PARTITIONS: Final = 10_000
"""Partitions a CreateTopics may ask for per topic."""
# Authorized-operation bitfields (Metadata v8+, when asked): Kafka's AclOperation codes READ 3,
# WRITE 4, CREATE 5, DELETE 6, DESCRIBE 8; without auth everything it serves, with auth those
# the principal's rules grant (sbpstream fetch, append, create, delete, describe).
KAFKA_OPS: Final = ((3, Op.FETCH), (4, Op.APPEND), (5, Op.CREATE), (6, Op.DELETE),
                    (8, Op.DESCRIBE))
TOPIC_OPERATIONS: Final = sum(1 << op for op, _ in KAFKA_OPS)
CLUSTER_OPERATIONS: Final = sum(1 << op for op in (5, 8))
NOT_REQUESTED: Final = -2147483648
TIMESTAMP_LATEST: Final = -1
TIMESTAMP_EARLIEST: Final = -2
PROBE_BYTES: Final = 64 * 1024


class AdminHandlers(TopicMap):
    """Metadata, CreateTopics, DeleteTopics and ListOffsets of
    :class:`~sbpstream.kafka.gateway.KafkaGateway`."""

    node_id: int
    auto_create: bool
    default_partitions: int
    replicas: int

    @property
    def advertised(self) -> tuple[str, int]:
        raise NotImplementedError

    async def _metadata(self, conn: Conn, version: int, req: dict[str, Any]
                        ) -> dict[str, Any]:
        """Only the topics the principal may describe are listed (the PM lists it no other
        stream); a topic named that it may not describe is TOPIC_AUTHORIZATION_FAILED."""
        client = self.client_of(conn)
        wanted = req["topics"]
        topics: list[dict[str, Any]] = []
        if wanted is None or (version == 0 and not wanted):
            try:
                every = await self._all_topics(client)
            except SbpError as exc:  # e.g. a cluster with auth and a connection without SASL
                log.warning("event=kafka_metadata_failed peer=%s error=%s", conn.peer, exc)
                every = {}
            for name, parts in sorted(every.items()):
                topics.append(self._topic_meta(name, parts))
        else:
            for t in wanted:
                name = t["name"]
                problem = topic_problem(name)
                if problem:
                    topics.append({"error_code": E.INVALID_TOPIC_EXCEPTION, "name": name})
                    continue
                code = E.UNKNOWN_TOPIC_OR_PARTITION
                try:
                    parts = await self._partitions(client, name)
                    if not parts and self.auto_create and req["allow_auto_topic_creation"]:
                        code, _ = await self._create(client, name, self.default_partitions,
                                                     self.replicas, {})
                        if code in (E.NONE, E.TOPIC_ALREADY_EXISTS):
                            parts = await self._partitions(client, name)
                            code = E.UNKNOWN_TOPIC_OR_PARTITION
                except SbpError as exc:
                    parts, code = {}, E.kafka_code(exc)
                if not parts and code == E.UNKNOWN_TOPIC_OR_PARTITION and \
                        conn.session is not None and not conn.session.perms.allows(
                            Op.DESCRIBE, None, stream_name(name, 0)):
                    code = E.TOPIC_AUTHORIZATION_FAILED
                if not parts:
                    topics.append({"error_code": code, "name": name})
                else:
                    topics.append(self._topic_meta(name, parts))
        host, port = self.advertised
        want_ops = req["include_topic_authorized_operations"]
        return {
            "brokers": [{"node_id": self.node_id, "host": host, "port": port, "rack": None}],
            "cluster_id": "sbpstream",
            "controller_id": self.node_id,
            "topics": [dict(t, topic_authorized_operations=self._topic_ops(conn, t["name"])
                            if want_ops else NOT_REQUESTED) for t in topics],
            "cluster_authorized_operations": CLUSTER_OPERATIONS
            if req["include_cluster_authorized_operations"] else NOT_REQUESTED,
        }

    def _topic_ops(self, conn: Conn, topic: str) -> int:
        """Kafka's authorized-operations bitfield of ``topic`` for the connection's principal."""
        if conn.session is None:
            return TOPIC_OPERATIONS
        perms, name = conn.session.perms, stream_name(topic, 0)
        sid = self._sids.get((topic, 0))
        return sum(1 << code for code, op in KAFKA_OPS if perms.allows(op, sid, name))

    def _topic_meta(self, name: str, parts: dict[int, int]) -> dict[str, Any]:
        n = self.node_id
        return {"error_code": 0, "name": name, "partitions": [
            {"error_code": 0, "partition_index": p, "leader_id": n, "leader_epoch": -1,
             "replica_nodes": [n], "isr_nodes": [n], "offline_replicas": []}
            for p in sorted(parts)]}

    async def _list_offsets(self, conn: Conn, version: int, req: dict[str, Any]
                            ) -> dict[str, Any]:
        client = self.client_of(conn)
        topics = []
        for t in req["topics"]:
            parts = []
            for p in t["partitions"]:
                r: dict[str, Any] = {"partition_index": p["partition_index"], "error_code": 0,
                                     "timestamp": -1, "offset": -1, "leader_epoch": -1}
                try:
                    sid = await self._sid(client, t["name"], p["partition_index"])
                    ts = p["timestamp"]
                    if ts == TIMESTAMP_EARLIEST:
                        r["offset"] = await client.start_offset(sid)
                    elif ts == TIMESTAMP_LATEST:
                        r["offset"] = await client.end_offset(sid)
                    elif ts >= 0:
                        got = await self._offset_for_time(client, sid, ts)
                        if got is not None:
                            r["offset"], r["timestamp"] = got
                    else:  # -3 (max timestamp, v7+) and below are not served
                        r["error_code"] = E.INVALID_REQUEST
                except SbpError as exc:
                    r["error_code"] = E.kafka_code(exc)
                parts.append(r)
            topics.append({"name": t["name"], "partitions": parts})
        return {"throttle_time_ms": 0, "topics": topics}

    async def _offset_for_time(self, client: AsyncClient, sid: int, target_ms: int
                               ) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record at or after ``target_ms``: a binary search
        by the batches' largest timestamps, one FETCH per probe (:mod:`sbpstream.kafka.bytime`).
        """
        start = await client.start_offset(sid)
        end = await client.end_offset(sid)
        if start >= end:
            return None
        c = client.consumer(sid, start, subscribe=False, batch_max_bytes=PROBE_BYTES)

        async def probe(offset: int) -> list[memoryview]:
            await c.seek(offset)
            return await c.fetch_batches(0)

        try:
            return await offset_for_time(probe, start, end, target_ms)
        except ProbeLimitError as exc:
            raise RequestTimeoutError(str(exc)) from exc
        finally:
            await c.close()

    async def _create(self, client: AsyncClient, name: str, partitions: int, replicas: int,
                      configs: dict[str, str | None], validate_only: bool = False
                      ) -> tuple[int, str | None]:
        if partitions == -1:
            partitions = self.default_partitions
        if replicas == -1:
            replicas = self.replicas
        if not 0 < partitions <= MAX_PARTITIONS:
            return E.INVALID_PARTITIONS, f"partitions must be in [1, {MAX_PARTITIONS}]"
        if replicas < 1:
            return E.INVALID_REPLICATION_FACTOR, "replication factor must be at least 1"
        problem = topic_problem(name, partitions)
        if problem:
            return E.INVALID_TOPIC_EXCEPTION, problem
        retention: dict[str, int] = {}
        for k, v in configs.items():
            if k == "retention.ms" and v is not None:
                try:
                    retention["retention_ms"] = int(v)
                except ValueError:
                    return E.INVALID_CONFIG, f"retention.ms {v!r} is not an integer"
        try:
            if await self._partitions(client, name):
                return E.TOPIC_ALREADY_EXISTS, f"topic {name!r} already exists"
            if validate_only:
                return E.NONE, None
            await client.create_streams(
                names=[stream_name(name, p) for p in range(partitions)],
                replica_nums=replicas, **retention)
        except SbpError as exc:
            code = E.kafka_code(exc)
            if code == E.NOT_ENOUGH_REPLICAS:
                code = E.INVALID_REPLICATION_FACTOR
            elif "exist" in exc.message.lower() or "in use" in exc.message.lower():
                code = E.TOPIC_ALREADY_EXISTS
            return code, exc.message
        return E.NONE, None

    async def _create_topics(self, conn: Conn, version: int, req: dict[str, Any]
                             ) -> dict[str, Any]:
        out = []
        for t in req["topics"]:
            configs = {c["name"]: c["value"] for c in t["configs"]}
            code, msg = await self._create(
                self.client_of(conn), t["name"], t["num_partitions"], t["replication_factor"],
                configs, req["validate_only"])
            parts = t["num_partitions"] if t["num_partitions"] > 0 else self.default_partitions
            out.append({"name": t["name"], "error_code": code, "error_message": msg,
                        "num_partitions": parts if code == E.NONE else -1,
                        "replication_factor": (t["replication_factor"] if
                                               t["replication_factor"] > 0 else self.replicas)
                        if code == E.NONE else -1,
                        "configs": None})
        return {"throttle_time_ms": 0, "topics": out}

    async def _delete_topics(self, conn: Conn, version: int, req: dict[str, Any]
                             ) -> dict[str, Any]:
        out = []
        for name in req["topic_names"]:
            code, msg = E.NONE, None
            try:
                parts = await self._partitions(self.client_of(conn), name)
                if not parts:
                    code = E.UNKNOWN_TOPIC_OR_PARTITION
                else:
                    await self.client_of(conn).delete_streams(list(parts.values()))
                    self._forget(name)
            except SbpError as exc:
                code, msg = E.kafka_code(exc), exc.message
            out.append({"name": name, "error_code": code, "error_message": msg})
        return {"throttle_time_ms": 0, "responses": out}
