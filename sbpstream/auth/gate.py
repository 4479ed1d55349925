"""The server side of auth: who may send what on a connection, per item where requests batch.

:class:`ServerAuth` is the :class:`~sbpstream.net.server.ConnectionGate` of a server with auth
on. Before any handler runs, a request frame on a connection that has not authenticated is
answered with AUTHENTICATION_REQUIRED (PING and AUTHENTICATE alone pass), one whose token has
expired with TOKEN_EXPIRED, and a cluster-internal opcode (heartbeats of data nodes, SEAL/SYNC on
a data node, replication, ...) from anything but a node token with AUTHORIZATION_FAILED: nothing
runs, nothing changes.

Handlers of stream operations are wrapped (:meth:`ServerAuth.wrap`) so that each item of a
batch is checked against the principal's ACL rules (carried in its token): items the rules deny
are answered AUTHORIZATION_FAILED in their place, the others run as if sent alone. ``prefix:``
rules match stream names, looked up by id where the server holds only ids
(:mod:`sbpstream.auth.names`). Consumer-group opcodes are checked on the group (``group:``
rules) and, where they name streams, per stream. Node tokens pass the ACL checks; a data node's
token is checked against the node id it names wherever a request speaks for a node.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sbpstream.auth import cursor, tokens
from sbpstream.auth.acl import Op, Permissions
from sbpstream.auth.names import StreamNames
from sbpstream.net.server import Handler, Request, Responder, ServerConnection
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    AuthenticationRequiredError,
    AuthorizationFailedError,
    ErrorCode,
    InternalError,
    InvalidRequestError,
    SbpError,
    TokenExpiredError,
    error_for,
)
from sbpstream.protocol.frame import Buffer
from sbpstream.protocol.opcodes import Opcode

CONN_CLAIMS: Final = "auth.claims"
CONN_PERMS: Final = "auth.perms"
"""Keys in a connection's ``attributes`` once it has authenticated."""
CONN_GATE: Final = "auth.gate"
"""The gate that accepted the connection's token (live reads re-check through it)."""
CONN_WATCHERS: Final = "auth.watchers"
"""Callbacks run when the connection presents a new token (live reads re-check their streams)."""

MECH_TOKEN: Final = "TOKEN"

OPEN_OPCODES: Final = frozenset({Opcode.PING, Opcode.GOAWAY, Opcode.AUTHENTICATE})

PM_NODE_ONLY: Final = frozenset({Opcode.ALLOCATE_ID, Opcode.REPORT_METRICS})
"""On the PM: what only data nodes send (a DATA_NODE heartbeat is checked by its role)."""
DATANODE_PM_ONLY: Final = frozenset({
    Opcode.SEAL_RANGES, Opcode.SYNC_RANGES, Opcode.TRIM_STREAMS, Opcode.DELETE_STREAMS,
    Opcode.LIST_RANGES,
})
"""On a data node: what only the PM sends (the cluster's token; not another data node's, not a
user's). Replication APPEND is checked by its flag (a data node's token); HEARTBEAT, which SDK
clients send to declare their client id, by its role like on the PM."""


def now_ms() -> int:
    return int(time.time() * 1000)


def claims_of(conn: ServerConnection) -> tokens.Claims | None:
    c = conn.attributes.get(CONN_CLAIMS)
    return c if isinstance(c, tokens.Claims) else None


def set_claims(conn: ServerConnection, claims: tokens.Claims,
               gate: ServerAuth | None = None) -> None:
    """The connection now acts with ``claims``; its live reads are told (they re-check)."""
    conn.attributes[CONN_CLAIMS] = claims
    conn.attributes[CONN_PERMS] = Permissions(claims.acls)
    if gate is not None:
        conn.attributes[CONN_GATE] = gate
    watchers = conn.attributes.get(CONN_WATCHERS)
    if isinstance(watchers, set):
        for cb in list(watchers):
            cb()


def perms_of(conn: ServerConnection) -> Permissions:
    p = conn.attributes.get(CONN_PERMS)
    return p if isinstance(p, Permissions) else Permissions(())


def denied_status(claims: tokens.Claims, op: Op | str, what: str, grant: str) -> m.Status:
    """AUTHORIZATION_FAILED naming the principal, the operation, the resource and the fix."""
    p = claims.principal
    o = op.value if isinstance(op, Op) else op
    return m.Status(int(ErrorCode.AUTHORIZATION_FAILED),
                    f"{p} may not {o} {what}: no rule grants {o} on it; add one with "
                    f"`sbpstream acl add {p} {o} {grant}`")


