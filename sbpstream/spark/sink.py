"""The ``sbpstream`` sink: ``df.write`` / ``writeStream`` append rows to one stream.

Exactly once for streaming writes rests on the data node's idempotent-producer check. Each Spark
task appends with its own producer id, ``hash(query id, partition id, batch id)`` (all three
read from the TaskContext: Spark keeps the query id in the checkpoint, so a restarted query
replays batch N with the same ids), epoch 0 and sequences from 0. Batches are cut by size
from the rows alone (one timestamp per task unless the rows carry one), encoded in bulk from
Spark's Arrow buffers (``BatchBuilder.add_columns``: the same bytes and cuts as row by row), so a
replay rebuilds the same batches with the same sequences; up to ``SINK_IN_FLIGHT`` of them are in
flight, a sliding window (``_Route.submit`` says why that stays exact). The data node answers a
duplicate among a producer's last 5 batches with its original offset, and an older one with
OUT_OF_ORDER_SEQUENCE, which this writer reads as "already stored" (its sequences have no
gaps). Across seals: before writing, the task asks the PM for the producer states stored with
the stream's sealed ranges (SEAL_RANGES is idempotent on any sealed range), newest first, and
skips the sequences they already hold, so a replay after any number of seals is deduplicated
(docs/spark.md).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructType,
    TimestampType,
)

from sbpstream.auth.client import client_security
from sbpstream.client import AsyncClient
from sbpstream.client.retry import MOVE_CODES
from sbpstream.client.types import Range, codec_of
from sbpstream.net.client import ConnectionPool
from sbpstream.net.loop import new_event_loop
from sbpstream.protocol.errors import ErrorCode, SbpError, code_name
from sbpstream.protocol.limits import SEQUENCE_WRAP
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
)
from sbpstream.records import BatchBuilder, BinaryColumn, Int64Column
from sbpstream.spark.meta import replica_addresses
from sbpstream.spark.options import SinkOptions
from sbpstream.spark.profiling import profiled

log = logging.getLogger("sbpstream.spark")

SINK_BATCH_BYTES = 1024 * 1024  # one APPEND batch; cut by the rows' sizes, so replays match
APPEND_MARGIN_MS = 2000
PRODUCER_ID_MASK = (1 << 63) - 1
BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark's MicroBatchExecution on every task
QUERY_ID_PROPERTY = "sql.streaming.queryId"  # the query's id, kept in its checkpoint

_BYTES_OR_STRING = (BinaryType, StringType)


def _is_bytes_or_string(t: DataType) -> bool:
    return isinstance(t, _BYTES_OR_STRING)


def check_sink_schema(schema: StructType, routed: bool = False) -> None:
    """``value`` is required; ``key``, ``headers`` and ``timestamp`` optional; others ignored.
    ``routed`` (no option 'stream'): a ``stream`` column, string (a name or id) or integer."""
    fields = {f.name.lower(): f for f in schema.fields}
    if routed:
        st = fields.get("stream")
        if st is None:
            raise ValueError("the sbpstream sink needs option 'stream' or a 'stream' column "
                             "(a stream name or id per row)")
        if not isinstance(st.dataType, StringType | IntegerType | LongType):
            raise ValueError(f"column 'stream' must be a string (name or id) or an integer, "
                             f"not {st.dataType}")
    value = fields.get("value")
    if value is None:
        raise ValueError(
            "the sbpstream sink needs a 'value' column (binary or string); got columns "
            + ", ".join(schema.fieldNames())
        )
    if not _is_bytes_or_string(value.dataType):
        raise ValueError(f"column 'value' must be binary or string, not {value.dataType}")
    key = fields.get("key")
    if key is not None and not _is_bytes_or_string(key.dataType):
        raise ValueError(f"column 'key' must be binary or string, not {key.dataType}")
    ts = fields.get("timestamp")
    if ts is not None and not isinstance(ts.dataType, TimestampType):
        raise ValueError(f"column 'timestamp' must be a timestamp, not {ts.dataType}")
    headers = fields.get("headers")
    if headers is not None:
        t = headers.dataType
        ok = (
            isinstance(t, ArrayType)
            and isinstance(t.elementType, StructType)
            and [f.name for f in t.elementType.fields] == ["key", "value"]
            and isinstance(t.elementType.fields[0].dataType, StringType)
            and _is_bytes_or_string(t.elementType.fields[1].dataType)
        )
        if not ok:
            raise ValueError(
                "column 'headers' must be array<struct<key: string, value: binary>>, "
                f"not {t.simpleString()}"
            )


def producer_id_of(*parts: object) -> int:
    """A stable 63-bit producer id from its parts (never -1, the non-idempotent marker)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & PRODUCER_ID_MASK


