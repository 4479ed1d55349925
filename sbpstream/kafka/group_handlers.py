"""The Kafka gateway's consumer groups: Kafka's classic group protocol run by the gateway
(:mod:`sbpstream.kafka.groups`), its offsets kept as the sbpstream group's, and the gateway's
member in the sbpstream group of every Kafka group live here (so the PM hands SDK consumers of
that group none of its streams meanwhile). With auth, each request is checked against the
rules of the connection's principal, and what goes to the PM goes with its token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Final

from sbpstream.auth.acl import Op
from sbpstream.client.aclient import AsyncClient
from sbpstream.kafka import errors as E
from sbpstream.kafka.connections import Conn
from sbpstream.kafka.groups import COMPLETING, PREPARING, KafkaGroups, group_topics
from sbpstream.kafka.topics import TopicMap
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import IllegalGenerationError, SbpError, UnknownMemberError
from sbpstream.protocol.names import validate_group_name

log = logging.getLogger("sbpstream.kafka")

GROUP_TICK_S: Final = 0.1
"""How often group session timeouts and rebalance deadlines are checked."""
KEY_TYPE_GROUP: Final = 0
PM_SESSION_TIMEOUT_MS: Final = 10_000
"""Session timeout of the gateway's member in the sbpstream group of a Kafka group live here:
how long a dead gateway keeps SDK consumers of that group from its streams."""
PM_HEARTBEAT_S: Final = 2.0
"""How often that member heartbeats (and the memberships are brought in line with the Kafka
groups: joined for a new one, left for one without members)."""
PM_CLIENT_ID: Final = "kafka-gateway"


@dataclass(slots=True)
class PmMember:
    """The gateway's member in the sbpstream group of a Kafka group live here."""
    client: AsyncClient  # of the Kafka member seen last (with auth: a live member's principal)
    generation: int = -1  # -1: not (or no longer) joined
    streams: tuple[int, ...] = ()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def group_ok(group: str) -> bool:
    """A Kafka group id is an sbpstream group name (1-255 bytes, printable, no '/')."""
    try:
        validate_group_name(group)
    except SbpError:
        return False
    return True


