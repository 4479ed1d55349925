"""The consumer: reads streams from an offset, across their ranges and their replicas.

:class:`AsyncConsumer` is the application's side: a facade over one reader, a
:class:`StreamReader` (iteration, poll, seek, the buffer, positions of a set of streams) or a
group member (:mod:`sbpstream.client.groups`, which reads through a StreamReader of its own).
By default a reader **subscribes**: :class:`~sbpstream.client.push.Subscriber` (module
:mod:`sbpstream.client.push`) runs one FETCH with a window per data node and pushes records
into the reader's buffer; the reader is its :class:`~sbpstream.client.push.SubscriberHost`.

Those long polls run in a **fetch session** per feed (docs/protocol.md, "Fetch sessions"): the
first FETCH is full and makes the session, each next one names only the streams whose position or
range changed plus the ones dropped (``forgotten``), and the node answers only the streams with
records or a changed state. A session error (FETCH_SESSION_ID_NOT_FOUND,
INVALID_FETCH_SESSION_EPOCH) or any failed round starts a full session again from the consumer's
own positions, so nothing is skipped or read twice.

Without a subscription (``subscribe=False``, :meth:`AsyncConsumer.poll_columns`,
:meth:`AsyncConsumer.fetch_batches`) each round is one FETCH (long-polled with ``max_wait_ms``
at the end of the stream) to a replica of the range holding the position, the primary first,
another replica after an error. When a sealed range is read to its end the consumer moves to the
next range index. A fetch that starts inside a batch returns that whole batch; records before
the position are skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from sbpstream.client.options import ConsumerOptions
from sbpstream.client.pull import StreamReader, iter_columns
from sbpstream.client.types import (
    ColumnBatch,
    ConsumedRecord,
    RebalanceEvent,
)
from sbpstream.protocol.errors import InvalidRequestError

__all__ = ["AsyncConsumer", "ConsumerReader", "GroupReader", "StreamReader", "iter_columns"]


class ConsumerReader(Protocol):
    """What an :class:`AsyncConsumer` reads through: a :class:`StreamReader`, or a group
    member (:class:`~sbpstream.client.groups.GroupMember`). The calls are the consumer's."""

    options: ConsumerOptions

    @property
    def throttle_time_ms(self) -> int: ...

    @property
    def position(self) -> int | None: ...

    @property
    def at_end(self) -> bool: ...

    @property
    def caught_up(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def buffered(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[ConsumedRecord]: ...

    async def __anext__(self) -> ConsumedRecord: ...

    async def poll(self, max_records: int = 10_000,
                   timeout_ms: int | None = None) -> list[ConsumedRecord]: ...

    async def poll_columns(self, timeout_ms: int | None = None) -> ColumnBatch: ...

    async def fill(self, timeout_ms: int | None = None) -> int: ...

    def next_buffered(self) -> ConsumedRecord | None: ...

    async def fetch_batches(self, timeout_ms: int = 0) -> list[memoryview]: ...

    async def seek(self, offset: int) -> None: ...

    async def close(self) -> None: ...

    async def set_streams(self, streams: int | Sequence[int]) -> None: ...


class GroupReader(ConsumerReader, Protocol):
    """A consumer group member: a reader with the group side the consumer delegates to."""

    @property
    def group(self) -> str: ...

    @property
    def assignment(self) -> tuple[int, ...]: ...

    async def commit(self, offsets: Mapping[int, int] | None = None) -> None: ...

    async def committed(self) -> dict[int, int]: ...

    def rebalance_events(self) -> list[RebalanceEvent]: ...


class AsyncConsumer:
    """Async iterator of :class:`ConsumedRecord` of one or more streams, each in offset order
    (``record.stream_id`` says which; streams interleave as their records arrive).

    Without ``end`` the iteration never stops: at the end of the stream it long-polls for new
    records. With ``end`` it stops before that offset. :meth:`poll` and :meth:`poll_columns` are
    the non-blocking-ish forms (one fetch round, bounded by ``timeout_ms``). ``auto_reset =
    "earliest"`` makes a position whose records were trimmed jump to the stream's start instead
    of raising :class:`OffsetTrimmedError`. ``subscribe`` (the default) has the nodes push
    records under a ``window_bytes`` window; with ``subscribe=False`` every round is a long
    poll. ``end``, :meth:`poll_columns`, :meth:`fetch_batches` and :attr:`position` are for a
    single stream. Create with :meth:`AsyncClient.consumer`.

    The consumer is a facade over one reader, fixed for its life: a :class:`StreamReader` of
    the given streams, or, with ``group``, a group member (client/groups.py) that holds a plain
    reader of its assigned streams and changes it on each rebalance. The group-only calls
    (:meth:`commit`, :meth:`committed`) are the member's; without a group they are refused.
    """

    def __init__(self, reader: StreamReader | GroupReader) -> None:
        #: What the consumer reads through (the subscriber's host, for a plain reader).
        self.reader: ConsumerReader = reader
        self._plain: StreamReader | None = None
        self._member: GroupReader | None = None
        if isinstance(reader, StreamReader):
            self._plain = reader
        else:
            self._member = reader
        #: The options the consumer was made with.
        self.options = reader.options

    @property
    def throttle_time_ms(self) -> int:
        """Quotas: total throttle_time_ms the data nodes asked of this consumer's client (it
        waits each one out before its next FETCH from that node)."""
        return self.reader.throttle_time_ms

    @property
    def position(self) -> int | None:
        """The offset of the next record to return (None until the start is resolved)."""
        return self.reader.position

    @property
    def at_end(self) -> bool:
        """True when ``end`` was given and every record before it was returned."""
        return self.reader.at_end

    @property
    def caught_up(self) -> bool:
        """True when the last fetch found nothing past the position (the stream's end)."""
        return self.reader.caught_up

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (iteration has ended)."""
        return self.reader.closed

    @property
    def buffered(self) -> int:
        """Records fetched but not yet returned."""
        return self.reader.buffered

    def __aiter__(self) -> AsyncIterator[ConsumedRecord]:
        return aiter(self.reader)  # ``async for`` runs the reader: no extra call per record

    async def __anext__(self) -> ConsumedRecord:
        return await anext(self.reader)

    async def poll(self, max_records: int = 10_000, timeout_ms: int | None = None) -> list[
            ConsumedRecord]:
        """Up to ``max_records`` records: buffered ones, else one fetch waiting ``timeout_ms``.

        Returns an empty list when nothing arrived in time or ``end`` was reached.
        """
        return await self.reader.poll(max_records, timeout_ms)

    async def poll_columns(self, timeout_ms: int | None = None) -> ColumnBatch:
        """One fetch round decoded as columns (the bulk path); may hold no records."""
        return await self.reader.poll_columns(timeout_ms)

    async def fill(self, timeout_ms: int | None = None) -> int:
        """Fetch one round into the buffer unless records are buffered (or ``end`` was reached,
        or the consumer is closed), waiting up to ``timeout_ms``; return the records buffered.

        With :meth:`next_buffered` this is iteration in two steps: the sync consumer fetches on
        its loop thread and hands records out on the caller's thread without crossing over.
        """
        return await self.reader.fill(timeout_ms)

    def next_buffered(self) -> ConsumedRecord | None:
        """The next buffered record, without fetching (None when the buffer is empty)."""
        return self.reader.next_buffered()

    async def fetch_batches(self, timeout_ms: int = 0) -> list[memoryview]:
        """One FETCH round at the position, as the raw record batches that hold it (their
        headers carry producer ids and sequences); the position does not move: :meth:`seek`
        past them to go on. Errors are retried as for the records."""
        return await self.reader.fetch_batches(timeout_ms)

    async def seek(self, offset: int) -> None:
        """Continue from ``offset``."""
        await self.reader.seek(offset)

    async def close(self) -> None:
        """Stop (cancels the subscriptions); iteration ends."""
        await self.reader.close()

    async def set_streams(self, streams: int | Sequence[int]) -> None:
        """Read ``streams`` from now on (one id or a sequence of distinct ids), without starting
        over: the streams kept go on from where they are, the new ones start at the consumer's
        ``start``, and the dropped ones' buffered records are discarded. A running subscription
        is changed in place (an incremental FETCH of its session adds and forgets streams); a
        long-poll feed names the new streams in its next round and forgets the dropped ones."""
        await self.reader.set_streams(streams)

    # ------------------------------------------------- consumer groups (the member's side)

    @property
    def group(self) -> str | None:
        """The consumer group (``group=`` of :meth:`AsyncClient.consumer`); None without one."""
        return None if self._member is None else self._member.group

    @property
    def assignment(self) -> tuple[int, ...]:
        """The streams read now: all of them without a group, the assigned ones with one."""
        if self._member is not None:
            return self._member.assignment
        return self._plain_reader("assignment").stream_ids

    async def commit(self, offsets: Mapping[int, int] | None = None) -> None:
        """Commit the group's offsets: by default, past every record handed out so far; or
        ``offsets`` (stream id -> next offset to read). A group consumer only."""
        await self._group_member("commit()").commit(offsets)

    async def committed(self) -> dict[int, int]:
        """The group's committed offsets of the assigned streams (stream id -> next offset to
        read; streams without one are absent). A group consumer only."""
        return await self._group_member("committed()").committed()

    def rebalance_events(self) -> list[RebalanceEvent]:
        """The rebalance events since the last call, oldest first (always empty without a
        group)."""
        return [] if self._member is None else self._member.rebalance_events()

    # ------------------------------------ the plain reader's fetch state (the Kafka gateway)

    @property
    def high_watermark(self) -> int:
        """The stream's end as the last fetch saw it (-1 before one). Without a group only."""
        return self._plain_reader("high_watermark").high_watermark

    @property
    def batch_max_bytes(self) -> int:
        """The most bytes one FETCH asks of a stream (settable between rounds). Without a group
        only."""
        return self._plain_reader("batch_max_bytes").batch_max_bytes

    @batch_max_bytes.setter
    def batch_max_bytes(self, value: int) -> None:
        self._plain_reader("batch_max_bytes").batch_max_bytes = value

    def _group_member(self, what: str) -> GroupReader:
        if self._member is None:
            raise InvalidRequestError(f"{what} needs a consumer with a group")
        return self._member

    def _plain_reader(self, what: str) -> StreamReader:
        if self._plain is None:
            raise InvalidRequestError(f"{what} is for a consumer without a group")
        return self._plain


