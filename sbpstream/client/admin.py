"""The cluster's administration calls: :class:`AsyncAdmin`, ``client.admin`` (issue 32).

Streams (create, find, list, update, trim, delete), quotas, consumer groups seen from outside
(list, describe, committed offsets, reset, delete), users and ACLs. Each is a request to the PM
(or, for quota counters, to one data node), sent through the client it is built on, typed
against :class:`~sbpstream.client.core.ClientCore`. :class:`~sbpstream.client.aclient.AsyncClient`
keeps a delegating method of the same name and signature for each (``client.create_stream(...)``
is ``client.admin.create_stream(...)``); the synchronous twin is
:class:`sbpstream.client.sync.Admin`, ``Client.admin``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Final

from sbpstream.client.core import ClientCore
from sbpstream.client.groups import GroupAdmin
from sbpstream.client.retry import Attempts, bounded_calls
from sbpstream.client.routing import replica_addresses
from sbpstream.client.types import (
    DEFAULT_RETENTION_MS,
    DrainStatus,
    GroupInfo,
    GroupMemberInfo,
    GroupStreamInfo,
    StartPosition,
    Stream,
)
from sbpstream.protocol.errors import (
    InvalidRequestError,
    InvalidStreamConfigError,
    ProtocolViolationError,
    SbpError,
)
from sbpstream.protocol.messages import (
    AclEntry,
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    DeleteQuotasRequest,
    DeleteQuotasResponse,
    DeleteStreamsRequest,
    DeleteStreamsResponse,
    DescribeQuotasRequest,
    DescribeQuotasResponse,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    DrainNodeRequest,
    DrainNodeResponse,
    ManageAclsRequest,
    ManageAclsResponse,
    ManageUsersRequest,
    ManageUsersResponse,
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
from sbpstream.protocol.names import name_problem, validate_name_prefix
from sbpstream.quota.model import QuotaKind, QuotaSpec
from sbpstream.quota.model import validate as validate_quota

LIST_PAGE_SIZE: Final = 1000
"""Streams per DESCRIBE_STREAMS page when listing: one page is one PM answer of bounded size."""

DESCRIBE_GROUP_CONCURRENCY: Final = 64
"""End offsets looked up at once by describe_group: bounds the requests in flight."""

RETENTION_UNCHANGED: Final = -1
"""UPDATE_STREAMS' retention_period_ms for "keep the current one" (docs/protocol.md)."""


