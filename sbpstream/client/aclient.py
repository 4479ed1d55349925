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
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar, cast, overload

from sbpstream.auth.client import client_security
from sbpstream.client.admin import AsyncAdmin, compile_stream_pattern
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.client.core import StreamNames
from sbpstream.client.groups import GroupAdmin, GroupMember
from sbpstream.client.options import ConsumerOptions, ProducerOptions, build
from sbpstream.client.producer import AsyncProducer
from sbpstream.client.pull import StreamReader
from sbpstream.client.retry import Attempts, bounded_calls, deadline_scope, remaining_s
from sbpstream.client.routing import RangeRouter, primary_address, replica_addresses
from sbpstream.client.types import (
    Range,
    RetryPolicy,
    StartPosition,
    Stream,
    pm_addresses,
)
from sbpstream.net.client import Authenticator, Connection, ConnectionPool
from sbpstream.net.pmcaller import PmCaller
from sbpstream.protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    SbpError,
    StreamNotFoundError,
)
from sbpstream.protocol.limits import DEFAULT_CONNECT_TIMEOUT_S
from sbpstream.protocol.messages import (
    RESPONSES,
    ClientRole,
    DescribeRangeItem,
    DescribeRangesRequest,
    DescribeRangesResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    HeartbeatRequest,
    Message,
)
from sbpstream.protocol.names import parse_stream_ref
from sbpstream.protocol.opcodes import Opcode
from sbpstream.quota.model import validate_client_id

log = logging.getLogger("sbpstream.client")

M = TypeVar("M", bound=Message)
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["AsyncClient", "compile_stream_pattern"]


HEARTBEAT_INTERVAL_S: Final = 5.0
"""How often a client sends HEARTBEAT (its client_id) to the PM and to each data node it used.
The PM counts a client live for node_timeout * CLIENT_TIMEOUT_FACTOR (pm/service.py), a few
intervals; more often would only add idle traffic per client."""

PRIMARY_END_SHARE: Final = 0.5
"""end_offset asks a writable range's primary within at most this share of what is left of the
call's deadline: a silent (stopped) primary leaves time to ask the other replicas, whose highest
committed offset is the answer at the deadline."""

HEARTBEAT_TIMEOUT_S: Final = 2.0
"""One heartbeat's bound: it is best effort and never delays the client's own requests."""


def new_client_id() -> str:
    """A client id unique to this process and client: host, pid and a random part."""
    return f"sdk-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _delegate(fn: Callable[Concatenate[AsyncAdmin, P], Awaitable[R]]
              ) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """``AsyncClient``'s method forwarding to ``client.admin``'s: the same signature, defaults
    and docstring (stated once, in :mod:`sbpstream.client.admin`)."""

    @functools.wraps(fn)
    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await fn(self.admin, *args, **kwargs)

    return method


