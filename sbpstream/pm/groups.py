"""Consumer groups on the PM leader: membership, sticky cooperative assignment, offsets.

Two halves (docs/protocol.md, "Consumer groups"):

- **Committed offsets** are durable metadata (:mod:`sbpstream.pm.rules` ``commit_offset``, on
  SQLite or etcd): they survive restarts and PM failover.
- **Membership** is soft state in the leader's memory (:class:`GroupCoordinator`): members join,
  heartbeat, leave or miss their session timeout. After a failover the new leader knows no member;
  each member's next heartbeat gets UNKNOWN_MEMBER and it rejoins with its id, reporting the
  streams it still holds, so the assignment is rebuilt from the members themselves.

Assignment is **sticky and cooperative** (Kafka's KIP-429): on every membership change the
coordinator computes a *target* per member that keeps what each member has (up to an even share)
and spreads the rest over the least loaded members. A member is handed only the streams of its
target that no other member still *holds* (reports in its heartbeat); a member that lost a stream
in the target commits it and stops reporting it, and only then does the new owner get it. So a
stream is never consumed by two members of the same generation, and only the streams that must
move do.

Every target change bumps the group's **generation**. A commit names the member and the generation
it was last told; an older generation is refused with ILLEGAL_GENERATION (heartbeat, then commit
again), an unknown member (it left, or missed its session timeout and its streams moved) with
UNKNOWN_MEMBER.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from sbpstream.net.server import Handler, Request, Responder
from sbpstream.pm.metadata import OffsetMeta
from sbpstream.pm.service import PmService, within
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    GroupNotEmptyError,
    IllegalGenerationError,
    InvalidRequestError,
    LimitExceededError,
    SbpError,
    UnknownMemberError,
)
from sbpstream.protocol.messages import Status
from sbpstream.protocol.names import validate_group_name
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.pm.groups")

DEFAULT_SESSION_TIMEOUT_MS: Final = 10_000
"""A member that sends no heartbeat for this long loses its streams (a join may ask for
:data:`MIN_SESSION_TIMEOUT_MS` to :data:`MAX_SESSION_TIMEOUT_MS`)."""
MIN_SESSION_TIMEOUT_MS: Final = 100
MAX_SESSION_TIMEOUT_MS: Final = 300_000
MAX_GROUP_STREAMS: Final = 100_000
"""Streams one member may subscribe (ids, names and the pattern's matches together)."""
PATTERN_PAGE: Final = 1000


@dataclass(slots=True)
class Member:
    member_id: str
    client_id: str
    host: str
    streams: frozenset[int]
    """The subscription (resolved stream ids)."""
    session_timeout_ms: int
    last_seen_ms: int
    target: set[int] = field(default_factory=set)
    """What the coordinator wants this member to have."""
    held: set[int] = field(default_factory=set)
    """What the member reported consuming in its last heartbeat."""
    assigned: set[int] = field(default_factory=set)
    """What the last heartbeat answer handed it (target minus what others still hold)."""


@dataclass(slots=True)
class Group:
    name: str
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)

    @property
    def state(self) -> str:
        if not self.members:
            return "empty"
        settled = all(mb.held == mb.target for mb in self.members.values())
        return "stable" if settled else "rebalancing"


