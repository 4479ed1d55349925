"""Where a stream's records live and how to reach them: the client's range routing.

One :class:`RangeRouter` per :class:`~sbpstream.client.aclient.AsyncClient` holds the cache of
range metadata (from LIST_RANGES, coalesced across streams), asks the PM to seal a range
(SEAL_AND_NEW), and sends requests to data nodes over the client's connection pool. Producers,
consumers and the Spark sink use it through its public methods only; the client's admin calls
keep the cache fresh (trim and delete forget a stream's ranges).

The router never retries a data-node request itself: what to do after an error (another replica,
a seal, a refresh) is the caller's policy; :meth:`RangeRouter.invalidate` and
``ranges(..., refresh=True)`` are how it asks for fresh metadata.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sbpstream.client.retry import (
    Attempts,
    clip_timeout,
    deadline_scope,
    remaining_s,
    within_deadline,
)
from sbpstream.client.types import Range, RetryPolicy
from sbpstream.net.client import Connection, ConnectionPool, ResponseStream
from sbpstream.protocol.errors import ClientTimeoutError, ErrorCode, StreamNotFoundError
from sbpstream.protocol.frame import Buffer, Frame
from sbpstream.protocol.messages import (
    ClientRole,
    HeartbeatRequest,
    HeartbeatResponse,
    ListRangesRequest,
    ListRangesResponse,
    Message,
    SealItem,
    SealRangesRequest,
    SealRangesResponse,
    SealResult,
    StreamOwner,
)
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.wire import throttle_time_ms_of

M = TypeVar("M", bound=Message)

ADDRESSES_USED_MAX = 1000
"""Data node addresses remembered for the client's heartbeats (a cluster has far fewer)."""

MAX_RANGE_LOOKUPS_PER_REQUEST = 256
"""Streams per coalesced LIST_RANGES request. Small enough that the first answer comes soon: the
PM answers 256 streams in ~8 ms against ~30 ms for 1,000, so a consumer of 1,000 streams starts
reading its first ones after one such answer while the PM works on the rest. Far under the
protocol's items-per-request limit, and the response far below the frame limit."""

class PmCall(Protocol):
    """Send a request to the PM leader and decode its answer (following redirects, retrying)."""

    async def __call__(self, req: Message, resp_cls: type[M], /) -> M: ...


def primary_address(rng: Range) -> str | None:
    """The advertise address of a range's primary replica (None when it has none)."""
    for rep in rng.replica_nodes:
        if rep.is_primary and rep.data_node.advertise_addr:
            return rep.data_node.advertise_addr
    return None


def replica_addresses(rng: Range) -> list[str]:
    """Every replica's address, the primary first."""
    reps = sorted(rng.replica_nodes, key=lambda r: not r.is_primary)
    return [r.data_node.advertise_addr for r in reps if r.data_node.advertise_addr]


@dataclass(slots=True)
class ThrottleStats:
    """Quotas (issue 22): how often data nodes throttled this client, and for how long."""

    throttled_responses: int = 0  # responses that carried throttle_time_ms > 0
    throttle_time_ms_total: int = 0  # their throttle times added up
    waits: int = 0  # requests that waited out a throttle before going


class _Observed:
    """A FETCH's response stream that notes the throttle time of its frames."""

    def __init__(self, inner: ResponseStream, note: ThrottleNote) -> None:
        self._inner = inner
        self._note = note

    def __aiter__(self) -> _Observed:
        return self

    async def __anext__(self) -> Frame:
        frame = await self._inner.__anext__()
        self._note(frame.header)
        return frame

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _Observed:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ThrottleNote(Protocol):
    def __call__(self, header: Buffer) -> None: ...