# Sealed ranges asked per SEAL_RANGES request when a task learns what a replayed batch already
# stored (well under the protocol's items-per-request limit).
SEAL_LOOKUP_CHUNK = 500


@dataclass(frozen=True)
class SinkCommitMessage(WriterCommitMessage):
    partition_id: int
    producer_id: int
    records: int
    batches: int
    duplicate_batches: int


def _b(v: Any) -> bytes | None:
    if v is None or isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)


def split_by_stream(batch: Any) -> list[tuple[Any, Any]]:
    """(stream name or id, its rows) per distinct value of the ``stream`` column, in order of
    first appearance; each stream's rows keep their order (what a replay rebuilds)."""
    names = {n.lower(): n for n in batch.schema.names}
    col = batch.column(names["stream"])
    if col.null_count:
        raise ValueError("column 'stream' is null in a row: every row needs a stream")
    uniques = pc.unique(col)
    if len(uniques) == 1:
        return [(uniques[0].as_py(), batch)]
    return [(u.as_py(), batch.filter(pc.equal(col, u))) for u in uniques]


def _binary(arr: Any) -> BinaryColumn:
    if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.binary())
    validity, offsets, data = arr.buffers()
    return BinaryColumn(offsets, b"" if data is None else data,
                        validity if arr.null_count else None, arr.offset)


def arrow_columns(batch: Any) -> tuple[BinaryColumn, BinaryColumn | None,
                                       Int64Column | None] | None:
    """The value, key and timestamp columns of an Arrow record batch as raw Arrow buffers (for
    ``BatchBuilder.add_columns``: no Python object per row), or None when a row has headers
    (those rows take the per-row path)."""
    names = {n.lower(): n for n in batch.schema.names}
    if "headers" in names:
        hs = batch.column(names["headers"])
        if len(hs.flatten()):
            return None
    keys = _binary(batch.column(names["key"])) if "key" in names else None
    stamps = None
    if "timestamp" in names:
        ts = batch.column(names["timestamp"])
        if ts.type.unit != "us":
            ts = ts.cast(pa.timestamp("us", ts.type.tz))
        validity, values = ts.buffers()
        stamps = Int64Column(values, validity if ts.null_count else None, ts.offset, 1000)
    return _binary(batch.column(names["value"])), keys, stamps


