"""Consumer groups in the SDK: committed offsets and members sharing streams (issue 21).

:class:`GroupAdmin` speaks the group opcodes (docs/protocol.md, "Consumer groups").
:class:`GroupMember` is the reader behind ``AsyncClient.consumer(streams, group="g")`` (an
:class:`~sbpstream.client.consumer.AsyncConsumer` delegating to it, by composition): it holds a
plain :class:`~sbpstream.client.pull.StreamReader` of the streams assigned to it now.

- It joins the group and heartbeats from a background task (every ``heartbeat_interval_ms``,
  faster while a rebalance is under way). The PM answers with the streams to read.
- Assignment changes are applied between rounds of the iteration (as Kafka applies them in
  ``poll``): revoked streams are committed first, then released (the next heartbeat no longer
  reports them, and only then does the PM hand them to another member); added streams start at
  their committed offset, else at ``start``.
- Auto-commit (the default) commits, every ``auto_commit_interval_ms`` and at close, the offset
  after the last record *handed out* per stream: at least once (records handed out but not
  processed when the process dies are read again by the next owner).
- After a PM failover (or a missed session) the heartbeat gets UNKNOWN_MEMBER: the consumer
  rejoins with its member id and reports the streams it still reads, which it keeps unless
  another member holds them by then (those are *lost*: their commits are refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

from sbpstream.client.options import ConsumerOptions
from sbpstream.client.pull import StreamReader
from sbpstream.client.types import (
    ColumnBatch,
    ConsumedRecord,
    RebalanceEvent,
)
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    IllegalGenerationError,
    InvalidRequestError,
    SbpError,
    UnknownMemberError,
)

if TYPE_CHECKING:
    from sbpstream.client.core import ClientCore

log = logging.getLogger("sbpstream.client.groups")

REBALANCE_HEARTBEAT_MS: Final = 100
"""Heartbeat interval while the assignment is moving (released streams reach their new owner
one heartbeat later)."""

LATEST_LOOKUPS: Final = 64
"""End offsets looked up at once when newly assigned streams start at "latest"."""

PmCall = Callable[[Any, Any], Awaitable[Any]]
"""``AsyncClient``'s call to the PM leader (redirects and retries included)."""

StreamSpec = int | str | Sequence[int | str]
"""Ids, names and at most one pattern (a name prefix ending in ``*``)."""


def split_streams(streams: StreamSpec) -> tuple[tuple[int, ...], tuple[str, ...], str]:
    """(ids, names, pattern) of a group consumer's ``streams``."""
    items: Sequence[int | str] = (
        [streams] if isinstance(streams, int | str) else list(streams))
    ids = tuple(s for s in items if isinstance(s, int))
    strs = [s for s in items if isinstance(s, str)]
    patterns = [s for s in strs if s.endswith("*")]
    if len(patterns) > 1:
        raise InvalidRequestError(f"at most one stream pattern, got {patterns}")
    names = tuple(s for s in strs if not s.endswith("*"))
    if not (ids or names or patterns):
        raise InvalidRequestError("a group consumer needs streams: ids, names or a pattern")
    return ids, names, patterns[0] if patterns else ""


