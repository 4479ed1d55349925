"""Primary-to-secondary replication of a range (design.md section 5).

The primary assigns offsets and writes locally; right after ``store.append`` (synchronously, so
in offset order) the batch is handed to the range's :class:`RangeReplicator`. One sender task per
range forwards everything queued as ONE replication APPEND (``replication=True``, batches carrying
their base offsets, ``committed_offset`` = what the primary has acknowledged so far) to every
secondary at once, and resolves the batches' futures when **all** secondaries answered OK. Rounds
are strictly sequential, so a secondary always receives a range's batches in offset order (it
rejects a batch that does not start at its next offset).

The first failed round breaks the replicator for good: that batch and every later one fail with
REPLICA_UNAVAILABLE, nothing more is forwarded, and the writer seals the range at the PM (which
cuts it at the minimum end over the reachable replicas, so unacknowledged tails vanish and every
acknowledged record survives). Each successful round raises the range's ``replicated_offset``
(every secondary holds everything below it); the seal answers it as this node's end, so batches
written here but never replicated are cut by the seal instead of leaving the secondaries short.
A secondary learns the committed offset with the next round, or the
sealed end at seal time; until then it does not serve the newest records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sbpstream.protocol.errors import ReplicaUnavailableError, SbpError
from sbpstream.protocol.messages import AppendItem, AppendRequest, AppendResponse
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records.header import patch_base_offset, read_header

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext
    from sbpstream.datanode.ranges import RangeInfo

log = logging.getLogger("sbpstream.datanode.replication")

# One replication round carries at most this many bytes of batches: it must fit one frame (16 MiB)
# with room for the header; a bigger backlog goes in the next round.
MAX_ROUND_BYTES: Final = 8 * 1024 * 1024
# ...and at most this many batches (the header's item vector grows with it).
MAX_ROUND_ITEMS: Final = 1000
# A secondary that does not answer a round within this bound is treated as failed.
ROUND_TIMEOUT_S: Final = 10.0
# Bytes queued for replication per range before appends are refused (memory bound).
MAX_QUEUED_BYTES: Final = 64 * 1024 * 1024


@dataclass(slots=True)
class _Pending:
    data: bytearray  # the batch with its base offset written in
    done: asyncio.Future[None]
    next_offset: int  # the offset after the batch


class RangeReplicator:
    def __init__(self, ctx: NodeContext, rng: RangeInfo) -> None:
        self.ctx = ctx
        self.rng = rng
        self.queue: deque[_Pending] = deque()
        self.queued_bytes = 0
        self.broken: SbpError | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def secondaries(self) -> list[str]:
        return [rn.data_node.advertise_addr for rn in self.rng.replicas
                if rn.data_node.node_id != self.ctx.node_id]

    def submit(self, batch: memoryview, base_offset: int) -> asyncio.Future[None]:
        """Queue a batch just stored at ``base_offset``; the future resolves once replicated."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self.broken is None and self.queued_bytes + len(batch) > MAX_QUEUED_BYTES:
            self._break(ReplicaUnavailableError(
                f"replication backlog of range {self.rng.stream_id}/{self.rng.range_index} "
                f"exceeds {MAX_QUEUED_BYTES} bytes: secondaries too slow"))
        if self.broken is not None:
            fut.set_exception(self.broken)
            return fut
        data = bytearray(batch)
        patch_base_offset(data, base_offset)
        self.queue.append(_Pending(data, fut, base_offset + read_header(data).record_count))
        self.queued_bytes += len(data)
        self._wake.set()
        if self._task is None:
            self._task = loop.create_task(self._run())
        return fut

    def _break(self, exc: SbpError, *, failure: bool = True) -> None:
        if self.broken is None:
            self.broken = exc
            if failure:
                log.warning("event=replication_broken stream_id=%d range_index=%d error=%r",
                            self.rng.stream_id, self.rng.range_index, str(exc))
        pending, self.queue = self.queue, deque()
        self.queued_bytes = 0
        for p in pending:
            if not p.done.done():
                p.done.set_exception(exc)

    async def _run(self) -> None:
        while self.broken is None:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            take: list[_Pending] = []
            size = 0
            while self.queue and len(take) < MAX_ROUND_ITEMS and (
                    not take or size + len(self.queue[0].data) <= MAX_ROUND_BYTES):
                p = self.queue.popleft()
                take.append(p)
                size += len(p.data)
            self.queued_bytes -= size
            try:
                await self._round(take)
            except SbpError as exc:
                for p in take:
                    if not p.done.done():
                        p.done.set_exception(exc)
                self._break(exc)
                return
            except Exception as exc:  # a failed round must never leave writers hanging
                err = ReplicaUnavailableError(f"replication failed: {type(exc).__name__}: {exc}")
                for p in take:
                    if not p.done.done():
                        p.done.set_exception(err)
                self._break(err)
                return
            # every secondary holds these batches: raise the mark BEFORE any writer can be
            # acknowledged (the futures' callbacks run later), so that whatever was acknowledged
            # is below it when a seal reads it
            self.rng.replicated_offset = max(self.rng.replicated_offset, take[-1].next_offset)
            for p in take:
                if not p.done.done():
                    p.done.set_result(None)

    async def _round(self, take: list[_Pending]) -> None:
        rng = self.rng
        header = AppendRequest(
            timeout_ms=int(ROUND_TIMEOUT_S * 1000),
            items=tuple(AppendItem(stream_id=rng.stream_id, request_index=i,
                                   batch_length=len(p.data), range_index=rng.range_index)
                        for i, p in enumerate(take)),
            replication=True,
            committed_offset=rng.committed_offset,
        ).encode()
        payload = [p.data for p in take]
        targets = self.secondaries
        results = await asyncio.gather(
            *(self._send(addr, header, payload, len(take)) for addr in targets),
            return_exceptions=True)
        for addr, res in zip(targets, results, strict=True):
            if isinstance(res, BaseException):
                if isinstance(res, SbpError):
                    raise ReplicaUnavailableError(
                        f"secondary {addr} failed for range {rng.stream_id}/{rng.range_index}: "
                        f"{res}") from res
                raise ReplicaUnavailableError(
                    f"secondary {addr} failed for range {rng.stream_id}/{rng.range_index}: "
                    f"{type(res).__name__}: {res}") from res

    async def _send(self, addr: str, header: bytes, payload: list[bytearray], n: int) -> None:
        conn = await self.ctx.pool.get(addr)
        frames = await conn.request(Opcode.APPEND, header, payload, timeout_s=ROUND_TIMEOUT_S)
        answered = 0
        for f in frames:
            for r in AppendResponse.decode(f.header).items:
                answered += 1
                if r.status.code:
                    raise r.status.error()
        if answered != n:
            raise ReplicaUnavailableError(f"secondary {addr} answered {answered} of {n} items")

    def close(self) -> None:
        """The range was sealed or deleted here: not a failure, nothing more is forwarded."""
        self._break(ReplicaUnavailableError(
            f"range {self.rng.stream_id}/{self.rng.range_index} is no longer replicated here"),
            failure=False)
        if self._task is not None:
            self._task.cancel()


class Replicators:
    """The replicators of this node's primary ranges that have secondaries."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.by_range: dict[tuple[int, int], RangeReplicator] = {}

    def needs(self, rng: RangeInfo) -> bool:
        return any(rn.data_node.node_id != self.ctx.node_id for rn in rng.replicas)

    def get(self, rng: RangeInfo) -> RangeReplicator:
        key = (rng.stream_id, rng.range_index)
        r = self.by_range.get(key)
        if r is None or r.rng is not rng:
            if r is not None:
                r.close()  # the range was adopted again: the old replicator must not linger
            r = self.by_range[key] = RangeReplicator(self.ctx, rng)
        return r

    def drop(self, stream_id: int, range_index: int | None = None) -> None:
        for key in [k for k in self.by_range
                    if k[0] == stream_id and (range_index is None or k[1] == range_index)]:
            self.by_range.pop(key).close()

    def close(self) -> None:
        for r in self.by_range.values():
            with contextlib.suppress(Exception):
                r.close()
        self.by_range.clear()