def stream_denied(claims: tokens.Claims, op: Op, stream_id: int | None,
                  name: str | None) -> m.Status:
    """A refusal about one stream (``stream_id`` None: one to be created, named ``name``)."""
    if stream_id is None:
        if name:
            return denied_status(claims, op, f"stream {name!r}", f"'prefix:{name}'")
        return denied_status(claims, op, "an unnamed stream", "'*'")
    what = f"stream {stream_id}" + (f" ({name})" if name else "")
    return denied_status(claims, op, what, f"stream:{stream_id}")


def group_denied(claims: tokens.Claims, op: Op, group: str) -> m.Status:
    return denied_status(claims, op, f"group {group!r}", f"'group:{group}'")


def cluster_denied(claims: tokens.Claims, op: Op, what: str) -> m.Status:
    return denied_status(claims, op, f"{what} (it needs {op.value} on *)", "'*'")


def require_admin(conn: ServerConnection) -> tokens.Claims:
    """Users, ACLs, quotas, a group's offsets: a user token with ``admin`` on ``*``. Node tokens
    are refused: a data node (or anything holding the cluster secret's node tokens) is not a user
    administrator; the first admin is made with a bootstrap *user* token (auth/bootstrap.py)."""
    claims = claims_of(conn)
    if claims is None:
        raise AuthenticationRequiredError()
    if claims.is_node:
        raise AuthorizationFailedError(
            f"{claims.principal} holds a node token, which may not administer users, ACLs or "
            "quotas; use an admin user, or `sbpstream user add --secret-file` for the first one")
    if not perms_of(conn).allows(Op.ADMIN):
        raise AuthorizationFailedError(cluster_denied(claims, Op.ADMIN, "administer users, "
                                                      "ACLs, quotas and groups").message)
    return claims


# --------------------------------------------------------------------------- live reads
# A data node's subscriptions and fetch sessions outlive the request that made them: they ask
# these about their connection's current token (see docs/security.md, "Revocation and live
# reads").


def watch_token(conn: ServerConnection, callback: Callable[[], None]) -> None:
    """Run ``callback`` whenever the connection presents a new token."""
    w = conn.attributes.get(CONN_WATCHERS)
    if not isinstance(w, set):
        w = conn.attributes[CONN_WATCHERS] = set()
    w.add(callback)


def unwatch_token(conn: ServerConnection, callback: Callable[[], None]) -> None:
    w = conn.attributes.get(CONN_WATCHERS)
    if isinstance(w, set):
        w.discard(callback)


def token_expiry_s(conn: ServerConnection) -> float | None:
    """Seconds until the connection's token expires (<= 0: expired); None without auth or for a
    node token (nodes renew their own)."""
    claims = claims_of(conn)
    if claims is None or claims.is_node:
        return None
    gate = conn.attributes.get(CONN_GATE)
    now = gate.clock_ms() if isinstance(gate, ServerAuth) else now_ms()
    return (claims.expires_ms - now) / 1000.0


def token_expired(conn: ServerConnection) -> TokenExpiredError | None:
    """TOKEN_EXPIRED when the connection's (user) token has expired and was not renewed."""
    left = token_expiry_s(conn)
    if left is None or left > 0:
        return None
    claims = claims_of(conn)
    assert claims is not None
    return TokenExpiredError(f"the token of {claims.principal} expired and the connection did "
                             "not present a new one; authenticate again and read again")


async def live_verdicts(conn: ServerConnection, op: Op,
                        stream_ids: Sequence[int]) -> list[m.Status | None]:
    """Per stream, under the connection's current token: None when ``op`` is granted, else the
    status ending that stream (AUTHORIZATION_FAILED, or a name lookup's retriable error)."""
    claims = claims_of(conn)
    if claims is None or claims.is_node or not stream_ids:
        return [None] * len(stream_ids)
    gate = conn.attributes.get(CONN_GATE)
    perms = perms_of(conn)
    if not isinstance(gate, ServerAuth):  # (every data node connection has one)
        return [None if perms.allows(op, sid) else stream_denied(claims, op, sid, None)
                for sid in stream_ids]
    return await gate.allowed(perms, (op,), [(sid, None) for sid in stream_ids], claims)


ADMIN_OPCODES: Final = frozenset({
    Opcode.SET_QUOTAS, Opcode.DELETE_QUOTAS, Opcode.DELETE_GROUP, Opcode.RESET_OFFSETS,
    Opcode.DRAIN_NODE,
})
"""What changes other principals' limits, a group's committed offsets or where the cluster's
data lives (draining, removing a data node): the admin operation."""

GROUP_READ: Final = (Op.FETCH,)
"""A group's members (join, heartbeat, leave, commit): ``fetch`` on the group, like Kafka's READ."""
GROUP_LOOK: Final = (Op.FETCH, Op.DESCRIBE)
"""Reading a group's committed offsets: ``fetch`` or ``describe`` on the group and the streams."""


