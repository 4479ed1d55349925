"""The asyncio SDK client, written by hand. :mod:`sbpstream.client.sync` is generated from it.

One :class:`AsyncClient` holds a connection pool (one multiplexed connection per server), the
placement manager addresses (following PM_NOT_LEADER to the leader), and its
:class:`~sbpstream.client.routing.RangeRouter` (``client.routing``): the cache of range metadata,
refreshed when a data node says it is stale, seals, and data-node requests. Admin calls go to the
PM; :meth:`AsyncClient.producer` and :meth:`AsyncClient.consumer` move records, through the
router's public methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar, cast, overload

from sbpstream.auth.client import client_security
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.client.groups import GroupAdmin, GroupConsumer
from sbpstream.client.options import ConsumerOptions, ProducerOptions, build
from sbpstream.client.producer import AsyncProducer
from sbpstream.client.retry import Attempts
from sbpstream.client.routing import RangeRouter, primary_address, replica_addresses
from sbpstream.client.types import (
    DEFAULT_RETENTION_MS,
    GroupInfo,
    GroupMemberInfo,
    GroupStreamInfo,
    Range,
    RetryPolicy,
    StartPosition,
    Stream,
    pm_addresses,
)
from sbpstream.net.client import Connection, ConnectionPool
from sbpstream.net.pmcaller import PmCaller
from sbpstream.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    InvalidStreamConfigError,
    ProtocolViolationError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.limits import DEFAULT_CONNECT_TIMEOUT_S
from sbpstream.protocol.messages import (
    RESPONSES,
    AclEntry,
    ClientRole,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    DeleteQuotasRequest,
    DeleteQuotasResponse,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DescribeQuotasRequest,
    DescribeQuotasResponse,
    DescribeRangeItem,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    HeartbeatRequest,
    ManageAclsRequest,
    ManageAclsResponse,
    ManageUsersRequest,
    ManageUsersResponse,
    Message,
    Quota,
    QuotaCountersRequest,
    QuotaCountersResponse,
    QuotaResult,
    SetQuotasRequest,
    SetQuotasResponse,
    Status,
    TrimItem,
    TrimStreamsRequest,
    TrimStreamsResponse,
    UpdateStreamsRequest,
    UpdateStreamsResponse,
)
from sbpstream.protocol.names import name_problem, parse_stream_ref, validate_name_prefix
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.model import QuotaKind, QuotaSpec, validate_client_id
from sbpstream.quota.model import validate as validate_quota

log = logging.getLogger("sbpstream.client")

M = TypeVar("M", bound=Message)

LIST_PAGE_SIZE = 1000  # streams per DESCRIBE_STREAMS page when listing
DESCRIBE_GROUP_CONCURRENCY = 64  # end offsets looked up at once by describe_group

HEARTBEAT_INTERVAL_S: Final = 5.0
"""How often a client sends HEARTBEAT (its client_id) to the PM and to each data node it used.
The PM counts a client live for node_timeout * CLIENT_TIMEOUT_FACTOR (pm/service.py), a few
intervals; more often would only add idle traffic per client."""

HEARTBEAT_TIMEOUT_S: Final = 2.0
"""One heartbeat's bound: it is best effort and never delays the client's own requests."""

RETENTION_UNCHANGED: Final = -1
"""UPDATE_STREAMS' retention_period_ms for "keep the current one" (docs/protocol.md)."""


