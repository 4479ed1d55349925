"""The producer's bookkeeping: what a send resolves and what travels (issue 32 split this out
of :mod:`sbpstream.client.producer`).

:class:`Offsets` is what one ``send_batch`` call resolves to; :class:`Piece` stands for a run of
its records inside one batch; :class:`Batch` is one record batch on its way (sequence numbers,
waiters, the range it went to); :class:`StreamState` is one stream's queue, batches in flight and
flow state. :func:`locate` and :func:`scan` read a sealed range back, in recovery, to learn where
this producer's batches landed.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, overload

from sbpstream.client.flow import FlowMachine
from sbpstream.client.retry import Attempts
from sbpstream.client.routing import RangeRouter, replica_addresses
from sbpstream.client.types import Range
from sbpstream.protocol.errors import (
    InvalidRequestError,
    ReplicaUnavailableError,
    SbpError,
    UnknownServerError,
)
from sbpstream.protocol.limits import SEQUENCE_WRAP
from sbpstream.protocol.messages import FetchItem, FetchRequest, FetchResponse
from sbpstream.records import (
    HEADER_SIZE,
    BatchBuilder,
    EncodedRecords,
    Record,
    iter_batches,
    read_header,
)

__all__ = ["Batch", "Offsets", "Piece", "StreamState", "Waiter", "as_sbp_error",
           "fail_waiters", "locate", "scan", "seq_le", "whole_sizes"]

log = logging.getLogger("sbpstream.client.producer")

READ_BACK_BYTES: Final = 1024 * 1024
"""batch_max_bytes of each FETCH reading a sealed range back in recovery: a few batches per
round trip, bounded so one answer stays small."""

READ_BACK_TIMEOUT_MARGIN_MS: Final = 2000
"""Client-side wait for a read-back FETCH beyond the request timeout (as the producer's APPEND
margin): only a lost node or connection takes longer."""


def whole_sizes(records: Sequence[Record] | EncodedRecords, overhead: int
                ) -> tuple[int, int, int]:
    """(records, bytes counted against the buffer, an upper bound of the batch's bytes) of
    ``send_whole``'s records; ``overhead``: the buffer's per-record charge."""
    if isinstance(records, EncodedRecords):
        n = len(records.section)
        return records.count, overhead * records.count + n, HEADER_SIZE + n
    size = 0
    bound = HEADER_SIZE
    for r in records:
        hdr = sum(len(k) + len(v) for k, v in r.headers)
        size += overhead + len(r.value or b"") + len(r.key or b"") + hdr
        # an upper bound of the encoded record: varints of at most 10 bytes each
        bound += 50 + len(r.value or b"") + len(r.key or b"") + 3 * hdr + 20 * len(r.headers)
    return len(records), size, bound


def seq_le(a: int, b: int) -> bool:
    """a <= b for wrapping int32 sequences (a is at most half the space behind b)."""
    return (b - a) % SEQUENCE_WRAP < SEQUENCE_WRAP // 2


class Offsets(Sequence[int]):
    """The offsets of the records of one :meth:`AsyncProducer.send_batch` call, in call order.

    One object (and one future) for the whole call instead of one future per record: the
    records travel in one or more batches, and each record's offset is derived from its batch's
    base offset. ``offsets[i]`` is the offset of the call's record ``i``, or raises that
    record's error; :attr:`error` is the first error (None when every record was acknowledged)
    and :attr:`failed` counts the records that were not.
    """

    __slots__ = ("_count", "_errors", "_future", "_on_done", "_pending", "_runs", "_sorted")

    def __init__(self, count: int, future: asyncio.Future[Offsets] | None = None,
                 on_done: Callable[[Offsets], object] | None = None) -> None:
        """``future`` gets the offsets as its result and ``on_done`` is called with them, once
        every record is settled (on the producer's loop)."""
        self._count = count
        self._runs: list[tuple[int, int, int]] = []  # (first index, first offset, records)
        self._errors: list[tuple[int, int, SbpError]] = []  # (first index, records, error)
        self._pending = count
        self._future = future
        self._on_done = on_done
        self._sorted = True
        if not count:
            self._settled(0)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("record index out of range")
        if not self._sorted:
            self._runs.sort()
            self._sorted = True
        k = bisect.bisect_right(self._runs, (i, 1 << 63, 0)) - 1
        if k >= 0:
            start, offset, n = self._runs[k]
            if i < start + n:
                return offset + i - start
        for start, n, err in self._errors:
            if start <= i < start + n:
                raise err
        raise InvalidRequestError(f"record {i} of the batch is not settled yet")

    @property
    def done(self) -> bool:
        """True once every record is acknowledged or failed."""
        return not self._pending

    @property
    def failed(self) -> int:
        """Records that were not acknowledged."""
        return sum(n for _, n, _ in self._errors)

    @property
    def error(self) -> SbpError | None:
        """The error of the first failed record (in call order), None if none failed."""
        return min(self._errors, key=lambda e: e[0])[2] if self._errors else None

    @property
    def first(self) -> int | None:
        """Once done: the offset of record 0 when every record was acknowledged at consecutive
        offsets (record ``i`` is then at ``first + i``), else None."""
        if self._pending or self._errors or not self._count:
            return None
        runs = self._runs
        if not self._sorted:
            runs.sort()
            self._sorted = True
        first = runs[0][1]
        for start, offset, _ in runs:
            if offset != first + start:
                return None
        return first

    def record_acked(self, start: int, offset: int, n: int) -> None:
        """Records ``start .. start+n-1`` were stored from ``offset`` on (the producer)."""
        runs = self._runs
        if runs and runs[-1][0] > start:
            self._sorted = False
        runs.append((start, offset, n))
        self._settled(n)

    def record_failed(self, start: int, n: int, err: SbpError) -> None:
        """Records ``start .. start+n-1`` failed with ``err`` (the producer)."""
        self._errors.append((start, n, err))
        self._settled(n)

    def _settled(self, n: int) -> None:
        self._pending -= n
        if self._pending:
            return
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result(self)
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done(self)


class Piece:
    """Records ``start .. start+count-1`` of one send_batch call, consecutive in one batch: an
    entry of a batch's waiters standing for ``count`` records (a plain future stands for one)."""

    __slots__ = ("count", "offsets", "start")

    def __init__(self, offsets: Offsets, start: int, count: int) -> None:
        self.offsets = offsets
        self.start = start
        self.count = count


# What a batch resolves, in record order: a future per record sent alone, a piece per run of
# records of one send_batch call.
Waiter = asyncio.Future[int] | Piece


@dataclass(slots=True, eq=False)
class Batch:
    stream_id: int
    data: bytes
    base_sequence: int
    record_count: int
    futures: list[Waiter]
    nbytes: int  # counted against buffer_max_bytes
    attempts: Attempts | None = None
    rng: Range | None = None  # the range it was last sent to
    error: SbpError | None = None  # set when its last send failed; cleared on resend
    settled: bool = False  # acknowledged or failed for good (counted out once)

    @property
    def last_sequence(self) -> int:
        return (self.base_sequence + self.record_count - 1) % SEQUENCE_WRAP


@dataclass(slots=True, eq=False)
class StreamState:
    stream_id: int
    next_sequence: int = 0
    builder: BatchBuilder | None = None
    started: float = 0.0  # monotonic time of the open batch's first record
    futures: list[Waiter] = field(default_factory=list)
    pending_bytes: int = 0
    ready: deque[Batch] = field(default_factory=deque)
    # sent and not yet acknowledged, in sequence order (at most max_in_flight_per_stream)
    in_flight: deque[Batch] = field(default_factory=deque)
    flow: FlowMachine = field(default_factory=FlowMachine)  # only SENDING dispatches
    acked_next: int = -1  # offset after this producer's last acknowledged batch of the stream
    # the newest range that acknowledged a batch of this producer on the stream: until a range
    # has, one batch at a time goes to it (its first batch is not checked against a sequence)
    acked_range: int = -1
    # a batch failed for good with its outcome unknown: its sequences are skipped, never reused
    # (a later batch with them would be taken for it), so the stream's next OUT_OF_ORDER_SEQUENCE
    # is this gap, and the recovery seals the range and moves on
    sequence_gap: bool = False


async def locate(routing: RangeRouter, producer_id: int, st: StreamState, sealed: Range,
             batches: list[Batch], attempts: Attempts) -> dict[int, int]:
    """Offsets of this producer's ``batches`` in a sealed range, read back from a replica
    that holds the range through its end (a replica still copying the range, or one that
    cannot be reached, is skipped: the next one is tried, and all of them again after a
    backoff, until the deadline, which raises). A batch missing from the result is not in
    the range."""
    wanted = {b.base_sequence for b in batches}
    start = max(sealed.start_offset, st.acked_next)
    while True:
        last_err: SbpError = ReplicaUnavailableError(
            f"range {st.stream_id}/{sealed.range_index} lists no replica to read back from")
        for addr in replica_addresses(sealed):
            try:
                return await scan(routing, producer_id, addr, st.stream_id, sealed, start, wanted)
            except SbpError as exc:
                last_err = exc
            except (OSError, TimeoutError) as exc:
                last_err = as_sbp_error(exc)
            log.debug("event=read_back_retry stream=%d range=%d replica=%s error=%s",
                      st.stream_id, sealed.range_index, addr, last_err)
        await attempts.backoff(ReplicaUnavailableError(
            f"could not read back range {st.stream_id}/{sealed.range_index} from any "
            f"replica before the deadline: {last_err}"))

async def scan(routing: RangeRouter, producer_id: int, addr: str, stream_id: int, sealed: Range,
           start: int, wanted: set[int]) -> dict[int, int]:
    """Read ``[start, end)`` of the sealed range at one replica for the wanted sequences;
    raises unless the replica answered through the end (or until all were found)."""
    found: dict[int, int] = {}
    pos = start
    timeout_s = (routing.request_timeout_ms + READ_BACK_TIMEOUT_MARGIN_MS) / 1000
    while pos < sealed.end_offset and len(found) < len(wanted):
        req = FetchRequest(max_wait_ms=0, min_bytes=1, items=(FetchItem(
            stream_id=stream_id, request_index=0, fetch_offset=pos,
            batch_max_bytes=READ_BACK_BYTES, range_index=sealed.range_index),))
        progressed = False
        rs = await routing.stream(addr, req, timeout_s=timeout_s)
        async with rs:
            async for frame in rs:
                resp = FetchResponse.decode(frame.header)
                resp.status.raise_for_error()
                for item, chunk in resp.chunks(frame.payload):
                    if not item.status.ok:
                        raise item.status.error()
                    for batch in iter_batches(chunk):
                        h = read_header(batch)
                        if h.base_offset >= sealed.end_offset:
                            break
                        if h.producer_id == producer_id and h.base_sequence in wanted:
                            found[h.base_sequence] = h.base_offset
                        if h.base_offset + h.record_count > pos:
                            pos = h.base_offset + h.record_count
                            progressed = True
        if not progressed:
            raise ReplicaUnavailableError(
                f"replica {addr} returned nothing at {pos} < {sealed.end_offset}")
    return found


def fail_waiters(waiters: list[Waiter], exc: SbpError) -> None:
    for f in waiters:
        if isinstance(f, Piece):
            f.offsets.record_failed(f.start, f.count, exc)
        elif not f.done():
            f.set_exception(exc)


def as_sbp_error(exc: BaseException) -> SbpError:
    """``exc`` itself when it is an SbpError, else a FATAL UnknownServerError wrapping it."""
    if isinstance(exc, SbpError):
        return exc
    return UnknownServerError(f"producer failure: {exc!r}")