def check_data_node(claims: tokens.Claims, node_id: int, what: str) -> None:
    """A request speaking for data node ``node_id`` must come with that node's token."""
    if not claims.is_data_node:
        raise AuthorizationFailedError(f"{what} needs a data node's token")
    if claims.node_id != node_id:
        raise AuthorizationFailedError(
            f"{what} for node {node_id} with the token of node {claims.node_id}")


# --------------------------------------------------------------------------- per-item rules


@dataclass(frozen=True, slots=True)
class ItemRule:
    """How one batched opcode is checked item by item."""

    op: Op
    field: str  # the request's vector of items
    stream_id: Callable[[Any], int | None]  # None: a stream to be created (CREATE)
    denied: Callable[[Any, m.Status], Any]  # the result answering a denied item
    payload_bytes: Callable[[Any], int] | None = None  # APPEND: each item's share of the payload
    streaming: bool = False  # several response frames: denied results go out in a frame first
    response_field: str = "items"
    name: Callable[[Any], str] | None = None  # CREATE: the name of the stream to be created
    also: tuple[Op, ...] = ()  # other operations that grant the item as well
    group_ops: tuple[Op, ...] = ()  # the request's ``group`` needs one of these first
    by_name: str = ""  # a request field naming one more stream, answered after the items
    #: naming nothing, the request reads what the server already holds for the connection (a
    #: FETCH session's poll): passed through, the data node re-checks the session itself
    #: (datanode/fetch.py); else naming nothing is a listing, filtered frame by frame
    empty_passes: bool = False
    #: the operations one item needs, when they depend on the item (None: ``ops``)
    item_ops: Callable[[Any], tuple[Op, ...]] | None = None

    @property
    def ops(self) -> tuple[Op, ...]:
        return (self.op, *self.also)


DIGEST_OPS: Final = (Op.FETCH,)
"""A digest (DESCRIBE_RANGES with digest fields, datanode/digest.py) reads the stored batches
as a FETCH would, and answers a function of their bytes: ``fetch`` on the stream, not only
``describe``."""


def _sid(attr: str = "stream_id") -> Callable[[Any], int | None]:
    return lambda it: int(getattr(it, attr))


PM_RULES: Final[Mapping[int, ItemRule]] = {
    Opcode.CREATE_STREAMS: ItemRule(
        Op.CREATE, "items", lambda it: None,
        lambda it, st: m.CreateStreamResult(None, it.replica_nums, it.retention_period_ms, st),
        name=lambda it: str(it.name)),
    Opcode.DELETE_STREAMS: ItemRule(
        Op.DELETE, "items", _sid(), lambda it, st: m.StreamResult(m.Stream(it.stream_id), st)),
    Opcode.UPDATE_STREAMS: ItemRule(
        Op.UPDATE, "items", _sid(), lambda it, st: m.StreamResult(m.Stream(it.stream_id), st)),
    Opcode.DESCRIBE_STREAMS: ItemRule(
        Op.DESCRIBE, "stream_ids", int, lambda sid, st: m.StreamResult(m.Stream(sid), st),
        by_name="name"),
    Opcode.TRIM_STREAMS: ItemRule(
        Op.TRIM, "items", _sid(), lambda it, st: m.TrimResult(m.Stream(it.stream_id), st)),
    Opcode.SEAL_RANGES: ItemRule(  # a producer seals a full range: part of appending
        Op.APPEND, "items", _sid(), lambda it, st: m.SealResult(it.stream_id, st)),
    Opcode.DESCRIBE_RANGES: ItemRule(
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.DescribeRangeResult(it.stream_id, st)),
    Opcode.LIST_RANGES: ItemRule(
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.ListRangesResult(it.stream_id, st),
        streaming=True),
    Opcode.OFFSET_COMMIT: ItemRule(
        Op.FETCH, "items", _sid(), lambda it, st: m.OffsetCommitResult(it.stream_id, st),
        group_ops=GROUP_READ),
    Opcode.OFFSET_FETCH: ItemRule(
        Op.FETCH, "stream_ids", int, lambda sid, st: m.OffsetFetchResult(sid, status=st),
        also=(Op.DESCRIBE,), group_ops=GROUP_LOOK),
}

DATANODE_RULES: Final[Mapping[int, ItemRule]] = {
    Opcode.APPEND: ItemRule(
        Op.APPEND, "items", _sid(),
        lambda it, st: m.AppendResult(it.stream_id, it.request_index, status=st),
        payload_bytes=lambda it: int(it.batch_length)),
    Opcode.FETCH: ItemRule(
        Op.FETCH, "items", _sid(),
        lambda it, st: m.FetchResult(it.stream_id, it.request_index, 0, st), streaming=True,
        empty_passes=True),
    Opcode.DESCRIBE_RANGES: ItemRule(  # the SDK asks the primary for a writable range's end
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.DescribeRangeResult(it.stream_id, st),
        item_ops=lambda it: DIGEST_OPS if it.digest_end_offset >= 0 else (Op.DESCRIBE,)),
}


