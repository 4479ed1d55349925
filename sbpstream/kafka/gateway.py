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
the rules in the token.

One concept per module: connections, framing, limits and SASL (:mod:`.connections`), topics
over streams (:mod:`.topics`), Produce and InitProducerId (:mod:`.produce`), Fetch
(:mod:`.fetch`), Metadata, CreateTopics, DeleteTopics and ListOffsets (:mod:`.admin`), the group
coordinator (:mod:`.group_handlers`, :mod:`.groups`); :class:`KafkaGateway` joins them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import OrderedDict

from sbpstream.client.producer import AsyncProducer
from sbpstream.kafka.admin import AdminHandlers
from sbpstream.kafka.connections import Conn, Connections, Handler
from sbpstream.kafka.fetch import FetchHandlers
from sbpstream.kafka.group_handlers import GroupHandlers, PmMember
from sbpstream.kafka.groups import KafkaGroups
from sbpstream.kafka.produce import ProduceHandlers, SeqState
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
from sbpstream.kafka.topics import parse_stream_name, stream_name, topic_problem
from sbpstream.net.tls import TlsConfig, client_context, server_context
from sbpstream.protocol.errors import (
    SbpError,
)

log = logging.getLogger("sbpstream.kafka")


class KafkaGateway(ProduceHandlers, FetchHandlers, AdminHandlers, GroupHandlers, Connections):
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
        self._seq: OrderedDict[tuple[int, int], SeqState] = OrderedDict()
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


async def run_gateway(gateway: KafkaGateway) -> None:
    """Serve until cancelled, then close."""
    try:
        await gateway.serve_forever()
    finally:
        await gateway.close()


__all__ = ["KafkaGateway", "parse_stream_name", "run_gateway", "stream_name",
           "topic_problem"]
