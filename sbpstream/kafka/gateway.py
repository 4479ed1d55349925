"""The Kafka gateway: an asyncio server speaking the Kafka binary protocol over the SDK.

A topic ``T`` with ``P`` partitions is the ``P`` named streams ``T.0`` .. ``T.<P-1>``; a Kafka
offset is the stream's offset. Produce goes through an idempotent SDK producer (the gateway's
one, or with SASL the connection's principal's; each Kafka batch lands in one sbpstream batch, so
its offsets are consecutive); Fetch reads through SDK
consumers (long-poll mode), one per connection and partition. Idempotent Kafka producers get a
producer id from InitProducerId and the gateway checks their sequences per partition (a window
of :data:`PRODUCER_WINDOW` batches, like a broker): a retried batch is answered with the offset
of the first copy, never stored twice. Consumer groups: the gateway runs Kafka's classic group
protocol (:mod:`sbpstream.kafka.groups`) and keeps committed offsets as the sbpstream group's
(group G's offset of T partition p is G's committed offset of stream ``T.p``); while a Kafka
group has members here, the gateway is a member of the sbpstream group holding the subscribed
topics' streams, so the PM hands SDK consumers of the group none of them. ListOffsets by time
searches the batches' timestamps (:mod:`sbpstream.kafka.bytime`). See docs/kafka.md.

Security: the listener is PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL. On a SASL listener each
connection logs in as a user of the cluster (:mod:`sbpstream.kafka.session`) and everything done
for it goes through an SBP client carrying that user's token: the servers apply that user's
ACLs, and what the gateway decides itself (its Kafka groups, InitProducerId) it checks against
the rules in the token. Framing, limits and SASL are :mod:`sbpstream.kafka.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Final

from sbpstream.auth.acl import Op
from sbpstream.auth.config import TlsConfig
from sbpstream.auth.tls import client_context, server_context
from sbpstream.client.aclient import AsyncClient
from sbpstream.client.producer import AsyncProducer, Offsets
from sbpstream.kafka import errors as E
from sbpstream.kafka.bytime import ProbeLimitError, offset_for_time
from sbpstream.kafka.codec import KafkaDecodeError
from sbpstream.kafka.connections import Conn, Connections, Handler, Reader
from sbpstream.kafka.group_handlers import GroupHandlers, PmMember
from sbpstream.kafka.groups import KafkaGroups
from sbpstream.kafka.records import (
    InflateBudget,
    InflateLimitError,
    KafkaBatch,
    UnsupportedBatchError,
    UnsupportedCompressionError,
    decode_batches,
    sbp_to_kafka,
)
from sbpstream.kafka.sasl import PLAINTEXT, listener_problem, mechanisms, uses_tls
from sbpstream.kafka.schemas import (
    CREATE_TOPICS,
    DELETE_TOPICS,
    DESCRIBE_GROUPS,
    FETCH,
    FIND_COORDINATOR,
    HEARTBEAT,
    INIT_PRODUCER_ID,
    JOIN_GROUP,
    LEAVE_GROUP,
    LIST_GROUPS,
    LIST_OFFSETS,
    METADATA,
    OFFSET_COMMIT,
    OFFSET_FETCH,
    SYNC_GROUP,
)
from sbpstream.kafka.session import plain_client
from sbpstream.protocol.errors import (
    RequestTimeoutError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import MAX_STREAM_NAME_LEN
from sbpstream.records import RecordTooLargeError

log = logging.getLogger("sbpstream.kafka")

PRODUCER_WINDOW: Final = 5
"""Batches per (producer, partition) remembered for deduplication: Kafka's
max.in.flight.requests.per.connection bound for idempotence."""
MAX_PRODUCER_STATES: Final = 100_000
"""(producer id, partition) sequence states kept; the least recently used goes first."""
MAX_READERS_PER_CONNECTION: Final = 1024
"""Partition readers (SDK consumers) cached per connection; the least recently used is closed."""
MAX_FETCH_WAIT_MS: Final = 30_000
"""A Fetch's max_wait_ms is capped at this."""
MAX_PARTITIONS: Final = 10_000
"""Partitions a CreateTopics may ask for per topic."""
READ_BATCH_BYTES: Final = (64 * 1024, 8 * 1024 * 1024)
"""Bounds of the data-node fetch size asked per partition (from partition_max_bytes)."""
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
"""Data-node fetch size of one probe of a lookup by time (a probe needs one batch)."""

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


@dataclass(slots=True)
class _Sent:
    first: int
    last: int
    result: asyncio.Future[int]  # the base offset