def sticky_assign(members: Sequence[Member]) -> dict[str, set[int]]:
    """Targets for ``members``: each keeps what it holds or was targeted (held first) up to an
    even share of the streams it subscribes; the rest go, in id order, to the eligible member
    with the fewest streams still under its share. Deterministic (members by id)."""
    ordered = sorted(members, key=lambda mb: mb.member_id)
    every = sorted(set().union(*(mb.streams for mb in ordered))) if ordered else []
    if not ordered:
        return {}
    n_members = len(ordered)
    base, extra = divmod(len(every), n_members)
    # Members keeping the most get the +1 shares: fewer streams move.
    keep: dict[str, list[int]] = {}
    taken: set[int] = set()
    for mb in ordered:
        wanted = [s for s in sorted(mb.held) if s in mb.streams]
        wanted += [s for s in sorted(mb.target) if s in mb.streams and s not in mb.held]
        mine = [s for s in wanted if s not in taken]
        keep[mb.member_id] = mine
        taken.update(mine)
    by_keep = sorted(ordered, key=lambda mb: (-len(keep[mb.member_id]), mb.member_id))
    cap = {mb.member_id: base + (1 if i < extra else 0) for i, mb in enumerate(by_keep)}
    out: dict[str, set[int]] = {}
    for mb in ordered:
        mine = keep[mb.member_id][: cap[mb.member_id]]
        out[mb.member_id] = set(mine)
    owned = set().union(*out.values())
    for s in every:
        if s in owned:
            continue
        eligible = [mb for mb in ordered if s in mb.streams]
        under = [mb for mb in eligible if len(out[mb.member_id]) < cap[mb.member_id]]
        pick = min(under or eligible, key=lambda mb: (len(out[mb.member_id]), mb.member_id))
        out[pick.member_id].add(s)
    return out