MAX_CAPTURED_FRAMES: Final = 1
"""A sub-request's answer the gate merges with its refusals is one frame (the batched opcodes
answer in one, at most MAX_FRAME_LENGTH): more is refused, never buffered. Multi-frame answers
(FETCH, LIST_RANGES, listings) are forwarded frame by frame instead."""


class _Capture:
    """A Responder stand-in holding the one frame of a sub-request's answer."""

    def __init__(self, real: Responder) -> None:
        self.opcode = real.opcode
        self.request_id = real.request_id
        self._real = real
        self.frames: list[tuple[bytes, bytes]] = []
        self.finished = False
        self.frames_sent = 0

    @property
    def closed(self) -> bool:
        return self._real.closed

    async def send(self, header: Buffer = b"", payload: Buffer | Sequence[Buffer] = b"", *,
                   end: bool = True) -> None:
        if len(self.frames) >= MAX_CAPTURED_FRAMES:
            raise InternalError(f"{Opcode(self.opcode).name} answered in more than "
                                f"{MAX_CAPTURED_FRAMES} frame(s): the gate merges one-frame "
                                "answers only")
        body = bytes(payload) if isinstance(payload, bytes | bytearray | memoryview) \
            else b"".join(bytes(p) for p in payload)
        self.frames.append((bytes(header), body))
        self.frames_sent += 1
        self.finished = end

    async def send_error(self, code: int, message: str, detail: bytes = b"") -> None:
        self.finished = True
        raise error_for(code, message, detail)


class _Filter:
    """A Responder stand-in passing each frame of an answer through ``edit`` as it is sent:
    nothing is buffered beyond the frame in hand."""

    def __init__(self, real: Responder,
                 edit: Callable[[bytes], Awaitable[bytes]]) -> None:
        self.opcode = real.opcode
        self.request_id = real.request_id
        self._real = real
        self._edit = edit

    @property
    def closed(self) -> bool:
        return self._real.closed

    @property
    def frames_sent(self) -> int:
        return int(getattr(self._real, "frames_sent", 0))

    async def send(self, header: Buffer = b"", payload: Buffer | Sequence[Buffer] = b"", *,
                   end: bool = True) -> None:
        await self._real.send(await self._edit(bytes(header)), payload, end=end)

    async def send_error(self, code: int, message: str, detail: bytes = b"") -> None:
        await self._real.send_error(code, message, detail)


# --------------------------------------------------------------------------- the gate


