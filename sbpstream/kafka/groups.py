"""Kafka's classic consumer-group protocol, run by the gateway: the group state machine.

Written from Kafka's protocol guide (JoinGroup, SyncGroup, Heartbeat, LeaveGroup) and its
"consumer group" design: a group goes Empty -> PreparingRebalance -> CompletingRebalance ->
Stable. A rebalance starts when a member joins, leaves or misses its session timeout; it waits
(at most the longest rebalance timeout of the members) until every known member has sent
JoinGroup, then bumps the generation, picks the leader (the previous one if still a member,
else the first to join) and a protocol every member supports, and answers every JoinGroup: the
leader gets the members with their protocol metadata. The leader computes the assignment
(client side, as in Kafka) and sends it in its SyncGroup; every member's SyncGroup is answered
with its part. Heartbeats tell members of a rebalance (REBALANCE_IN_PROGRESS) so they rejoin.

Only membership lives here (memory, one gateway); committed offsets are sbpstream's own (the
gateway stores them through the PM's group offset API). No I/O: waiting callers get asyncio
futures, and time advances only through :meth:`KafkaGroups.tick` with the injected clock.
"""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sbpstream.kafka import errors as E

EMPTY: Final = "Empty"
PREPARING: Final = "PreparingRebalance"
COMPLETING: Final = "CompletingRebalance"
STABLE: Final = "Stable"

MIN_SESSION_TIMEOUT_MS: Final = 1_000
"""Kafka's group.min.session.timeout.ms (6 s) is lowered: tests and tools use short ones."""
MAX_SESSION_TIMEOUT_MS: Final = 300_000
"""Kafka's group.max.session.timeout.ms (30 min) is lowered to the PM's own bound."""
MAX_MEMBERS: Final = 1_000
"""Members per group (Kafka's group.max.size has no default bound; this one is generous)."""
MAX_GROUPS: Final = 10_000
"""Groups with members that one gateway coordinates at once."""


@dataclass(slots=True)
class JoinResult:
    error_code: int
    generation: int = -1
    protocol_name: str | None = None
    leader: str = ""
    member_id: str = ""
    members: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class KMember:
    member_id: str
    client_id: str
    host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    last_seen_ms: int
    assignment: bytes = b""
    join: asyncio.Future[JoinResult] | None = None
    sync: asyncio.Future[tuple[int, bytes]] | None = None

    def metadata(self, protocol: str) -> bytes:
        for name, meta in self.protocols:
            if name == protocol:
                return meta
        return b""


@dataclass(slots=True)
class KGroup:
    name: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: str = ""
    protocol_name: str | None = None
    leader: str = ""
    members: dict[str, KMember] = field(default_factory=dict)
    rebalance_deadline_ms: int = 0


