"""The PM's stream operations: create, describe and list (by id, name or prefix), update,
delete and trim, forwarding deletes and trims to the data nodes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Final, TypeVar

from sbpstream.pm.deadlines import call_timeout
from sbpstream.pm.metadata import (
    CreatedStream,
    DeleteOutcome,
    NewStream,
    RangeMeta,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.service_base import ServiceBase, check_batch, validate_stream_config
from sbpstream.protocol.errors import (
    InvalidRequestError,
    OffsetOutOfRangeError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import name_problem, validate_name_prefix, validate_stream_name

log = logging.getLogger("sbpstream.pm")

T = TypeVar("T")

RETENTION_UNCHANGED: Final = -1
"""UPDATE_STREAMS' retention_period_ms meaning "keep the current retention" (0 means keep
records forever, and a negative retention is otherwise invalid)."""

DESCRIBE_STREAMS_PAGE_MAX: Final = 1000
"""Default and largest page of DESCRIBE_STREAMS without ids (about 40 KiB of response)."""


class StreamOps(ServiceBase):
    async def create_streams(
        self, items: Sequence[tuple[int, int]], names: Sequence[str] = ()
    ) -> list[CreatedStream | SbpError]:
        """(replica_nums, retention_period_ms) items: validate, place, persist, tell the nodes.
        ``names``, when given, names each item ("" = unnamed; rules in protocol/names.py)."""
        check_batch(len(items))
        names = list(names) or [""] * len(items)
        out: list[CreatedStream | SbpError | None] = [None] * len(items)
        valid: list[int] = []
        for i, (replica_nums, retention_ms) in enumerate(items):
            try:
                validate_stream_config(replica_nums, retention_ms)
                if names[i]:
                    validate_stream_name(names[i])
            except SbpError as e:
                out[i] = e
                continue
            valid.append(i)
        if valid:
            await self._warm_up(max(items[i][0] for i in valid))
        placed = self.placer.place_many([items[i][0] for i in valid], self.clock())
        todo: list[tuple[int, NewStream]] = []
        for i, replicas in zip(valid, placed, strict=True):
            if isinstance(replicas, SbpError):
                out[i] = replicas
            else:
                todo.append((i, NewStream(items[i][0], items[i][1], replicas, names[i])))
        try:
            results = await self.meta.create_streams([ns for _, ns in todo], self.wall_ms())
        except SbpError as e:
            if e.redirect:
                raise  # not the leader (etcd backend): the whole request goes to the leader
            results = [e] * len(todo)
        fresh: list[RangeMeta] = []
        for (i, ns), res in zip(todo, results, strict=True):
            out[i] = res
            if isinstance(res, CreatedStream):
                fresh.append(res.first_range)
            else:
                self.placer.closed(r.node_id for r in ns.replicas)
        if fresh:
            log.info("event=streams_created count=%d first=%d last=%d", len(fresh),
                     fresh[0].stream_id, fresh[-1].stream_id)
            await self._sync_ranges(fresh)
        return [o for o in out if o is not None]

    async def describe_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | SbpError]:
        check_batch(len(stream_ids))
        found = await self.meta.get_streams(stream_ids)
        return [self._live_or_error(sid, s) for sid, s in zip(stream_ids, found, strict=True)]

    async def describe_stream_named(self, name: str) -> StreamMeta | SbpError:
        """The live stream holding ``name``, or StreamNotFoundError."""
        problem = name_problem(name)
        if problem is not None:
            return InvalidRequestError(problem)
        s = await self.meta.get_stream_by_name(name)
        return s if s is not None else StreamNotFoundError(f"no stream is named {name!r}")

    async def list_streams_by_prefix(
        self, prefix: str, continuation: int, limit: int
    ) -> tuple[list[StreamMeta], int]:
        """:meth:`list_streams` restricted to the streams named ``prefix...``."""
        validate_name_prefix(prefix)
        if limit <= 0 or limit > DESCRIBE_STREAMS_PAGE_MAX:
            limit = DESCRIBE_STREAMS_PAGE_MAX
        page = await self.meta.list_streams_by_prefix(prefix, max(continuation, 0), limit + 1)
        if len(page) > limit:
            page = page[:limit]
            return page, page[-1].stream_id
        return page, -1

    async def list_streams(self, continuation: int, limit: int) -> tuple[list[StreamMeta], int]:
        """A page of live streams after ``continuation`` (-1 = from the start) and the next
        continuation (-1 = no more)."""
        if limit <= 0 or limit > DESCRIBE_STREAMS_PAGE_MAX:
            limit = DESCRIBE_STREAMS_PAGE_MAX
        page = await self.meta.list_streams(max(continuation, 0), limit + 1)
        if len(page) > limit:
            page = page[:limit]
            return page, page[-1].stream_id
        return page, -1

    async def update_streams(
        self, items: Sequence[tuple[int, int, int]]
    ) -> list[StreamMeta | SbpError]:
        """(stream_id, replica_nums, retention_period_ms). An absent field keeps its current
        value: replica_nums 0 (the wire default) and retention_period_ms -1
        (RETENTION_UNCHANGED). A new count applies from the stream's next range."""
        check_batch(len(items))
        current = await self.meta.get_streams([sid for sid, _, _ in items])
        out: list[StreamMeta | SbpError | None] = [None] * len(items)
        todo: list[tuple[int, StreamUpdate]] = []
        for i, ((sid, rn, ret), cur) in enumerate(zip(items, current, strict=True)):
            s = self._live_or_error(sid, cur)
            if isinstance(s, SbpError):
                out[i] = s
                continue
            replica_nums = rn if rn != 0 else s.replica_nums
            retention = s.retention_period_ms if ret == RETENTION_UNCHANGED else ret
            try:
                validate_stream_config(replica_nums, retention)
            except SbpError as e:
                out[i] = e
                continue
            todo.append((i, StreamUpdate(sid, replica_nums, retention)))
        results = await self._guarded(
            self.meta.update_streams([u for _, u in todo], self.wall_ms()), len(todo)
        )
        for (i, _), res in zip(todo, results, strict=True):
            out[i] = res
        return [o for o in out if o is not None]

    async def _guarded(self, call: Awaitable[list[T | SbpError]], n: int) -> list[T | SbpError]:
        """A whole-batch metadata failure becomes that failure in every item's slot."""
        try:
            return await call
        except SbpError as e:
            if e.redirect:
                raise  # not the leader (etcd backend): the whole request goes to the leader
            return [e] * n

    async def delete_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | SbpError]:
        check_batch(len(stream_ids))
        async with self._locks.hold(stream_ids):
            results = await self._guarded(
                self.meta.delete_streams(stream_ids, self.wall_ms()), len(stream_ids)
            )
        forward: dict[int, list[int]] = {}
        out: list[StreamMeta | SbpError] = []
        for res in results:
            if not isinstance(res, DeleteOutcome):
                out.append(res)
                continue
            out.append(res.stream)
            for r in res.removed:
                if r.writable:
                    self.placer.closed(r.node_ids)
                for nid in r.node_ids:
                    forward.setdefault(nid, []).append(res.stream.stream_id)
            log.info("event=stream_deleted stream_id=%d ranges=%d", res.stream.stream_id,
                     len(res.removed))
        await self._each_node(
            {n: sorted(set(ids)) for n, ids in forward.items()}, self.dn.delete_streams,
            "delete_streams",
        )
        return out

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], from_data_node: bool
    ) -> list[TrimOutcome | SbpError]:
        """(stream_id, trim_offset). From users: checked against the stream's end, then forwarded
        to every data node that held a range of the stream. From data nodes (retention): only
        the metadata moves."""
        check_batch(len(items))
        out: list[TrimOutcome | SbpError | None] = [None] * len(items)
        async with self._locks.hold(sid for sid, _ in items):
            todo: list[tuple[int, tuple[int, int]]] = []
            for i, (sid, off) in enumerate(items):
                try:
                    if off < 0:
                        raise InvalidRequestError(f"trim offset {off} is negative")
                    if not from_data_node:
                        await self._check_trim_offset(sid, off)
                except SbpError as e:
                    out[i] = e
                    continue
                todo.append((i, (sid, off)))
            results = await self._guarded(
                self.meta.trim_streams([it for _, it in todo], self.wall_ms()), len(todo)
            )
        trimmed: list[TrimOutcome] = []
        for (i, (sid, _)), res in zip(todo, results, strict=True):
            out[i] = res
            if isinstance(res, TrimOutcome):
                trimmed.append(res)
                log.info("event=stream_trimmed stream_id=%d start_offset=%d dropped=%d "
                         "source=%s", sid, res.stream.start_offset, len(res.dropped),
                         "data_node" if from_data_node else "client")
        if trimmed and not from_data_node:
            await self._forward_trims(trimmed)
        return [o for o in out if o is not None]

    async def _forward_trims(self, trimmed: Sequence[TrimOutcome]) -> None:
        """Every node that held a range of the stream (dropped or left) drops what is below."""
        left = await self.meta.list_ranges([t.stream.stream_id for t in trimmed])
        forward: dict[int, list[tuple[int, int]]] = {}
        for t, ranges in zip(trimmed, left, strict=True):
            nodes = {n for r in (*t.dropped, *ranges) for n in r.node_ids}
            for nid in nodes:
                forward.setdefault(nid, []).append((t.stream.stream_id, t.stream.start_offset))
        await self._each_node(forward, self.dn.trim_streams, "trim_streams")

    async def _check_trim_offset(self, stream_id: int, trim_offset: int) -> None:
        """A user may not trim past the stream's end. The PM's knowledge of the writable range's
        end may be stale, so past it, ask the primary once before refusing."""
        ranges = (await self.meta.list_ranges([stream_id]))[0]
        if not ranges:
            return  # unknown / deleted: the metadata trim reports it
        last = ranges[-1]
        known_end = last.end_offset if not last.writable else max(last.next_offset,
                                                                   last.start_offset)
        if trim_offset <= known_end:
            return
        if last.writable:
            known_end = max(known_end, await self._fresh_next_offset(last))
        if trim_offset > known_end:
            raise OffsetOutOfRangeError(
                f"trim offset {trim_offset} is past the end {known_end} of stream {stream_id}"
            )

    async def _fresh_next_offset(self, rng: RangeMeta) -> int:
        pid = rng.primary_node_id
        st = self.registry.get(pid) if pid is not None else None
        if st is None or not self.registry.is_live(st.node_id, self.clock()):
            return rng.next_offset
        try:
            nxt = await asyncio.wait_for(
                self.dn.describe_range(st, rng.stream_id, rng.range_index), call_timeout()
            )
        except (SbpError, OSError, TimeoutError) as e:
            log.warning("event=describe_range_failed node_id=%d stream_id=%d range_index=%d "
                        "error=%r", st.node_id, rng.stream_id, rng.range_index, str(e))
            return rng.next_offset
        await self.meta.record_next_offsets([(rng.stream_id, rng.range_index, nxt)])
        return nxt