class ServerAuth:
    """Authentication and authorization of one server (PM or data node)."""

    def __init__(self, secret: bytes, node_only: frozenset[int],
                 item_rules: Mapping[int, ItemRule],
                 clock_ms: Callable[[], int] = now_ms, *,
                 cluster_only: frozenset[int] = frozenset()) -> None:
        self.key = tokens.derive_key(secret)
        self.cursor_key = cursor.derive_cursor_key(secret)
        self.node_only = node_only
        self.cluster_only = cluster_only
        self.item_rules = item_rules
        self.clock_ms = clock_ms
        self.names: StreamNames | None = None
        """Stream names by id for ``prefix:`` rules; None: every stream reads as unnamed."""
        self.ids: Callable[[Sequence[str]], Awaitable[Mapping[str, int]]] | None = None
        """Stream ids by name (the PM): a stream a group names is checked by id too."""

    # ---- ConnectionGate
    def refuse(self, conn: ServerConnection, opcode: int) -> SbpError | None:
        if opcode in OPEN_OPCODES:
            return None
        claims = claims_of(conn)
        name = Opcode(opcode).name
        if claims is None:
            return AuthenticationRequiredError(
                f"{name} needs an authenticated connection: send AUTHENTICATE first")
        if self.clock_ms() >= claims.expires_ms:
            return TokenExpiredError(f"the token of {claims.principal} expired; "
                                     "authenticate again")
        if opcode in self.node_only and not claims.is_node:
            return AuthorizationFailedError(f"{name} is for PMs and data nodes only")
        if opcode in self.cluster_only and not claims.is_cluster:
            return AuthorizationFailedError(f"{name} is for the PM only")
        return None

    # ---- AUTHENTICATE with a token (every server); the PM adds SCRAM (pmauth)
    def accept_token(self, conn: ServerConnection, token: bytes) -> m.AuthenticateResponse:
        claims = tokens.verify(token, self.key, self.clock_ms())
        set_claims(conn, claims, self)
        return m.AuthenticateResponse(expires_at_ms=claims.expires_ms,
                                      principal=claims.principal, done=True)

    async def authenticate(self, req: Request, resp: Responder) -> None:
        a = m.AuthenticateRequest.decode(req.header)
        if a.mechanism != MECH_TOKEN:
            raise InvalidRequestError(f"mechanism {a.mechanism!r}: this server takes TOKEN")
        await resp.send(self.accept_token(req.conn, a.data).encode())

    # ---- the checks of one item, names looked up where only a prefix: rule could grant
    async def allowed(self, perms: Permissions, ops: tuple[Op, ...],
                      keys: Sequence[tuple[int | None, str | None]],
                      claims: tokens.Claims) -> list[m.Status | None]:
        """Per (stream id, name) key: None when one of ``ops`` is granted, else the status to
        answer the item with (AUTHORIZATION_FAILED naming the stream, or the name lookup's
        error)."""
        out: list[m.Status | None] = []
        need: list[int] = []
        first, more = ops[0], ops[1:]
        for sid, name in keys:
            if perms.allows(first, sid, name) or (
                    more and any(perms.allows(o, sid, name) for o in more)):
                out.append(None)
            elif sid is not None and name is None and any(perms.needs_name(o, sid) for o in ops):
                out.append(None)
                need.append(sid)
            else:
                out.append(stream_denied(claims, first, sid, name))
        if not need:
            return out
        try:
            names = {} if self.names is None else await self.names.resolve(need)
        except SbpError as e:
            failed: m.Status | None = m.Status.of(e)
            names = {}
        else:
            failed = None
        wanted = set(need)
        for i, (sid, name) in enumerate(keys):
            if sid in wanted and name is None and out[i] is None:
                known = names.get(sid, "")
                ok = failed is None and any(perms.allows(o, sid, known) for o in ops)
                out[i] = None if ok else (failed or stream_denied(claims, first, sid, known))
        return out

    # ---- per-item authorization
    def wrap(self, handlers: Mapping[int, Handler]) -> dict[int, Handler]:
        out = {op: self._wrap_one(op, h) for op, h in handlers.items()}
        out.setdefault(Opcode.AUTHENTICATE, self.authenticate)
        return out

    def _wrap_one(self, op: int, handler: Handler) -> Handler:
        rule = self.item_rules.get(op)
        if op == Opcode.HEARTBEAT:
            return self._heartbeat_gate(handler)
        if op in ADMIN_OPCODES:
            async def admin_only(req: Request, resp: Responder) -> None:
                require_admin(req.conn)
                await handler(req, resp)

            return admin_only
        special = _SPECIAL.get(op)
        if special is not None:
            async def checked(req: Request, resp: Responder) -> None:
                claims = claims_of(req.conn)
                if claims is None:
                    return await handler(req, resp)
                await special(self, claims, handler, req, resp)

            return checked
        if rule is None:
            return handler

        async def gated(req: Request, resp: Responder) -> None:
            claims = claims_of(req.conn)
            if claims is None:
                return await handler(req, resp)  # no auth on this connection's path
            if claims.is_node:
                return await self._node_items(claims, handler, req, resp)
            await self._authorize_items(rule, handler, req, resp, claims)

        return gated

    @staticmethod
    async def _node_items(claims: tokens.Claims, handler: Handler, req: Request,
                          resp: Responder) -> None:
        """A node passes the ACLs; what it says about a node must be about itself."""
        if req.opcode == Opcode.APPEND and claims.is_cluster and \
                m.AppendRequest.decode(req.header).replication:
            raise AuthorizationFailedError("replication APPEND comes from data nodes")
        if req.opcode == Opcode.LIST_RANGES and claims.is_data_node:
            for it in m.ListRangesRequest.decode(req.header).items:
                if isinstance(it, m.DataNode):
                    check_data_node(claims, it.node_id, "LIST_RANGES by data node")
        await handler(req, resp)

    def _heartbeat_gate(self, handler: Handler) -> Handler:
        async def gated(req: Request, resp: Responder) -> None:
            claims = claims_of(req.conn)
            if claims is not None:
                hb = m.HeartbeatRequest.decode(req.header)
                if hb.client_role == m.ClientRole.DATA_NODE:
                    check_data_node(claims, -1 if hb.data_node is None else
                                    hb.data_node.node_id, "a DATA_NODE heartbeat")
            await handler(req, resp)

        return gated

    async def _authorize_items(self, rule: ItemRule, handler: Handler, req: Request,
                               resp: Responder, claims: tokens.Claims) -> None:
        msg = m.decode_request(req.opcode, req.header)
        resp_cls = m.RESPONSES[Opcode(req.opcode)]
        if getattr(msg, "replication", False):
            raise AuthorizationFailedError("replication APPEND is for data nodes only")
        perms = perms_of(req.conn)
        if rule.group_ops:
            group = str(msg.group)  # type: ignore[attr-defined]  # the rule says it has one
            if not any(perms.allows_group(o, group) for o in rule.group_ops):
                whole: Any = resp_cls
                await resp.send(whole(status=group_denied(
                    claims, rule.group_ops[0], group)).encode())
                return None
        items: tuple[Any, ...] = getattr(msg, rule.field)
        if rule.field == "items" and any(isinstance(it, m.DataNode) for it in items):
            raise AuthorizationFailedError("LIST_RANGES by data node is for PMs and nodes only")
        by_name = str(getattr(msg, rule.by_name)) if rule.by_name else ""
        if not items and not by_name:
            if rule.empty_passes:  # a session's poll: the data node re-checks the session
                return await handler(req, resp)
            # a listing (DESCRIBE_STREAMS pages): answered, filtered frame by frame
            return await self._filtered_listing(rule, handler, req, resp, perms, claims)
        sid_of, name_of = rule.stream_id, rule.name
        keys: list[tuple[int | None, str | None]] = [
            (sid_of(it), None if name_of is None else name_of(it)) for it in items]
        verdict = await self._verdicts(rule, items, keys, perms, claims)
        allowed = [v is None for v in verdict]
        if all(allowed) and not by_name:
            return await handler(req, resp)
        denied = [rule.denied(it, v) for it, v in zip(items, verdict, strict=True)
                  if v is not None]
        if not any(allowed) and not by_name:
            await resp.send(resp_cls(**{rule.response_field: tuple(denied)}).encode())
            return None
        sub = self._sub_request(rule, msg, items, allowed, req)
        if rule.streaming:
            await resp.send(resp_cls(**{rule.response_field: tuple(denied)}).encode(),
                            end=False)
            return await handler(sub, resp)
        cap = _Capture(resp)
        await handler(sub, cap)  # type: ignore[arg-type]  # a Responder in all it is used for
        header, payload = cap.frames[-1]
        out = resp_cls.decode(header)
        got = iter(getattr(out, rule.response_field))
        merged = []
        it_denied = iter(denied)
        for ok in allowed:
            merged.append(next(got) if ok else next(it_denied))
        for extra in got:  # the stream named by ``by_name``: checked now that its id is known
            merged.append(await self._by_name_result(rule, perms, claims, by_name, extra))
        done: Any = out
        await resp.send(dataclasses.replace(done, **{rule.response_field: tuple(merged)})
                        .encode(), payload)
        return None

    async def _verdicts(self, rule: ItemRule, items: Sequence[Any],
                        keys: list[tuple[int | None, str | None]], perms: Permissions,
                        claims: tokens.Claims) -> list[m.Status | None]:
        if rule.item_ops is None:
            return await self.allowed(perms, rule.ops, keys, claims)
        by_ops: dict[tuple[Op, ...], list[int]] = {}
        for i, it in enumerate(items):
            by_ops.setdefault(rule.item_ops(it), []).append(i)
        out: list[m.Status | None] = [None] * len(keys)
        for ops, at in by_ops.items():
            got = await self.allowed(perms, ops, [keys[i] for i in at], claims)
            for i, v in zip(at, got, strict=True):
                out[i] = v
        return out

    async def _by_name_result(self, rule: ItemRule, perms: Permissions, claims: tokens.Claims,
                              name: str, result: Any) -> Any:
        stream = getattr(result, "stream", None)
        sid = int(stream.stream_id) if stream is not None and not result.status.code else None
        (v,) = await self.allowed(perms, rule.ops, [(sid, name)], claims)
        return result if v is None else m.StreamResult(m.Stream(name=name), v)

    @staticmethod
    def _sub_request(rule: ItemRule, msg: m.Message, items: tuple[Any, ...],
                     allowed: list[bool], req: Request) -> Request:
        keep = tuple(it for it, ok in zip(items, allowed, strict=True) if ok)
        payload: Buffer = req.payload
        if rule.payload_bytes is not None:
            view, parts, at = memoryview(req.payload), [], 0
            for it, ok in zip(items, allowed, strict=True):
                n = rule.payload_bytes(it)
                if ok:
                    parts.append(view[at:at + n])
                at += n
            payload = b"".join(parts)
        whole: Any = msg
        header = dataclasses.replace(whole, **{rule.field: keep}).encode()
        return Request(req.opcode, req.request_id, req.flags, header, payload, req.conn,
                       req.received_at)

    async def _filtered_listing(self, rule: ItemRule, handler: Handler, req: Request,
                                resp: Responder, perms: Permissions,
                                claims: tokens.Claims) -> None:
        """A listing answered with only what the principal may see, each frame filtered as the
        handler sends it (nothing is buffered). A DESCRIBE_STREAMS continuation is sealed
        (auth/cursor.py): the PM's names the last stream it read, maybe one filtered out."""
        resp_cls = m.RESPONSES[Opcode(req.opcode)]
        listing = req.opcode == Opcode.DESCRIBE_STREAMS
        if listing:
            r = m.DescribeStreamsRequest.decode(req.header)
            pos = cursor.unseal(self.cursor_key, r.continuation)
            if pos is not None:
                req = Request(req.opcode, req.request_id, req.flags,
                              dataclasses.replace(r, continuation=pos).encode(), req.payload,
                              req.conn, req.received_at)

        async def edit(header: bytes) -> bytes:
            out: Any = resp_cls.decode(header)
            results = getattr(out, rule.response_field)
            verdict = await self.allowed(perms, rule.ops, [_result_key(r) for r in results],
                                         claims)
            kept = tuple(r for r, v in zip(results, verdict, strict=True) if v is None)
            out = dataclasses.replace(out, **{rule.response_field: kept})
            if listing and 0 <= out.continuation < cursor.SEALED_BIT:
                out = dataclasses.replace(out, continuation=cursor.seal(self.cursor_key,
                                                                        out.continuation))
            return bytes(out.encode())

        await handler(req, _Filter(resp, edit))  # type: ignore[arg-type]