@bounded_calls(lambda admin: admin.core.retry)
class AsyncAdmin:
    """The administration calls of one client (``client.admin``); see the module docstring.
    Each returns or fails within the client's ``retry_deadline_ms``."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

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
        attempts = Attempts(self.core.retry)
        while True:
            # items answered with a RETRIABLE error (NOT_ENOUGH_DATA_NODES while nodes are
            # coming back, a new PM leader still waiting for heartbeats) are asked for again
            req = CreateStreamsRequest(timeout_ms=self.core.request_timeout_ms,
                                       items=tuple(items[i] for i in todo))
            resp = await self.core.pm_request(req, CreateStreamsResponse)
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
                    self.core.stream_names.put(r.stream.name, r.stream.stream_id)
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

    async def find_streams(self, prefix: str = "", pattern: str | None = None) -> list[Stream]:
        """The live named streams whose name starts with ``prefix`` ("" = every named stream)
        and, with ``pattern``, fully matches that regular expression; in id order."""
        validate_name_prefix(prefix)
        rx = compile_stream_pattern(pattern) if pattern is not None else None
        out: list[Stream] = []
        continuation = -1
        while True:
            # name_prefix "" lists every stream: the unnamed ones are filtered out below
            req = DescribeStreamsRequest(timeout_ms=self.core.request_timeout_ms,
                                         name_prefix=prefix, limit=LIST_PAGE_SIZE,
                                         continuation=continuation)
            resp = await self.core.pm_request(req, DescribeStreamsResponse)
            resp.status.raise_for_error()
            for r in resp.items:
                st = r.stream
                if r.status.ok and st is not None and st.name and (
                        rx is None or rx.fullmatch(st.name)):
                    self.core.stream_names.put(st.name, st.stream_id)
                    out.append(st)
            # a filtered page may be empty and go on (the gate hides streams the principal
            # may not describe); a continuation that does not move ends it
            if resp.continuation < 0 or resp.continuation == continuation:
                return out
            continuation = resp.continuation

    async def list_streams(self) -> list[Stream]:
        """Every stream, in id order (pages through DESCRIBE_STREAMS)."""
        out: list[Stream] = []
        continuation = -1
        while True:
            req = DescribeStreamsRequest(timeout_ms=self.core.request_timeout_ms,
                                         limit=LIST_PAGE_SIZE, continuation=continuation)
            resp = await self.core.pm_request(req, DescribeStreamsResponse)
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
        stream_id = await self.core.resolve_stream(stream_id)
        new = Stream(
            stream_id=stream_id,
            replica_nums=0 if replica_nums is None else replica_nums,
            retention_period_ms=RETENTION_UNCHANGED if retention_ms is None else retention_ms,
        )
        req = UpdateStreamsRequest(timeout_ms=self.core.request_timeout_ms, items=(new,))
        resp = await self.core.pm_request(req, UpdateStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        return r.stream or await self.core.describe_stream(stream_id)

    async def trim_stream(self, stream_id: int | str, offset: int) -> Stream:
        """Drop the records before ``offset``; return the stream (its new start_offset)."""
        stream_id = await self.core.resolve_stream(stream_id)
        req = TrimStreamsRequest(
            timeout_ms=self.core.request_timeout_ms,
            items=(TrimItem(stream_id=stream_id, trim_offset=offset),),
        )
        resp = await self.core.pm_request(req, TrimStreamsResponse)
        r = resp.items[0]
        r.status.raise_for_error()
        self.core.routing.invalidate(stream_id)
        if r.stream is None:
            return await self.core.describe_stream(stream_id)
        return r.stream

    async def delete_streams(self, stream_ids: Sequence[int | str]) -> None:
        """Delete streams (by id or name); raises the first per-stream error (after all were
        attempted)."""
        if not stream_ids:
            return
        stream_ids = await self.core.resolve_streams(stream_ids)
        self.core.stream_names.forget_ids(stream_ids)
        req = DeleteStreamsRequest(
            timeout_ms=self.core.request_timeout_ms,
            items=tuple(Stream(stream_id=s) for s in stream_ids),
        )
        resp = await self.core.pm_request(req, DeleteStreamsResponse)
        for sid in stream_ids:
            self.core.routing.invalidate(sid)
        for r in resp.items:
            r.status.raise_for_error()

    async def delete_stream(self, stream_id: int | str) -> None:
        """Delete one stream."""
        await self.delete_streams([stream_id])

    # -------------------------------------------------------------------------------- quotas

    async def set_quota(self, quota: QuotaSpec) -> QuotaSpec:
        """Create or replace a quota at the PM (hostile values raise InvalidRequestError
        here, before anything is sent); returns it as stored. Data nodes apply it within a
        heartbeat interval."""
        q = validate_quota(quota)
        resp = await self.core.pm_request(SetQuotasRequest(
            timeout_ms=self.core.request_timeout_ms, quotas=(_quota_msg(q),)), SetQuotasResponse)
        return _quota_result(resp.status, resp.results)

    async def delete_quota(self, kind: QuotaKind, name: str = "", user: str = "") -> QuotaSpec:
        """Delete the quota of a client id, a stream (``name`` = its id), the default, a user
        (``user``) or a user's client id (CLIENT with ``name`` and ``user``)."""
        resp = await self.core.pm_request(DeleteQuotasRequest(
            timeout_ms=self.core.request_timeout_ms, quotas=(Quota(int(kind), name, user=user),)),
            DeleteQuotasResponse)
        return _quota_result(resp.status, resp.results)

    async def list_quotas(self) -> list[QuotaSpec]:
        """Every quota the PM stores, by key."""
        resp = await self.core.pm_request(
            DescribeQuotasRequest(timeout_ms=self.core.request_timeout_ms), DescribeQuotasResponse)
        resp.status.raise_for_error()
        return [_quota_spec(q) for q in resp.quotas]

    async def quota_counters(self, address: str) -> QuotaCountersResponse:
        """The live quota counters of one data node, with their remaining TTL."""
        frame = await self.core.routing.request(
            address, QuotaCountersRequest(timeout_ms=self.core.request_timeout_ms))
        resp = QuotaCountersResponse.decode(frame.header)
        resp.status.raise_for_error()
        return resp

    async def data_node_addresses(self) -> list[str]:
        """The data nodes holding a replica of any stream's range (sorted)."""
        found: set[str] = set()
        for s in await self.list_streams():
            for r in await self.core.routing.ranges(s.stream_id, refresh=True):
                found.update(replica_addresses(r))
        return sorted(found)

    # ----------------------------------------------------------------------- consumer groups

    @property
    def group_admin(self) -> GroupAdmin:
        """The group opcodes as plain calls (e.g. for a gateway speaking another group
        protocol); the methods below cover the usual needs."""
        return GroupAdmin(self.core.pm_request)

    async def list_groups(self) -> list[str]:
        """Every consumer group with live members or committed offsets."""
        return await GroupAdmin(self.core.pm_request).list()

    async def describe_group(self, group: str) -> GroupInfo:
        """Members, assignments and, per stream, the committed offset, end offset and lag."""
        admin = GroupAdmin(self.core.pm_request)
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
            return await self.core.end_offset(sid)
        except SbpError:
            return None  # deleted since it was committed

    async def committed_offsets(
        self, group: str, streams: Sequence[int | str] = ()
    ) -> dict[int, int]:
        """The group's committed offsets (stream id -> next offset to read); every stream it
        has one for when ``streams`` is empty."""
        ids = await self.core.resolve_streams(streams) if streams else []
        return await GroupAdmin(self.core.pm_request).fetch(group, ids)

    async def commit_offsets(self, group: str, offsets: Mapping[int | str, int]) -> None:
        """Commit offsets for a group from outside it (e.g. Spark's ``commitToGroup``); refused
        with GROUP_NOT_EMPTY while the group has live members, which commit their own."""
        ids = await self.core.resolve_streams(list(offsets))
        errs = await GroupAdmin(self.core.pm_request).commit(
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
        admin = GroupAdmin(self.core.pm_request)
        ids = (await self.core.resolve_streams(streams) if streams
               else sorted(await admin.fetch(group)))
        if isinstance(to, int) and to < 0:
            raise InvalidRequestError(f"bad offset {to}: offsets are >= 0")
        new: dict[int, int] = {}
        for sid in ids:
            if to == "earliest":
                new[sid] = await self.core.start_offset(sid)
            elif to == "latest":
                new[sid] = await self.core.end_offset(sid)
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
        await GroupAdmin(self.core.pm_request).delete(group)

    # ------------------------------------------------------------------------ users and ACLs

    async def add_user(self, user: str, password: str) -> None:
        """Add a user, or set a user's password (needs ``admin``)."""
        await self.core.pm_request(ManageUsersRequest(1, user, password), ManageUsersResponse)

    async def delete_user(self, user: str) -> None:
        """Delete a user and its ACL rules (needs ``admin``)."""
        await self.core.pm_request(ManageUsersRequest(2, user), ManageUsersResponse)

    async def list_users(self) -> list[str]:
        resp = await self.core.pm_request(ManageUsersRequest(3), ManageUsersResponse)
        return [u.name for u in resp.users]

    async def add_acl(self, principal: str, operations: str, resource: str) -> None:
        """Grant ``operations`` (``append,fetch``, or ``all``) on ``resource`` (``*``,
        ``stream:ID`` or ``prefix:TEXT``) to ``principal`` (needs ``admin``)."""
        await self.core.pm_request(ManageAclsRequest(1, AclEntry(principal, operations, resource)),
                                   ManageAclsResponse)

    async def delete_acl(self, principal: str, resource: str, operations: str = "all") -> None:
        await self.core.pm_request(ManageAclsRequest(2, AclEntry(principal, operations, resource)),
                                   ManageAclsResponse)

    async def list_acls(self, principal: str = "") -> list[tuple[str, str, str]]:
        """(principal, operations, resource) of every rule, or of ``principal``'s."""
        resp = await self.core.pm_request(ManageAclsRequest(3, principal=principal),
                                          ManageAclsResponse)
        return [(a.principal, a.operations, a.resource) for a in resp.acls]

    # ------------------------------------------------------------------------ data nodes

    async def drain_node(self, node: int | str) -> DrainStatus:
        """Start draining a data node (by id or address; needs ``admin``): the PM places no
        new range on it, seals and reopens elsewhere its writable ranges, copies its sealed
        ones to other nodes and then drops it from their replica sets. Watch it with
        :meth:`drain_status`; it is complete when no range lists the node."""
        return (await self._drain(1, node))[0]

    async def cancel_drain(self, node: int | str) -> DrainStatus:
        """Stop draining a data node: it takes new ranges again (moved ranges stay moved)."""
        return (await self._drain(2, node))[0]

    async def drain_status(self, node: int | str | None = None) -> list[DrainStatus]:
        """The named node's drain state, or every draining node's when ``node`` is None."""
        return await self._drain(3, node)

    async def remove_node(self, node: int | str) -> None:
        """Forget a stopped data node that no range lists (a completed drain, or a dead node
        whose replicas were re-created elsewhere); refused while it runs or holds a range."""
        await self._drain(4, node)

    async def _drain(self, action: int, node: int | str | None) -> list[DrainStatus]:
        node_id, address = 0, ""
        if isinstance(node, int) or (isinstance(node, str) and node.isdigit()):
            node_id = int(node)
        elif node:
            address = node
        req = DrainNodeRequest(timeout_ms=self.core.request_timeout_ms, action=action,
                               node_id=node_id, address=address)
        resp = await self.core.pm_request(req, DrainNodeResponse)
        return [DrainStatus(n.node_id, n.address, n.draining, n.live, n.ranges_left,
                            n.writable_left) for n in resp.nodes]


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