def iter_records(batch: Any, default_ts_ms: int) -> Iterator[tuple[Any, ...]]:
    """(value, key, headers, timestamp_ms) per row of an Arrow record batch."""
    names = {n.lower(): n for n in batch.schema.names}
    n = batch.num_rows
    values = batch.column(names["value"]).to_pylist()
    keys = batch.column(names["key"]).to_pylist() if "key" in names else [None] * n
    if "headers" in names:
        headers = [
            tuple((h["key"], _b(h["value"]) or b"") for h in hs) if hs else ()
            for hs in batch.column(names["headers"]).to_pylist()
        ]
    else:
        headers = [()] * n
    if "timestamp" in names:
        col = batch.column(names["timestamp"]).cast(pa.int64()).to_pylist()
        stamps = [default_ts_ms if t is None else t // 1000 for t in col]
    else:
        stamps = [default_ts_ms] * n
    for i in range(n):
        yield _b(values[i]), _b(keys[i]), headers[i], stamps[i]


class Appender:
    """Appends one producer's batches to one stream, deduplicated on replay."""

    def __init__(self, opts: SinkOptions, producer_id: int, stream_id: int,
                 client: AsyncClient, pool: ConnectionPool) -> None:
        self.opts = opts
        self.stream_id = stream_id
        self.producer_id = producer_id
        self.client = client
        self.pool = pool
        self.range: Range | None = None
        self.stored_through = -1  # the highest sequence an earlier, sealed range already holds
        self.duplicates = 0
        self.primed = False
        """True once a batch of this producer is confirmed in the current writable range: only
        then may several be in flight (the node accepts *any* first sequence of a producer it
        has not seen in a range, so a first batch overtaken by its successor would be lost)."""

    async def start(self) -> None:
        """Find the writable range, and the highest sequence of this producer that any sealed
        range already holds (a replayed batch skips those). Sealed ranges are asked newest
        first, ``SEAL_LOOKUP_CHUNK`` per request (SEAL_RANGES is idempotent on a sealed range:
        it answers the producer states stored at its seal); the first range that knows this
        producer holds its highest sequence, since a task sends its batches in order."""
        ranges = await self.client.list_ranges(self.stream_id)
        sealed = [r for r in reversed(ranges) if r.sealed and r.end_offset > r.start_offset]
        for i in range(0, len(sealed), SEAL_LOOKUP_CHUNK):
            chunk = sealed[i : i + SEAL_LOOKUP_CHUNK]
            try:
                items = await self.client.routing.sealed_states(
                    self.stream_id, [r.range_index for r in chunk])
            except SbpError as exc:
                log.warning("event=sink_prior_seal_unknown stream=%d error=%s", self.stream_id,
                            exc)
                break
            for item in sorted(items, key=lambda it: -max(
                    (r.range_index for r in it.ranges), default=-1)):
                if not item.status.ok:
                    log.warning("event=sink_prior_seal_unknown stream=%d error=%s",
                                self.stream_id, item.status.message)
                    continue
                for p in item.producers:
                    if p.producer_id == self.producer_id and p.producer_epoch == 0:
                        self.stored_through = max(self.stored_through, p.last_sequence)
            if self.stored_through >= 0:
                break
        await self._refresh()

    async def _refresh(self) -> Range:
        ranges = await self.client.list_ranges(self.stream_id)
        if not ranges:
            raise RuntimeError(f"option 'stream': stream {self.stream_id} has no ranges")
        if ranges[-1].sealed:
            res = await self.client.routing.seal(self.stream_id, ranges[-1].range_index)
            self.range = res.ranges[-1] if res.ranges else None
        else:
            self.range = ranges[-1]
        if self.range is None or self.range.sealed:
            raise RuntimeError(f"stream {self.stream_id} has no writable range")
        return self.range

    async def append(self, data: bytes, base_sequence: int, count: int) -> None:
        if base_sequence + count - 1 <= self.stored_through:
            self.duplicates += 1  # stored before the last seal: a replay
            return
        deadline = time.monotonic() + self.opts.timeout_ms / 1000
        attempt = 0
        while True:
            rng = self.range or await self._refresh()
            addrs = replica_addresses(rng)
            try:
                if not addrs:
                    raise RuntimeError(f"range {rng.range_index} has no primary")
                code = await self.send(addrs[0], rng, data)
            except SbpError as exc:
                code = exc.code
                if not (exc.retriable or code in MOVE_CODES):
                    raise
                self.pool.discard(addrs[0])
            if code == ErrorCode.NONE:
                self.primed = True
                return
            if code == ErrorCode.OUT_OF_ORDER_SEQUENCE:
                self.duplicates += 1  # older than the node's dedup window: already stored
                self.primed = True
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"stream {self.stream_id}: append failed ({code_name(code)}) for "
                    f"{self.opts.timeout_ms} ms (option 'timeoutMs')"
                )
            if code in MOVE_CODES:
                res = await self.client.routing.seal(self.stream_id, rng.range_index)
                last = (base_sequence + count - 1) % SEQUENCE_WRAP
                for p in res.producers:
                    if p.producer_id == self.producer_id and p.last_sequence >= last:
                        self.stored_through = max(self.stored_through, p.last_sequence)
                        return
                self.range = None
                self.primed = False
            elif code == ErrorCode.RANGE_NOT_FOUND:
                self.range = None
                self.primed = False
            await asyncio.sleep(min(1.0, 0.02 * 2**attempt))
            attempt += 1

    async def send(self, addr: str, rng: Range, data: bytes) -> int:
        """One APPEND of one batch; its error code (NONE when stored or a known duplicate)."""
        req = AppendRequest(
            timeout_ms=self.opts.timeout_ms,
            items=(
                AppendItem(
                    stream_id=self.stream_id,
                    request_index=0,
                    batch_length=len(data),
                    range_index=rng.range_index,
                ),
            ),
        )
        conn = await self.pool.get(addr)
        frame = await conn.request_one(
            req.OPCODE,
            req.encode(),
            data,
            timeout_s=(self.opts.timeout_ms + APPEND_MARGIN_MS) / 1000,
        )
        resp = AppendResponse.decode(frame.header)
        resp.status.raise_for_error()
        item = resp.items[0]
        code = int(item.status.code)
        if code not in (ErrorCode.NONE, ErrorCode.OUT_OF_ORDER_SEQUENCE) and not (
            item.status.error().retriable or code in MOVE_CODES or code == ErrorCode.RANGE_NOT_FOUND
        ):
            raise item.status.error()
        return code


