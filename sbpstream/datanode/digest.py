"""Digest of a range's stored batches, for ``sbpstream check`` (DESCRIBE_RANGES' digest fields).

Replicas of a range hold the same batches byte for byte (a secondary stores what the primary
forwarded, a copy what a replica served), so the hex BLAKE2b-128 of the batches' bytes, as they
travel in FETCH, from the batch holding ``start`` below ``end``, is equal on every replica that
holds that part. ``end`` is capped at what is committed here (a reader's view: the uncommitted
tail of a writable range is not compared). The digest is computed on the event loop in chunks of
``DIGEST_CHUNK_BYTES``, yielding between them.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sbpstream.records.header import read_header

if TYPE_CHECKING:
    from sbpstream.datanode.context import NodeContext

DIGEST_CHUNK_BYTES: Final = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RangeDigest:
    digest: str
    start_offset: int  # base offset of the first batch covered (== end when none)
    end_offset: int  # the offset after the last batch covered


async def range_digest(ctx: NodeContext, stream_id: int, range_index: int, start: int,
                       end: int) -> RangeDigest:
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
    while pos < limit:
        res = ctx.store.read(stream_id, pos, DIGEST_CHUNK_BYTES, max_offset=limit)
        if not res.batches:
            break
        for view in res.batches:
            hdr = read_header(view)
            if first < 0:
                first = hdr.base_offset
            h.update(view)
        pos = res.next_offset
        await asyncio.sleep(0)
    return RangeDigest(h.hexdigest(), first if first >= 0 else pos, max(pos, first))