@bounded_calls(lambda client: client.retry)
class AsyncClient:
    """Asyncio client of an sbpstream cluster.

    ``pm`` names the placement manager(s): ``"host:port,host:port"``, a list, or None
    for ``$SBPSTREAM_PM`` (default ``127.0.0.1:12378``). ``request_timeout_ms`` bounds
    one attempt of one request; RETRIABLE errors are retried with exponential backoff
    until ``retry_deadline_ms`` has passed in total. Each call returns or fails within
    ``retry_deadline_ms`` (every wait inside takes its bound from what is left of it). Use as
    ``async with AsyncClient() as c:`` or call :meth:`close`. ``client_id`` names this client
    to the data nodes, which apply the quotas of that id (docs/operations.md, Quotas); "" is
    the default quota's.
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
        #: Stream name -> id, as the PM answered (shared with :attr:`admin`).
        self.stream_names = StreamNames()
        self._admin = AsyncAdmin(self)

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

    # ------------------------------------------------- administration (delegated to .admin)

    @property
    def admin(self) -> AsyncAdmin:
        """The administration calls: streams, quotas, groups seen from outside, users and ACLs
        (:class:`~sbpstream.client.admin.AsyncAdmin`). Each also has a method of the same name
        and signature on the client, delegating to it."""
        return self._admin

    create_streams = _delegate(AsyncAdmin.create_streams)
    create_stream = _delegate(AsyncAdmin.create_stream)
    find_streams = _delegate(AsyncAdmin.find_streams)
    list_streams = _delegate(AsyncAdmin.list_streams)
    update_stream = _delegate(AsyncAdmin.update_stream)
    trim_stream = _delegate(AsyncAdmin.trim_stream)
    delete_streams = _delegate(AsyncAdmin.delete_streams)
    delete_stream = _delegate(AsyncAdmin.delete_stream)
    set_quota = _delegate(AsyncAdmin.set_quota)
    delete_quota = _delegate(AsyncAdmin.delete_quota)
    list_quotas = _delegate(AsyncAdmin.list_quotas)
    quota_counters = _delegate(AsyncAdmin.quota_counters)
    data_node_addresses = _delegate(AsyncAdmin.data_node_addresses)
    list_groups = _delegate(AsyncAdmin.list_groups)
    describe_group = _delegate(AsyncAdmin.describe_group)
    committed_offsets = _delegate(AsyncAdmin.committed_offsets)
    commit_offsets = _delegate(AsyncAdmin.commit_offsets)
    reset_offsets = _delegate(AsyncAdmin.reset_offsets)
    delete_group = _delegate(AsyncAdmin.delete_group)
    add_user = _delegate(AsyncAdmin.add_user)
    delete_user = _delegate(AsyncAdmin.delete_user)
    list_users = _delegate(AsyncAdmin.list_users)
    add_acl = _delegate(AsyncAdmin.add_acl)
    delete_acl = _delegate(AsyncAdmin.delete_acl)
    list_acls = _delegate(AsyncAdmin.list_acls)

    @property
    def group_admin(self) -> GroupAdmin:
        """The group opcodes as plain calls (e.g. for a gateway speaking another group
        protocol); the methods of :attr:`admin` cover the usual needs."""
        return self.admin.group_admin

    # ------------------------------------------------------------------------ stream ids

    async def resolve_stream(self, stream: int | str, *, refresh: bool = False) -> int:
        """The id of ``stream``: an id (int, or a string of digits) as is; a name through
        DESCRIBE_STREAMS, cached (``refresh`` asks again). StreamNotFoundError when no live
        stream has the name; InvalidStreamConfigError for text that is neither."""
        ref = parse_stream_ref(stream) if isinstance(stream, str) else stream
        if isinstance(ref, int):
            return ref
        known = None if refresh else self.stream_names.get(ref)
        if known is not None:
            return known
        req = DescribeStreamsRequest(timeout_ms=self.request_timeout_ms, name=ref)
        resp = await self.pm_request(req, DescribeStreamsResponse)
        r = resp.items[0] if resp.items else None
        if r is None or r.status.code == ErrorCode.STREAM_NOT_FOUND or r.stream is None:
            self.stream_names.forget(ref)
            raise StreamNotFoundError(f"no stream is named {ref!r}")
        r.status.raise_for_error()
        self.stream_names.put(ref, r.stream.stream_id)
        return r.stream.stream_id

    async def resolve_streams(self, streams: Sequence[int | str]) -> list[int]:
        """:meth:`resolve_stream` of each, concurrently; ids in the same order."""
        if all(type(s) is int for s in streams):  # ids as they are, without a task each
            return list(cast(Sequence[int], streams))
        return list(await asyncio.gather(*(self.resolve_stream(s) for s in streams)))

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
                left = remaining_s()
                share = None if left is None else time.monotonic() + left * PRIMARY_END_SHARE
                with deadline_scope(share):
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
            return AsyncConsumer(GroupMember(self, self.pm_request, streams, o))
        if isinstance(streams, str) or (not isinstance(streams, int)
                                        and any(isinstance(s, str) for s in streams)):
            raise InvalidRequestError("stream names and patterns are for a group consumer; "
                                      "resolve_streams() gives ids")
        ids = streams if isinstance(streams, int) else [s for s in streams if isinstance(s, int)]
        return AsyncConsumer(StreamReader(self, ids, o))

    # ------------------------------------------------------------------- plumbing (SDK use)

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

    def act_as(self, authenticator: Authenticator | None) -> None:
        """Authenticate this client's new connections with ``authenticator`` instead of its own
        credentials (None: no authentication at all, not even the environment's). For a
        server acting for one caller with that caller's token (the Kafka gateway's sessions);
        call it before the first request."""
        self.credentials = None
        self._pool.authenticator = authenticator

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
            with deadline_scope(None, replace=True):  # outlives the call that starts it
                self._heartbeat_task = asyncio.get_running_loop().create_task(
                    self._heartbeats())

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


