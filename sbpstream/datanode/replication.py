"""Primary-to-secondary replication of a range (design.md section 5).

The primary assigns offsets and writes locally; right after ``store.append`` (synchronously, so
in offset order) the batch is handed to the range's :class:`RangeReplicator`. One sender task per
set of secondaries (:class:`_Channel`) forwards everything queued by all its ranges as ONE
replication APPEND (``replication=True``, batches carrying their base offsets, and what the
primary has acknowledged so far: ``committed_offset`` for a round of one range,
``committed_offsets`` per item for several) to every secondary at once, and resolves the batches'
futures when **all** secondaries answered OK. Several rounds may be out at once, but a range is
in at most one of them, so a secondary always receives a range's batches in offset order (it
rejects a batch that does not start at its next offset).

The first failed round breaks the replicator for good: that batch and every later one fail with
REPLICA_UNAVAILABLE, nothing more is forwarded, and the writer seals the range at the PM (which
cuts it at the minimum end over the reachable replicas, so unacknowledged tails vanish and every
acknowledged record survives). Each successful round raises the range's ``replicated_offset``
(every secondary holds everything below it); the seal answers it as this node's end, so batches
written here but never replicated are cut by the seal instead of leaving the secondaries short.
For the same reason a round still out when the range is closed here (the seal's stop) acknowledges
nothing, even if every secondary answers it: the stop has already answered its end, and
committing those batches afterwards let writers and readers see records the seal then cut.
A secondary learns the committed offset with the next round, or the sealed end at seal time.

**Deadlines.** Each batch carries the deadline of the APPEND that wrote it (its ``timeout_ms``).
A round waits for its secondaries until the latest deadline of the batches it carries (a round
serves several requests), never longer than MAX_ROUND_TIMEOUT_S nor shorter than
MIN_ROUND_TIMEOUT_S; past that the secondary counts as failed, the round is abandoned and the
range breaks as above. The APPEND handler itself stops waiting at its own deadline and answers
TIMEOUT (the batch may still be replicated and committed by its round: a retry is a duplicate).
A retried batch that is a duplicate of one still in flight is acknowledged only once its round
succeeded (:meth:`RangeReplicator.wait_replicated`), never merely because the primary holds it.
When writes stop, there is no next round: a channel left idle with commits its secondaries have
not heard of sends them a **commit round** (items with ``batch_length`` 0: no batch, only the
range's committed offset) after COMMIT_IDLE_S, so that a reader of a secondary gets every
acknowledged record without waiting for a write that may never come. A commit round is best
effort: its failure breaks nothing (the next data round carries the offset again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sbpstream.protocol.errors import ReplicaUnavailableError, SbpError
from sbpstream.protocol.frame import Buffer, ChecksummedPayload
from sbpstream.protocol.messages import AppendItem, AppendRequest, AppendResponse, AppendResult
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records.header import BASE_OFFSET_STRUCT, read_header

if TYPE_CHECKING:
    from sbpstream.datanode.host import ReplicaHost
    from sbpstream.datanode.ranges import ReplicaRange

log = logging.getLogger("sbpstream.datanode.replication")

# One replication round carries at most this many bytes of batches: it must fit one frame (16 MiB)
# with room for the header; a bigger backlog goes in the next round.
MAX_ROUND_BYTES: Final = 8 * 1024 * 1024
# ...and at most this many batches (the header's item vector grows with it).
MAX_ROUND_ITEMS: Final = 1000
# Rounds out at once per set of secondaries (each range in at most one of them): the transfer of
# the next round overlaps the secondaries' write and fsync of the previous ones.
MAX_ROUNDS_IN_FLIGHT: Final = 4
# A secondary that does not answer a round by the latest deadline of the requests whose batches
# it carries is treated as failed, and never later than this bound (a request with a longer or
# no timeout_ms still cannot hold a range's replication, and its writers, longer)...
MAX_ROUND_TIMEOUT_S: Final = 10.0
# ...nor sooner than this one: an abandoned round breaks the range (a seal and a new range for
# every writer of it), which a single request with a tiny timeout_ms must not cause on a
# secondary that is merely a little slow.
MIN_ROUND_TIMEOUT_S: Final = 0.5
# A commit round (idle, on no request's behalf, best effort) waits this long for its secondaries.
COMMIT_ROUND_TIMEOUT_S: Final = MAX_ROUND_TIMEOUT_S
# Bytes queued for replication per range before appends are refused (memory bound).
MAX_QUEUED_BYTES: Final = 64 * 1024 * 1024
# An idle channel tells its secondaries the commits they missed after this long without data...
COMMIT_IDLE_S: Final = 0.01
# ...and keeps looking for this many idle periods for a commit the writer has not made yet.
COMMIT_IDLE_TICKS: Final = 100


@dataclass(slots=True)
class _Pending:
    # the batch as sent: its base offset (8 bytes), then the rest of it, a view of the client's
    # request (immutable bytes; nothing is copied to write the offset in)
    head: bytes
    rest: memoryview
    size: int
    done: asyncio.Future[None]
    next_offset: int  # the offset after the batch
    deadline: float  # time.monotonic() by which the request that wrote it wants its answer


def round_timeout(deadline: float, now: float) -> float:
    """How long a round whose latest request deadline is ``deadline`` waits for a secondary."""
    return min(MAX_ROUND_TIMEOUT_S, max(MIN_ROUND_TIMEOUT_S, deadline - now))


class RangeReplicator:
    """One primary range's replication: its queue of batches, its futures, its broken state.
    The sending is done by the :class:`_Channel` of its secondaries, shared with every range
    replicated to the same secondaries."""

    def __init__(self, ctx: ReplicaHost, rng: ReplicaRange,
                 channel: _Channel | None = None) -> None:
        self.ctx = ctx
        self.rng = rng
        self.queue: deque[_Pending] = deque()
        self.queued_bytes = 0
        self.broken: SbpError | None = None
        # the committed offset the secondaries were last sent (-1: none yet)
        self.sent_committed = -1
        # the offset after the last batch queued here (-1: none since this replicator began)
        self.submitted_offset = -1
        # retried duplicates waiting for their original's round: (next offset, future)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.channel = channel if channel is not None else _Channel(ctx, tuple(self.secondaries))

    @property
    def secondaries(self) -> list[str]:
        return [rn.data_node.advertise_addr for rn in self.rng.replicas
                if rn.data_node.node_id != self.ctx.node_id]

    def submit(self, batch: memoryview, base_offset: int,
               deadline: float) -> asyncio.Future[None]:
        """Queue a batch just stored at ``base_offset`` by a request due by ``deadline``
        (monotonic); the future resolves once replicated."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self.broken is None and self.queued_bytes + len(batch) > MAX_QUEUED_BYTES:
            self._break(ReplicaUnavailableError(
                f"replication backlog of range {self.rng.stream_id}/{self.rng.range_index} "
                f"exceeds {MAX_QUEUED_BYTES} bytes: secondaries too slow"))
        if self.broken is not None:
            fut.set_exception(self.broken)
            return fut
        nxt = base_offset + read_header(batch).record_count
        size = len(batch)
        self.queue.append(_Pending(BASE_OFFSET_STRUCT.pack(base_offset),
                                   batch[BASE_OFFSET_STRUCT.size:], size, fut, nxt, deadline))
        self.submitted_offset = max(self.submitted_offset, nxt)
        self.queued_bytes += size
        self.channel.ready(self)
        return fut

    def wait_replicated(self, next_offset: int) -> asyncio.Future[None] | None:
        """A retried batch was a duplicate of one stored here, ending at ``next_offset``: a
        future that resolves once every secondary holds it (None: they do, or it was stored
        before this replicator began, e.g. before a restart, and is not tracked), or fails as
        the replicator breaks. Acknowledging the duplicate merely because this node holds the
        original would acknowledge a record that a seal after a failed round cuts."""
        if next_offset <= self.rng.replicated_offset:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.broken is not None:
            fut.set_exception(self.broken)
        elif next_offset > self.submitted_offset:
            return None
        else:
            self._waiters.append((next_offset, fut))
        return fut

    def replicated(self) -> None:
        """A round succeeded: wake the duplicates it covers."""
        if self._waiters:
            top = self.rng.replicated_offset
            keep: list[tuple[int, asyncio.Future[None]]] = []
            for off, fut in self._waiters:
                if off > top:
                    keep.append((off, fut))
                elif not fut.done():
                    fut.set_result(None)
            self._waiters = keep

    def _break(self, exc: SbpError, *, failure: bool = True) -> None:
        if self.broken is None:
            self.broken = exc
            if failure:
                log.warning("event=replication_broken stream_id=%d range_index=%d error=%r",
                            self.rng.stream_id, self.rng.range_index, str(exc))
        pending, self.queue = self.queue, deque()
        self.queued_bytes = 0
        for p in pending:
            if not p.done.done():
                p.done.set_exception(exc)
        waiters, self._waiters = self._waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(exc)

    def fail(self, taken: list[_Pending], exc: SbpError) -> None:
        """A round failed for this range: its batches, and every later one, fail."""
        for p in taken:
            if not p.done.done():
                p.done.set_exception(exc)
        self._break(exc)

    def close(self) -> None:
        """The range was sealed or deleted here: not a failure, nothing more is forwarded."""
        self._break(ReplicaUnavailableError(
            f"range {self.rng.stream_id}/{self.rng.range_index} is no longer replicated here"),
            failure=False)


