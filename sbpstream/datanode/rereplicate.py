"""Re-replication: copy a sealed range this node was just given from a surviving replica.

The PM hands a sealed range (``end_offset > start_offset``) to a node that does not hold it when
one of its replicas died for good (design.md 5). The node creates the range at its start (or
resumes a copy an earlier attempt left unfinished), FETCHes ``[start, end)`` from any other
replica the Range lists, chunk by chunk (``COPY_CHUNK_BYTES`` per FETCH bounds memory), appends
each batch as a replication append (offsets already assigned), makes it durable, seals the range
at ``end`` and commits it there. Only then does SYNC_RANGES answer OK for it. Concurrent requests
for the same range (a PM retrying after its call timed out) join the copy in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final

from sbpstream.net.client import Connection
from sbpstream.protocol.errors import (
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
)
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse, Range
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records.header import BatchError, split_batches

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

log = logging.getLogger("sbpstream.datanode")

COPY_CHUNK_BYTES: Final = 4 * 1024 * 1024
"""batch_max_bytes of each FETCH of a copy: bounds the bytes held at once."""
COPY_FETCH_TIMEOUT_S: Final = 30.0
"""One FETCH round trip to the source replica."""
COPY_CONNECT_TIMEOUT_S: Final = 5.0


def needs_copy(ctx: NodeContext, r: Range) -> bool:
    """A sealed range with data that this node lacks (absent, or an unfinished earlier copy)."""
    if r.end_offset <= r.start_offset or (r.replica_nodes and not ctx.is_me(r.replica_nodes)):
        return False
    try:
        st = ctx.store.describe_range(r.stream_id, r.range_index)
    except RangeNotFoundError:
        return True
    return not st.sealed and st.next_offset < r.end_offset


class Rereplicator:
    """Copies sealed ranges into this node, one task per range."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._inflight: dict[tuple[int, int], asyncio.Task[None]] = {}

    async def copy(self, r: Range) -> None:
        key = (r.stream_id, r.range_index)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._copy(r))
            self._inflight[key] = task
            task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        await asyncio.shield(task)

    def _sources(self, r: Range) -> list[str]:
        return [rn.data_node.advertise_addr for rn in r.replica_nodes
                if rn.data_node.node_id != self.ctx.node_id and rn.data_node.advertise_addr]

    async def _copy(self, r: Range) -> None:
        ctx = self.ctx
        store = ctx.store
        try:
            st = store.describe_range(r.stream_id, r.range_index)
        except RangeNotFoundError:
            st = store.create_range(r.stream_id, r.range_index, r.start_offset)
        ctx.table.ensure(r.stream_id, r.range_index, st.start_offset)
        errors: list[str] = []
        t0 = time.monotonic()
        for addr in self._sources(r):
            try:
                copied = await self._copy_from(addr, r)
            except (SbpError, OSError, TimeoutError, BatchError) as exc:
                errors.append(f"{addr}: {type(exc).__name__}: {exc}")
                log.warning("event=rereplicate_source_failed stream_id=%d range_index=%d "
                            "source=%s error=%r", r.stream_id, r.range_index, addr, str(exc))
                continue
            await store.sync(store.log_position)
            end = store.seal_range(r.stream_id, r.range_index, r.end_offset)
            ctx.set_committed(r.stream_id, r.range_index, end)
            log.info("event=range_copied stream_id=%d range_index=%d start_offset=%d "
                     "end_offset=%d source=%s bytes=%d elapsed_ms=%d", r.stream_id,
                     r.range_index, r.start_offset, end, addr, copied,
                     int((time.monotonic() - t0) * 1000))
            return
        raise ReplicaUnavailableError(
            f"range {r.stream_id}/{r.range_index}: no replica to copy from "
            f"({'; '.join(errors) or 'none listed'})")

    async def _copy_from(self, addr: str, r: Range) -> int:
        """Append [local next, end) fetched from ``addr``; returns the bytes copied."""
        store = self.ctx.store
        pool = self.ctx.pool  # its TLS and node credentials (auth on) serve this copy too
        conn = await Connection.open(addr, connect_timeout_s=COPY_CONNECT_TIMEOUT_S,
                                     ssl_context=pool.ssl_context,
                                     authenticator=pool.authenticator)
        copied = 0
        try:
            offset = store.describe_range(r.stream_id, r.range_index).next_offset
            while offset < r.end_offset:
                req = FetchRequest(max_wait_ms=0, min_bytes=1, items=(FetchItem(
                    stream_id=r.stream_id, request_index=0, fetch_offset=offset,
                    batch_max_bytes=COPY_CHUNK_BYTES, range_index=r.range_index),))
                frames = await conn.request(Opcode.FETCH, req.encode(),
                                            timeout_s=COPY_FETCH_TIMEOUT_S)
                progressed = False
                for f in frames:
                    for item in FetchResponse.decode(f.header).items:
                        if item.status.code:
                            raise item.status.error()
                    payload = memoryview(f.payload)
                    for pos, h in split_batches(payload):
                        if h.base_offset >= r.end_offset:
                            break
                        if h.base_offset + h.record_count <= offset:
                            continue  # already here (an overlapping answer)
                        batch = payload[pos : pos + h.total_size]
                        store.append(r.stream_id, r.range_index, batch, assign_offset=False)
                        offset = h.base_offset + h.record_count
                        copied += h.total_size
                        progressed = True
                if not progressed:
                    raise ReplicaUnavailableError(
                        f"replica {addr} returned nothing at {offset} < {r.end_offset}")
                # durable chunk by chunk: the page cache holds no unbounded backlog
                await store.sync(store.log_position)
        finally:
            await conn.aclose()
        if offset != r.end_offset:
            raise ReplicaUnavailableError(
                f"replica {addr}: copy ended at {offset}, the range ends at {r.end_offset}")
        return copied
