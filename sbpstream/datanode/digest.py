"""Digest of a range's stored batches, for ``sbpstream check`` (DESCRIBE_RANGES' digest fields).

Replicas of a range hold the same batches byte for byte (a secondary stores what the primary
forwarded, a copy what a replica served), so the hex BLAKE2b-128 of the batches' bytes, as they
travel in FETCH, from the batch holding ``start`` below ``end``, is equal on every replica that
holds that part. ``end`` is capped at what is committed here (a reader's view: the uncommitted
tail of a writable range is not compared). The digest is computed on the event loop in chunks of
``DIGEST_CHUNK_BYTES``, yielding between them.

**Cost.** A digest reads what a FETCH of the same window would (the gate asks ``fetch`` on the
stream for it), so it is bounded and paid for like one: one DESCRIBE_RANGES hashes at most
:data:`MAX_DIGEST_BYTES_PER_REQUEST` over all its items (:class:`DigestBudget`); an item reached
with the budget spent stops at the last whole batch within it, and its answer's window
(``digest_end_offset``) says how far it got (ask again from there); and the bytes hashed are
charged to the caller's fetch quota (datanode/control.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from sbpstream.protocol.limits import MiB
from sbpstream.records.header import read_header

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

DIGEST_CHUNK_BYTES: Final = 4 * 1024 * 1024

MAX_DIGEST_BYTES_PER_REQUEST: Final = 1024 * MiB
"""Bytes one DESCRIBE_RANGES may hash over all its items: about a second of BLAKE2b on one
core, where an unbounded digest could hold the node for the whole digest deadline (120 s). A
window cut by it ends early (its answer says where); the caller asks again from there."""


@dataclass(slots=True)
class DigestBudget:
    """What one request may still hash, and what it hashed per stream (charged as fetch)."""

    left: int = MAX_DIGEST_BYTES_PER_REQUEST
    used: int = 0
    by_stream: dict[int, int] = field(default_factory=dict)

    def take(self, stream_id: int, n: int) -> None:
        self.left -= n
        self.used += n
        self.by_stream[stream_id] = self.by_stream.get(stream_id, 0) + n


@dataclass(frozen=True, slots=True)
class RangeDigest:
    digest: str
    start_offset: int  # base offset of the first batch covered (== end when none)
    end_offset: int  # the offset after the last batch covered


async def range_digest(ctx: NodeContext, stream_id: int, range_index: int, start: int,
                       end: int, budget: DigestBudget | None = None) -> RangeDigest:
    """The digest of ``[start, end)`` of a range as held here, within ``budget`` (a new one:
    MAX_DIGEST_BYTES_PER_REQUEST)."""
    budget = DigestBudget() if budget is None else budget
    st = ctx.store.describe_range(stream_id, range_index)
    info = ctx.table.get(stream_id, range_index)
    limit = min(end, st.next_offset)
    if info is not None:
        limit = min(limit, info.committed_offset)
    if st.sealed and st.end_offset >= 0:
        limit = min(limit, st.end_offset)
    pos = max(start if start >= 0 else st.start_offset, st.start_offset)
    stream_start = ctx.stream_start(stream_id)
    pos = max(pos, stream_start) if stream_start >= 0 else pos
    h = hashlib.blake2b(digest_size=16)
    first = -1
    while pos < limit and budget.left > 0:
        res = ctx.store.read(stream_id, pos, min(DIGEST_CHUNK_BYTES, budget.left),
                             max_offset=limit)
        if not res.batches:
            break
        for view in res.batches:
            if len(view) > budget.left:  # a whole batch or none: the window ends before it
                break
            hdr = read_header(view)
            if first < 0:
                first = hdr.base_offset
            h.update(view)
            budget.take(stream_id, len(view))
            pos = hdr.base_offset + hdr.record_count
        else:
            pos = res.next_offset
            await asyncio.sleep(0)
            continue
        break
    return RangeDigest(h.hexdigest(), first if first >= 0 else pos, max(pos, first))