@dataclass(slots=True)
class _SeqState:
    epoch: int
    sent: deque[_Sent] = field(default_factory=deque)




class KafkaGateway(Connections, GroupHandlers):
    """Serve Kafka clients at ``host:port`` over the cluster whose PM is ``pm``.

    ``listener``: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (SSL ones serve ``tls_cert`` and
    ``tls_key``; SASL_PLAINTEXT beyond loopback needs ``allow_sasl_plaintext``). ``tls_ca``
    verifies the PM and the data nodes (TLS to the cluster when given).

    ``advertised`` is the ``host:port`` Metadata tells clients to connect to (default: the
    listening address). ``auto_create`` creates a topic of ``default_partitions`` partitions
    when a Metadata request names an unknown one and allows it (Kafka's
    auto.create.topics.enable); ``replicas`` is the replica count of streams it creates when a
    CreateTopics leaves the replication factor to the broker.
    """

    def __init__(
        self,
        pm: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 9092,
        advertised: str | None = None,
        node_id: int = 0,
        auto_create: bool = True,
        default_partitions: int = 1,
        replicas: int = 1,
        linger_ms: float = 2.0,
        listener: str = PLAINTEXT,
        tls_cert: str = "",
        tls_key: str = "",
        tls_ca: str = "",
        allow_sasl_plaintext: bool = False,
    ) -> None:
        problem = listener_problem(listener, host, bool(tls_cert and tls_key),
                                   allow_sasl_plaintext)
        if problem:
            raise ValueError(problem)
        TlsConfig(tls_cert, tls_key, tls_ca).validate()
        self.listener = listener
        self.mechanisms = mechanisms(listener)
        self.tls_ca = tls_ca
        self._server_ssl = server_context(TlsConfig(tls_cert, tls_key)) if uses_tls(
            listener) else None
        self._pm_ssl: ssl.SSLContext | None = client_context(TlsConfig(ca=tls_ca))
        self._per_source: dict[str, int] = {}
        self.pm = pm
        self.host = host
        self.port = port
        self._advertised = advertised
        self.node_id = node_id
        self.auto_create = auto_create
        self.default_partitions = default_partitions
        self.replicas = replicas
        self.linger_ms = linger_ms
        # the gateway's own: no credentials (the environment's neither), so on a cluster with
        # auth it can do nothing for a connection that has not logged in
        self.client = plain_client(pm, tls_ca)
        self._producer: AsyncProducer | None = None
        self._server: asyncio.Server | None = None
        self._sids: dict[tuple[str, int], int] = {}
        self._seq: OrderedDict[tuple[int, int], _SeqState] = OrderedDict()
        self._conns: set[asyncio.Task[None]] = set()
        self._handlers: dict[int, Handler] = {
            METADATA: self._metadata,
            FETCH: self._fetch,
            LIST_OFFSETS: self._list_offsets,
            CREATE_TOPICS: self._create_topics,
            DELETE_TOPICS: self._delete_topics,
            INIT_PRODUCER_ID: self._init_producer_id,
            FIND_COORDINATOR: self._find_coordinator,
            JOIN_GROUP: self._join_group,
            SYNC_GROUP: self._sync_group,
            HEARTBEAT: self._heartbeat,
            LEAVE_GROUP: self._leave_group,
            OFFSET_COMMIT: self._offset_commit,
            OFFSET_FETCH: self._offset_fetch,
            LIST_GROUPS: self._list_groups,
            DESCRIBE_GROUPS: self._describe_groups,
        }
        self.groups = KafkaGroups(lambda: int(time.monotonic() * 1000))
        self._ticker: asyncio.Task[None] | None = None
        self._pm_members: dict[str, PmMember] = {}
        self._pm_loop: asyncio.Task[None] | None = None

    @property
    def advertised(self) -> tuple[str, int]:
        if self._advertised:
            h, _, p = self._advertised.rpartition(":")
            return h, int(p)
        return self.host, self.port

    def producer_of(self, conn: Conn) -> AsyncProducer:
        """The producer storing ``conn``'s batches: its principal's, else the gateway's."""
        if conn.session is not None:
            return conn.session.producer(self.linger_ms)
        if self._producer is None:
            self._producer = self.client.producer(
                linger_ms=self.linger_ms, batch_max_bytes=1024 * 1024)
        return self._producer

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  ssl=self._server_ssl)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.create_task(self._tick_groups())
        self._pm_loop = asyncio.create_task(self._pm_groups_loop())
        log.info("event=kafka_gateway_listening listener=%s addr=%s:%d pm=%s mechanisms=%s",
                 self.listener, self.host, self.port, ",".join(self.client.pm_addresses),
                 ",".join(self.mechanisms) or "-")

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in (self._ticker, self._pm_loop):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(BaseException):
                await t
        for group, pmm in list(self._pm_members.items()):  # streams back to SDK consumers now
            with contextlib.suppress(SbpError, TimeoutError):
                await asyncio.wait_for(pmm.client.group_admin.leave(group, self.pm_member_id),
                                       5)
        self._pm_members.clear()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.close()
        await self.client.close()

    # ------------------------------------------------------------------------ topic mapping

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

    # ----------------------------------------------------------------------------- metadata

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

    # ----------------------------------------------------------------------------- produce

    async def _produce(self, conn: Conn, req: dict[str, Any]
                       ) -> Awaitable[dict[str, Any]] | None:
        """Queue every partition's records now (in request order); return the awaitable of the
        response (None for acks=0, which gets none). What the request's batches decompress to
        is bounded as a whole (:class:`~sbpstream.kafka.records.InflateBudget`)."""
        acks = req["acks"]
        budget = InflateBudget()
        results: list[tuple[str, int, Awaitable[tuple[int, int]]]] = []
        for td in req["topic_data"]:
            for pd in td["partition_data"]:
                results.append((td["name"], pd["index"], await self._produce_partition(
                    conn, td["name"], pd["index"], pd["records"], acks, req, budget)))
        if acks == 0:
            for _, _, aw in results:
                asyncio.ensure_future(aw).add_done_callback(_log_failure)
            return None
        return self._produce_response(results, req["timeout_ms"])

    async def _produce_response(self, results: list[tuple[str, int, Awaitable[tuple[int, int]]]],
                                timeout_ms: int) -> dict[str, Any]:
        by_topic: dict[str, list[dict[str, Any]]] = {}
        timeout = max(timeout_ms, 1000) / 1000
        for topic, partition, aw in results:
            try:
                code, base = await asyncio.wait_for(asyncio.shield(aw), timeout)
            except TimeoutError:
                code, base = E.REQUEST_TIMED_OUT, -1
            by_topic.setdefault(topic, []).append(
                {"index": partition, "error_code": code, "base_offset": base,
                 "log_append_time_ms": -1, "log_start_offset": -1, "record_errors": [],
                 "error_message": None})
        return {"responses": [{"name": t, "partition_responses": p}
                              for t, p in by_topic.items()], "throttle_time_ms": 0}

    async def _produce_partition(self, conn: Conn, topic: str, partition: int,
                                 records: bytes | None, acks: int, req: dict[str, Any],
                                 budget: InflateBudget) -> Awaitable[tuple[int, int]]:
        """Queue one partition's batches; the awaitable of (error code, base offset)."""
        code = E.NONE
        if acks not in (0, 1, -1):
            code = E.INVALID_REQUIRED_ACKS
        elif req["transactional_id"] is not None:
            code = E.INVALID_REQUEST
        batches: list[KafkaBatch] = []
        if code == E.NONE:
            try:
                batches = decode_batches(records or b"", budget=budget)
            except InflateLimitError as exc:
                log.info("event=kafka_batch_too_large topic=%s partition=%d error=%s",
                         topic, partition, exc)
                code = E.MESSAGE_TOO_LARGE
            except UnsupportedCompressionError:
                code = E.UNSUPPORTED_COMPRESSION_TYPE
            except UnsupportedBatchError:
                code = E.UNSUPPORTED_FOR_MESSAGE_FORMAT
            except KafkaDecodeError as exc:
                log.info("event=kafka_corrupt_batch topic=%s partition=%d error=%s",
                         topic, partition, exc)
                code = E.CORRUPT_MESSAGE
            if not batches and code == E.NONE:
                code = E.CORRUPT_MESSAGE
        if code == E.NONE:
            try:
                sid = await self._sid(self.client_of(conn), topic, partition)
            except SbpError as exc:
                code = E.kafka_code(exc)
        if code != E.NONE:
            return _ready((code, -1))
        waits: list[Awaitable[tuple[int, int]]] = []
        for b in batches:
            waits.append(await self._produce_batch(conn, topic, partition, sid, b))
        return _first_base(waits)

    async def _produce_batch(self, conn: Conn, topic: str, partition: int, sid: int,
                             b: KafkaBatch) -> Awaitable[tuple[int, int]]:
        state: _SeqState | None = None
        if b.producer_id >= 0:
            key = (b.producer_id, sid)
            state = self._seq.get(key)
            if state is None or b.producer_epoch > state.epoch:
                state = _SeqState(b.producer_epoch)
                self._seq[key] = state
                while len(self._seq) > MAX_PRODUCER_STATES:
                    self._seq.popitem(last=False)
            self._seq.move_to_end(key)
            if b.producer_epoch < state.epoch:
                return _ready((E.INVALID_PRODUCER_EPOCH, -1))
            for s in state.sent:
                if s.first == b.base_sequence and s.last == b.last_sequence:
                    return _dup(s.result)  # a retry: the first copy's outcome
            if state.sent and b.base_sequence != (state.sent[-1].last + 1) & 0x7FFFFFFF:
                return _ready((E.OUT_OF_ORDER_SEQUENCE_NUMBER, -1))
        try:
            fut = await self.producer_of(conn).send_whole(sid, b.records)
        except RecordTooLargeError:
            return _ready((E.MESSAGE_TOO_LARGE, -1))
        except SbpError as exc:
            return _ready((E.kafka_code(exc), -1))
        result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        sent = None
        if state is not None:
            sent = _Sent(b.base_sequence, b.last_sequence, result)
            state.sent.append(sent)
            if len(state.sent) > PRODUCER_WINDOW:
                state.sent.popleft()
        # a task now: the outcome settles the dedup window even if no one awaits the response
        return asyncio.ensure_future(self._settle(topic, partition, fut, result, state, sent))

    async def _settle(self, topic: str, partition: int, fut: asyncio.Future[Offsets],
                      result: asyncio.Future[int], state: _SeqState | None,
                      sent: _Sent | None) -> tuple[int, int]:
        offsets = await fut
        err = offsets.error
        if err is None:
            result.set_result(offsets[0])
            return E.NONE, offsets[0]
        code = E.kafka_code(err)
        result.set_exception(err)
        result.exception()  # retrieved: duplicates re-raise their own copy
        if code == E.UNKNOWN_TOPIC_OR_PARTITION:
            self._forget(topic, partition)
        if state is not None and sent is not None and sent in state.sent:
            # not stored: the client's retry of this batch (and of those after) must be taken
            while state.sent and state.sent[-1] is not sent:
                state.sent.pop()
            state.sent.pop()
        return code, -1

    # ------------------------------------------------------------------------------- fetch

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

    # ------------------------------------------------------------------------ list offsets

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

    # ---------------------------------------------------------------------- create, delete

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

    # ------------------------------------------------------------------------ idempotence

    async def _init_producer_id(self, conn: Conn, version: int, req: dict[str, Any]
                                ) -> dict[str, Any]:
        if req["transactional_id"] is not None:
            return {"throttle_time_ms": 0, "error_code": E.INVALID_REQUEST,
                    "producer_id": -1, "producer_epoch": -1}
        if conn.session is not None and not conn.session.may_append_somewhere():
            # Kafka's check: an idempotent producer needs WRITE on some topic
            return {"throttle_time_ms": 0, "error_code": E.CLUSTER_AUTHORIZATION_FAILED,
                    "producer_id": -1, "producer_epoch": -1}
        # a fresh id per call, from the OS's CSPRNG: 62 random bits make a collision with a live
        # producer negligible, and nobody can predict another producer's id to answer as it
        return {"throttle_time_ms": 0, "error_code": 0,
                "producer_id": secrets.randbits(62), "producer_epoch": 0}


# ------------------------------------------------------------------------------------ helpers


async def _ready(value: tuple[int, int]) -> tuple[int, int]:
    return value


async def _dup(result: asyncio.Future[int]) -> tuple[int, int]:
    try:
        return E.NONE, await asyncio.shield(result)
    except SbpError as exc:
        return E.kafka_code(exc), -1


async def _first_base(waits: list[Awaitable[tuple[int, int]]]) -> tuple[int, int]:
    """Several batches for one partition: the first error, else the first base offset."""
    got = [await w for w in waits]
    for code, _ in got:
        if code != E.NONE:
            return code, -1
    return got[0]


def _log_failure(fut: asyncio.Future[tuple[int, int]]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.warning("event=kafka_acks0_produce_failed error=%s", exc)
    elif fut.result()[0] != E.NONE:
        log.warning("event=kafka_acks0_produce_failed code=%d", fut.result()[0])


async def run_gateway(gateway: KafkaGateway) -> None:
    """Serve until cancelled, then close."""
    try:
        await gateway.serve_forever()
    finally:
        await gateway.close()


__all__ = ["KafkaGateway", "parse_stream_name", "run_gateway", "stream_name",
           "topic_problem"]