def _result_key(result: Any) -> tuple[int | None, str | None]:
    """A listed result's stream id, and its name when the result carries the stream."""
    stream = getattr(result, "stream", None)
    if stream is not None:
        return int(stream.stream_id), str(stream.name)
    return int(getattr(result, "stream_id", -1)), None


# --------------------------------------------------------------------------- whole requests

Special = Callable[[ServerAuth, tokens.Claims, Handler, Request, Responder], Awaitable[None]]


async def _answer(resp: Responder, status: m.Status) -> None:
    resp_cls: Any = m.RESPONSES[Opcode(resp.opcode)]
    await resp.send(resp_cls(status=status).encode())


async def _join_group(gate: ServerAuth, claims: tokens.Claims, handler: Handler, req: Request,
                      resp: Responder) -> None:
    """JOIN_GROUP: ``fetch`` on the group and on every stream it subscribes to (by id, by name,
    or every stream a name pattern could match). Refused whole: nothing joins."""
    if claims.is_node:
        return await handler(req, resp)
    r = m.JoinGroupRequest.decode(req.header)
    perms = perms_of(req.conn)
    if not perms.allows_group(Op.FETCH, r.group):
        return await _answer(resp, group_denied(claims, Op.FETCH, r.group))
    names = [n.name for n in r.stream_names]
    ids = {} if gate.ids is None or not names else await gate.ids(names)
    keys: list[tuple[int | None, str | None]] = [(sid, None) for sid in r.stream_ids]
    keys += [(ids.get(n), n) for n in names]
    verdict = await gate.allowed(perms, (Op.FETCH,), keys, claims)
    bad = next((v for v in verdict if v is not None), None)
    if bad is not None:
        return await _answer(resp, bad)
    pattern = r.stream_pattern
    if pattern and not perms.allows_pattern(Op.FETCH, pattern.removesuffix("*")):
        prefix = pattern.removesuffix("*")
        return await _answer(resp, denied_status(
            claims, Op.FETCH, f"every stream named {pattern!r}", f"'prefix:{prefix}'"))
    await handler(req, resp)


