"""Kafka Produce and InitProducerId: each partition's batches go to its stream through an
idempotent SDK producer (one Kafka batch is one sbpstream batch, its records converted without
being decoded: :func:`~sbpstream.kafka.records.kafka_to_sbp`); an idempotent Kafka producer's
sequences are checked per partition over a window of :data:`PRODUCER_WINDOW` batches, so a
retried batch is answered with its first copy's offset and never stored twice."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Final

from sbpstream.client.producer import AsyncProducer, Offsets
from sbpstream.kafka import errors as E
from sbpstream.kafka.codec import KafkaDecodeError
from sbpstream.kafka.connections import Conn
from sbpstream.kafka.records import (
    InflateBudget,
    InflateLimitError,
    KafkaBatch,
    UnsupportedBatchError,
    UnsupportedCompressionError,
    decode_batches,
)
from sbpstream.kafka.topics import TopicMap
from sbpstream.protocol.errors import (
    SbpError,
)
from sbpstream.records import RecordTooLargeError

log = logging.getLogger("sbpstream.kafka")

PRODUCER_WINDOW: Final = 5
"""Batches per (producer, partition) remembered for deduplication: Kafka's
max.in.flight.requests.per.connection bound for idempotence."""
MAX_PRODUCER_STATES: Final = 100_000
"""(producer id, partition) sequence states kept; the least recently used goes first."""


@dataclass(slots=True)
class _Sent:
    first: int
    last: int
    result: asyncio.Future[int]  # the base offset


@dataclass(slots=True)
class SeqState:
    epoch: int
    sent: deque[_Sent] = field(default_factory=deque)


class ProduceHandlers(TopicMap):
    """Produce and InitProducerId of :class:`~sbpstream.kafka.gateway.KafkaGateway`."""

    _seq: OrderedDict[tuple[int, int], SeqState]

    def producer_of(self, conn: Conn) -> AsyncProducer:
        raise NotImplementedError

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
                batches = decode_batches(records or b"", budget=budget, encode=True)
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
        state: SeqState | None = None
        if b.producer_id >= 0:
            key = (b.producer_id, sid)
            state = self._seq.get(key)
            if state is None or b.producer_epoch > state.epoch:
                state = SeqState(b.producer_epoch)
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
            fut = await self.producer_of(conn).send_whole(
                sid, b.encoded if b.encoded is not None else b.records)
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
                      result: asyncio.Future[int], state: SeqState | None,
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