class GroupHandlers(TopicMap):
    """The group requests of :class:`~sbpstream.kafka.gateway.KafkaGateway` (a base class)."""

    client: AsyncClient
    node_id: int
    groups: KafkaGroups
    _pm_members: dict[str, PmMember]

    @property
    def advertised(self) -> tuple[str, int]:
        raise NotImplementedError

    @property
    def pm_member_id(self) -> str:
        """This gateway's member id in the sbpstream groups of its live Kafka groups (the same
        after a restart, so a restarted gateway takes its own membership back)."""
        host, port = self.advertised
        return f"{PM_CLIENT_ID}@{host}:{port}"

    async def _tick_groups(self) -> None:
        while True:
            await asyncio.sleep(GROUP_TICK_S)
            self.groups.tick()

    async def _find_coordinator(self, conn: Conn, version: int, req: dict[str, Any]
                                ) -> dict[str, Any]:
        host, port = self.advertised
        if req["key_type"] != KEY_TYPE_GROUP:  # transactions are not served
            return {"throttle_time_ms": 0, "error_code": E.COORDINATOR_NOT_AVAILABLE,
                    "error_message": "only group coordinators (transactions are not served)",
                    "node_id": -1, "host": "", "port": -1}
        if self._group_denied(conn, Op.DESCRIBE, req["key"]):
            return {"throttle_time_ms": 0, "error_code": E.GROUP_AUTHORIZATION_FAILED,
                    "error_message": f"no describe on group {req['key']!r}",
                    "node_id": -1, "host": "", "port": -1}
        return {"throttle_time_ms": 0, "error_code": 0, "error_message": None,
                "node_id": self.node_id, "host": host, "port": port}

    def _group_denied(self, conn: Conn, op: Op, group: str) -> bool:
        """True when the connection's principal may not do ``op`` on ``group``: the gateway
        runs Kafka groups itself, so it checks the rules of the principal's token (the PM
        checks them again for everything the gateway then does at the PM for it)."""
        return conn.session is not None and not conn.session.may_group(op, group)

    def _seen(self, conn: Conn, group: str) -> None:
        """A member of ``group`` spoke: its principal's client acts for the group at the PM."""
        pmm = self._pm_members.get(group)
        if pmm is not None:
            pmm.client = self.client_of(conn)

    async def _sbp_members(self, client: AsyncClient, group: str) -> int:
        """Live members of the sbpstream group of that name other than this gateway's own
        (SDK consumers, or another gateway's Kafka members)."""
        return sum(1 for mb in (await client.group_admin.describe(group)).members
                   if mb.member_id != self.pm_member_id)

    async def _join_group(self, conn: Conn, version: int, req: dict[str, Any]
                          ) -> dict[str, Any]:
        group = req["group_id"]

        def error(code: int) -> dict[str, Any]:
            return {"throttle_time_ms": 0, "error_code": code, "generation_id": -1,
                    "protocol_name": "", "leader": "", "member_id": req["member_id"],
                    "members": []}

        if not group_ok(group):
            return error(E.INVALID_GROUP_ID)
        if self._group_denied(conn, Op.FETCH, group):
            return error(E.GROUP_AUTHORIZATION_FAILED)
        if not self.groups.live(group):
            # the first Kafka member: the group must not be live in sbpstream consumers
            try:
                if await self._sbp_members(self.client_of(conn), group):
                    return error(E.INCONSISTENT_GROUP_PROTOCOL)
            except SbpError as exc:
                return error(E.group_code(exc))
        joined = self.groups.join(
            group, req["member_id"], conn.client_id, conn.host, req["session_timeout_ms"],
            req["rebalance_timeout_ms"], req["protocol_type"],
            [(p["name"], p["metadata"]) for p in req["protocols"]])
        if self.groups.live(group):  # the PM's group holds the (maybe new) subscription
            try:
                await self._pm_sync(group, self.client_of(conn))
            except SbpError as exc:  # retried every PM_HEARTBEAT_S
                log.warning("event=kafka_group_pm_sync_failed group=%s error=%s", group, exc)
        r = await joined
        if r.error_code != E.NONE:
            return error(r.error_code)
        return {"throttle_time_ms": 0, "error_code": 0, "generation_id": r.generation,
                "protocol_name": r.protocol_name, "leader": r.leader, "member_id": r.member_id,
                "members": [{"member_id": mid, "group_instance_id": None, "metadata": meta}
                            for mid, meta in r.members]}

    async def _sync_group(self, conn: Conn, version: int, req: dict[str, Any]
                          ) -> dict[str, Any]:
        if self._group_denied(conn, Op.FETCH, req["group_id"]):
            return {"throttle_time_ms": 0, "error_code": E.GROUP_AUTHORIZATION_FAILED,
                    "assignment": b""}
        self._seen(conn, req["group_id"])
        code, assignment = await self.groups.sync(
            req["group_id"], req["generation_id"], req["member_id"],
            [(a["member_id"], a["assignment"]) for a in req["assignments"]])
        return {"throttle_time_ms": 0, "error_code": code, "assignment": assignment}

    async def _heartbeat(self, conn: Conn, version: int, req: dict[str, Any]
                         ) -> dict[str, Any]:
        if self._group_denied(conn, Op.FETCH, req["group_id"]):
            return {"throttle_time_ms": 0, "error_code": E.GROUP_AUTHORIZATION_FAILED}
        self._seen(conn, req["group_id"])
        code = self.groups.heartbeat(req["group_id"], req["generation_id"], req["member_id"])
        return {"throttle_time_ms": 0, "error_code": code}

    async def _leave_group(self, conn: Conn, version: int, req: dict[str, Any]
                           ) -> dict[str, Any]:
        group = req["group_id"]
        if self._group_denied(conn, Op.FETCH, group):
            return {"throttle_time_ms": 0, "error_code": E.GROUP_AUTHORIZATION_FAILED,
                    "members": []}
        if version < 3:
            code = self.groups.leave(group, req["member_id"])
            out: dict[str, Any] = {"throttle_time_ms": 0, "error_code": code}
        else:
            out = {"throttle_time_ms": 0, "error_code": 0, "members": [
                {"member_id": mb["member_id"], "group_instance_id": mb["group_instance_id"],
                 "error_code": self.groups.leave(group, mb["member_id"])}
                for mb in req["members"]]}
        if group in self._pm_members and not self.groups.live(group):
            with contextlib.suppress(SbpError):  # the last one left: so does the PM member
                await self._pm_sync(group)
        return out

    async def _offset_commit(self, conn: Conn, version: int, req: dict[str, Any]
                             ) -> dict[str, Any]:
        """Kafka commits of group G for T partition p are sbpstream group G's committed
        offsets of the stream T.p, stored through the PM (from outside the sbpstream group:
        refused while SDK consumers are its live members)."""
        group = req["group_id"]
        client = self.client_of(conn)
        code = (self.groups.check_commit(group, req["generation_id"], req["member_id"])
                if group_ok(group) else E.INVALID_GROUP_ID)
        if code == E.NONE and self._group_denied(conn, Op.FETCH, group):
            code = E.GROUP_AUTHORIZATION_FAILED
        codes: dict[tuple[str, int], int] = {}
        offsets: dict[int, int] = {}
        where: dict[int, tuple[str, int]] = {}
        for t in req["topics"]:
            for p in t["partitions"]:
                key = (t["name"], p["partition_index"])
                codes[key] = code
                if code != E.NONE:
                    continue
                if p["committed_offset"] < 0:
                    codes[key] = E.INVALID_REQUEST  # sbpstream keeps offsets >= 0
                    continue
                try:
                    sid = await self._sid(client, *key)
                except SbpError as exc:
                    codes[key] = E.kafka_code(exc)
                    continue
                offsets[sid] = p["committed_offset"]
                where[sid] = key
        if offsets:
            try:
                errs = await self._pm_commit(client, group, offsets, bool(req["member_id"]))
            except SbpError as exc:  # the whole commit: a refusal is the group's
                for sid in offsets:
                    codes[where[sid]] = E.group_code(exc)
                errs = {}
            for sid, err in errs.items():
                if err is not None and sid in where:
                    codes[where[sid]] = E.kafka_code(err)
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for (topic, part), c in codes.items():
            by_topic.setdefault(topic, []).append({"partition_index": part, "error_code": c})
        return {"throttle_time_ms": 0, "topics": [{"name": t, "partitions": ps}
                                                  for t, ps in by_topic.items()]}

    async def _pm_commit(self, client: AsyncClient, group: str, offsets: dict[int, int],
                         as_member: bool) -> dict[int, SbpError | None]:
        """Store a Kafka commit as the sbpstream group's: a member's through this gateway's
        member of that group (its generation refreshed by a heartbeat when stale), one from
        outside the group from outside (refused while the group has live members). Sent with
        ``client``: the committing connection's principal."""
        admin = client.group_admin
        for attempt in range(2):
            if not as_member:
                return await admin.commit(group, offsets)
            pmm = self._pm_members.get(group)
            if attempt or pmm is None or pmm.generation < 0 or not set(offsets) <= set(
                    pmm.streams):
                pmm = await self._pm_sync(group, client)
            if pmm is None:
                raise UnknownMemberError(f"group {group!r} has no member at this gateway")
            try:
                errs = await admin.commit(group, offsets, self.pm_member_id, pmm.generation)
            except (IllegalGenerationError, UnknownMemberError):
                if attempt:
                    raise
                continue
            if attempt or not any(isinstance(e, IllegalGenerationError) for e in errs.values()):
                return errs
        raise AssertionError("unreachable")

    async def _pm_sync(self, group: str, client: AsyncClient | None = None
                       ) -> PmMember | None:
        """Bring this gateway's member of the sbpstream group ``group`` in line with the Kafka
        group live here: joined with the streams of every topic its members subscribe (so the
        PM hands none of them to SDK consumers of the group meanwhile), heartbeating, and left
        once the Kafka group has no member. Returns the member (None: left). ``client``: the
        client of the member acting (the PM checks its principal's rights on the group and the
        streams); by default the one of the member seen last."""
        pmm = self._pm_members.setdefault(group, PmMember(client or self.client))
        if client is not None:
            pmm.client = client
        admin = pmm.client.group_admin
        async with pmm.lock:
            g = self.groups.get(group)
            if g is None or not g.members:
                if self._pm_members.get(group) is pmm:
                    del self._pm_members[group]
                if pmm.generation >= 0:
                    pmm.generation = -1
                    with contextlib.suppress(UnknownMemberError):
                        await admin.leave(group, self.pm_member_id)
                return None
            sids: set[int] = set()
            for topic in sorted(group_topics(g)):
                with contextlib.suppress(SbpError):  # an unknown topic has no streams to hold
                    sids.update((await self._partitions(pmm.client, topic)).values())
            streams = tuple(sorted(sids))
            for attempt in range(2):
                try:
                    if pmm.generation < 0 or streams != pmm.streams:
                        joined: m.JoinGroupResponse = await admin.pm_call(
                            m.JoinGroupRequest(0, group, self.pm_member_id, streams, (), "",
                                               PM_SESSION_TIMEOUT_MS, PM_CLIENT_ID),
                            m.JoinGroupResponse)
                        pmm.generation, pmm.streams = joined.generation, streams
                    # it holds every stream it subscribes: the PM gives SDK members none of them
                    hb = await admin.heartbeat(group, self.pm_member_id, pmm.generation, streams)
                    pmm.generation = hb.generation
                    return pmm
                except UnknownMemberError:  # a PM failover, or a missed session: join again
                    pmm.generation = -1
                    if attempt:
                        raise
            raise AssertionError("unreachable")

    async def _pm_groups_loop(self) -> None:
        while True:
            await asyncio.sleep(PM_HEARTBEAT_S)
            for group in sorted(set(self._pm_members) | set(self.groups.groups)):
                try:
                    await self._pm_sync(group)
                except SbpError as exc:
                    log.warning("event=kafka_group_pm_sync_failed group=%s error=%s", group,
                                exc)

    async def _offset_fetch(self, conn: Conn, version: int, req: dict[str, Any]
                            ) -> dict[str, Any]:
        group = req["group_id"]
        if not group_ok(group):
            return {"throttle_time_ms": 0, "topics": [], "error_code": E.INVALID_GROUP_ID}
        if self._group_denied(conn, Op.DESCRIBE, group):
            return {"throttle_time_ms": 0, "topics": [],
                    "error_code": E.GROUP_AUTHORIZATION_FAILED}
        client = self.client_of(conn)
        wanted: list[tuple[str, int]] = []
        sids: dict[tuple[str, int], int] = {}
        code = E.NONE
        committed: dict[int, int] = {}
        try:
            if req["topics"] is None:  # every partition the group has an offset for
                committed = await client.committed_offsets(group)
                for topic, parts in sorted((await self._all_topics(client)).items()):
                    for p, sid in sorted(parts.items()):
                        if sid in committed:
                            wanted.append((topic, p))
                            sids[(topic, p)] = sid
            else:
                for t in req["topics"]:
                    for p in t["partition_indexes"]:
                        wanted.append((t["name"], p))
                        with contextlib.suppress(SbpError):  # unknown: nothing committed
                            sids[(t["name"], p)] = await self._sid(client, t["name"], p)
                if sids:
                    committed = await client.committed_offsets(group, list(sids.values()))
        except SbpError as exc:
            code = E.group_code(exc)
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for topic, part in wanted:
            known = sids.get((topic, part))
            by_topic.setdefault(topic, []).append({
                "partition_index": part, "committed_leader_epoch": -1, "metadata": "",
                "committed_offset": -1 if known is None else committed.get(known, -1),
                "error_code": code})
        return {"throttle_time_ms": 0, "error_code": code,
                "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()]}

    async def _list_groups(self, conn: Conn, version: int, req: dict[str, Any]
                           ) -> dict[str, Any]:
        try:  # the PM lists only the groups the principal may describe; so does the gateway
            names = set(await self.client_of(conn).list_groups()) | {
                g for g in self.groups.groups if not self._group_denied(conn, Op.DESCRIBE, g)}
        except SbpError as exc:
            return {"throttle_time_ms": 0, "error_code": E.cluster_code(exc), "groups": []}
        return {"throttle_time_ms": 0, "error_code": 0, "groups": [
            {"group_id": n, "protocol_type": "consumer"} for n in sorted(names)]}

    async def _describe_groups(self, conn: Conn, version: int, req: dict[str, Any]
                               ) -> dict[str, Any]:
        return {"throttle_time_ms": 0,
                "groups": [await self._describe_group(conn, n) for n in req["groups"]]}

    async def _describe_group(self, conn: Conn, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"error_code": 0, "group_id": name, "group_state": "Dead",
                               "protocol_type": "", "protocol_data": "", "members": []}
        if self._group_denied(conn, Op.DESCRIBE, name):
            out["error_code"] = E.GROUP_AUTHORIZATION_FAILED
            return out
        g = self.groups.get(name)
        if g is not None:  # a Kafka group live at this gateway
            proto = g.protocol_name or "" if g.state not in (PREPARING, COMPLETING) else ""
            out.update(group_state=g.state, protocol_type=g.protocol_type, protocol_data=proto,
                       members=[{"member_id": mb.member_id, "group_instance_id": None,
                                 "client_id": mb.client_id, "client_host": mb.host,
                                 "member_metadata": mb.metadata(g.protocol_name or ""),
                                 "member_assignment": mb.assignment}
                                for mb in g.members.values()])
            return out
        if not group_ok(name):
            out["error_code"] = E.INVALID_GROUP_ID
            return out
        try:  # the sbpstream group: SDK consumers, or committed offsets only
            d = await self.client_of(conn).group_admin.describe(name)
        except SbpError as exc:
            out["error_code"] = E.group_code(exc)
            return out
        if d.members:
            out.update(group_state="Stable" if d.state == "stable" else "PreparingRebalance",
                       protocol_type="sbpstream",
                       members=[{"member_id": mb.member_id, "group_instance_id": None,
                                 "client_id": mb.client_id, "client_host": mb.host,
                                 "member_metadata": b"", "member_assignment": b""}
                                for mb in d.members])
        elif d.committed_streams:
            out.update(group_state="Empty", protocol_type="consumer")
        return out