class _Channel:
    """Sends the queued batches of every range replicated to the same secondaries.

    A round takes what each ready range has queued (in the order the ranges became ready, within
    MAX_ROUND_ITEMS / MAX_ROUND_BYTES) and forwards it as ONE replication APPEND to every
    secondary at once: with 1,000 streams, a few frames per round instead of two per range. A
    request of one range carries ``committed_offset``; of several, ``committed_offsets`` (each
    item its range's). Up to MAX_ROUNDS_IN_FLIGHT rounds are out at once, but **a range is in at
    most one of them**: a range's next round starts only after its previous one was settled, so
    its batches reach a secondary in offset order whatever the secondary does with concurrent
    requests (e.g. look a range up at the PM), and each range's rounds succeed or fail in order.
    A failed send fails every range of the round; an item a secondary refused fails its range
    only.
    """

    def __init__(self, ctx: ReplicaHost, targets: tuple[str, ...]) -> None:
        self.ctx = ctx
        self.targets = targets
        self._ready: dict[RangeReplicator, None] = {}  # insertion-ordered set
        # ranges with a round out: not taken again until it is settled
        self._busy: set[RangeReplicator] = set()
        self._rounds: set[asyncio.Task[None]] = set()
        # ranges whose secondaries may not know the last commit: idle periods left to tell them
        self._owed: dict[RangeReplicator, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def ready(self, rep: RangeReplicator) -> None:
        self._ready[rep] = None
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _take(self) -> list[tuple[RangeReplicator, list[_Pending]]]:
        round_: list[tuple[RangeReplicator, list[_Pending]]] = []
        items = size = 0
        busy = self._busy
        for rep in list(self._ready):
            if items >= MAX_ROUND_ITEMS or size >= MAX_ROUND_BYTES:
                break
            if rep in busy:
                continue  # its round is out: stays ready for a later one
            taken: list[_Pending] = []
            q = rep.queue
            while q and items < MAX_ROUND_ITEMS and (
                    not items or size + q[0].size <= MAX_ROUND_BYTES):
                p = q.popleft()
                taken.append(p)
                items += 1
                size += p.size
                rep.queued_bytes -= p.size
            if not q:
                del self._ready[rep]
            if taken and rep.broken is None:
                round_.append((rep, taken))
        return round_

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            while len(self._rounds) < MAX_ROUNDS_IN_FLIGHT:
                round_ = self._take()
                if not round_:
                    break
                self._busy.update(rep for rep, _ in round_)
                task = loop.create_task(self._run_round(round_))
                self._rounds.add(task)
            if self._rounds or self._ready:
                # a round out, or ranges waiting for theirs: a settled round or new data wakes
                await self._wake.wait()
                continue
            if not self._owed:
                await self._wake.wait()
                continue
            try:
                async with asyncio.timeout(COMMIT_IDLE_S):
                    await self._wake.wait()
            except TimeoutError:
                await self._commit_round()

    async def _run_round(self, round_: list[tuple[RangeReplicator, list[_Pending]]]) -> None:
        try:
            try:
                failed = await self._round(round_)
            except SbpError as exc:
                failed = {rep: exc for rep, _ in round_}
            except asyncio.CancelledError:  # the node closes: no writer may be left hanging
                err = ReplicaUnavailableError("replication stopped: the node is closing")
                for rep, taken in round_:
                    for p in taken:
                        if not p.done.done():
                            p.done.set_exception(err)
                    rep._break(err, failure=False)
                raise
            except Exception as exc:  # a failed round must never leave writers hanging
                err = ReplicaUnavailableError(f"replication failed: {type(exc).__name__}: {exc}")
                failed = {rep: err for rep, _ in round_}
            self._settle(round_, failed)
        finally:
            self._busy.difference_update(rep for rep, _ in round_)
            task = asyncio.current_task()
            if task is not None:
                self._rounds.discard(task)
            self._wake.set()

    def _settle(self, round_: list[tuple[RangeReplicator, list[_Pending]]],
                failed: dict[RangeReplicator, SbpError]) -> None:
        for rep, taken in round_:
            why = failed.get(rep)
            if why is None and rep.broken is not None:
                # closed while the round was out (a seal's stop, a delete, re-adoption):
                # the stop already answered its end from replicated_offset, so these
                # batches are past that end and must not be acknowledged (the seal cuts
                # them), nor committed (a reader would get records the seal then drops)
                why = rep.broken
            if why is not None:
                rep.fail(taken, why)
                continue
            # every secondary holds these batches: raise the mark BEFORE any writer can be
            # acknowledged (the futures' callbacks run later), so that whatever was
            # acknowledged is below it when a seal reads it (docs/operations.md)
            rep.rng.replicated_offset = max(rep.rng.replicated_offset, taken[-1].next_offset)
            self._owed[rep] = COMMIT_IDLE_TICKS
            for p in taken:
                if not p.done.done():
                    p.done.set_result(None)
            rep.replicated()

    async def _round(
        self, round_: list[tuple[RangeReplicator, list[_Pending]]]
    ) -> dict[RangeReplicator, SbpError]:
        """Send one round; returns the ranges that failed (with why)."""
        owners: list[RangeReplicator] = []
        items: list[AppendItem] = []
        committed: list[int] = []
        payload: list[bytes | memoryview] = []
        deadline = 0.0
        for rep, taken in round_:
            rng = rep.rng
            for p in taken:
                items.append(AppendItem(stream_id=rng.stream_id, request_index=len(items),
                                        batch_length=p.size, range_index=rng.range_index))
                committed.append(rng.committed_offset)
                owners.append(rep)
                payload.append(p.head)
                payload.append(p.rest)
                deadline = max(deadline, p.deadline)
            rep.sent_committed = max(rep.sent_committed, rng.committed_offset)
        one = len(round_) == 1
        timeout_s = round_timeout(deadline, time.monotonic())
        header = AppendRequest(
            timeout_ms=max(1, int(timeout_s * 1000)), items=tuple(items), replication=True,
            committed_offset=committed[0] if one else -1,
            committed_offsets=() if one else tuple(committed),
        ).encode()
        body = ChecksummedPayload(payload)  # one CRC for every secondary
        results = await asyncio.gather(
            *(self._send(addr, header, body, timeout_s) for addr in self.targets),
            return_exceptions=True)
        failed: dict[RangeReplicator, SbpError] = {}
        for addr, res in zip(self.targets, results, strict=True):
            if isinstance(res, BaseException):
                why = str(res) if isinstance(res, SbpError) else f"{type(res).__name__}: {res}"
                for rep, _ in round_:
                    failed.setdefault(rep, ReplicaUnavailableError(
                        f"secondary {addr} failed for range {rep.rng.stream_id}/"
                        f"{rep.rng.range_index}: {why}"))
                continue
            answered = [False] * len(items)
            for r in res:
                if 0 <= r.request_index < len(items):
                    answered[r.request_index] = True
                    if r.status.code:
                        rep = owners[r.request_index]
                        failed.setdefault(rep, ReplicaUnavailableError(
                            f"secondary {addr} failed for range {rep.rng.stream_id}/"
                            f"{rep.rng.range_index}: {r.status.error()}"))
            for i, ok in enumerate(answered):
                if not ok:
                    failed.setdefault(owners[i], ReplicaUnavailableError(
                        f"secondary {addr} did not answer item {i} of a replication round"))
        return failed

    async def _commit_round(self) -> None:
        """Idle: send the secondaries the committed offsets they have not heard of (items
        without a batch). Best effort: a failure is left to the next data round."""
        owed = [rep for rep in self._owed
                if rep.broken is None and rep.rng.committed_offset > rep.sent_committed]
        if owed:
            items = tuple(AppendItem(stream_id=rep.rng.stream_id, request_index=i,
                                     batch_length=0, range_index=rep.rng.range_index)
                          for i, rep in enumerate(owed))
            committed = [rep.rng.committed_offset for rep in owed]
            one = len(owed) == 1
            header = AppendRequest(
                timeout_ms=int(COMMIT_ROUND_TIMEOUT_S * 1000), items=items, replication=True,
                committed_offset=committed[0] if one else -1,
                committed_offsets=() if one else tuple(committed),
            ).encode()
            results = await asyncio.gather(
                *(self._send(addr, header, [], COMMIT_ROUND_TIMEOUT_S) for addr in self.targets),
                return_exceptions=True)
            for addr, res in zip(self.targets, results, strict=True):
                if isinstance(res, BaseException):
                    log.debug("event=commit_round_failed target=%s error=%r", addr, str(res))
            for rep, c in zip(owed, committed, strict=True):
                rep.sent_committed = max(rep.sent_committed, c)
        for rep in list(self._owed):
            left = self._owed[rep] - 1
            if (rep.broken is not None or left <= 0
                    or rep.sent_committed >= rep.rng.replicated_offset):
                del self._owed[rep]
            else:
                self._owed[rep] = left

    async def _send(self, addr: str, header: bytes, payload: Sequence[Buffer],
                    timeout_s: float) -> list[AppendResult]:
        async with asyncio.timeout(timeout_s):  # the connect too
            conn = await self.ctx.pool.get(addr)
            frames = await conn.request(Opcode.APPEND, header, payload, timeout_s=timeout_s)
        return [r for f in frames for r in AppendResponse.decode(f.header).items]

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._rounds):
            task.cancel()