def new_client_id() -> str:
    """A client id unique to this process and client: host, pid and a random part."""
    return f"sdk-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class AsyncClient:
    """Asyncio client of an sbpstream cluster.

    ``pm`` names the placement manager(s): ``"host:port,host:port"``, a list, or None
    for ``$SBPSTREAM_PM`` (default ``127.0.0.1:12378``). ``request_timeout_ms`` bounds
    one attempt of one request; RETRIABLE errors are retried with exponential backoff
    until ``retry_deadline_ms`` has passed in total. Use as ``async with AsyncClient()
    as c:`` or call :meth:`close`. ``client_id`` names this client to the data nodes, which
    apply the quotas of that id (docs/operations.md, Quotas); "" is the default quota's.
    """

    def __init__(
        self,
        pm: str | Sequence[str] | None = None,
        *,
        request_timeout_ms: int = 10_000,
        retry_deadline_ms: int = 30_000,
        connect_timeout_ms: int = int(DEFAULT_CONNECT_TIMEOUT_S * 1000),
        client_id: str | None = None,
        user: str = "",
        password: str = "",
        token_file: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        self.pm_addresses: list[str] = pm_addresses(pm)
        #: Sent in HEARTBEAT to the PM and the data nodes this client uses; data nodes apply
        #: quotas per client id (issue 22). Default: unique to this client.
        self.client_id = validate_client_id(client_id) if client_id else new_client_id()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._ends: dict[int, int] = {}
        self.request_timeout_ms = request_timeout_ms
        self.retry = RetryPolicy(deadline_ms=retry_deadline_ms)
        # security (docs/security.md): arguments, else $SBPSTREAM_USER, _PASSWORD, _TOKEN_FILE,
        # _TLS_CA; TLS when a CA is given, credentials when a user or token file is
        self.credentials, ssl_context = client_security(
            self.pm_addresses, user=user, password=password, token_file=token_file,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._pool = ConnectionPool(connect_timeout_s=connect_timeout_ms / 1000,
                                    ssl_context=ssl_context, authenticator=self.credentials)
        self._pm = PmCaller(self.pm_addresses, self._pool, timeout_s=request_timeout_ms / 1000,
                            retry=self.retry)
        #: The range cache and data-node requests, shared by this client's producers and
        #: consumers (see :class:`~sbpstream.client.routing.RangeRouter`).
        self.routing = RangeRouter(self._pool, self.pm_request,
                                   request_timeout_ms=request_timeout_ms, retry=self.retry,
                                   client_id=self.client_id)
        self._closed = False
        self._names: dict[str, int] = {}
        """Stream name -> id, as DESCRIBE_STREAMS answered (names are immutable while the
        stream lives; a deleted stream's entries are dropped by this client's deletes)."""

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection. Producers should be closed (flushed) first."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        await self._pool.close()

    # ------------------------------------------------------------------------------ streams

    async def create_streams(
        self, count: int = 1, *, replica_nums: int = 1, retention_ms: int = DEFAULT_RETENTION_MS,
        names: Sequence[str] = (),
    ) -> list[int]:
        """Create ``count`` streams, or one per name of ``names`` (unique names; see
        :mod:`sbpstream.protocol.names` for the rules); return their ids in order."""
        if names:
            for n in names:
                problem = name_problem(n)
                if problem is not None:
                    raise InvalidStreamConfigError(problem)
            count = len(names)
        if count < 1:
            raise InvalidRequestError(f"count must be at least 1, not {count}")
        item = CreateStreamItem(replica_nums=replica_nums, retention_period_ms=retention_ms)
        items = (tuple(dataclasses.replace(item, name=n) for n in names) if names
                 else (item,) * count)
        ids: list[int] = [-1] * len(items)
        todo = list(range(len(items)))
        attempts = Attempts(self.retry)
        while True:
            # items answered with a RETRIABLE error (NOT_ENOUGH_DATA_NODES while nodes are
            # coming back, a new PM leader still waiting for heartbeats) are asked for again
            req = CreateStreamsRequest(timeout_ms=self.request_timeout_ms,
                                       items=tuple(items[i] for i in todo))
            resp = await self.pm_request(req, CreateStreamsResponse)
            retry: SbpError | None = None
            again: list[int] = []
            for i, r in zip(todo, resp.items, strict=False):
                if not r.status.ok:
                    err = r.status.error()
                    if not err.retriable:
                        raise err
                    retry = err
                    again.append(i)
                    continue
                if r.stream is None:
                    raise InvalidRequestError("the PM created a stream but returned no id")
                ids[i] = r.stream.stream_id
                if r.stream.name:
                    self._names[r.stream.name] = r.stream.stream_id
            again += todo[len(resp.items):]
            if not again:
                return ids
            await attempts.backoff(retry or InvalidRequestError(
                f"the PM answered {len(resp.items)} of {len(todo)} stream(s)"))
            todo = again

    async def create_stream(
        self, name: str = "", *, replica_nums: int = 1, retention_ms: int = DEFAULT_RETENTION_MS
    ) -> int:
        """Create one stream (named ``name``, unless empty); return its id."""
        ids = await self.create_streams(1, replica_nums=replica_nums, retention_ms=retention_ms,
                                        names=(name,) if name else ())
        return ids[0]

    async def resolve_stream(self, stream: int | str, *, refresh: bool = False) -> int:
        """The id of ``stream``: an id (int, or a string of digits) as is; a name through
        DESCRIBE_STREAMS, cached (``refresh`` asks again). StreamNotFoundError when no live
        stream has the name; InvalidStreamConfigError for text that is neither."""
        ref = parse_stream_ref(stream) if isinstance(stream, str) else stream
        if isinstance(ref, int):
            return ref
        if not refresh and ref in self._names:
            return self._names[ref]
        req = DescribeStreamsRequest(timeout_ms=self.request_timeout_ms, name=ref)
        resp = await self.pm_request(req, DescribeStreamsResponse)
        r = resp.items[0] if resp.items else None
        if r is None or r.status.code == ErrorCode.STREAM_NOT_FOUND or r.stream is None:
            self._names.pop(ref, None)
            raise StreamNotFoundError(f"no stream is named {ref!r}")
        r.status.raise_for_error()
        self._names[ref] = r.stream.stream_id
        return r.stream.stream_id

    async def resolve_streams(self, streams: Sequence[int | str]) -> list[int]:
        """:meth:`resolve_stream` of each, concurrently; ids in the same order."""
        if all(type(s) is int for s in streams):  # ids as they are, without a task each
            return list(cast(Sequence[int], streams))
        return list(await asyncio.gather(*(self.resolve_stream(s) for s in streams)))

    async def find_streams(self, prefix: str = "", pattern: str | None = None) -> list[Stream]:
        """The live named streams whose name starts with ``prefix`` ("" = every named stream)
        and, with ``pattern``, fully matches that regular expression; in id order."""
        validate_name_prefix(prefix)
        rx = compile_stream_pattern(pattern) if pattern is not None else None
        out: list[Stream] = []
        continuation = -1
        while True:
            # name_prefix "" lists every stream: the unnamed ones are filtered out below
            req = DescribeStreamsRequest(timeout_ms=self.request_timeout_ms, name_prefix=prefix,
                                         limit=LIST_PAGE_SIZE, continuation=continuation)
            resp = await self.pm_request(req, DescribeStreamsResponse)
            resp.status.raise_for_error()
            for r in resp.items:
                st = r.stream
                if r.status.ok and st is not None and st.name and (
                        rx is None or rx.fullmatch(st.name)):
                    self._names[st.name] = st.stream_id
                    out.append(st)
            # a filtered page may be empty and go on (the gate hides streams the principal
            # may not describe); a continuation that does not move ends it
            if resp.continuation < 0 or resp.continuation == continuation:
                return out
            continuation = resp.continuation

    async def describe_streams(self, stream_ids: Sequence[int | str]) -> list[Stream]:
        """Describe the given streams, by id or name (StreamNotFoundError for an unknown one)."""
        if not stream_ids:
            return []
        stream_ids = await self.resolve_streams(stream_ids)
        req = DescribeStreamsRequest(
            timeout_ms=self.request_timeout_ms, stream_ids=tuple(stream_ids)
        )
        resp = await self.pm_request(req, DescribeStreamsResponse)
        out: list[Stream] = []
        for sid, r in zip(stream_ids, resp.items, strict=False):
            if r.status.code == ErrorCode.STREAM_NOT_FOUND or (r.status.ok and r.stream is None):
                raise StreamNotFoundError(f"stream {sid} does not exist")
            r.status.raise_for_error()
            assert r.stream is not None
            out.append(r.stream)
        return out

    async def describe_stream(self, stream_id: int | str) -> Stream:
        """Describe one stream (by id or name)."""
        return (await self.describe_streams([stream_id]))[0]

    async def list_streams(self) -> list[Stream]:
        """Every stream, in id order (pages through DESCRIBE_STREAMS)."""
        out: list[Stream] = []
        continuation = -1
        while True:
            req = DescribeStreamsRequest(
                timeout_ms=self.request_timeout_ms, limit=LIST_PAGE_SIZE, continuation=continuation
            )
            resp = await self.pm_request(req, DescribeStreamsResponse)
            for r in resp.items:
                if r.status.ok and r.stream is not None:
                    out.append(r.stream)
            # a filtered page may be empty and go on (the gate hides streams the principal
            # may not describe); a continuation that does not move ends it
            if resp.continuation < 0 or resp.continuation == continuation:
                return out
            continuation = resp.continuation

    async def update_stream(
        self,
        stream_id: int | str,
        *,
        replica_nums: int | None = None,
        retention_ms: int | None = None,
    ) -> Stream:
        """Change a stream's replica count and/or retention; return its new description.

        A field left None is sent as absent (replica_nums 0, retention -1) and the PM keeps its
        current value: no read-modify-write, so concurrent updates of different fields do not
        undo each other."""
        stream_id = await self.resolve_stream(stream_id)
        new = Stream(
            stream_id=stream_id,
            replica_nums=0 if replica_nums is None else replica_nums,
            retention_period_ms=RETENTION_UNCHANGED if retention_ms is None else retention_ms,
        )
        req = UpdateStreamsRequest(timeout_ms=self.request_timeout_ms, items=(new,))
        resp = await self.pm_request(req, UpdateStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        return r.stream or await self.describe_stream(stream_id)

    async def trim_stream(self, stream_id: int | str, offset: int) -> Stream:
        """Drop the records before ``offset``; return the stream (its new start_offset)."""
        stream_id = await self.resolve_stream(stream_id)
        req = TrimStreamsRequest(
            timeout_ms=self.request_timeout_ms,
            items=(TrimItem(stream_id=stream_id, trim_offset=offset),),
        )
        resp = await self.pm_request(req, TrimStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        self.routing.invalidate(stream_id)
        if r.stream is None:
            return await self.describe_stream(stream_id)
        return r.stream

    async def delete_streams(self, stream_ids: Sequence[int | str]) -> None:
        """Delete streams (by id or name); raises the first per-stream error (after all were
        attempted)."""
        if not stream_ids:
            return
        stream_ids = await self.resolve_streams(stream_ids)
        gone = set(stream_ids)
        for name in [n for n, sid in self._names.items() if sid in gone]:
            del self._names[name]
        req = DeleteStreamsRequest(
            timeout_ms=self.request_timeout_ms,
            items=tuple(Stream(stream_id=s) for s in stream_ids),
        )
        resp = await self.pm_request(req, DeleteStreamsResponse)
        for sid in stream_ids:
            self.routing.invalidate(sid)
        for r in resp.items:
            r.status.raise_for_error()

    async def delete_stream(self, stream_id: int | str) -> None:
        """Delete one stream."""
        await self.delete_streams([stream_id])

    # ------------------------------------------------------------------------------- quotas

    async def set_quota(self, quota: QuotaSpec) -> QuotaSpec:
        """Create or replace a quota at the PM (hostile values raise InvalidRequestError
        here, before anything is sent); returns it as stored. Data nodes apply it within a
        heartbeat interval."""
        q = validate_quota(quota)
        resp = await self.pm_request(SetQuotasRequest(
            timeout_ms=self.request_timeout_ms, quotas=(_quota_msg(q),)), SetQuotasResponse)
        return _quota_result(resp.status, resp.results)

    async def delete_quota(self, kind: QuotaKind, name: str = "", user: str = "") -> QuotaSpec:
        """Delete the quota of a client id, a stream (``name`` = its id), the default, a user
        (``user``) or a user's client id (CLIENT with ``name`` and ``user``)."""
        resp = await self.pm_request(DeleteQuotasRequest(
            timeout_ms=self.request_timeout_ms, quotas=(Quota(int(kind), name, user=user),)),
            DeleteQuotasResponse)
        return _quota_result(resp.status, resp.results)

    async def list_quotas(self) -> list[QuotaSpec]:
        """Every quota the PM stores, by key."""
        resp = await self.pm_request(DescribeQuotasRequest(timeout_ms=self.request_timeout_ms),
                                   DescribeQuotasResponse)
        resp.status.raise_for_error()
        return [_quota_spec(q) for q in resp.quotas]

    async def quota_counters(self, address: str) -> QuotaCountersResponse:
        """The live quota counters of one data node, with their remaining TTL."""
        frame = await self.routing.request(
            address, QuotaCountersRequest(timeout_ms=self.request_timeout_ms))
        resp = QuotaCountersResponse.decode(frame.header)
        resp.status.raise_for_error()
        return resp

    async def data_node_addresses(self) -> list[str]:
        """The data nodes holding a replica of any stream's range (sorted)."""
        found: set[str] = set()
        for s in await self.list_streams():
            for r in await self.routing.ranges(s.stream_id, refresh=True):
                found.update(replica_addresses(r))
        return sorted(found)

    # ------------------------------------------------------------------------------- ranges

    async def list_ranges(self, stream_id: int | str) -> list[Range]:
        """The stream's ranges from the PM, by range index (the last one is writable)."""
        stream_id = await self.resolve_stream(stream_id)
        return list(await self.routing.ranges(stream_id, refresh=True))

    async def describe_range(self, stream_id: int | str, range_index: int) -> Range:
        """One range. A writable range is described by its replicas (the primary first): their
        next_offset is the committed offset they hold; the PM answers when none does."""
        stream_id = await self.resolve_stream(stream_id)
        ranges = await self.routing.ranges(stream_id)
        rng = next((r for r in ranges if r.range_index == range_index), None)
        if rng is not None and not rng.sealed:
            got = await self._describe_on_replicas(rng)
            if got:
                return max(got, key=lambda r: (r.sealed, r.next_offset))
        return await self._describe_on_pm(stream_id, range_index)

    async def _describe_on_pm(self, stream_id: int, range_index: int) -> Range:
        req = DescribeRangesRequest(
            timeout_ms=self.request_timeout_ms,
            items=(DescribeRangeItem(stream_id=stream_id, range_index=range_index),),
        )
        resp = await self.pm_request(req, DescribeRangesResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        if r.range is None:
            raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
        return r.range

    async def _describe_on_replicas(self, rng: Range, *, all_replicas: bool = False
                                    ) -> list[Range]:
        """DESCRIBE_RANGES on the range's replicas: the primary's answer alone when it gives
        one (unless ``all_replicas``), else every other replica's that answers."""
        addrs = replica_addresses(rng)
        if not addrs:
            return []
        if not all_replicas:
            first = await self._describe_on(addrs[0], rng)
            if isinstance(first, Range):
                return [first]
            addrs = addrs[1:]
        got = await asyncio.gather(*(self._describe_on(a, rng) for a in addrs))
        return [r for r in got if isinstance(r, Range)]

    async def _describe_on(self, addr: str, rng: Range) -> Range | SbpError:
        """One data node's DESCRIBE_RANGES of ``rng``, or why it did not answer."""
        req = DescribeRangesRequest(
            timeout_ms=self.request_timeout_ms,
            items=(DescribeRangeItem(stream_id=rng.stream_id, range_index=rng.range_index),),
        )
        try:
            frame = await self.routing.request(addr, req)
            items = DescribeRangesResponse.decode(frame.header).items
            if not items:
                return ReplicaUnavailableError(f"the data node at {addr} described no range")
            items[0].status.raise_for_error()
            if items[0].range is None:
                return ReplicaUnavailableError(f"the data node at {addr} described no range")
            return items[0].range
        except SbpError as exc:
            log.debug("event=describe_range_dn_failed addr=%s error=%s", addr, exc)
            return exc

    async def start_offset(self, stream_id: int | str) -> int:
        """The stream's first readable offset."""
        stream_id = await self.resolve_stream(stream_id)
        stream = await self.describe_stream(stream_id)
        ranges = await self.routing.ranges(stream_id, refresh=True)
        first = ranges[0].start_offset if ranges else 0
        return max(stream.start_offset, first)

    async def end_offset(self, stream_id: int | str) -> int:
        """The offset after the stream's last committed record (the next one appended gets at
        least this). Never smaller than an end this client returned before for the stream.

        A writable range's end comes from its primary. While the primary cannot be reached (it
        died and the PM has not sealed its range yet), this retries until the range is sealed
        or the primary answers, within the retry deadline; at the deadline it returns the
        highest committed offset the other replicas and the PM know, or raises the primary's
        error when no replica answered (a reader must not take an unknown end for an empty
        stream).
        """
        stream_id = await self.resolve_stream(stream_id)
        attempts = Attempts(self.retry)
        while True:
            ranges = await self.routing.ranges(stream_id, refresh=True)
            if not ranges:
                return self._monotonic_end(stream_id, 0)
            last = ranges[-1]
            if last.sealed:
                return self._monotonic_end(stream_id, last.end_offset)
            addr = primary_address(last)
            got: Range | SbpError = ReplicaUnavailableError(
                f"range {stream_id}/{last.range_index} has no primary")
            if addr:
                got = await self._describe_on(addr, last)
            if isinstance(got, Range):
                return self._monotonic_end(
                    stream_id, got.end_offset if got.sealed else got.next_offset)
            others = await self._describe_on_replicas(last, all_replicas=True)
            known = max([last.next_offset, *(r.end_offset if r.sealed else r.next_offset
                                             for r in others)])
            try:
                await attempts.backoff(got)  # the primary's error: what we are waiting for
            except SbpError:
                if not others:  # no replica answered: the end is unknown, never guess it
                    raise
                return self._monotonic_end(stream_id, known)

    def _monotonic_end(self, stream_id: int, end: int) -> int:
        best = max(self._ends.get(stream_id, 0), end)
        self._ends[stream_id] = best
        return best

    # ------------------------------------------------------------------------ data plane

    def producer(self, options: ProducerOptions | None = None, **kw: Any) -> AsyncProducer:
        """A batching, idempotent producer (see :class:`AsyncProducer`). Close it when done.

        Keyword arguments are the fields of :class:`~sbpstream.client.options.ProducerOptions`
        (``linger_ms``, ``batch_max_bytes``, ``compression``, ...); ``options`` gives them as one
        object, keyword arguments overriding its fields.
        """
        return AsyncProducer(self, build(ProducerOptions, options, kw))

    def consumer(self, streams: int | str | Sequence[int | str],
                 start: StartPosition | None = None, *,
                 options: ConsumerOptions | None = None, **kw: Any) -> AsyncConsumer:
        """An async iterator over the records of ``streams`` (one id or a sequence; see
        :class:`AsyncConsumer`); each record's ``stream_id`` says which.

        Keyword arguments are the fields of :class:`~sbpstream.client.options.ConsumerOptions`
        (``options`` gives them as one object, keyword arguments overriding its fields).
        ``start`` is ``"earliest"`` (the default), ``"latest"`` or an offset (for every stream);
        with ``end`` (one stream only) the iteration stops before that offset, otherwise it
        waits for new records forever. By default the data nodes push records (a subscription,
        at most ``window_bytes`` unacknowledged per node); ``subscribe=False`` long-polls
        instead.

        With ``group`` the consumer is a member of that consumer group (docs/client.md,
        "Consumer groups"): ``streams`` may also hold names and one pattern (``"orders.*"``);
        the group's members share them, each stream resumes at the group's committed offset
        (else at ``start``), and with ``auto_commit`` the offsets of the records handed out are
        committed every ``auto_commit_interval_ms`` and at close (at least once).
        ``on_rebalance`` is called (on the event loop) with each :class:`RebalanceEvent`.
        """
        if start is not None:
            kw["start"] = start
        o = build(ConsumerOptions, options, kw)
        if o.group is not None:
            return GroupConsumer(self, self.pm_request, streams, o)
        if isinstance(streams, str) or (not isinstance(streams, int)
                                        and any(isinstance(s, str) for s in streams)):
            raise InvalidRequestError("stream names and patterns are for a group consumer; "
                                      "resolve_streams() gives ids")
        ids = streams if isinstance(streams, int) else [s for s in streams if isinstance(s, int)]
        return AsyncConsumer(self, ids, o)

    # ------------------------------------------------------------------- consumer groups

    @property
    def group_admin(self) -> GroupAdmin:
        """The group opcodes as plain calls (e.g. for a gateway speaking another group
        protocol); the methods below cover the usual needs."""
        return GroupAdmin(self.pm_request)

    async def list_groups(self) -> list[str]:
        """Every consumer group with live members or committed offsets."""
        return await GroupAdmin(self.pm_request).list()

    async def describe_group(self, group: str) -> GroupInfo:
        """Members, assignments and, per stream, the committed offset, end offset and lag."""
        admin = GroupAdmin(self.pm_request)
        d = await admin.describe(group)
        committed = await admin.fetch(group)
        owner = {sid: mb.member_id for mb in d.members for sid in mb.assigned}
        sids = sorted(set(committed) | set(owner))
        rows: list[GroupStreamInfo] = []
        for i in range(0, len(sids), DESCRIBE_GROUP_CONCURRENCY):
            chunk = sids[i:i + DESCRIBE_GROUP_CONCURRENCY]
            ends = await asyncio.gather(*(self._end_or_none(sid) for sid in chunk))
            for sid, end in zip(chunk, ends, strict=True):
                c = committed.get(sid, -1)
                e = -1 if end is None else end
                lag = -1 if end is None else max(0, e - max(c, 0))
                rows.append(GroupStreamInfo(sid, c, e, lag, owner.get(sid, "")))
        members = tuple(GroupMemberInfo(mb.member_id, mb.client_id, mb.host, mb.stream_ids,
                                        mb.assigned) for mb in d.members)
        return GroupInfo(d.group, d.state, d.generation, members, tuple(rows))

    async def _end_or_none(self, sid: int) -> int | None:
        try:
            return await self.end_offset(sid)
        except SbpError:
            return None  # deleted since it was committed

    async def committed_offsets(
        self, group: str, streams: Sequence[int | str] = ()
    ) -> dict[int, int]:
        """The group's committed offsets (stream id -> next offset to read); every stream it
        has one for when ``streams`` is empty."""
        ids = await self.resolve_streams(streams) if streams else []
        return await GroupAdmin(self.pm_request).fetch(group, ids)

    async def commit_offsets(self, group: str, offsets: Mapping[int | str, int]) -> None:
        """Commit offsets for a group from outside it (e.g. Spark's ``commitToGroup``); refused
        with GROUP_NOT_EMPTY while the group has live members, which commit their own."""
        ids = await self.resolve_streams(list(offsets))
        errs = await GroupAdmin(self.pm_request).commit(
            group, dict(zip(ids, offsets.values(), strict=True)))
        for err in errs.values():
            if err is not None:
                raise err

    async def reset_offsets(
        self, group: str, to: StartPosition, streams: Sequence[int | str] = ()
    ) -> dict[int, int]:
        """Move a stopped group's committed offsets to ``"earliest"``, ``"latest"`` or an
        offset, for ``streams`` (default: every stream it has committed); the new offsets.
        GROUP_NOT_EMPTY while the group has live members."""
        admin = GroupAdmin(self.pm_request)
        ids = await self.resolve_streams(streams) if streams else sorted(await admin.fetch(group))
        if isinstance(to, int) and to < 0:
            raise InvalidRequestError(f"bad offset {to}: offsets are >= 0")
        new: dict[int, int] = {}
        for sid in ids:
            if to == "earliest":
                new[sid] = await self.start_offset(sid)
            elif to == "latest":
                new[sid] = await self.end_offset(sid)
            elif isinstance(to, int):
                new[sid] = to
            else:
                raise InvalidRequestError(f"bad reset target {to!r}: earliest, latest or an "
                                          "offset")
        await admin.reset(group, new)
        return new

    async def delete_group(self, group: str) -> None:
        """Forget a group without live members and its committed offsets (GROUP_NOT_EMPTY
        while it has members)."""
        await GroupAdmin(self.pm_request).delete(group)

    # ------------------------------------------------------------------- plumbing (SDK use)

    # ------------------------------------------------------------------ users and ACLs (admin)

    async def add_user(self, user: str, password: str) -> None:
        """Add a user, or set a user's password (needs ``admin``)."""
        await self.pm_request(ManageUsersRequest(1, user, password), ManageUsersResponse)

    async def delete_user(self, user: str) -> None:
        """Delete a user and its ACL rules (needs ``admin``)."""
        await self.pm_request(ManageUsersRequest(2, user), ManageUsersResponse)

    async def list_users(self) -> list[str]:
        resp = await self.pm_request(ManageUsersRequest(3), ManageUsersResponse)
        return [u.name for u in resp.users]

    async def add_acl(self, principal: str, operations: str, resource: str) -> None:
        """Grant ``operations`` (``append,fetch``, or ``all``) on ``resource`` (``*``,
        ``stream:ID`` or ``prefix:TEXT``) to ``principal`` (needs ``admin``)."""
        await self.pm_request(ManageAclsRequest(1, AclEntry(principal, operations, resource)),
                            ManageAclsResponse)

    async def delete_acl(self, principal: str, resource: str, operations: str = "all") -> None:
        await self.pm_request(ManageAclsRequest(2, AclEntry(principal, operations, resource)),
                            ManageAclsResponse)

    async def list_acls(self, principal: str = "") -> list[tuple[str, str, str]]:
        """(principal, operations, resource) of every rule, or of ``principal``'s."""
        resp = await self.pm_request(ManageAclsRequest(3, principal=principal),
                                   ManageAclsResponse)
        return [(a.principal, a.operations, a.resource) for a in resp.acls]

    @overload
    async def pm_request(self, request: Message) -> Message: ...

    @overload
    async def pm_request(self, request: Message, response_cls: type[M]) -> M: ...

    async def pm_request(self, request: Message,
                         response_cls: type[Message] | None = None) -> Message:
        """Send ``request`` to the PM leader and return its decoded answer (of
        ``response_cls``, by default the protocol's response to the request's opcode).

        Goes through the client's one PM caller (:mod:`sbpstream.net.pmcaller`): every address
        tried, PM_NOT_LEADER followed, RETRIABLE errors retried with backoff within the retry
        deadline, FATAL errors raised at once. A top-level error status is raised;
        NoPmReachableError when no PM answers in time."""
        self._start_heartbeats()
        cls = RESPONSES[Opcode(request.OPCODE)] if response_cls is None else response_cls
        return await self._pm.call(request, cls)

    async def connection(self, address: str) -> Connection:
        """This client's pooled connection to ``address`` (its TLS and credentials; no
        client-id HEARTBEAT is sent for it): for tools that speak the protocol themselves,
        such as the CLI's introspection."""
        return await self._pool.get(address)

    @property
    def pm_leader(self) -> str | None:
        """The PM address that answered this client last (the leader then), None before."""
        return self._pm.leader

    def _start_heartbeats(self) -> None:
        if self._heartbeat_task is None and not self._closed:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        """HEARTBEAT with this client's id to the PM and every data node it used, every
        HEARTBEAT_INTERVAL_S until close (best effort: failures are ignored)."""
        hb = HeartbeatRequest(client_id=self.client_id, client_role=ClientRole.CLIENT).encode()

        async def one(addr: str) -> None:
            try:
                conn = await self._pool.get(addr)
                await conn.request_one(HeartbeatRequest.OPCODE, hb,
                                       timeout_s=HEARTBEAT_TIMEOUT_S)
            except (SbpError, OSError) as exc:
                log.debug("event=heartbeat_failed addr=%s error=%s", addr, exc)

        while not self._closed:
            pm = self._pm.current
            await asyncio.gather(one(pm), *(one(a) for a in sorted(self.routing.addresses_used)))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def _quota_msg(q: QuotaSpec) -> Quota:
    return Quota(int(q.kind), q.name, *q.rates(), q.user)


def _quota_spec(q: Quota) -> QuotaSpec:
    return QuotaSpec(QuotaKind(q.kind), q.name, q.produce_bytes_per_s, q.fetch_bytes_per_s,
                     q.requests_per_s, q.user)


def _quota_result(status: Status, results: Sequence[QuotaResult]) -> QuotaSpec:
    status.raise_for_error()
    if len(results) != 1:
        raise ProtocolViolationError(f"{len(results)} results for one quota")
    results[0].status.raise_for_error()
    if results[0].quota is None:
        raise ProtocolViolationError("a quota result without its quota")
    return _quota_spec(results[0].quota)


def compile_stream_pattern(pattern: str) -> re.Pattern[str]:
    """A stream-name regular expression (matched against whole names, as Kafka's
    ``subscribePattern``); InvalidRequestError, one line, when it does not compile."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidRequestError(f"bad stream pattern {pattern!r}: {e}") from None