def _group_only(ops: tuple[Op, ...]) -> Special:
    async def check(gate: ServerAuth, claims: tokens.Claims, handler: Handler, req: Request,
                    resp: Responder) -> None:
        if claims.is_node:
            return await handler(req, resp)
        group = str(m.decode_request(req.opcode, req.header).group)  # type: ignore[attr-defined]
        if not any(perms_of(req.conn).allows_group(o, group) for o in ops):
            return await _answer(resp, group_denied(claims, ops[0], group))
        await handler(req, resp)

    return check


async def _describe_groups(gate: ServerAuth, claims: tokens.Claims, handler: Handler,
                           req: Request, resp: Responder) -> None:
    """DESCRIBE_GROUPS: ``describe`` on each group, per item."""
    if claims.is_node:
        return await handler(req, resp)
    r = m.DescribeGroupsRequest.decode(req.header)
    perms = perms_of(req.conn)
    ok = [perms.allows_group(Op.DESCRIBE, g.name) for g in r.groups]
    if all(ok):
        return await handler(req, resp)
    cap = _Capture(resp)
    sub = dataclasses.replace(r, groups=tuple(g for g, y in zip(r.groups, ok, strict=True) if y))
    await handler(Request(req.opcode, req.request_id, req.flags, sub.encode(), req.payload,
                          req.conn, req.received_at), cap)  # type: ignore[arg-type]
    out = m.DescribeGroupsResponse.decode(cap.frames[-1][0])
    got = iter(out.items)
    items = tuple(next(got) if y else m.GroupDescription(
        g.name, group_denied(claims, Op.DESCRIBE, g.name))
        for g, y in zip(r.groups, ok, strict=True))
    await resp.send(dataclasses.replace(out, items=items).encode())