class Replicators:
    """The replicators of this node's primary ranges that have secondaries, and the channels
    (one per set of secondaries) that send for them."""

    def __init__(self, ctx: ReplicaHost) -> None:
        self.ctx = ctx
        self.by_range: dict[tuple[int, int], RangeReplicator] = {}
        self.channels: dict[tuple[str, ...], _Channel] = {}

    def needs(self, rng: ReplicaRange) -> bool:
        return any(rn.data_node.node_id != self.ctx.node_id for rn in rng.replicas)

    def get(self, rng: ReplicaRange) -> RangeReplicator:
        key = (rng.stream_id, rng.range_index)
        r = self.by_range.get(key)
        if r is None or r.rng is not rng:
            if r is not None:
                r.close()  # the range was adopted again: the old replicator must not linger
            r = RangeReplicator(self.ctx, rng, self._channel(rng))
            self.by_range[key] = r
        return r

    def wait_replicated(self, rng: ReplicaRange, next_offset: int) -> asyncio.Future[None] | None:
        """See :meth:`RangeReplicator.wait_replicated` (None: no replicator of ``rng`` here)."""
        r = self.by_range.get((rng.stream_id, rng.range_index))
        if r is None or r.rng is not rng:
            return None
        return r.wait_replicated(next_offset)

    def _channel(self, rng: ReplicaRange) -> _Channel:
        targets = tuple(rn.data_node.advertise_addr for rn in rng.replicas
                        if rn.data_node.node_id != self.ctx.node_id)
        ch = self.channels.get(targets)
        if ch is None:
            ch = self.channels[targets] = _Channel(self.ctx, targets)
        return ch

    def drop(self, stream_id: int, range_index: int | None = None) -> None:
        for key in [k for k in self.by_range
                    if k[0] == stream_id and (range_index is None or k[1] == range_index)]:
            self.by_range.pop(key).close()

    def close(self) -> None:
        for r in self.by_range.values():
            with contextlib.suppress(Exception):
                r.close()
        self.by_range.clear()
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()