class KafkaGroups:
    """Every Kafka group this gateway coordinates. ``clock_ms`` is monotonic milliseconds."""

    def __init__(self, clock_ms: Callable[[], int]) -> None:
        self.clock_ms = clock_ms
        self.groups: dict[str, KGroup] = {}

    def get(self, group: str) -> KGroup | None:
        return self.groups.get(group)

    def live(self, group: str) -> bool:
        """True while the group has members here."""
        g = self.groups.get(group)
        return g is not None and bool(g.members)

    # ------------------------------------------------------------------------------ requests

    def join(self, group: str, member_id: str, client_id: str, host: str,
             session_timeout_ms: int, rebalance_timeout_ms: int, protocol_type: str,
             protocols: Sequence[tuple[str, bytes]]) -> asyncio.Future[JoinResult]:
        """A JoinGroup: the future of its answer (settled when the rebalance completes)."""
        fut: asyncio.Future[JoinResult] = asyncio.get_running_loop().create_future()
        g = self.groups.get(group)
        code = E.NONE
        if not MIN_SESSION_TIMEOUT_MS <= session_timeout_ms <= MAX_SESSION_TIMEOUT_MS:
            code = E.INVALID_SESSION_TIMEOUT
        elif not protocol_type or not protocols or (g is not None and g.members and (
                protocol_type != g.protocol_type
                or not self._common(g, {n for n, _ in protocols}, skip=member_id))):
            code = E.INCONSISTENT_GROUP_PROTOCOL
        elif member_id and (g is None or member_id not in g.members):
            code = E.UNKNOWN_MEMBER_ID
        elif g is None and len(self.groups) >= MAX_GROUPS:
            code = E.COORDINATOR_NOT_AVAILABLE
        elif not member_id and g is not None and len(g.members) >= MAX_MEMBERS:
            code = E.GROUP_MAX_SIZE_REACHED
        if code != E.NONE:
            fut.set_result(JoinResult(code, member_id=member_id))
            return fut
        if g is None:
            g = self.groups[group] = KGroup(group)
        now = self.clock_ms()
        mid = member_id or f"{client_id or 'consumer'}-{uuid.uuid4()}"
        old = g.members.get(mid)
        if old is not None and old.join is not None and not old.join.done():
            # a second JoinGroup replaces the first (the client gave up on it)
            old.join.set_result(JoinResult(E.REBALANCE_IN_PROGRESS, member_id=mid))
        mb = KMember(mid, client_id, host, session_timeout_ms,
                     rebalance_timeout_ms if rebalance_timeout_ms > 0 else session_timeout_ms,
                     protocol_type, list(protocols), now, join=fut)
        if old is not None:
            mb.assignment = old.assignment
        g.members[mid] = mb
        g.protocol_type = protocol_type
        if g.state != PREPARING:
            self._prepare(g)
        self._maybe_complete(g)
        return fut

    def sync(self, group: str, generation: int, member_id: str,
             assignments: Sequence[tuple[str, bytes]]) -> asyncio.Future[tuple[int, bytes]]:
        """A SyncGroup: the future of (error code, this member's assignment)."""
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        g = self.groups.get(group)
        mb = None if g is None else g.members.get(member_id)
        if g is None or mb is None:
            fut.set_result((E.UNKNOWN_MEMBER_ID, b""))
        elif generation != g.generation:
            fut.set_result((E.ILLEGAL_GENERATION, b""))
        elif g.state == PREPARING:
            fut.set_result((E.REBALANCE_IN_PROGRESS, b""))
        elif g.state == STABLE:
            mb.last_seen_ms = self.clock_ms()
            fut.set_result((E.NONE, mb.assignment))
        else:  # CompletingRebalance: the leader's assignment settles every member's sync
            mb.last_seen_ms = self.clock_ms()
            if mb.sync is not None and not mb.sync.done():
                mb.sync.set_result((E.REBALANCE_IN_PROGRESS, b""))
            mb.sync = fut
            if member_id == g.leader:
                given = dict(assignments)
                for m in g.members.values():
                    m.assignment = given.get(m.member_id, b"")
                g.state = STABLE
                for m in g.members.values():
                    if m.sync is not None and not m.sync.done():
                        m.sync.set_result((E.NONE, m.assignment))
                    m.sync = None
        return fut

    def heartbeat(self, group: str, generation: int, member_id: str) -> int:
        g = self.groups.get(group)
        mb = None if g is None else g.members.get(member_id)
        if g is None or mb is None:
            return E.UNKNOWN_MEMBER_ID
        if generation != g.generation:
            return E.ILLEGAL_GENERATION
        mb.last_seen_ms = self.clock_ms()
        return E.REBALANCE_IN_PROGRESS if g.state == PREPARING else E.NONE

    def leave(self, group: str, member_id: str) -> int:
        g = self.groups.get(group)
        if g is None or member_id not in g.members:
            return E.UNKNOWN_MEMBER_ID
        self._remove(g, [member_id])
        return E.NONE

    def check_commit(self, group: str, generation: int, member_id: str) -> int:
        """Whether an OffsetCommit may store: a member's commit of the current generation
        (allowed while a rebalance is being prepared, so eager members commit what they give
        up), or a commit from outside the group (no member id, generation -1) while it has no
        members here."""
        g = self.groups.get(group)
        if not member_id and generation < 0:
            return E.NONE if g is None or not g.members else E.UNKNOWN_MEMBER_ID
        mb = None if g is None else g.members.get(member_id)
        if g is None or mb is None:
            return E.UNKNOWN_MEMBER_ID
        if generation != g.generation:
            return E.ILLEGAL_GENERATION
        if g.state == COMPLETING:
            return E.REBALANCE_IN_PROGRESS
        mb.last_seen_ms = self.clock_ms()
        return E.NONE

    # ---------------------------------------------------------------------------------- time

    def tick(self) -> None:
        """Expire members past their session timeout and end rebalances past their deadline."""
        now = self.clock_ms()
        for g in list(self.groups.values()):
            late = g.state == PREPARING and now >= g.rebalance_deadline_ms
            gone = [mid for mid, mb in g.members.items()
                    if not _waiting(mb.join) and (
                        late or (not _waiting(mb.sync)
                                 and now - mb.last_seen_ms > mb.session_timeout_ms))]
            if gone:  # late: the members that did not rejoin in time are out
                self._remove(g, gone)

    # ----------------------------------------------------------------------------- internals

    @staticmethod
    def _common(g: KGroup, names: set[str], skip: str = "") -> set[str]:
        out = set(names)
        for mid, mb in g.members.items():
            if mid != skip:
                out &= {n for n, _ in mb.protocols}
        return out

    def _prepare(self, g: KGroup) -> None:
        g.state = PREPARING
        g.rebalance_deadline_ms = self.clock_ms() + max(
            (mb.rebalance_timeout_ms for mb in g.members.values()), default=0)
        for mb in g.members.values():  # a sync waiting on the old generation is over
            if mb.sync is not None and not mb.sync.done():
                mb.sync.set_result((E.REBALANCE_IN_PROGRESS, b""))
            mb.sync = None

    def _remove(self, g: KGroup, member_ids: Sequence[str]) -> None:
        for mid in member_ids:
            mb = g.members.pop(mid, None)
            if mb is None:
                continue
            if mb.join is not None and not mb.join.done():
                mb.join.set_result(JoinResult(E.UNKNOWN_MEMBER_ID))
            if mb.sync is not None and not mb.sync.done():
                mb.sync.set_result((E.UNKNOWN_MEMBER_ID, b""))
        if not g.members:
            g.state, g.leader, g.protocol_name = EMPTY, "", None
            g.generation += 1
            del self.groups[g.name]
            return
        if g.state != PREPARING:
            self._prepare(g)
        self._maybe_complete(g)

    def _maybe_complete(self, g: KGroup) -> None:
        """Complete the rebalance once every member has rejoined."""
        if g.state != PREPARING or not g.members or not all(
                _waiting(mb.join) for mb in g.members.values()):
            return
        g.generation += 1
        ordered = list(g.members.values())
        if g.leader not in g.members:
            g.leader = ordered[0].member_id
        leader = g.members[g.leader]
        common = self._common(g, {n for n, _ in leader.protocols})
        g.protocol_name = next(n for n, _ in leader.protocols if n in common)
        g.state = COMPLETING
        everyone = [(mb.member_id, mb.metadata(g.protocol_name)) for mb in ordered]
        for mb in ordered:
            mb.last_seen_ms = self.clock_ms()
            if mb.join is not None and not mb.join.done():
                mb.join.set_result(JoinResult(
                    E.NONE, g.generation, g.protocol_name, g.leader, mb.member_id,
                    everyone if mb.member_id == g.leader else []))
            mb.join = None