class RangeRouter:
    """Range cache, seal requests and data-node requests of one client.

    ``request_timeout_ms`` bounds one data-node or PM request; ``retry`` bounds the retries of a
    seal whose answer is RETRIABLE.
    """

    def __init__(
        self, pool: ConnectionPool, pm_call: PmCall, *, request_timeout_ms: int,
        retry: RetryPolicy, client_id: str = "",
    ) -> None:
        self._pool = pool
        self._pm_call = pm_call
        self.request_timeout_ms = request_timeout_ms
        self.retry = retry
        self._ranges: dict[int, list[Range]] = {}
        self._waiters: dict[int, asyncio.Future[list[Range]]] = {}  # lookups not sent yet
        self._in_flight: dict[int, asyncio.Future[list[Range]]] = {}  # lookups sent
        #: LIST_RANGES requests sent for range lookups (each covers up to
        #: MAX_RANGE_LOOKUPS_PER_REQUEST streams): how many PM round trips the cache misses cost
        self.range_lookup_requests = 0
        self._flusher: asyncio.Task[None] | None = None
        #: Data nodes this client sent requests to (its heartbeats go to them too).
        self.addresses_used: set[str] = set()
        # Quotas (issue 22): the client id declared on each data-node connection (HEARTBEAT),
        # and when each node allows this client's next request (event-loop time).
        self.client_id = client_id
        self.throttle = ThrottleStats()
        self._throttled_until: dict[str, float] = {}
        self._declared: weakref.WeakKeyDictionary[Connection, asyncio.Future[None]] = (
            weakref.WeakKeyDictionary())

    # ----------------------------------------------------------------------------- the cache

    def cached(self, stream_id: int) -> list[Range] | None:
        """The cached ranges of a stream, by range index (None when not looked up)."""
        return self._ranges.get(stream_id)

    def writable(self, stream_id: int) -> Range | None:
        """The stream's writable range as cached (None: not cached, or its last one is sealed)."""
        ranges = self._ranges.get(stream_id)
        if ranges and not ranges[-1].sealed:
            return ranges[-1]
        return None

    def invalidate(self, stream_id: int) -> None:
        """Forget the cached ranges of a stream; the next use reads them again."""
        self._ranges.pop(stream_id, None)

    def merge(self, stream_id: int, ranges: Sequence[Range]) -> None:
        """Put fresher ranges (e.g. a seal result) into the cache."""
        cur = {r.range_index: r for r in self._ranges.get(stream_id, [])}
        for r in ranges:
            cur[r.range_index] = r
        self._ranges[stream_id] = [cur[i] for i in sorted(cur)]

    async def ranges(self, stream_id: int, *, refresh: bool = False) -> list[Range]:
        """Cached ranges of a stream (from LIST_RANGES), by range index.

        Lookups are coalesced: every stream asked for in the same event-loop turn (a producer or
        consumers of 1,000 streams) goes to the PM in ONE LIST_RANGES request (up to
        ``MAX_RANGE_LOOKUPS_PER_REQUEST`` streams each), not one round trip per stream.
        """
        cached = self._ranges.get(stream_id)
        if cached is not None and not refresh:
            return cached
        # shared with other callers: this one stops waiting at its own deadline
        return await within_deadline(self._lookup(stream_id, refresh),
                                     f"the PM (the ranges of stream {stream_id})")

    async def ranges_many(self, stream_ids: Sequence[int], *,
                          refresh: bool = False) -> list[list[Range]]:
        """:meth:`ranges` of many streams (in their order), looked up together, without a task
        per stream: a consumer of 1,000 streams starts with one LIST_RANGES. Raises the first
        stream's error, in order, if any failed."""
        got: list[list[Range] | asyncio.Future[list[Range]]] = []
        for sid in stream_ids:
            cached = None if refresh else self._ranges.get(sid)
            got.append(cached if cached is not None else self._lookup(sid, refresh))
        pending = [f for f in got if isinstance(f, asyncio.Future) and not f.done()]
        if pending:
            # never cancels them: other callers may share them
            _, late = await asyncio.wait(pending, timeout=remaining_s())
            if late:
                raise ClientTimeoutError(
                    f"the ranges of {len(late)} stream(s): not looked up by the call's deadline")
        return [f.result() if isinstance(f, asyncio.Future) else f for f in got]

    def _lookup(self, stream_id: int, refresh: bool = False) -> asyncio.Future[list[Range]]:
        """The future of ``stream_id``'s next coalesced lookup: the one not sent yet, else (unless
        ``refresh``: its answer may predate what made the caller refresh) the one under way, else
        a new one."""
        fut = self._waiters.get(stream_id)
        if fut is None and not refresh:
            fut = self._in_flight.get(stream_id)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._waiters[stream_id] = fut
            if self._flusher is None or self._flusher.done():
                # serves every caller: bounded by each PM call's own deadline, not this caller's
                with deadline_scope(None, replace=True):
                    self._flusher = loop.create_task(self._flush_lookups())
        return fut

    async def _flush_lookups(self) -> None:
        """Send the pending lookups, MAX_RANGE_LOOKUPS_PER_REQUEST streams per LIST_RANGES, one
        request after the other in the order they were asked for (the PM goes from one to the
        next; a consumer of 100,000 streams does not queue hundreds of them at the PM)."""
        await asyncio.sleep(0)  # let every task of this turn ask first
        while self._waiters:
            ids = list(itertools.islice(self._waiters, MAX_RANGE_LOOKUPS_PER_REQUEST))
            futs = {sid: self._waiters.pop(sid) for sid in ids}
            self._in_flight.update(futs)
            self.range_lookup_requests += 1
            try:
                await self._lookup_batch(futs)
            finally:
                for sid, f in futs.items():
                    if self._in_flight.get(sid) is f:
                        del self._in_flight[sid]

    async def _lookup_batch(self, futs: dict[int, asyncio.Future[list[Range]]]) -> None:
        """One LIST_RANGES for the streams of ``futs``; each future gets its stream's ranges or
        error (the request's own failure goes to all of them)."""
        try:
            req = ListRangesRequest(
                timeout_ms=self.request_timeout_ms,
                items=tuple(StreamOwner(stream_id=sid) for sid in futs),
            )
            resp = await self._pm_call(req, ListRangesResponse)
        except BaseException as exc:
            for f in futs.values():
                if not f.done():
                    f.set_exception(exc)
                    f.exception()  # retrieved here: a cancelled caller must not warn
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        by_id = {item.stream_id: item for item in resp.items}
        for sid, f in futs.items():
            if f.done():
                continue
            item = by_id.get(sid)
            if item is None or item.status.code == ErrorCode.STREAM_NOT_FOUND:
                f.set_exception(StreamNotFoundError(f"stream {sid} does not exist"))
                f.exception()
            elif not item.status.ok:
                f.set_exception(item.status.error())
                f.exception()
            else:
                ranges = sorted(item.ranges, key=lambda r: r.range_index)
                self._ranges[sid] = ranges
                f.set_result(ranges)

    # ---------------------------------------------------------------------------------- seals

    async def seal(self, stream_id: int, range_index: int) -> SealResult:
        """Ask the PM to seal a range and open the next (SEAL_AND_NEW; idempotent).

        RETRIABLE answers are retried under ``retry``; the result's ranges go into the cache.
        """
        req = SealRangesRequest(
            timeout_ms=self.request_timeout_ms,
            items=(SealItem(stream_id=stream_id, range_index=range_index, end_offset=-1),),
        )
        attempts = Attempts(self.retry)
        while True:
            resp = await self._pm_call(req, SealRangesResponse)
            r = resp.items[0]
            if r.status.ok:
                self.merge(stream_id, r.ranges)
                return r
            err = r.status.error()
            if not err.retriable:
                raise err
            await attempts.backoff(err)

    async def sealed_states(
        self, stream_id: int, range_indexes: Sequence[int]
    ) -> tuple[SealResult, ...]:
        """One SEAL_RANGES request for already sealed ranges: each answers the producer states
        stored at its seal (idempotent). Per-range errors are in the results, not raised."""
        req = SealRangesRequest(timeout_ms=self.request_timeout_ms, items=tuple(
            SealItem(stream_id=stream_id, range_index=i, end_offset=-1) for i in range_indexes))
        resp = await self._pm_call(req, SealRangesResponse)
        return resp.items

    # ----------------------------------------------------------------------- data-node requests

    async def request(
        self, addr: str, req: Message, payload: Buffer | Sequence[Buffer] = b"",
        timeout_ms: int | None = None,
    ) -> Frame:
        """One request to a data node whose answer is one frame (raises its system error)."""
        conn = await self._node_conn(addr)
        t = self.request_timeout_ms if timeout_ms is None else timeout_ms
        frame = await conn.request_one(req.OPCODE, req.encode(), payload, timeout_s=t / 1000)
        self.note_throttle(addr, req.OPCODE, frame.header)
        return frame

    async def request_all(
        self, addr: str, req: Message, payload: Buffer | Sequence[Buffer] = b"",
        timeout_ms: int | None = None,
    ) -> list[Frame]:
        """Like :meth:`request` for an answer that may span several frames (APPEND answers
        items as they complete); returns every frame, the END frame last."""
        return await (await self.start_all(addr, req, payload, timeout_ms))

    async def start_all(
        self, addr: str, req: Message, payload: Buffer | Sequence[Buffer] = b"",
        timeout_ms: int | None = None,
    ) -> Coroutine[None, None, list[Frame]]:
        """The first half of :meth:`request_all`: returns once the request is written to the
        node's connection (so requests started one after the other reach the node in that
        order, whatever each waited for: a throttle, a connection, a paused socket); the
        returned coroutine, which the caller must await, collects the answer's frames."""
        conn = await self._node_conn(addr)
        t = self.request_timeout_ms if timeout_ms is None else timeout_ms
        rs = await conn.stream(req.OPCODE, req.encode(), payload, timeout_s=t / 1000)
        return self._collect(addr, req.OPCODE, rs)

    async def _collect(self, addr: str, opcode: int, rs: ResponseStream) -> list[Frame]:
        frames = [f async for f in rs]
        if frames:
            self.note_throttle(addr, opcode, frames[-1].header)
        return frames

    async def connection(self, addr: str) -> Connection:
        """The connection to the data node at ``addr`` (a subscription's BUFFER_ACKs must go on
        the connection its FETCH came in on), as :meth:`_node_conn` gives it."""
        return await self._node_conn(addr)

    async def stream(self, addr: str, req: Message, *, timeout_s: float) -> _Observed:
        """Send a request to a data node; iterate its answer's frames (FETCH long-polls)."""
        conn = await self._node_conn(addr)
        rs = await conn.stream(req.OPCODE, req.encode(), timeout_s=timeout_s)
        return _Observed(rs, lambda header: self.note_throttle(addr, req.OPCODE, header))

    # ------------------------------------------------------------- quotas (issue 22)

    async def _node_conn(self, addr: str) -> Connection:
        """The connection to a data node, once any throttle of that node is waited out, with
        this client's id declared on it (one HEARTBEAT per new connection)."""
        until = self._throttled_until.get(addr)
        if until is not None:
            loop = asyncio.get_running_loop()
            delay = until - loop.time()
            if delay > 0:
                self.throttle.waits += 1
                left = clip_timeout(delay)
                assert left is not None
                await asyncio.sleep(left)
                if left < delay:
                    raise ClientTimeoutError(
                        f"{addr} throttles this client past the call's deadline")
            if self._throttled_until.get(addr, 0.0) <= loop.time():
                # not a later throttle noted while this one slept: that one still holds
                self._throttled_until.pop(addr, None)
        if addr not in self.addresses_used and len(self.addresses_used) < ADDRESSES_USED_MAX:
            self.addresses_used.add(addr)  # the client's heartbeats go to it too
        conn = await self._pool.get(addr)
        if self.client_id:
            fut = self._declared.get(conn)
            if fut is None:
                with deadline_scope(None, replace=True):  # shared by the connection's users
                    fut = self._declared[conn] = asyncio.ensure_future(self._declare(conn))
            await within_deadline(fut, f"{addr} (declaring this client's id)")
        return conn

    async def _declare(self, conn: Connection) -> None:
        hb = HeartbeatRequest(client_id=self.client_id, client_role=ClientRole.CLIENT)
        try:
            frame = await conn.request_one(hb.OPCODE, hb.encode(),
                                           timeout_s=self.request_timeout_ms / 1000)
        except BaseException:
            self._declared.pop(conn, None)  # the next request tries again
            raise
        HeartbeatResponse.decode(frame.header).status.raise_for_error()

    def note_throttle(self, addr: str, opcode: int, header: Buffer) -> None:
        if opcode not in (Opcode.APPEND, Opcode.FETCH):
            return
        ms = throttle_time_ms_of(header)
        if ms <= 0:
            return
        self.throttle.throttled_responses += 1
        self.throttle.throttle_time_ms_total += ms
        until = asyncio.get_running_loop().time() + ms / 1000
        if until > self._throttled_until.get(addr, 0.0):
            self._throttled_until[addr] = until