class GroupCoordinator:
    """Every group's membership and assignment (memory only; no I/O). ``clock_ms`` is a
    monotonic clock in milliseconds."""

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self.clock_ms = clock_ms or (lambda: int(time.monotonic() * 1000))
        self.groups: dict[str, Group] = {}

    def reset(self) -> None:
        """Forget every member (a PM that becomes leader starts from the members' heartbeats)."""
        self.groups.clear()

    # --------------------------------------------------------------------- membership
    def join(self, group: str, member_id: str, streams: Iterable[int], session_timeout_ms: int,
             client_id: str = "", host: str = "") -> tuple[Member, int]:
        """Add (or re-add, keeping ``member_id``) a member; (member, generation)."""
        validate_group_name(group)
        timeout = session_timeout_ms or DEFAULT_SESSION_TIMEOUT_MS
        if not MIN_SESSION_TIMEOUT_MS <= timeout <= MAX_SESSION_TIMEOUT_MS:
            raise InvalidRequestError(
                f"bad session_timeout_ms {timeout}: {MIN_SESSION_TIMEOUT_MS}-"
                f"{MAX_SESSION_TIMEOUT_MS}")
        g = self.groups.setdefault(group, Group(group))
        self._expire(g)
        mid = member_id or f"{client_id or 'member'}-{uuid.uuid4().hex[:12]}"
        subs = frozenset(streams)
        old = g.members.get(mid)
        mb = Member(mid, client_id, host, subs, timeout, self.clock_ms())
        if old is not None:
            mb.target, mb.held, mb.assigned = old.target, old.held, old.assigned
        g.members[mid] = mb
        if old is None or old.streams != subs:
            self._rebalance(g, f"join member={mid}")
        return mb, g.generation

    def heartbeat(self, group: str, member_id: str, generation: int,
                  owned: Iterable[int]) -> tuple[int, list[int], int]:
        """(generation, assigned streams, streams of its target still held elsewhere)."""
        g, mb = self._member(group, member_id)
        mb.last_seen_ms = self.clock_ms()
        others = self._held_by_others(g, mb)
        held = {s for s in owned if s in mb.streams and s not in others}
        rebalance = bool(held - mb.held - mb.target - mb.assigned)  # seeded after a failover
        mb.held = held
        if rebalance:
            self._rebalance(g, f"held member={member_id}")
            others = self._held_by_others(g, mb)
        mb.assigned = {s for s in mb.target if s not in others}
        return g.generation, sorted(mb.assigned), len(mb.target) - len(mb.assigned)

    def leave(self, group: str, member_id: str) -> None:
        g, _ = self._member(group, member_id)
        del g.members[member_id]
        self._rebalance(g, f"leave member={member_id}")

    def check_commit(self, group: str, member_id: str, generation: int,
                     stream_ids: Sequence[int]) -> list[SbpError | None]:
        """Fence a commit: raises for the whole request (unknown member, old generation, a
        commit from outside a group with members); per stream, ILLEGAL_GENERATION when the
        member neither holds it nor is assigned it."""
        g = self.groups.get(group)
        if g is not None:
            self._expire(g)
        if not member_id:
            if g is not None and g.members:
                raise GroupNotEmptyError(
                    f"group {group!r} has {len(g.members)} live members: only they commit")
            return [None] * len(stream_ids)
        g, mb = self._member(group, member_id)
        if generation != g.generation:
            raise IllegalGenerationError(
                f"generation {generation} of group {group!r} is stale (now {g.generation})")
        mine = mb.held | mb.assigned
        return [None if s in mine else IllegalGenerationError(
            f"stream {s} is not assigned to member {member_id} in generation {g.generation}")
            for s in stream_ids]

    def require_empty(self, group: str) -> None:
        g = self.groups.get(group)
        if g is not None:
            self._expire(g)
            if g.members:
                raise GroupNotEmptyError(f"group {group!r} has {len(g.members)} live members")

    def describe(self, group: str) -> Group | None:
        g = self.groups.get(group)
        if g is not None:
            self._expire(g)
        return g

    def forget(self, group: str) -> None:
        self.groups.pop(group, None)

    def live_groups(self) -> list[str]:
        for g in list(self.groups.values()):
            self._expire(g)
        return sorted(name for name, g in self.groups.items() if g.members)

    # --------------------------------------------------------------------- internals
    def _member(self, group: str, member_id: str) -> tuple[Group, Member]:
        g = self.groups.get(group)
        if g is not None:
            self._expire(g)
        mb = None if g is None else g.members.get(member_id)
        if g is None or mb is None:
            raise UnknownMemberError(f"member {member_id!r} is not in group {group!r}; rejoin")
        return g, mb

    @staticmethod
    def _held_by_others(g: Group, mb: Member) -> set[int]:
        out: set[int] = set()
        for other in g.members.values():
            if other is not mb:
                out |= other.held
        return out

    def _expire(self, g: Group) -> None:
        now = self.clock_ms()
        gone = [mid for mid, mb in g.members.items()
                if now - mb.last_seen_ms > mb.session_timeout_ms]
        for mid in gone:
            del g.members[mid]
        if gone:
            self._rebalance(g, f"session_timeout members={','.join(gone)}")

    def _rebalance(self, g: Group, why: str) -> None:
        targets = sticky_assign(list(g.members.values()))
        changed = any(mb.target != targets[mid] for mid, mb in g.members.items())
        for mid, mb in g.members.items():
            mb.target = targets[mid]
        if changed or why.startswith(("leave", "session_timeout")):
            g.generation += 1
            log.info("event=group_rebalanced group=%s generation=%d members=%d reason=%s",
                     g.name, g.generation, len(g.members), why)


# ------------------------------------------------------------------------------ PM handlers