_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
CONSUMER_PROTOCOL: Final = "consumer"
MAX_SUBSCRIBED_TOPICS: Final = 10_000


def subscribed_topics(protocol_type: str, metadata: bytes) -> list[str]:
    """The topics of a member's ConsumerProtocolSubscription (every version starts with int16
    version, then the topics as an array of int16-length strings); [] for another protocol
    type or metadata that does not parse."""
    if protocol_type != CONSUMER_PROTOCOL:
        return []
    try:
        n = _I32.unpack_from(metadata, 2)[0]
        if not 0 <= n <= min(MAX_SUBSCRIBED_TOPICS, len(metadata)):
            return []
        at, out = 6, []
        for _ in range(n):
            size = _I16.unpack_from(metadata, at)[0]
            if size < 0 or at + 2 + size > len(metadata):
                return []
            out.append(metadata[at + 2:at + 2 + size].decode())
            at += 2 + size
        return out
    except (struct.error, UnicodeDecodeError):
        return []


def group_topics(g: KGroup) -> set[str]:
    """Every topic a member of ``g`` subscribes (from its first protocol's metadata: every
    assignor of the consumer protocol carries the same subscription)."""
    out: set[str] = set()
    for mb in g.members.values():
        if mb.protocols:
            out.update(subscribed_topics(mb.protocol_type, mb.protocols[0][1]))
    return out


def _waiting(fut: asyncio.Future[Any] | None) -> bool:
    return fut is not None and not fut.done()


__all__ = ["COMPLETING", "EMPTY", "PREPARING", "STABLE", "JoinResult", "KGroup", "KMember",
           "KafkaGroups", "group_topics", "subscribed_topics"]
