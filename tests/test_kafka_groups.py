"""The gateway's Kafka group state machine (sbpstream/kafka/groups.py), on a fake clock."""

from __future__ import annotations

import asyncio
import struct

import pytest

from sbpstream.kafka import errors as E
from sbpstream.kafka.groups import COMPLETING, PREPARING, STABLE, KafkaGroups, subscribed_topics

pytestmark = pytest.mark.unit

PROTO = [("range", b"meta-range"), ("roundrobin", b"meta-rr")]


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def _join(gs: KafkaGroups, member: str = "", protocols: list[tuple[str, bytes]] | None = None,
          session_ms: int = 6000, rebalance_ms: int = 10_000) -> asyncio.Future:  # type: ignore[type-arg]
    return gs.join("g", member, "cid", "host", session_ms, rebalance_ms, "consumer",
                   PROTO if protocols is None else protocols)


async def _settle() -> None:
    await asyncio.sleep(0)


def test_a_lone_member_becomes_leader_and_syncs_its_own_assignment() -> None:
    async def run() -> None:
        gs = KafkaGroups(Clock())
        r = await _join(gs)
        assert r.error_code == E.NONE and r.generation == 1 and r.leader == r.member_id
        assert r.protocol_name == "range" and r.members == [(r.member_id, b"meta-range")]
        assert gs.groups["g"].state == COMPLETING
        code, data = await gs.sync("g", 1, r.member_id, [(r.member_id, b"all")])
        assert (code, data) == (E.NONE, b"all") and gs.groups["g"].state == STABLE
        assert gs.heartbeat("g", 1, r.member_id) == E.NONE
        assert gs.heartbeat("g", 0, r.member_id) == E.ILLEGAL_GENERATION
        assert gs.heartbeat("g", 1, "nobody") == E.UNKNOWN_MEMBER_ID
    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_second_member_triggers_a_rebalance_and_both_get_the_leaders_assignment() -> None:
    async def run() -> None:
        gs = KafkaGroups(Clock())
        a = await _join(gs)
        await gs.sync("g", 1, a.member_id, [(a.member_id, b"a-all")])
        b_fut = _join(gs, protocols=[("roundrobin", b"b-rr")])
        await _settle()
        assert not b_fut.done() and gs.groups["g"].state == PREPARING
        # the old generation may still commit (eager members commit what they give up)
        assert gs.check_commit("g", 1, a.member_id) == E.NONE
        assert gs.heartbeat("g", 1, a.member_id) == E.REBALANCE_IN_PROGRESS
        a2 = await _join(gs, a.member_id)
        b = await b_fut
        assert a2.generation == b.generation == 2 and a2.leader == b.leader == a.member_id
        assert a2.protocol_name == "roundrobin"  # the leader's first that everyone has
        assert sorted(a2.members) == sorted([(a.member_id, b"meta-rr"), (b.member_id, b"b-rr")])
        assert b.members == []
        b_sync = gs.sync("g", 2, b.member_id, [])
        await _settle()
        assert not b_sync.done()
        assert gs.check_commit("g", 2, b.member_id) == E.REBALANCE_IN_PROGRESS
        await gs.sync("g", 2, a.member_id, [(a.member_id, b"A"), (b.member_id, b"B")])
        assert await b_sync == (E.NONE, b"B")
        assert gs.check_commit("g", 1, a.member_id) == E.ILLEGAL_GENERATION
        assert gs.check_commit("g", 2, a.member_id) == E.NONE
        # a commit from outside the group while it has members
        assert gs.check_commit("g", -1, "") == E.UNKNOWN_MEMBER_ID
    asyncio.run(asyncio.wait_for(run(), 10))


def test_session_timeout_and_leave_rebalance_and_an_empty_group_goes() -> None:
    async def run() -> None:
        clock = Clock()
        gs = KafkaGroups(clock)
        a = await _join(gs)  # alone: completes at once
        b_fut = _join(gs)  # waits for a to rejoin
        await _join(gs, a.member_id)
        b = await b_fut
        gen = gs.groups["g"].generation
        assert gen == b.generation == 2
        await gs.sync("g", gen, a.leader, [])
        clock.now = 5000
        assert gs.heartbeat("g", gen, b.member_id) == E.NONE
        clock.now = 6500  # a missed its session, b did not
        gs.tick()
        g = gs.groups["g"]
        assert a.member_id not in g.members and g.state == PREPARING
        assert gs.heartbeat("g", gen, b.member_id) == E.REBALANCE_IN_PROGRESS
        b2 = await _join(gs, b.member_id)
        assert b2.leader == b.member_id and b2.generation == gen + 1
        assert gs.leave("g", b.member_id) == E.NONE
        assert "g" not in gs.groups and gs.check_commit("g", -1, "") == E.NONE
        assert gs.leave("g", b.member_id) == E.UNKNOWN_MEMBER_ID
    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_member_that_does_not_rejoin_in_the_rebalance_timeout_is_dropped() -> None:
    async def run() -> None:
        clock = Clock()
        gs = KafkaGroups(clock)
        a = await _join(gs, rebalance_ms=3000)
        await gs.sync("g", 1, a.member_id, [])
        b_fut = _join(gs, rebalance_ms=3000)
        for t in range(0, 3001, 500):  # a heartbeats but never rejoins
            clock.now = t
            gs.heartbeat("g", 1, a.member_id)
            gs.tick()
            await _settle()
        b = await b_fut
        assert b.error_code == E.NONE and b.leader == b.member_id and b.generation == 2
        assert a.member_id not in gs.groups["g"].members
    asyncio.run(asyncio.wait_for(run(), 10))


def test_joins_that_cannot_be_served_are_refused() -> None:
    async def run() -> None:
        gs = KafkaGroups(Clock())
        assert (await _join(gs, session_ms=10)).error_code == E.INVALID_SESSION_TIMEOUT
        assert (await _join(gs, "stale-id")).error_code == E.UNKNOWN_MEMBER_ID
        assert (await _join(gs, protocols=[])).error_code == E.INCONSISTENT_GROUP_PROTOCOL
        await _join(gs)
        other = await _join(gs, protocols=[("cooperative-sticky", b"")])
        assert other.error_code == E.INCONSISTENT_GROUP_PROTOCOL
        assert (await gs.sync("g", 1, "nobody", [])) == (E.UNKNOWN_MEMBER_ID, b"")
    asyncio.run(asyncio.wait_for(run(), 10))


def test_subscribed_topics_of_consumer_protocol_metadata() -> None:
    def meta(version: int, topics: list[str], tail: bytes = b"\xff\xff\xff\xff") -> bytes:
        out = struct.pack(">hi", version, len(topics))
        for t in topics:
            out += struct.pack(">h", len(t)) + t.encode()
        return out + tail

    assert subscribed_topics("consumer", meta(0, ["a", "bb.c"])) == ["a", "bb.c"]
    assert subscribed_topics("consumer", meta(3, ["x"], b"")) == ["x"]  # tail not needed
    assert subscribed_topics("connect", meta(0, ["a"])) == []  # another protocol type
    good = meta(1, ["orders", "payments"])
    for cut in range(len(good) - 4):  # truncated inside the topics: nothing, never an error
        assert subscribed_topics("consumer", good[:cut]) == []
    assert subscribed_topics("consumer", struct.pack(">hi", 0, 1 << 30)) == []  # claims too many
    assert subscribed_topics("consumer", struct.pack(">hih", 0, 1, -1)) == []
    assert subscribed_topics("consumer", struct.pack(">hih", 0, 1, 2) + b"\xff\xfe") == []