class GroupHandlers:
    """The PM's consumer-group opcodes over a :class:`GroupCoordinator` and the metadata."""

    def __init__(self, service: PmService, coordinator: GroupCoordinator | None = None) -> None:
        self.service = service
        self.coordinator = coordinator or GroupCoordinator()

    def handlers(self) -> dict[int, Handler]:
        return {
            Opcode.JOIN_GROUP: self._join,
            Opcode.GROUP_HEARTBEAT: self._heartbeat,
            Opcode.LEAVE_GROUP: self._leave,
            Opcode.OFFSET_COMMIT: self._commit,
            Opcode.OFFSET_FETCH: self._fetch,
            Opcode.DESCRIBE_GROUPS: self._describe,
            Opcode.LIST_GROUPS: self._list,
            Opcode.DELETE_GROUP: self._delete,
            Opcode.RESET_OFFSETS: self._reset,
        }

    async def _resolve(self, r: m.JoinGroupRequest) -> list[int]:
        ids: list[int] = []
        live = await self.service.describe_streams(list(r.stream_ids))
        for sid, o in zip(r.stream_ids, live, strict=True):
            if isinstance(o, SbpError):
                raise o
            ids.append(sid)
        for n in r.stream_names:
            got = await self.service.describe_stream_named(n.name)
            if isinstance(got, SbpError):
                raise got
            ids.append(got.stream_id)
        if r.stream_pattern:
            if not r.stream_pattern.endswith("*") or "*" in r.stream_pattern[:-1]:
                raise InvalidRequestError(
                    f"bad stream_pattern {r.stream_pattern!r}: a name prefix ending in '*'")
            cont = 0
            while cont >= 0:
                page, cont = await self.service.list_streams_by_prefix(
                    r.stream_pattern[:-1], cont, PATTERN_PAGE)
                ids += [s.stream_id for s in page]
                if len(ids) > MAX_GROUP_STREAMS:
                    break
        ids = sorted(set(ids))
        if len(ids) > MAX_GROUP_STREAMS:
            raise LimitExceededError(f"a member subscribes at most {MAX_GROUP_STREAMS} streams")
        return ids

    async def _join(self, req: Request, resp: Responder) -> None:
        r = m.JoinGroupRequest.decode(req.header)
        try:
            async with within(r.timeout_ms, "JOIN_GROUP"):
                ids = await self._resolve(r)
            mb, gen = self.coordinator.join(r.group, r.member_id, ids, r.session_timeout_ms,
                                            r.client_id, str(req.conn.peer))
            out = m.JoinGroupResponse(m.STATUS_OK, mb.member_id, gen, tuple(ids),
                                      mb.session_timeout_ms)
        except SbpError as e:
            out = m.JoinGroupResponse(Status.of(e))
        await resp.send(out.encode())

    async def _heartbeat(self, req: Request, resp: Responder) -> None:
        r = m.GroupHeartbeatRequest.decode(req.header)
        try:
            gen, assigned, pending = self.coordinator.heartbeat(
                r.group, r.member_id, r.generation, r.owned)
            out = m.GroupHeartbeatResponse(m.STATUS_OK, gen, tuple(assigned), pending)
        except SbpError as e:
            out = m.GroupHeartbeatResponse(Status.of(e))
        await resp.send(out.encode())

    async def _leave(self, req: Request, resp: Responder) -> None:
        r = m.LeaveGroupRequest.decode(req.header)
        try:
            self.coordinator.leave(r.group, r.member_id)
            out = m.LeaveGroupResponse()
        except SbpError as e:
            out = m.LeaveGroupResponse(Status.of(e))
        await resp.send(out.encode())

    async def _store(self, group: str, items: Sequence[m.OffsetCommitItem],
                     fences: Sequence[SbpError | None]) -> tuple[m.OffsetCommitResult, ...]:
        todo = [OffsetMeta(group, it.stream_id, it.offset, it.metadata)
                for it, f in zip(items, fences, strict=True) if f is None]
        stored = iter(await self.service.meta.commit_offsets(todo, self.service.wall_ms()))
        out: list[m.OffsetCommitResult] = []
        for it, f in zip(items, fences, strict=True):
            o = f if f is not None else next(stored)
            err = o if isinstance(o, SbpError) else None
            out.append(m.OffsetCommitResult(it.stream_id, m.STATUS_OK if err is None
                                            else Status.of(err)))
        return tuple(out)

    async def _commit(self, req: Request, resp: Responder) -> None:
        r = m.OffsetCommitRequest.decode(req.header)
        try:
            validate_group_name(r.group)
            if any(it.offset < 0 for it in r.items):
                raise InvalidRequestError("committed offsets are >= 0 (RESET_OFFSETS forgets)")
            fences = self.coordinator.check_commit(r.group, r.member_id, r.generation,
                                                   [it.stream_id for it in r.items])
            async with within(r.timeout_ms, "OFFSET_COMMIT"):
                stored = await self._store(r.group, r.items, fences)
            out = m.OffsetCommitResponse(items=stored)
        except SbpError as e:
            out = m.OffsetCommitResponse(Status.of(e))
        await resp.send(out.encode())

    async def _fetch(self, req: Request, resp: Responder) -> None:
        r = m.OffsetFetchRequest.decode(req.header)
        try:
            validate_group_name(r.group)
            async with within(r.timeout_ms, "OFFSET_FETCH"):
                got = {o.stream_id: o for o in await self.service.meta.fetch_offsets(
                    r.group, r.stream_ids)}
            ids = r.stream_ids or tuple(sorted(got))
            items = tuple(
                m.OffsetFetchResult(sid) if sid not in got else m.OffsetFetchResult(
                    sid, got[sid].offset, got[sid].metadata, got[sid].commit_ms)
                for sid in ids)
            out = m.OffsetFetchResponse(items=items)
        except SbpError as e:
            out = m.OffsetFetchResponse(Status.of(e))
        await resp.send(out.encode())

    async def _describe(self, req: Request, resp: Responder) -> None:
        r = m.DescribeGroupsRequest.decode(req.header)
        async with within(r.timeout_ms, "DESCRIBE_GROUPS"):
            counts = await self.service.meta.offset_groups()
        items: list[m.GroupDescription] = []
        for n in r.groups:
            g = self.coordinator.describe(n.name)
            if g is None:
                items.append(m.GroupDescription(n.name, m.STATUS_OK, "empty", 0, (),
                                                counts.get(n.name, 0)))
                continue
            members = tuple(
                m.GroupMember(mb.member_id, mb.client_id, mb.host, tuple(sorted(mb.streams)),
                              tuple(sorted(mb.assigned)))
                for mb in sorted(g.members.values(), key=lambda x: x.member_id))
            items.append(m.GroupDescription(n.name, m.STATUS_OK, g.state, g.generation,
                                            members, counts.get(n.name, 0)))
        await resp.send(m.DescribeGroupsResponse(items=tuple(items)).encode())

    async def _list(self, req: Request, resp: Responder) -> None:
        r = m.ListGroupsRequest.decode(req.header)
        async with within(r.timeout_ms, "LIST_GROUPS"):
            stored = await self.service.meta.offset_groups()
        names = sorted(set(stored) | set(self.coordinator.live_groups()))
        await resp.send(m.ListGroupsResponse(
            groups=tuple(m.NameItem(n) for n in names)).encode())

    async def _delete(self, req: Request, resp: Responder) -> None:
        r = m.DeleteGroupRequest.decode(req.header)
        items: list[m.GroupResult] = []
        for n in r.groups:
            try:
                validate_group_name(n.name)
                self.coordinator.require_empty(n.name)
                async with within(r.timeout_ms, "DELETE_GROUP"):
                    await self.service.meta.delete_offsets(n.name)
                self.coordinator.forget(n.name)
                items.append(m.GroupResult(n.name))
            except SbpError as e:
                items.append(m.GroupResult(n.name, Status.of(e)))
        await resp.send(m.DeleteGroupResponse(items=tuple(items)).encode())

    async def _reset(self, req: Request, resp: Responder) -> None:
        r = m.ResetOffsetsRequest.decode(req.header)
        try:
            validate_group_name(r.group)
            self.coordinator.require_empty(r.group)
            async with within(r.timeout_ms, "RESET_OFFSETS"):
                stored = await self._store(r.group, r.items, [None] * len(r.items))
            out = m.ResetOffsetsResponse(items=stored)
        except SbpError as e:
            out = m.ResetOffsetsResponse(Status.of(e))
        await resp.send(out.encode())