class GroupAdmin:
    """The group opcodes as calls (raises the response's top-level error)."""

    def __init__(self, pm_call: PmCall) -> None:
        self.pm_call = pm_call

    async def join(self, group: str, member_id: str, streams: StreamSpec,
                   session_timeout_ms: int, client_id: str) -> m.JoinGroupResponse:
        ids, names, pattern = split_streams(streams)
        req = m.JoinGroupRequest(0, group, member_id, ids, tuple(m.NameItem(n) for n in names),
                                 pattern, session_timeout_ms, client_id)
        out: m.JoinGroupResponse = await self.pm_call(req, m.JoinGroupResponse)
        return out

    async def heartbeat(self, group: str, member_id: str, generation: int,
                        owned: Sequence[int]) -> m.GroupHeartbeatResponse:
        req = m.GroupHeartbeatRequest(0, group, member_id, generation, tuple(owned))
        out: m.GroupHeartbeatResponse = await self.pm_call(req, m.GroupHeartbeatResponse)
        return out

    async def leave(self, group: str, member_id: str) -> None:
        await self.pm_call(m.LeaveGroupRequest(0, group, member_id), m.LeaveGroupResponse)

    async def commit(self, group: str, offsets: Mapping[int, int], member_id: str = "",
                     generation: int = -1) -> dict[int, SbpError | None]:
        """Commit ``offsets``; each stream's error (None: stored)."""
        items = tuple(m.OffsetCommitItem(sid, off) for sid, off in sorted(offsets.items()))
        resp: m.OffsetCommitResponse = await self.pm_call(
            m.OffsetCommitRequest(0, group, member_id, generation, items), m.OffsetCommitResponse)
        return {it.stream_id: None if it.status.ok else it.status.error()
                for it in resp.items}

    async def fetch(self, group: str, stream_ids: Sequence[int] = ()) -> dict[int, int]:
        resp: m.OffsetFetchResponse = await self.pm_call(
            m.OffsetFetchRequest(0, group, tuple(stream_ids)), m.OffsetFetchResponse)
        for it in resp.items:  # a stream refused (AUTHORIZATION_FAILED) is not "uncommitted"
            it.status.raise_for_error()
        return {it.stream_id: it.offset for it in resp.items if it.offset >= 0}

    async def list(self) -> list[str]:
        resp: m.ListGroupsResponse = await self.pm_call(m.ListGroupsRequest(),
                                                        m.ListGroupsResponse)
        return [n.name for n in resp.groups]

    async def describe(self, group: str) -> m.GroupDescription:
        resp: m.DescribeGroupsResponse = await self.pm_call(
            m.DescribeGroupsRequest(0, (m.NameItem(group),)), m.DescribeGroupsResponse)
        (d,) = resp.items
        d.status.raise_for_error()
        return d

    async def delete(self, group: str) -> None:
        resp: m.DeleteGroupResponse = await self.pm_call(
            m.DeleteGroupRequest(0, (m.NameItem(group),)), m.DeleteGroupResponse)
        for it in resp.items:
            it.status.raise_for_error()

    async def reset(self, group: str, offsets: Mapping[int, int]) -> None:
        """Set (offset -1: forget) committed offsets of a group without live members."""
        items = tuple(m.OffsetCommitItem(sid, off) for sid, off in sorted(offsets.items()))
        resp: m.ResetOffsetsResponse = await self.pm_call(
            m.ResetOffsetsRequest(0, group, items), m.ResetOffsetsResponse)
        for it in resp.items:
            it.status.raise_for_error()


class _Assigned(StreamReader):
    """A plain reader of the assigned streams, starting each where the group left off (its
    subscriber asks :meth:`resolve_starts`, the hook this overrides)."""

    def __init__(self, client: ClientCore, streams: Sequence[int], options: ConsumerOptions,
                 positions: Mapping[int, int]) -> None:
        super().__init__(client, streams, options)
        self.starts = dict(positions)

    async def resolve_starts(self, sids: Sequence[int]) -> list[int]:
        """The group's positions first; the rest as a plain consumer resolves them (batched)."""
        todo = [sid for sid in sids if sid not in self.starts]
        got = dict(zip(todo, await super().resolve_starts(todo), strict=True)) if todo else {}
        return [self.starts[sid] if sid in self.starts else got[sid] for sid in sids]