SINK_IN_FLIGHT = 4
"""Batches of one stream in flight per task (at most the node's 5 remembered per producer, so
a resent window's stored batches are all recognised as duplicates)."""


class _Route:
    """One destination stream of a task: its appender, open batch, next sequence, and the
    batches in flight (a sliding window of at most ``SINK_IN_FLIGHT``)."""

    def __init__(self, app: Appender, codec: int, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.codec = codec
        self.loop = loop
        self.seq = 0
        self.sent = 0
        self.inflight: collections.deque[tuple[asyncio.Task[int], tuple[bytes, int, int]]] = (
            collections.deque())
        self.builder = self.new_builder()

    def new_builder(self) -> BatchBuilder:
        return BatchBuilder(codec=self.codec, batch_bytes_max=SINK_BATCH_BYTES,
                            producer_id=self.app.producer_id, producer_epoch=0,
                            base_sequence=self.seq)

    def cut(self) -> None:
        """Close the open batch and send it (sequences continue without gaps)."""
        b = self.builder
        self.submit((b.build(), self.seq, len(b)))
        self.seq = (self.seq + len(b)) % SEQUENCE_WRAP
        self.builder = self.new_builder()

    def submit(self, item: tuple[bytes, int, int]) -> None:
        """Send one batch, keeping at most ``SINK_IN_FLIGHT`` unanswered: the oldest answer is
        awaited first when the window is full, so the data node always has the next batches
        while this task encodes more. Exactly once (docs/spark.md): a batch is trusted only
        when it and every batch before it answered NONE; the first batch after a start, a seal
        or RANGE_NOT_FOUND goes alone."""
        app = self.app
        self.sent += 1
        if item[1] + item[2] - 1 <= app.stored_through:
            app.duplicates += 1  # stored before the last seal: a replay
            return
        rng = app.range
        if not app.primed or rng is None or not replica_addresses(rng):
            self.settle()
            self.loop.run_until_complete(app.append(*item))
            return
        while len(self.inflight) >= SINK_IN_FLIGHT:
            self._confirm_oldest()
        rng = app.range
        if not app.primed or rng is None or not replica_addresses(rng):
            self.loop.run_until_complete(app.append(*item))  # a resend moved the range
            return
        task = self.loop.create_task(app.send(replica_addresses(rng)[0], rng, item[0]))
        self.inflight.append((task, item))
        self.loop.run_until_complete(asyncio.sleep(0))  # let it write its frame now

    def _confirm_oldest(self) -> None:
        task, _ = self.inflight[0]
        try:
            code: int | BaseException = self.loop.run_until_complete(task)
        except Exception as exc:  # SbpError, OSError: resent below
            code = exc
        if code == ErrorCode.NONE:
            self.inflight.popleft()
            return
        # not trusted from here on: let every later answer arrive, then resend one at a time
        rest = [item for _, item in self.inflight]
        self.loop.run_until_complete(asyncio.gather(
            *(t for t, _ in self.inflight), return_exceptions=True))
        self.inflight.clear()
        for item in rest:
            self.loop.run_until_complete(self.app.append(*item))

    def settle(self) -> None:
        """Wait until every batch sent is confirmed stored (resending what must be)."""
        while self.inflight:
            self._confirm_oldest()


def write_partition(
    opts: SinkOptions, producer_id: int, partition_id: int, batches: Iterator[Any],
    producer_parts: tuple[object, ...] = (),
) -> SinkCommitMessage:
    """Append every row of one Spark task (blocking, on a private event loop).

    With option 'stream', one producer (``producer_id``) appends to it. Without, each row's
    ``stream`` column routes it, and each destination stream gets a producer of its own,
    ``producer_id_of(*producer_parts, "stream", id)``, with its own sequences: a replay routes
    the same rows the same way, so every stream sees the same batches again.
    """
    loop = new_event_loop()
    client = AsyncClient(list(opts.pm), request_timeout_ms=opts.timeout_ms,
                         retry_deadline_ms=opts.timeout_ms, **opts.security.client_kwargs())
    creds, ssl_context = client_security(opts.pm, **opts.security.client_kwargs())
    pool = ConnectionPool(ssl_context=ssl_context, authenticator=creds)
    codec = codec_of(opts.compression)
    ts_ms = time.time_ns() // 1_000_000
    routes: dict[int, _Route] = {}
    refs: dict[Any, int] = {}
    records = 0

    def route(sid: int) -> _Route:
        r = routes.get(sid)
        if r is None:
            pid = producer_id if opts.stream is not None else producer_id_of(
                *producer_parts, "stream", sid)
            app = Appender(opts, pid, sid, client, pool)
            loop.run_until_complete(app.start())
            r = routes[sid] = _Route(app, codec, loop)
        return r

    def stream_of(ref: Any) -> int:
        sid = refs.get(ref)
        if sid is None:
            text = str(ref)
            sid = refs[ref] = loop.run_until_complete(
                client.resolve_stream(int(text) if isinstance(ref, int) else text))
        return sid

    def add_rows(r: _Route, rb: Any) -> None:
        """Every row of ``rb`` into the route's batches, cut by size (the same cuts row by row
        or in bulk), each batch sent as it is cut."""
        cols = arrow_columns(rb)
        n, i = rb.num_rows, 0
        rows = None if cols is not None else iter_records(rb, ts_ms)
        while i < n:
            if cols is not None:
                i = r.builder.add_columns(*cols, ts_ms, i, n)
            else:
                assert rows is not None
                for value, key, headers, ts in rows:
                    if not r.builder.add(value, key, headers, ts):
                        r.cut()
                        r.builder.add(value, key, headers, ts)
                    i += 1
            if i < n:
                r.cut()

    fixed = None
    try:
        if opts.stream is not None:
            fixed = route(loop.run_until_complete(client.resolve_stream(opts.stream)))
        for rb in batches:
            if fixed is not None:
                add_rows(fixed, rb)
            else:
                for ref, rows in split_by_stream(rb):
                    add_rows(route(stream_of(ref)), rows)
            records += rb.num_rows
        for r in routes.values():
            if len(r.builder):
                r.cut()
            r.settle()
        sent = sum(r.sent for r in routes.values())
        dups = sum(r.app.duplicates for r in routes.values())
        return SinkCommitMessage(partition_id, producer_id, records, sent, dups)
    finally:
        for r in routes.values():  # an error left batches in flight: let them end first
            for t, _ in r.inflight:
                t.cancel()
            if r.inflight:
                loop.run_until_complete(asyncio.gather(*(t for t, _ in r.inflight),
                                                       return_exceptions=True))
        try:
            loop.run_until_complete(pool.close())
            loop.run_until_complete(client.close())
        finally:
            loop.close()


class SbpstreamBatchWriter(DataSourceArrowWriter):
    """``df.write.format("sbpstream")``: a producer per task, so a retried task deduplicates."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        self.schema = schema
        self.job_id = uuid.uuid4().hex  # made on the driver, pickled to every task

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        tc = TaskContext.get()
        pid = tc.partitionId() if tc is not None else 0
        with profiled("write"):
            return write_partition(self.opts, producer_id_of(self.job_id, pid), pid, iterator,
                                   (self.job_id, pid))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _log_commit(self.opts, None, messages)


class SbpstreamStreamWriter(DataSourceStreamArrowWriter):
    """``writeStream.format("sbpstream")``: exactly once via (query, partition, batch) ids."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        self.schema = schema

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        tc = TaskContext.get()
        if tc is None:
            raise RuntimeError("the sbpstream stream writer runs only inside a Spark task")
        query = tc.getLocalProperty(QUERY_ID_PROPERTY)
        batch = tc.getLocalProperty(BATCH_ID_PROPERTY)
        if not query or batch is None:
            raise RuntimeError(
                "Spark did not tell the task its streaming query id and batch id "
                f"({QUERY_ID_PROPERTY}, {BATCH_ID_PROPERTY}); exactly-once needs them"
            )
        pid = tc.partitionId()
        producer = producer_id_of(query, pid, batch)
        with profiled("write"):
            return write_partition(self.opts, producer, pid, iterator, (query, pid, batch))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _log_commit(self.opts, batchId, messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "event=sink_abort stream=%s batch=%d: a replay of this batch appends only what is "
            "missing",
            self.opts.stream if self.opts.stream is not None else "(column)",
            batchId,
        )


def _log_commit(
    opts: SinkOptions, batch_id: int | None, messages: list[WriterCommitMessage | None]
) -> None:
    msgs = [m for m in messages if isinstance(m, SinkCommitMessage)]
    log.info(
        "event=sink_commit stream=%s batch=%s records=%d batches=%d duplicate_batches=%d",
        opts.stream if opts.stream is not None else "(column)",
        batch_id,
        sum(m.records for m in msgs),
        sum(m.batches for m in msgs),
        sum(m.duplicate_batches for m in msgs),
    )