async def _list_groups(gate: ServerAuth, claims: tokens.Claims, handler: Handler, req: Request,
                       resp: Responder) -> None:
    """LIST_GROUPS: only the groups the principal may describe."""
    if claims.is_node:
        return await handler(req, resp)
    cap = _Capture(resp)
    await handler(req, cap)  # type: ignore[arg-type]
    out = m.ListGroupsResponse.decode(cap.frames[-1][0])
    perms = perms_of(req.conn)
    await resp.send(dataclasses.replace(out, groups=tuple(
        g for g in out.groups if perms.allows_group(Op.DESCRIBE, g.name))).encode())


def _sees_cluster(claims: tokens.Claims, perms: Permissions) -> bool:
    """``describe`` on ``*`` (every stream, group and principal), or ``admin``; node tokens."""
    return claims.is_node or perms.allows(Op.DESCRIBE) or perms.allows(Op.ADMIN)


def _cluster_wide(what: str) -> Special:
    """An opcode showing the whole server (every principal's limits or counters, every
    connection, every stream's traffic): ``describe`` on ``*`` or ``admin``."""

    async def check(gate: ServerAuth, claims: tokens.Claims, handler: Handler, req: Request,
                    resp: Responder) -> None:
        if not _sees_cluster(claims, perms_of(req.conn)):
            return await _answer(resp, cluster_denied(claims, Op.DESCRIBE, what))
        await handler(req, resp)

    return check


async def _stats(gate: ServerAuth, claims: tokens.Claims, handler: Handler, req: Request,
                 resp: Responder) -> None:
    """STATS: the server's busiest streams need ``describe`` on ``*`` (or ``admin``); STATS of
    named streams answers the rows of those the principal may describe, the others left out."""
    perms = perms_of(req.conn)
    if _sees_cluster(claims, perms):
        return await handler(req, resp)
    r = m.StatsRequest.decode(req.header)
    if not r.stream_ids:
        return await _answer(resp, cluster_denied(claims, Op.DESCRIBE,
                                                  "see the busiest streams"))
    verdict = await gate.allowed(perms, (Op.DESCRIBE,), [(sid, None) for sid in r.stream_ids],
                                 claims)
    keep = tuple(sid for sid, v in zip(r.stream_ids, verdict, strict=True) if v is None)
    if not keep:
        return await _answer(resp, next(v for v in verdict if v is not None))
    # the handler builds rows of the streams named only (a PM's merge every node's rows of
    # them): naming the allowed ones alone is the filter
    sub = dataclasses.replace(r, stream_ids=keep)
    await handler(Request(req.opcode, req.request_id, req.flags, sub.encode(), req.payload,
                          req.conn, req.received_at), resp)


async def _report_metrics(gate: ServerAuth, claims: tokens.Claims, handler: Handler,
                          req: Request, resp: Responder) -> None:
    """REPORT_METRICS (node tokens only, see PM_NODE_ONLY): a data node reports for itself."""
    r = m.ReportMetricsRequest.decode(req.header)
    if claims.is_data_node:
        check_data_node(claims, -1 if r.data_node is None else r.data_node.node_id,
                        "REPORT_METRICS")
    await handler(req, resp)


_SPECIAL: Final[Mapping[int, Special]] = {
    Opcode.JOIN_GROUP: _join_group,
    Opcode.GROUP_HEARTBEAT: _group_only(GROUP_READ),
    Opcode.LEAVE_GROUP: _group_only(GROUP_READ),
    Opcode.DESCRIBE_GROUPS: _describe_groups,
    Opcode.LIST_GROUPS: _list_groups,
    Opcode.DESCRIBE_QUOTAS: _cluster_wide("describe quotas"),
    Opcode.QUOTA_COUNTERS: _cluster_wide("read the quota counters"),
    Opcode.INFO: _cluster_wide("read the server's figures (INFO)"),
    Opcode.CONNECTIONS: _cluster_wide("list the server's connections"),
    Opcode.STATS: _stats,
    Opcode.REPORT_METRICS: _report_metrics,
}
"""Opcodes checked as a whole (or per group) rather than per stream item."""