class GroupMember:
    """A member of consumer group ``group`` reading the streams the PM assigns it (see the
    module docstring): the reader of an :class:`~sbpstream.client.consumer.AsyncConsumer` with
    a group (a :class:`~sbpstream.client.consumer.GroupReader`). :meth:`commit`,
    :meth:`committed`, :meth:`rebalance_events` and ``on_rebalance`` (called on the event loop)
    are its group side. Single-stream calls (``seek``, ``poll_columns``, ``fetch_batches``) and
    ``set_streams`` are refused."""

    def __init__(
        self,
        client: ClientCore,
        pm_call: PmCall,
        streams: StreamSpec,
        options: ConsumerOptions,
        client_id: str = "",
    ) -> None:
        o = options
        start, group = o.start, o.group or ""
        auto_commit_interval_ms = o.auto_commit_interval_ms
        heartbeat_interval_ms = o.heartbeat_interval_ms
        # the reading is done by an _Assigned reader of the assignment
        split_streams(streams)  # refuse bad specs now
        if isinstance(start, int) and start < 0:
            raise InvalidRequestError(f"bad start offset {start}: offsets are >= 0")
        if auto_commit_interval_ms <= 0 or heartbeat_interval_ms <= 0:
            raise InvalidRequestError("auto_commit_interval_ms and heartbeat_interval_ms > 0")
        self._client = client
        self.admin = GroupAdmin(pm_call)
        self.streams = streams
        self._start = start
        self._group = group
        self.auto_commit = o.auto_commit
        self.auto_commit_interval_ms = auto_commit_interval_ms
        self.session_timeout_ms = o.session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.on_rebalance = o.on_rebalance
        self.client_id = client_id or f"sbpstream-{id(self):x}"
        self.max_wait_ms = o.max_wait_ms
        self.options = o
        # what each plain consumer of an assignment reads with: the group's start, no end
        self._inner_options = dataclasses.replace(o, end=None, group=None)
        self.member_id = ""
        self.generation = -1
        self.stream_ids: tuple[int, ...] = ()
        self._owned: frozenset[int] = frozenset()
        self._target: frozenset[int] | None = None
        self._positions: dict[int, int] = {}
        """stream -> offset after the last record handed out (or the committed one)."""
        self._committed: dict[int, int] = {}
        self._inner: _Assigned | None = None
        self._events: list[RebalanceEvent] = []
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._hb_task: asyncio.Task[None] | None = None
        self._joined = False
        self._closed = False
        self._last_commit = time.monotonic()
        self._pending = 0

    # ------------------------------------------------------------------ properties
    @property
    def group(self) -> str:
        return self._group

    @property
    def assignment(self) -> tuple[int, ...]:
        return tuple(sorted(self._owned))

    @property
    def throttle_time_ms(self) -> int:
        return self._client.routing.throttle.throttle_time_ms_total

    @property
    def position(self) -> int | None:
        return None

    @property
    def at_end(self) -> bool:
        return False

    @property
    def caught_up(self) -> bool:
        return self._inner.caught_up if self._inner is not None else False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered(self) -> int:
        return self._inner.buffered if self._inner is not None else 0

    # ------------------------------------------------------------------ iteration
    def __aiter__(self) -> GroupMember:
        return self

    async def __anext__(self) -> ConsumedRecord:
        while True:
            rec = self.next_buffered()
            if rec is not None:
                return rec
            if self._closed:
                raise StopAsyncIteration
            await self.fill()

    async def poll(self, max_records: int = 10_000, timeout_ms: int | None = None) -> list[
            ConsumedRecord]:
        if not self.buffered or self._due():
            await self.fill(timeout_ms)
        out: list[ConsumedRecord] = []
        while len(out) < max_records and (rec := self.next_buffered()) is not None:
            out.append(rec)
        return out

    async def fill(self, timeout_ms: int | None = None) -> int:
        """Apply a pending assignment change and a due auto-commit; then, unless records are
        buffered, fetch one round of the assigned streams."""
        if self._closed:
            return 0
        wait = self.max_wait_ms if timeout_ms is None else timeout_ms
        if not self._joined:
            await self._join()
            await self._heartbeat_once()
            self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        await self._maybe_auto_commit()
        await self._apply_assignment()
        if self.buffered:
            return self.buffered
        inner = self._inner
        if inner is None:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0) / 1000):
                    await self._changed.wait()
            return 0
        return await inner.fill(wait)

    def next_buffered(self) -> ConsumedRecord | None:
        """The next buffered record; None also while a rebalance or an auto-commit is due
        (the next :meth:`fill` does it first, so neither waits for the buffer to drain)."""
        inner = self._inner
        if inner is None or self._due():
            return None
        rec = inner.next_buffered()
        if rec is not None:
            self._positions[rec.stream_id] = rec.offset + 1
        return rec

    async def poll_columns(self, timeout_ms: int | None = None) -> ColumnBatch:
        raise InvalidRequestError("poll_columns is for a single-stream consumer without a group")

    async def fetch_batches(self, timeout_ms: int = 0) -> list[memoryview]:
        raise InvalidRequestError("fetch_batches is for a consumer without a group")

    async def seek(self, offset: int) -> None:
        raise InvalidRequestError("seek is for a consumer without a group (commit() moves "
                                  "a group's position; reset-offsets moves a stopped group's)")

    async def set_streams(self, streams: int | Sequence[int]) -> None:
        raise InvalidRequestError("set_streams is for a consumer without a group (the group "
                                  "assigns a member its streams)")

    async def close(self) -> None:
        """Commit what was handed out (with auto-commit), leave the group, stop."""
        if self._closed:
            return
        self._closed = True
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb_task
        if self._joined:
            if self.auto_commit:
                with contextlib.suppress(SbpError):
                    await self._commit_streams(self._owned)
            try:
                await self.admin.leave(self._group, self.member_id)
            except SbpError as e:
                log.info("event=group_leave_failed group=%s error=%r", self._group, e.message)
        if self._inner is not None:
            await self._inner.close()
            self._inner = None

    # ------------------------------------------------------------------ group side
    async def commit(self, offsets: Mapping[int, int] | None = None) -> None:
        if offsets is None:
            await self._commit_streams(self._owned, raise_errors=True)
            return
        self._positions.update(offsets)
        await self._commit_streams(frozenset(offsets), raise_errors=True)

    async def committed(self) -> dict[int, int]:
        return await self.admin.fetch(self._group, sorted(self._owned))

    def rebalance_events(self) -> list[RebalanceEvent]:
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ internals
    def _due(self) -> bool:
        if self._target is not None and self._target != self._owned:
            return True
        return self.auto_commit and bool(self._owned) and (
            time.monotonic() - self._last_commit) * 1000 >= self.auto_commit_interval_ms

    def _emit(self, kind: Literal["assigned", "revoked", "lost"], sids: Sequence[int]) -> None:
        if not sids:
            return
        ev = RebalanceEvent(kind, tuple(sorted(sids)), self.generation)
        self._events.append(ev)
        log.info("event=group_%s group=%s member=%s generation=%d streams=%d", kind,
                 self._group, self.member_id, self.generation, len(sids))
        if self.on_rebalance is not None:
            try:
                self.on_rebalance(ev)
            except Exception:
                log.exception("event=on_rebalance_failed")

    async def _join(self) -> None:
        r = await self.admin.join(self._group, self.member_id, self.streams,
                                  self.session_timeout_ms, self.client_id)
        self.member_id, self.generation = r.member_id, r.generation
        self.stream_ids = r.stream_ids
        self._joined = True

    async def _heartbeat_once(self) -> None:
        try:
            r = await self.admin.heartbeat(self._group, self.member_id, self.generation,
                                           sorted(self._owned))
        except UnknownMemberError:
            log.info("event=group_rejoin group=%s member=%s", self._group, self.member_id)
            await self._join()
            r = await self.admin.heartbeat(self._group, self.member_id, self.generation,
                                           sorted(self._owned))
        self.generation = r.generation
        self._pending = r.pending
        target = frozenset(r.assigned)
        if target != self._target:
            self._target = target
        if target != self._owned:
            self._changed.set()

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            moving = self._pending > 0 or (self._target is not None
                                           and self._target != self._owned)
            interval = REBALANCE_HEARTBEAT_MS if moving else self.heartbeat_interval_ms
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval / 1000):
                    await self._wake.wait()
            try:
                await self._heartbeat_once()
            except SbpError as e:
                log.warning("event=group_heartbeat_failed group=%s error=%r", self._group,
                            e.message)

    async def _apply_assignment(self) -> None:
        target = self._target
        if target is None or target == self._owned:
            return
        revoked = self._owned - target
        added = target - self._owned
        if revoked:
            refused = await self._commit_streams(revoked) if self.auto_commit else set()
            self._emit("lost", sorted(refused))
            self._emit("revoked", sorted(revoked - refused))
        if self._inner is not None and not target:
            await self._inner.close()
            self._inner = None
        for sid in revoked:
            self._positions.pop(sid, None)
            self._committed.pop(sid, None)
        if added:
            got = await self.admin.fetch(self._group, sorted(added))
            for sid in added:
                if sid in got:
                    self._positions[sid] = self._committed[sid] = got[sid]
            if self._start == "latest":  # pin "latest" now: a later rebuild must not skip
                fresh = sorted(sid for sid in added if sid not in got)
                for i in range(0, len(fresh), LATEST_LOOKUPS):
                    chunk = fresh[i:i + LATEST_LOOKUPS]
                    ends = await asyncio.gather(*(self._client.end_offset(s) for s in chunk))
                    self._positions.update(zip(chunk, ends, strict=True))
        self._owned = target
        if target and self._inner is not None:
            # the streams kept go on where they are, in the same subscriptions: the added
            # ones join them (an incremental FETCH of each node's session), the revoked ones
            # are forgotten there and their buffered records discarded
            self._inner.starts.update(
                {sid: self._positions[sid] for sid in added if sid in self._positions})
            await self._inner.set_streams(sorted(target))
        elif target:
            self._inner = _Assigned(self._client, sorted(target), self._inner_options,
                                    self._positions)
        self._emit("assigned", sorted(added))
        self._wake.set()  # report the release at once

    async def _maybe_auto_commit(self) -> None:
        if not self.auto_commit or not self._owned:
            return
        if (time.monotonic() - self._last_commit) * 1000 < self.auto_commit_interval_ms:
            return
        try:
            await self._commit_streams(self._owned)
        except SbpError as e:
            log.warning("event=group_auto_commit_failed group=%s error=%r", self._group,
                        e.message)

    async def _commit_streams(self, sids: frozenset[int],
                              raise_errors: bool = False) -> set[int]:
        """Commit the positions of ``sids`` that moved; the streams whose commit was refused
        (no longer this member's)."""
        self._last_commit = time.monotonic()
        offsets = {sid: self._positions[sid] for sid in sids
                   if sid in self._positions and self._committed.get(sid) != self._positions[sid]}
        if not offsets:
            return set()
        try:
            errs = await self.admin.commit(self._group, offsets, self.member_id, self.generation)
        except (IllegalGenerationError, UnknownMemberError):
            await self._heartbeat_once()  # the current generation (rejoining if need be)
            errs = await self.admin.commit(self._group, offsets, self.member_id, self.generation)
        refused = {sid for sid, e in errs.items() if e is not None}
        for sid, e in errs.items():
            if e is None:
                self._committed[sid] = offsets[sid]
        if refused and raise_errors:
            first = next(e for e in errs.values() if e is not None)
            raise first
        return refused
