"""Executor-side read of one partition: records [from, until) of one range, as Arrow batches.

Each FETCH answer is decoded straight into Arrow's buffer layout
(:func:`sbpstream.records.decode_column_buffers`), so no Python object is made per record.

Everything comes from the partition itself (replica addresses, range, offsets), so a read costs
no PM round trip: FETCH goes straight to the range's replicas, the primary first, another
replica after an error. The PM is asked only when every replica failed or the range ended
before ``until`` (it was sealed early, so the rest lives in the next range).

Records trimmed away before they were read are data loss: with ``failOnDataLoss`` the read
fails; without it they are skipped with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sbpstream.auth.client import client_security
from sbpstream.client import AsyncClient
from sbpstream.net.client import ConnectionPool, ResponseStream
from sbpstream.net.loop import new_event_loop
from sbpstream.protocol.errors import ErrorCode, SbpError
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse
from sbpstream.records import ColumnBuffers, decode_column_buffers, iter_batches, read_header
from sbpstream.records.reader import Buffer
from sbpstream.spark.meta import replica_addresses
from sbpstream.spark.options import SecurityOptions
from sbpstream.spark.profiling import Phases
from sbpstream.spark.schema import US_PER_MS

log = logging.getLogger("sbpstream.spark")

FETCH_MAX_WAIT_MS = 500  # long poll when a replica has not yet been told the records are committed
FETCH_FRAME_MARGIN_S = 5.0  # client wait for a response frame beyond max_wait_ms
BACKOFF_MAX_S = 1.0

LOSS_CODES = frozenset(
    {ErrorCode.OFFSET_TRIMMED, ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED}
)


RELOCATE_CODES = frozenset({ErrorCode.RANGE_NOT_FOUND, ErrorCode.NOT_PRIMARY})


class _Retry(Exception):
    """This replica could not serve the read now: try another, then ask the PM."""


class DataLossError(RuntimeError):
    """Records a query needs were trimmed away (or their stream deleted) before being read."""


def data_loss_message(stream_id: int, lo: int, hi: int, why: str) -> str:
    return (
        f"failOnDataLoss: records [{lo}, {hi}) of stream {stream_id} are gone ({why}) before "
        "the query read them; set option failOnDataLoss=false to skip lost records"
    )


@dataclass(frozen=True, slots=True)
class SpanRequest:
    """What one read needs (a plain copy of the partition's fields)."""

    pm: tuple[str, ...]
    stream_id: int
    range_index: int
    from_offset: int
    until_offset: int
    replicas: tuple[str, ...]
    fail_on_data_loss: bool
    timeout_ms: int
    fetch_max_bytes: int
    security: SecurityOptions = field(default_factory=SecurityOptions)


class SpanReader:
    """Async reader of one span; ``next_columns`` returns None once ``until`` is reached."""

    def __init__(self, req: SpanRequest, phases: Phases | None = None) -> None:
        self.req = req
        self.phases = phases
        self.pos = req.from_offset
        self.range_index = req.range_index
        self.replicas = list(req.replicas)
        self._replica = 0
        creds, ssl_context = client_security(req.pm, **req.security.client_kwargs())
        self._pool = ConnectionPool(connect_timeout_s=min(req.timeout_ms, 5000) / 1000,
                                    ssl_context=ssl_context, authenticator=creds)
        self._client: AsyncClient | None = None
        self._ahead: tuple[int, int, str, ResponseStream] | None = None
        """A FETCH sent before the last answer was handed over: (pos, range, replica, its
        response). The data node prepares it while Spark consumes the batch before it."""

    async def close(self) -> None:
        await self._drop_ahead()
        await self._pool.close()
        if self._client is not None:
            await self._client.close()

    async def next_columns(self) -> ColumnBuffers | None:
        """The next records of the span (possibly none yet), or None at its end."""
        req = self.req
        deadline = time.monotonic() + req.timeout_ms / 1000
        failures = 0
        while self.pos < req.until_offset:
            try:
                cols = await self._fetch_once()
            except _Retry as exc:
                failures += 1
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"option 'pm': cannot read stream {req.stream_id} range "
                        f"{self.range_index} at offset {self.pos} from any replica "
                        f"({','.join(self.replicas) or 'none'}): {exc}"
                    ) from None
                await self._next_replica(failures)
                continue
            if cols is not None:
                return cols
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"stream {req.stream_id}: offsets [{self.pos}, {req.until_offset}) planned "
                    f"but not readable within {req.timeout_ms} ms (option 'timeoutMs')"
                )
        return None

    async def _next_replica(self, failures: int) -> None:
        self._replica += 1
        if self._replica % max(1, len(self.replicas)) == 0:
            await asyncio.sleep(min(BACKOFF_MAX_S, 0.05 * 2 ** min(failures, 6)))
            await self._locate()

    async def _locate(self) -> None:
        """Ask the PM which range holds ``pos`` now, and its replicas."""
        if self.phases is not None:
            self.phases.add("pm_lookups", 0.0)
        if self._client is None:
            self._client = self._new_client()
        ranges = await self._client.list_ranges(self.req.stream_id)
        for r in ranges:
            if r.start_offset <= self.pos and (not r.sealed or self.pos < r.end_offset):
                self.range_index = r.range_index
                self.replicas = list(replica_addresses(r))
                return
        if ranges and self.pos < ranges[0].start_offset:
            self._lost(ranges[0].start_offset, "trimmed")

    async def _on_loss(self, code: int, start: int) -> None:
        why = ErrorCode(code).name.lower()
        if code in (ErrorCode.STREAM_NOT_FOUND, ErrorCode.STREAM_DELETED):
            self._lost(self.req.until_offset, why)
            return
        if start <= self.pos:  # the node did not say where the stream starts now: ask the PM
            if self._client is None:
                self._client = self._new_client()
            start = await self._client.start_offset(self.req.stream_id)
        if start <= self.pos:
            raise _Retry(f"offset {self.pos} reported {why}, but the stream starts at {start}")
        self._lost(start, why)

    def _new_client(self) -> AsyncClient:
        return AsyncClient(
            list(self.req.pm),
            request_timeout_ms=self.req.timeout_ms,
            retry_deadline_ms=self.req.timeout_ms,
            **self.req.security.client_kwargs(),
        )

    def _lost(self, new_start: int, why: str) -> None:
        req = self.req
        hi = min(new_start, req.until_offset)
        msg = data_loss_message(req.stream_id, self.pos, hi, why)
        if req.fail_on_data_loss:
            raise DataLossError(msg)
        log.warning("%s; skipped (failOnDataLoss=false)", msg.removeprefix("failOnDataLoss: "))
        self.pos = max(self.pos, hi)

    async def _drop_ahead(self) -> None:
        if self._ahead is not None:
            await self._ahead[3].aclose()
            self._ahead = None

    async def _send(self, addr: str, pos: int) -> ResponseStream:
        req = self.req
        fetch = FetchRequest(
            max_wait_ms=FETCH_MAX_WAIT_MS,
            min_bytes=1,
            items=(
                FetchItem(
                    stream_id=req.stream_id,
                    request_index=0,
                    fetch_offset=pos,
                    batch_max_bytes=req.fetch_max_bytes,
                    range_index=self.range_index,
                ),
            ),
        )
        conn = await self._pool.get(addr)
        timeout_s = FETCH_MAX_WAIT_MS / 1000 + req.timeout_ms / 1000 + FETCH_FRAME_MARGIN_S
        return await conn.stream(fetch.OPCODE, fetch.encode(), timeout_s=timeout_s)

    async def _fetch_once(self) -> ColumnBuffers | None:
        """One FETCH round; columns (maybe empty) when it advanced, None to try again."""
        req = self.req
        if not self.replicas:
            await self._locate()
            if not self.replicas:
                raise _Retry(f"stream {req.stream_id} range {self.range_index} has no replica")
        addr = self.replicas[self._replica % len(self.replicas)]
        ahead, self._ahead = self._ahead, None
        chunks: list[memoryview] = []
        range_end = -1
        loss: tuple[int, int] | None = None  # (code, the stream's start as the node reports it)
        try:
            if ahead is not None and ahead[:3] == (self.pos, self.range_index, addr):
                rs = ahead[3]
            else:
                if ahead is not None:
                    await ahead[3].aclose()
                rs = await self._send(addr, self.pos)
            async with rs:
                async for frame in rs:
                    resp = FetchResponse.decode(frame.header)
                    resp.status.raise_for_error()
                    for item, chunk in resp.chunks(frame.payload):
                        code = item.status.code
                        if code in LOSS_CODES or (
                            code == ErrorCode.OFFSET_OUT_OF_RANGE and item.start_offset > self.pos
                        ):
                            loss = (code, item.start_offset)
                        elif not item.status.ok:
                            raise item.status.error()
                        else:
                            if item.range_end_offset >= 0:
                                range_end = item.range_end_offset
                            if len(chunk):
                                chunks.append(chunk)
        except SbpError as exc:
            if exc.retriable or exc.code in RELOCATE_CODES:
                self._pool.discard(addr)
                raise _Retry(str(exc)) from None
            raise
        if loss is not None:
            await self._on_loss(*loss)
            return _EMPTY
        if chunks:
            buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            await self._fetch_ahead(addr, buf, range_end)
            t0 = time.perf_counter()
            cols = decode_column_buffers(buf, start_offset=self.pos,
                                         until_offset=req.until_offset, ts_scale=US_PER_MS)
            if self.phases is not None:
                self.phases.add("decode", time.perf_counter() - t0)
            if cols.rows:
                self.pos = int.from_bytes(cols.offsets[-8:], "little") + 1
                return cols
        if range_end >= 0 and self.pos >= range_end:
            await self._locate()  # sealed before `until`: the rest is in the next range
            return _EMPTY
        return None

    async def _fetch_ahead(self, addr: str, buf: Buffer, range_end: int) -> None:
        """Send the next FETCH now (from the end of the last whole batch in ``buf``), before
        this answer is decoded and handed to Spark, unless the span or the range ends here.
        An error sending it is left to the round that would use it (it sends again)."""
        nxt = -1
        for batch in iter_batches(buf, allow_partial_tail=True):
            nxt = read_header(batch).next_offset
        if nxt <= self.pos or nxt >= self.req.until_offset or 0 <= range_end <= nxt:
            return
        try:
            self._ahead = (nxt, self.range_index, addr, await self._send(addr, nxt))
        except (SbpError, OSError) as exc:
            log.debug("event=spark_fetch_ahead_failed addr=%s error=%r", addr, exc)


_EMPTY = decode_column_buffers(b"")


def read_span(req: SpanRequest, to_batch: Any, phases: Phases | None = None) -> Iterator[Any]:
    """Blocking generator of ``to_batch(columns)`` for the span, on a private event loop.
    With ``phases``, where the time went: fetch (and decode), arrow, handoff."""
    loop = new_event_loop()
    reader = SpanReader(req, phases)
    clock = time.perf_counter
    try:
        while True:
            t0 = clock()
            cols = loop.run_until_complete(reader.next_columns())
            if cols is None:
                return
            if cols.rows:
                if phases is None:
                    yield to_batch(cols)
                    continue
                t1 = clock()
                batch = to_batch(cols)
                t2 = clock()
                yield batch
                phases.add("fetch", t1 - t0)  # decode included; the bench subtracts it
                phases.add("arrow", t2 - t1)
                phases.add("handoff", clock() - t2)
                phases.add("rows", 0.0, cols.rows)
    finally:
        try:
            loop.run_until_complete(reader.close())
        finally:
            loop.close()
