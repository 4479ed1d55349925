"""Fetch sessions (Kafka's KIP-227, our own code): a data node remembers a consumer's streams and
positions, so a FETCH names only what changed and the answer holds only what changed.

The rules, by the request's ``(session_id, session_epoch)``:

- ``(0, -1)``: no session, a full FETCH as always (every named stream is answered).
- ``(0, 0)``: a full FETCH that also creates a session holding its items; the response's
  ``session_id`` names it (0 when the cache has no room: the FETCH is served sessionless).
- ``(id, 0)``: closes session ``id`` (if it is there) and creates a new one, as ``(0, 0)``.
- ``(id, n)``, ``n > 0``: an incremental FETCH. ``n`` must be the session's next epoch (1 after
  creation, +1 after each incremental FETCH, wrapping to 1 after 2**31 - 1), else
  INVALID_FETCH_SESSION_EPOCH; an unknown id (never made, evicted, expired, closed, or made on
  another connection) is FETCH_SESSION_ID_NOT_FOUND. Its items add streams or replace their
  offset, range and byte budget; ``forgotten`` drops streams. Then the session's streams are
  served, reading only the *dirty* ones (added or changed, woken by a commit through their
  :class:`Waker`, or last read with batches or an error), and the response lists only the
  streams with batches, an error, or a changed state (high watermark or sealed range end
  differing from what this session last reported).
- ``(id, -1)``: closes session ``id``, then serves the items sessionless.
- ``(0, n)`` with ``n > 0``, or an epoch below -1: INVALID_FETCH_SESSION_EPOCH.

Both session errors are retriable: the client's answer is a full FETCH ``(id, 0)`` from its own
positions (it never trusts the node's copy), so nothing is skipped or read twice.

The node does not advance a session's offsets on its own: as in Kafka, the client names a
stream again when its position moved (after it received records), so a position only ever
comes from the client.

**Lifetime.** A session belongs to the connection that made it and dies with it (requests on
another connection do not find it); it also dies after :data:`SESSION_IDLE_TIMEOUT_S` unused.

**The cache** holds at most :data:`MAX_FETCH_SESSIONS` sessions (Kafka's default: 1,000) and at
most :data:`MAX_SESSION_STREAMS_PER_NODE` streams over all of them; a session holds at most
:data:`MAX_SESSION_STREAMS` streams, about :data:`SESSION_STREAM_BYTES` each, so its memory is
bounded by its stream count. A new session that does not fit evicts, in this order (Kafka's rule,
``FetchSessionCache.tryEvict``):

1. dead sessions (connection closed, idle past the timeout), always;
2. the least recently used session unused for :data:`EVICTABLE_AFTER_S` (Kafka's 120 s
   ``min.incremental.fetch.session.eviction.ms``): stale sessions can be evicted by anyone;
3. else the smallest session (fewest streams; among those, the least recently used), and only
   if the new session has more streams than it: large sessions save the most request bytes per
   slot, so they are the ones worth keeping, and a flood of small sessions cannot push out the
   consumers of thousands of streams that used them recently.

A session in **push mode** is a subscription's (subscribe.py): the same id, epochs and
incremental FETCHes, but its streams are served by the live subscription, which pushes records
as they are committed; an incremental FETCH adds or drops streams of it without starting over.
It is never evicted nor expired while it streams, and it is closed when the subscription ends.

If nothing may be evicted, no session is made (response ``session_id`` 0) and the consumer
keeps sending full FETCHes, correct but larger. The protocol and records layers do no I/O; this
module is pure state plus the clock it is given.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, cast

from sbpstream.datanode.limits import MAX_FETCH_ITEMS
from sbpstream.datanode.ranges import StreamInfo
from sbpstream.introspect.counters import connection_counters
from sbpstream.protocol.errors import (
    FetchSessionIdNotFoundError,
    InvalidFetchSessionEpochError,
    LimitExceededError,
)
from sbpstream.protocol.messages import FetchItem, FetchRequest

MAX_FETCH_SESSIONS: Final = 1_000
"""Sessions one data node caches (Kafka's ``max.incremental.fetch.session.cache.slots``)."""

MAX_SESSION_STREAMS: Final = MAX_FETCH_ITEMS
"""Streams one session may hold (10,000, as one FETCH may name)."""

MAX_SESSION_STREAMS_PER_NODE: Final = 1_000_000
"""Streams held over all sessions of a node: ~``SESSION_STREAM_BYTES`` each, ~200 MiB at most."""

SESSION_STREAM_BYTES: Final = 200
"""About what one stream costs in a session (its FetchItem and what was last reported)."""

EVICTABLE_AFTER_S: Final = 120.0
"""A session unused this long may be evicted by any new session (Kafka's 120,000 ms)."""

SESSION_IDLE_TIMEOUT_S: Final = 300.0
"""A session unused this long is dropped, whether or not the cache is full."""

FINAL_EPOCH: Final = -1
INITIAL_EPOCH: Final = 0
_MAX_EPOCH: Final = 2**31 - 1
_NEVER: Final = -2  # a reported value before anything was reported


def next_epoch(epoch: int) -> int:
    """The epoch after ``epoch`` (1 after the largest int32: 0 and -1 mean create and close)."""
    return 1 if epoch >= _MAX_EPOCH else epoch + 1


class Waker:
    """Stands in a stream's waiter set (``StreamInfo.waiters``, where the append path calls
    ``set()`` after a commit, a seal's commit or a delete) for as long as the stream is in a
    session: it marks the stream to be read again and wakes the session's parked FETCH. So an
    incremental FETCH reads only the streams that changed, not all of them (a few dozen bytes
    each, against an ``asyncio.Event``'s few hundred)."""

    __slots__ = ("session", "stream_id")

    def __init__(self, session: FetchSession, stream_id: int) -> None:
        self.session = session
        self.stream_id = stream_id

    def set(self) -> None:
        s = self.session
        s.dirty.add(self.stream_id)
        if s.wake is not None:
            s.wake.set()

    def event(self) -> asyncio.Event:
        """As the waiter sets are typed (only ``set()`` is ever called on their members)."""
        return cast(asyncio.Event, self)


@dataclass(slots=True)
class SessionStream:
    """One stream of a session: what to fetch and what the consumer was last told."""

    item: FetchItem
    hwm: int = _NEVER  # high watermark last reported
    range_end: int = _NEVER  # range_end_offset last reported
    code: int = _NEVER  # status code last reported
    waker: Waker | None = None
    info: StreamInfo | None = None  # the StreamInfo whose waiters hold ``waker``

    def unwatch(self) -> None:
        if self.info is not None and self.waker is not None:
            self.info.waiters.discard(self.waker.event())
        self.info = None

    def watch(self, info: StreamInfo | None) -> None:
        """Register with ``info``'s waiters (the stream's table entry may have been replaced)."""
        if info is not self.info:
            self.unwatch()
            if info is not None and self.waker is not None:
                info.waiters.add(self.waker.event())
                self.info = info

    def changed(self, hwm: int, range_end: int, code: int) -> bool:
        return hwm != self.hwm or range_end != self.range_end or code != self.code

    def reported(self, hwm: int, range_end: int, code: int) -> None:
        self.hwm, self.range_end, self.code = hwm, range_end, code


@dataclass(slots=True, eq=False)
class FetchSession:
    """A consumer's streams on this node, in the order they were added."""

    session_id: int
    owner: object  # the connection that made it
    streams: dict[int, SessionStream]
    epoch: int = 1  # the epoch the next incremental FETCH must carry
    last_used: float = 0.0
    busy: bool = False  # a FETCH of this session is being served
    created: float = field(default_factory=time.monotonic)
    #: streams to read at the next chance: added, changed, woken by a commit, or last read
    #: with batches or an error (a stream read to its committed end stays out until woken)
    dirty: set[int] = field(default_factory=set)
    wake: asyncio.Event | None = None  # the parked FETCH's event, while one is parked
    closed: bool = False  # out of the cache: its wakers are unregistered and stay so
    #: push mode: the session is served by a subscription (subscribe.py) for as long as it
    #: streams; ``busy`` stays set (never evicted nor expired while it streams), incremental
    #: FETCHes change the live subscription's streams, and ``on_close`` ends it when the
    #: session is closed (epoch -1, replaced by ``(id, 0)``, or a refused update)
    push: bool = False
    on_close: Callable[[], None] | None = None
    #: auth: the token (claims) its streams were last checked against (None: not yet); a
    #: FETCH of the session under another token re-checks every stream first (fetch.py)
    claims: object = None

    def __post_init__(self) -> None:
        for sid, st in self.streams.items():
            st.waker = Waker(self, sid)
        self.dirty.update(self.streams)

    @property
    def size(self) -> int:
        return len(self.streams)

    def add(self, it: FetchItem) -> None:
        st = self.streams.get(it.stream_id)
        if st is None:
            st = self.streams[it.stream_id] = SessionStream(it)
            st.waker = Waker(self, it.stream_id)
        else:
            st.item = it
        self.dirty.add(it.stream_id)

    def drop(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            st.unwatch()
        self.dirty.discard(sid)

    def release(self) -> None:
        """Unregister every waker (the session is gone)."""
        self.closed = True
        for st in self.streams.values():
            st.unwatch()
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()


@dataclass(frozen=True, slots=True)
class SessionStats:
    sessions: int
    streams: int
    created: int
    evicted: int
    expired: int
    not_found: int
    bad_epoch: int
    refused: int  # full FETCHes asking for a session that found no room


class FetchSessionCache:
    """The sessions of one data node. ``alive(owner)`` says whether a connection is still open."""

    def __init__(self, *, max_sessions: int = MAX_FETCH_SESSIONS,
                 max_streams: int = MAX_SESSION_STREAMS_PER_NODE,
                 idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S,
                 evictable_after_s: float = EVICTABLE_AFTER_S,
                 alive: Callable[[object], bool] = lambda owner: True,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self.evictable_after_s = evictable_after_s
        self.alive = alive
        self.clock = clock
        self._rng = rng or random.Random()
        #: least recently used first (a use moves a session to the end)
        self.sessions: dict[int, FetchSession] = {}
        self.streams = 0
        self.created = self.evicted = self.expired = 0
        self.not_found = self.bad_epoch = self.refused = 0

    def stats(self) -> SessionStats:
        return SessionStats(len(self.sessions), self.streams, self.created, self.evicted,
                            self.expired, self.not_found, self.bad_epoch, self.refused)

    # -------------------------------------------------------------------- lifecycle

    def create(self, owner: object, items: Iterable[FetchItem]) -> FetchSession | None:
        """A new session holding ``items`` (the last item of a stream wins), or None when the
        cache has no room for it (nothing may be evicted for it)."""
        streams = {it.stream_id: SessionStream(it) for it in items}
        if len(streams) > MAX_SESSION_STREAMS:
            raise LimitExceededError(f"{len(streams)} streams in one fetch session; at most "
                                     f"{MAX_SESSION_STREAMS}")
        now = self.clock()
        self.sweep(now, closed_too=len(self.sessions) >= self.max_sessions)
        if not self._make_room(len(streams), now, sessions=1):
            self.refused += 1
            return None
        sid = self._new_id()
        s = FetchSession(sid, owner, streams, last_used=now)
        self.sessions[sid] = s
        self.streams += s.size
        self.created += 1
        _count(owner, 1)
        return s

    def get(self, owner: object, session_id: int, epoch: int) -> FetchSession:
        """The session for an incremental FETCH ``(session_id, epoch)``, marked used."""
        now = self.clock()
        self.sweep(now)
        s = self.sessions.get(session_id)
        if s is None or s.owner is not owner or not self.alive(owner):
            self.not_found += 1
            raise FetchSessionIdNotFoundError(
                f"fetch session {session_id} is not on this node (closed, evicted, expired, or "
                "made on another connection)")
        if epoch != s.epoch or (s.busy and not s.push):
            self.bad_epoch += 1
            why = "is being served" if epoch == s.epoch else f"expects epoch {s.epoch}"
            raise InvalidFetchSessionEpochError(
                f"fetch session {session_id} {why}; the request carries epoch {epoch}")
        s.epoch = next_epoch(epoch)
        self._touch(s, now)
        return s

    def update(self, s: FetchSession, items: Iterable[FetchItem],
               forgotten: Iterable[int]) -> None:
        """Apply an incremental FETCH: ``forgotten`` first, then ``items`` (add or replace)."""
        before = s.size
        for sid in forgotten:
            s.drop(sid)
        for it in items:
            s.add(it)
        grown = s.size - before
        if s.size > MAX_SESSION_STREAMS or (
                grown > 0 and not self._make_room(grown, self.clock(), sessions=0, keep=s)):
            self.streams += s.size - before
            self.close(s.session_id)  # a half-applied update must not stay
            raise LimitExceededError(
                f"fetch session {s.session_id} would hold {s.size} streams; at most "
                f"{MAX_SESSION_STREAMS} per session and {self.max_streams} per node")
        self.streams += grown

    def close(self, session_id: int) -> bool:
        s = self.sessions.pop(session_id, None)
        if s is None:
            return False
        self.streams -= s.size
        _count(s.owner, -1)
        s.release()
        return True

    def close_owned(self, owner: object, session_id: int) -> bool:
        """Close session ``session_id`` if ``owner`` made it (another's is left alone)."""
        s = self.sessions.get(session_id)
        return s is not None and s.owner is owner and self.close(session_id)

    def close_owner(self, owner: object) -> int:
        """Drop every session of a connection (it closed); returns how many."""
        ids = [sid for sid, s in self.sessions.items() if s.owner is owner]
        for sid in ids:
            self.close(sid)
        return len(ids)

    def sweep(self, now: float | None = None, *, closed_too: bool = False) -> int:
        """Drop sessions idle past the timeout (and, with ``closed_too``, those whose
        connection closed); returns how many."""
        now = self.clock() if now is None else now
        dead: list[int] = []
        for sid, s in self.sessions.items():  # least recently used first
            if now - s.last_used <= self.idle_timeout_s:
                break
            if not s.busy:
                dead.append(sid)
        if closed_too:
            dead += [sid for sid, s in self.sessions.items()
                     if not s.busy and not self.alive(s.owner)]
        n = sum(self.close(sid) for sid in dict.fromkeys(dead))
        self.expired += n
        return n

    # -------------------------------------------------------------------- internals

    def _touch(self, s: FetchSession, now: float) -> None:
        s.last_used = now
        self.sessions[s.session_id] = self.sessions.pop(s.session_id)  # to the LRU end

    def _new_id(self) -> int:
        while True:
            sid = self._rng.randint(1, _MAX_EPOCH)
            if sid not in self.sessions:
                return sid

    def _fits(self, streams: int, sessions: int) -> bool:
        return (len(self.sessions) + sessions <= self.max_sessions
                and self.streams + streams <= self.max_streams)

    def _make_room(self, size: int, now: float, *, sessions: int,
                   keep: FetchSession | None = None) -> bool:
        """Evict until ``sessions`` more sessions and ``size`` more streams fit (stale sessions
        first, least recently used first; then sessions smaller than ``size``, smallest and
        least recently used first; never ``keep`` nor a session being served)."""
        while not self._fits(size, sessions):
            victim: FetchSession | None = None
            for s in self.sessions.values():
                if s is keep or s.busy:
                    continue
                if now - s.last_used > self.evictable_after_s:
                    victim = s  # the least recently used stale session
                break
            if victim is None:
                candidates = [s for s in self.sessions.values()
                              if s is not keep and not s.busy and s.size < size]
                if not candidates:
                    return False
                victim = min(candidates, key=lambda s: (s.size, s.last_used))
            self.close(victim.session_id)
            self.evicted += 1
        return True


def _count(owner: object, change: int) -> None:
    """CONNECTIONS/WHOAMI: the sessions a connection holds (an owner without ``attributes``,
    as in unit tests, is not counted)."""
    attrs = getattr(owner, "attributes", None)
    if isinstance(attrs, dict):
        connection_counters(attrs).sessions += change


def is_sessionless(m: FetchRequest) -> bool:
    """A FETCH that neither uses nor makes a session: ``(0, -1)``."""
    return m.session_id == 0 and m.session_epoch == FINAL_EPOCH


__all__ = [
    "EVICTABLE_AFTER_S",
    "FINAL_EPOCH",
    "INITIAL_EPOCH",
    "MAX_FETCH_SESSIONS",
    "MAX_SESSION_STREAMS",
    "MAX_SESSION_STREAMS_PER_NODE",
    "SESSION_IDLE_TIMEOUT_S",
    "SESSION_STREAM_BYTES",
    "FetchSession",
    "FetchSessionCache",
    "SessionStats",
    "SessionStream",
    "Waker",
    "is_sessionless",
    "next_epoch",
]
