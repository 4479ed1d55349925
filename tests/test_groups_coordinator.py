"""The group coordinator alone (pm/groups.py): sticky cooperative assignment, sessions, fencing.
A fake clock drives the session timeouts."""

from __future__ import annotations

import pytest

from sbpstream.pm.groups import GroupCoordinator, Member, sticky_assign
from sbpstream.protocol.errors import (
    GroupNotEmptyError,
    IllegalGenerationError,
    InvalidRequestError,
    UnknownMemberError,
)

STREAMS = list(range(1, 11))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


def settle(c: GroupCoordinator, group: str, owned: dict[str, set[int]]) -> None:
    """Heartbeat every member, each releasing what it lost and taking what it got, until no
    assignment changes (the clients' loop, without I/O)."""
    for _ in range(10):
        changed = False
        for mid in sorted(owned):
            _, assigned, _ = c.heartbeat(group, mid, 0, owned[mid])
            if set(assigned) != owned[mid]:
                owned[mid] = set(assigned)
                changed = True
        if not changed:
            return
    raise AssertionError("assignment did not settle")


def test_two_members_share_ten_streams_evenly_and_a_third_moves_only_what_it_needs() -> None:
    c = GroupCoordinator(Clock())
    a, _ = c.join("g", "", STREAMS, 1_000, "a")
    b, _ = c.join("g", "", STREAMS, 1_000, "b")
    owned = {a.member_id: set(), b.member_id: set()}
    settle(c, "g", owned)
    assert sorted(len(v) for v in owned.values()) == [5, 5]
    assert set().union(*owned.values()) == set(STREAMS)
    before = {k: set(v) for k, v in owned.items()}
    x, _ = c.join("g", "", STREAMS, 1_000, "c")
    # cooperative: the new member gets nothing while the others still hold everything
    _, got, pending = c.heartbeat("g", x.member_id, 0, [])
    assert got == [] and pending == 3
    owned[x.member_id] = set()
    settle(c, "g", owned)
    assert sorted(len(v) for v in owned.values()) == [3, 3, 4]
    assert set().union(*owned.values()) == set(STREAMS)
    moved = sum(len(before[k] - owned[k]) for k in before)
    assert moved == 3  # exactly the new member's share moved; the rest stayed put
    assert all(owned[k] <= before[k] for k in before)


def test_missed_session_timeout_loses_streams_and_stale_commits_are_refused() -> None:
    clock = Clock()
    c = GroupCoordinator(clock)
    a, _ = c.join("g", "", STREAMS, 1_000, "a")
    b, _ = c.join("g", "", STREAMS, 5_000, "b")
    owned = {a.member_id: set(), b.member_id: set()}
    settle(c, "g", owned)
    gen = c.describe("g").generation  # type: ignore[union-attr]
    s_a = sorted(owned[a.member_id])
    assert c.check_commit("g", a.member_id, gen, s_a) == [None] * 5
    # another member's stream: refused per item
    (err,) = c.check_commit("g", a.member_id, gen, [min(owned[b.member_id])])
    assert isinstance(err, IllegalGenerationError)
    clock.now += 1_500  # a misses its session; b is still in
    _, assigned, _ = c.heartbeat("g", b.member_id, gen, owned[b.member_id])
    assert assigned == STREAMS
    with pytest.raises(UnknownMemberError):
        c.check_commit("g", a.member_id, gen, s_a)
    with pytest.raises(UnknownMemberError):
        c.heartbeat("g", a.member_id, gen, s_a)
    # b's commit with the generation from before a was evicted is stale
    with pytest.raises(IllegalGenerationError):
        c.check_commit("g", b.member_id, gen, STREAMS)
    new_gen = c.describe("g").generation  # type: ignore[union-attr]
    assert new_gen > gen
    assert c.check_commit("g", b.member_id, new_gen, STREAMS) == [None] * 10
    with pytest.raises(GroupNotEmptyError):
        c.check_commit("g", "", -1, [1])
    c.leave("g", b.member_id)
    assert c.check_commit("g", "", -1, [1]) == [None]
    assert c.live_groups() == []


def test_rejoin_after_failover_keeps_what_members_hold() -> None:
    c = GroupCoordinator(Clock())
    c.join("g", "m1", STREAMS, 1_000)
    c.join("g", "m2", STREAMS, 1_000)
    owned: dict[str, set[int]] = {"m1": set(), "m2": set()}
    settle(c, "g", owned)
    c.reset()  # a new leader knows nobody
    with pytest.raises(UnknownMemberError):
        c.heartbeat("g", "m1", 0, owned["m1"])
    c.join("g", "m1", STREAMS, 1_000)
    c.heartbeat("g", "m1", 0, owned["m1"])
    c.join("g", "m2", STREAMS, 1_000)
    before = {k: set(v) for k, v in owned.items()}
    settle(c, "g", owned)
    assert owned == before


def test_uneven_subscriptions_and_bad_requests() -> None:
    mbs = [Member("a", "", "", frozenset({1, 2, 3}), 1, 0),
           Member("b", "", "", frozenset({3, 4}), 1, 0)]
    out = sticky_assign(mbs)
    assert out["a"] | out["b"] == {1, 2, 3, 4} and not out["a"] & out["b"]
    assert out["b"] <= {3, 4}
    c = GroupCoordinator(Clock())
    with pytest.raises(InvalidRequestError):
        c.join("g", "", [1], 10)
    with pytest.raises(InvalidRequestError):
        c.join("a/b", "", [1], 1_000)
