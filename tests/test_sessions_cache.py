"""The fetch-session cache (sbpstream.datanode.sessions) on its own: epochs, updates, eviction
under a flood of sessions, expiry, a connection's sessions dying with it, the bounds."""

from __future__ import annotations

import pytest

from sbpstream.datanode.sessions import (
    EVICTABLE_AFTER_S,
    MAX_FETCH_SESSIONS,
    MAX_SESSION_STREAMS,
    SESSION_IDLE_TIMEOUT_S,
    FetchSessionCache,
    next_epoch,
)
from sbpstream.protocol.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    LimitExceededError,
)
from sbpstream.protocol.messages import FetchItem


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Conn:
    def __init__(self) -> None:
        self.closed = False


def items(n: int, first: int = 0) -> list[FetchItem]:
    return [FetchItem(stream_id=first + i, request_index=i, fetch_offset=0) for i in range(n)]


def cache(clock: Clock, **kw: int) -> FetchSessionCache:
    return FetchSessionCache(clock=clock, alive=lambda c: not c.closed,  # type: ignore[attr-defined]
                             **kw)  # type: ignore[arg-type]


def test_epochs_follow_kafka() -> None:
    clock, conn = Clock(), Conn()
    c = cache(clock)
    s = c.create(conn, items(3))
    assert s is not None and s.epoch == 1 and s.size == 3
    with pytest.raises(InvalidFetchSessionEpochError):
        c.get(conn, s.session_id, 2)  # skipped one
    with pytest.raises(FetchSessionIdNotFoundError):
        c.get(conn, s.session_id + 1, 1)
    with pytest.raises(FetchSessionIdNotFoundError):
        c.get(Conn(), s.session_id, 1)  # another connection's session is not found
    assert c.get(conn, s.session_id, 1) is s and s.epoch == 2
    with pytest.raises(InvalidFetchSessionEpochError):
        c.get(conn, s.session_id, 1)  # replayed
    assert c.stats().bad_epoch == 2 and c.stats().not_found == 2
    assert next_epoch(2**31 - 1) == 1  # wraps past 0 (create) and -1 (close)


def test_busy_session_refuses_a_second_fetch() -> None:
    clock, conn = Clock(), Conn()
    c = cache(clock)
    s = c.create(conn, items(1))
    assert s is not None
    s.busy = True
    with pytest.raises(InvalidFetchSessionEpochError):
        c.get(conn, s.session_id, 1)


def test_update_adds_replaces_and_forgets() -> None:
    clock, conn = Clock(), Conn()
    c = cache(clock)
    s = c.create(conn, items(3))
    assert s is not None
    c.update(s, [FetchItem(stream_id=1, fetch_offset=7), FetchItem(stream_id=9)], [0, 42])
    assert list(s.streams) == [1, 2, 9]
    assert s.streams[1].item.fetch_offset == 7
    assert c.streams == 3 == c.stats().streams


def test_session_stream_bound() -> None:
    clock, conn = Clock(), Conn()
    c = cache(clock)
    with pytest.raises(LimitExceededError):
        c.create(conn, items(MAX_SESSION_STREAMS + 1))
    s = c.create(conn, items(MAX_SESSION_STREAMS))
    assert s is not None
    with pytest.raises(LimitExceededError):
        c.update(s, [FetchItem(stream_id=-1)], [])
    assert c.sessions == {} and c.streams == 0  # a refused update closes the session


def test_node_stream_bound_evicts_or_refuses() -> None:
    clock, conn = Clock(), Conn()
    c = cache(clock, max_streams=10)
    a = c.create(conn, items(6))
    assert a is not None
    assert c.create(conn, items(5, 100)) is None  # 11 > 10; 5 < 6: may not evict a
    b = c.create(conn, items(8, 100))  # larger: evicts a
    assert b is not None and list(c.sessions) == [b.session_id] and c.streams == 8


def test_flood_of_small_sessions_keeps_large_recent_ones() -> None:
    clock = Clock()
    c = cache(clock)
    conn = Conn()
    big = [c.create(conn, items(1000, 10_000 * i)) for i in range(10)]
    assert all(s is not None for s in big)
    small = [c.create(conn, items(1, -i - 1)) for i in range(MAX_FETCH_SESSIONS - 10)]
    assert all(s is not None for s in small) and len(c.sessions) == MAX_FETCH_SESSIONS
    # the cache is full: a flood of one-stream sessions finds no smaller session to evict
    flood = [c.create(conn, items(1, 50_000 + i)) for i in range(5000)]
    assert flood.count(None) == 5000 and c.stats().refused == 5000
    # a two-stream session evicts the least recently used of the smallest
    clock.now += 1
    for s in small[1:]:
        assert s is not None
        c.get(conn, s.session_id, s.epoch)
    two = c.create(conn, items(2, 90_000))
    assert two is not None and small[0] is not None
    assert small[0].session_id not in c.sessions
    # every big session survives the flood
    assert all(s is not None and s.session_id in c.sessions for s in big)
    # sessions idle past EVICTABLE_AFTER_S are evictable by anyone, least recently used first
    clock.now += EVICTABLE_AFTER_S + 1
    for s in big[1:]:
        assert s is not None
        c.get(conn, s.session_id, s.epoch)
    stale_victim = next(iter(c.sessions))
    assert c.create(conn, items(1, 99_999)) is not None
    assert stale_victim not in c.sessions
    assert all(s is not None and s.session_id in c.sessions for s in big[1:])
    assert len(c.sessions) == MAX_FETCH_SESSIONS and c.stats().evicted == 2


def test_idle_sessions_expire_and_closed_connections_drop() -> None:
    clock = Clock()
    c = cache(clock)
    a, b = Conn(), Conn()
    sa = c.create(a, items(2))
    sb = c.create(b, items(3, 10))
    assert sa is not None and sb is not None
    b.closed = True
    with pytest.raises(FetchSessionIdNotFoundError):
        c.get(b, sb.session_id, 1)
    assert c.close_owner(b) == 1 and c.streams == 2
    clock.now += SESSION_IDLE_TIMEOUT_S + 1
    assert c.sweep() == 1 and c.sessions == {} and c.streams == 0
    with pytest.raises(FetchSessionIdNotFoundError):
        c.get(a, sa.session_id, 1)


def test_close_owned_leaves_others_sessions() -> None:
    clock = Clock()
    c = cache(clock)
    a, b = Conn(), Conn()
    sa = c.create(a, items(1))
    assert sa is not None
    assert not c.close_owned(b, sa.session_id)
    assert c.close_owned(a, sa.session_id) and not c.sessions
