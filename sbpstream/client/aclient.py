"""The asyncio SDK client, written by hand. :mod:`sbpstream.client.sync` is generated from it.

One :class:`AsyncClient` holds a connection pool (one multiplexed connection per server), the
placement manager addresses (following PM_NOT_LEADER to the leader), and its
:class:`~sbpstream.client.routing.RangeRouter` (``client.routing``): the cache of range metadata,
refreshed when a data node says it is stale, seals, and data-node requests. Admin calls go to the
PM; :meth:`AsyncClient.producer` and :meth:`AsyncClient.consumer` move records, through the
router's public methods.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TypeVar

from sbpstream.auth.client import client_security
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.client.producer import AsyncProducer
from sbpstream.client.retry import Attempts, is_connection_error
from sbpstream.client.routing import RangeRouter, primary_address
from sbpstream.client.types import (
    DEFAULT_RETENTION_MS,
    Compression,
    Range,
    RetryPolicy,
    StartPosition,
    Stream,
    pm_addresses,
)
from sbpstream.net.client import ConnectionPool
from sbpstream.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    NoPmReachableError,
    RangeNotFoundError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.frame import Frame
from sbpstream.protocol.limits import DEFAULT_CONNECT_TIMEOUT_S
from sbpstream.protocol.messages import (
    STATUS_OK,
    AclEntry,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DescribeRangeItem,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    ManageAclsRequest,
    ManageAclsResponse,
    ManageUsersRequest,
    ManageUsersResponse,
    Message,
    TrimItem,
    TrimStreamsRequest,
    TrimStreamsResponse,
    UpdateStreamsRequest,
    UpdateStreamsResponse,
)

log = logging.getLogger("sbpstream.client")

M = TypeVar("M", bound=Message)

MAX_REDIRECTS = 8  # PM_NOT_LEADER hops followed in a row before backing off
LIST_PAGE_SIZE = 1000  # streams per DESCRIBE_STREAMS page when listing


class AsyncClient:
    """Asyncio client of an sbpstream cluster.

    ``pm`` names the placement manager(s): ``"host:port,host:port"``, a list, or None
    for ``$SBPSTREAM_PM`` (default ``127.0.0.1:12378``). ``request_timeout_ms`` bounds
    one attempt of one request; RETRIABLE errors are retried with exponential backoff
    until ``retry_deadline_ms`` has passed in total. Use as ``async with AsyncClient()
    as c:`` or call :meth:`close`.
    """

    def __init__(
        self,
        pm: str | Sequence[str] | None = None,
        *,
        request_timeout_ms: int = 10_000,
        retry_deadline_ms: int = 30_000,
        connect_timeout_ms: int = int(DEFAULT_CONNECT_TIMEOUT_S * 1000),
        user: str = "",
        password: str = "",
        token_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        self.pm_addresses: list[str] = pm_addresses(pm)
        self.request_timeout_ms = request_timeout_ms
        self.retry = RetryPolicy(deadline_ms=retry_deadline_ms)
        # security (docs/security.md): arguments, else $SBPSTREAM_USER, _PASSWORD, _TOKEN_FILE,
        # _TLS_CA; TLS when a CA is given, credentials when a user or token file is
        self.credentials, ssl_context = client_security(
            self.pm_addresses, user=user, password=password, token_file=token_file,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._pool = ConnectionPool(connect_timeout_s=connect_timeout_ms / 1000,
                                    ssl_context=ssl_context, authenticator=self.credentials)
        self._leader: str | None = None
        #: The range cache and data-node requests, shared by this client's producers and
        #: consumers (see :class:`~sbpstream.client.routing.RangeRouter`).
        self.routing = RangeRouter(self._pool, self._pm_call,
                                   request_timeout_ms=request_timeout_ms, retry=self.retry)
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection. Producers should be closed (flushed) first."""
        if self._closed:
            return
        self._closed = True
        await self._pool.close()

    # ------------------------------------------------------------------------------ streams

    async def create_streams(
        self, count: int = 1, *, replica_nums: int = 1, retention_ms: int = DEFAULT_RETENTION_MS
    ) -> list[int]:
        """Create ``count`` streams; return their ids in order."""
        if count < 1:
            raise InvalidRequestError(f"count must be at least 1, not {count}")
        item = CreateStreamItem(replica_nums=replica_nums, retention_period_ms=retention_ms)
        req = CreateStreamsRequest(timeout_ms=self.request_timeout_ms, items=(item,) * count)
        resp = await self._pm_call(req, CreateStreamsResponse)
        ids: list[int] = []
        for r in resp.items:
            r.status.raise_for_error()
            if r.stream is None:
                raise InvalidRequestError("the PM created a stream but returned no id")
            ids.append(r.stream.stream_id)
        return ids

    async def create_stream(
        self, *, replica_nums: int = 1, retention_ms: int = DEFAULT_RETENTION_MS
    ) -> int:
        """Create one stream; return its id."""
        ids = await self.create_streams(1, replica_nums=replica_nums, retention_ms=retention_ms)
        return ids[0]

    async def describe_streams(self, stream_ids: Sequence[int]) -> list[Stream]:
        """Describe the given streams (raises StreamNotFoundError for an unknown one)."""
        if not stream_ids:
            return []
        req = DescribeStreamsRequest(
            timeout_ms=self.request_timeout_ms, stream_ids=tuple(stream_ids)
        )
        resp = await self._pm_call(req, DescribeStreamsResponse)
        out: list[Stream] = []
        for sid, r in zip(stream_ids, resp.items, strict=False):
            if r.status.code == ErrorCode.STREAM_NOT_FOUND or (r.status.ok and r.stream is None):
                raise StreamNotFoundError(f"stream {sid} does not exist")
            r.status.raise_for_error()
            assert r.stream is not None
            out.append(r.stream)
        return out

    async def describe_stream(self, stream_id: int) -> Stream:
        """Describe one stream."""
        return (await self.describe_streams([stream_id]))[0]

    async def list_streams(self) -> list[Stream]:
        """Every stream, in id order (pages through DESCRIBE_STREAMS)."""
        out: list[Stream] = []
        continuation = -1
        while True:
            req = DescribeStreamsRequest(
                timeout_ms=self.request_timeout_ms, limit=LIST_PAGE_SIZE, continuation=continuation
            )
            resp = await self._pm_call(req, DescribeStreamsResponse)
            for r in resp.items:
                if r.status.ok and r.stream is not None:
                    out.append(r.stream)
            if resp.continuation < 0 or not resp.items:
                return out
            continuation = resp.continuation

    async def update_stream(
        self,
        stream_id: int,
        *,
        replica_nums: int | None = None,
        retention_ms: int | None = None,
    ) -> Stream:
        """Change a stream's replica count and/or retention; return its new description."""
        cur = await self.describe_stream(stream_id)
        new = Stream(
            stream_id=stream_id,
            replica_nums=cur.replica_nums if replica_nums is None else replica_nums,
            retention_period_ms=cur.retention_period_ms if retention_ms is None else retention_ms,
            start_offset=cur.start_offset,
        )
        req = UpdateStreamsRequest(timeout_ms=self.request_timeout_ms, items=(new,))
        resp = await self._pm_call(req, UpdateStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        return r.stream or new

    async def trim_stream(self, stream_id: int, offset: int) -> Stream:
        """Drop the records before ``offset``; return the stream (its new start_offset)."""
        req = TrimStreamsRequest(
            timeout_ms=self.request_timeout_ms,
            items=(TrimItem(stream_id=stream_id, trim_offset=offset),),
        )
        resp = await self._pm_call(req, TrimStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        self.routing.invalidate(stream_id)
        if r.stream is None:
            return await self.describe_stream(stream_id)
        return r.stream

    async def delete_streams(self, stream_ids: Sequence[int]) -> None:
        """Delete streams; raises the first per-stream error (after all were attempted)."""
        if not stream_ids:
            return
        req = DeleteStreamsRequest(
            timeout_ms=self.request_timeout_ms,
            items=tuple(Stream(stream_id=s) for s in stream_ids),
        )
        resp = await self._pm_call(req, DeleteStreamsResponse)
        for sid in stream_ids:
            self.routing.invalidate(sid)
        for r in resp.items:
            r.status.raise_for_error()

    async def delete_stream(self, stream_id: int) -> None:
        """Delete one stream."""
        await self.delete_streams([stream_id])

    # ------------------------------------------------------------------------------- ranges

    async def list_ranges(self, stream_id: int) -> list[Range]:
        """The stream's ranges from the PM, by range index (the last one is writable)."""
        return list(await self.routing.ranges(stream_id, refresh=True))

    async def describe_range(self, stream_id: int, range_index: int) -> Range:
        """One range; for the writable range the primary data node answers authoritatively."""
        ranges = await self.routing.ranges(stream_id)
        rng = next((r for r in ranges if r.range_index == range_index), None)
        req = DescribeRangesRequest(
            timeout_ms=self.request_timeout_ms,
            items=(DescribeRangeItem(stream_id=stream_id, range_index=range_index),),
        )
        if rng is not None and not rng.sealed:
            primary = primary_address(rng)
            if primary:
                try:
                    frame = await self.routing.request(primary, req)
                    got = DescribeRangesResponse.decode(frame.header).items[0]
                    if got.status.ok and got.range is not None:
                        return got.range
                except SbpError as exc:
                    log.debug("event=describe_range_dn_failed addr=%s error=%s", primary, exc)
        resp = await self._pm_call(req, DescribeRangesResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        if r.range is None:
            raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
        return r.range

    async def start_offset(self, stream_id: int) -> int:
        """The stream's first readable offset."""
        stream = await self.describe_stream(stream_id)
        ranges = await self.routing.ranges(stream_id, refresh=True)
        first = ranges[0].start_offset if ranges else 0
        return max(stream.start_offset, first)

    async def end_offset(self, stream_id: int) -> int:
        """The offset the next record appended to the stream will get (its current end)."""
        ranges = await self.routing.ranges(stream_id, refresh=True)
        if not ranges:
            return 0
        last = ranges[-1]
        if last.sealed:
            return last.end_offset
        rng = await self.describe_range(stream_id, last.range_index)
        return rng.end_offset if rng.sealed else rng.next_offset

    # ------------------------------------------------------------------------ data plane

    def producer(
        self,
        *,
        linger_ms: float = 5.0,
        batch_max_bytes: int = 512 * 1024,
        buffer_max_bytes: int = 64 * 1024 * 1024,
        compression: Compression | None = None,
        producer_id: int | None = None,
        producer_epoch: int = 0,
        max_in_flight_per_node: int = 16,
        primary_retry_ms: int = 15_000,
        max_in_flight_per_stream: int = 4,
    ) -> AsyncProducer:
        """A batching, idempotent producer (see :class:`AsyncProducer`). Close it when done.

        ``primary_retry_ms``: how long to retry an unreachable primary of a single-replica range
        before asking the PM to seal it (no replica could report the range's end meanwhile).
        ``max_in_flight_per_stream``: batches of one stream sent before the first is
        acknowledged (1..5; more overlap the data node's fsync with the next transfer).
        """
        return AsyncProducer(
            self,
            linger_ms=linger_ms,
            batch_max_bytes=batch_max_bytes,
            buffer_max_bytes=buffer_max_bytes,
            compression=compression,
            producer_id=producer_id,
            producer_epoch=producer_epoch,
            max_in_flight_per_node=max_in_flight_per_node,
            primary_retry_ms=primary_retry_ms,
            max_in_flight_per_stream=max_in_flight_per_stream,
        )

    def consumer(
        self,
        stream_id: int,
        start: StartPosition = "earliest",
        *,
        end: int | None = None,
        max_wait_ms: int = 500,
        batch_max_bytes: int = 1024 * 1024,
        auto_reset: str | None = None,
    ) -> AsyncConsumer:
        """An async iterator over the records of ``stream_id`` (see :class:`AsyncConsumer`).

        ``start`` is ``"earliest"``, ``"latest"`` or an offset; with ``end`` the iteration stops
        before that offset, otherwise it waits for new records forever.
        """
        return AsyncConsumer(
            self,
            stream_id,
            start,
            end=end,
            max_wait_ms=max_wait_ms,
            batch_max_bytes=batch_max_bytes,
            auto_reset=auto_reset,
        )

    # ------------------------------------------------------------------- plumbing (SDK use)

    # ------------------------------------------------------------------ users and ACLs (admin)

    async def add_user(self, user: str, password: str) -> None:
        """Add a user, or set a user's password (needs ``admin``)."""
        await self._pm_call(ManageUsersRequest(1, user, password), ManageUsersResponse)

    async def delete_user(self, user: str) -> None:
        """Delete a user and its ACL rules (needs ``admin``)."""
        await self._pm_call(ManageUsersRequest(2, user), ManageUsersResponse)

    async def list_users(self) -> list[str]:
        resp = await self._pm_call(ManageUsersRequest(3), ManageUsersResponse)
        return [u.name for u in resp.users]

    async def add_acl(self, principal: str, operations: str, resource: str) -> None:
        """Grant ``operations`` (``append,fetch``, or ``all``) on ``resource`` (``*``,
        ``stream:ID`` or ``prefix:TEXT``) to ``principal`` (needs ``admin``)."""
        await self._pm_call(ManageAclsRequest(1, AclEntry(principal, operations, resource)),
                            ManageAclsResponse)

    async def delete_acl(self, principal: str, resource: str, operations: str = "all") -> None:
        await self._pm_call(ManageAclsRequest(2, AclEntry(principal, operations, resource)),
                            ManageAclsResponse)

    async def list_acls(self, principal: str = "") -> list[tuple[str, str, str]]:
        """(principal, operations, resource) of every rule, or of ``principal``'s."""
        resp = await self._pm_call(ManageAclsRequest(3, principal=principal),
                                   ManageAclsResponse)
        return [(a.principal, a.operations, a.resource) for a in resp.acls]

    async def _pm_call(self, req: Message, resp_cls: type[M]) -> M:
        """Send ``req`` to the PM leader and decode the answer; follows redirects and retries.

        Raises the response's top-level error, or NoPmReachableError when no PM answers within
        the retry deadline.
        """
        attempts = Attempts(self.retry)
        redirects = 0
        index = 0
        last: SbpError | None = None
        header = req.encode()
        while True:
            addr = self._leader or self.pm_addresses[index % len(self.pm_addresses)]
            try:
                conn = await self._pool.get(addr)
                frames = await conn.request(
                    req.OPCODE, header, timeout_s=self.request_timeout_ms / 1000
                )
                resp = _merge_frames(resp_cls, frames)
                getattr(resp, "status", STATUS_OK).raise_for_error()
                self._leader = addr
                return resp
            except SbpError as exc:
                last = exc
                self._leader = None
                if exc.redirect:
                    leader = exc.detail.decode("utf-8", "replace").strip()
                    redirects += 1
                    if leader and leader != addr and redirects <= MAX_REDIRECTS:
                        log.debug("event=pm_redirect from=%s to=%s", addr, leader)
                        self._leader = leader
                        continue
                    index += 1
                elif not exc.retriable:
                    raise
                else:
                    index += 1
                    if is_connection_error(exc):
                        self._pool.discard(addr)
                if index % len(self.pm_addresses) == 0 or exc.redirect:
                    try:
                        await attempts.backoff(exc)
                    except SbpError:
                        raise self._give_up(last) from None
                    redirects = 0

    def _give_up(self, last: SbpError) -> SbpError:
        if is_connection_error(last):
            return NoPmReachableError(
                f"no placement manager reachable at {','.join(self.pm_addresses)} ({last.message})"
            )
        return last


def _merge_frames(resp_cls: type[M], frames: Sequence[Frame]) -> M:
    """One response from the frames of a streamed answer: a PM may split a long list (e.g.
    LIST_RANGES results) over several frames; their ``items`` are concatenated in order."""
    decoded = [resp_cls.decode(f.header) for f in frames]
    last = decoded[-1]
    if len(decoded) == 1 or not hasattr(last, "items"):
        return last
    items = tuple(it for d in decoded for it in d.items)  # type: ignore[attr-defined]
    return dataclasses.replace(last, items=items)  # type: ignore[type-var]
