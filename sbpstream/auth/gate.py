"""The server side of auth: who may send what on a connection, per item where requests batch.

:class:`ServerAuth` is the :class:`~sbpstream.net.server.ConnectionGate` of a server with auth
on. Before any handler runs, a request frame on a connection that has not authenticated is
answered with AUTHENTICATION_REQUIRED (PING and AUTHENTICATE alone pass), one whose token has
expired with TOKEN_EXPIRED, and a cluster-internal opcode (heartbeats of data nodes, SEAL/SYNC on
a data node, replication, ...) from anything but a node token with AUTHORIZATION_FAILED: nothing
runs, nothing changes.

Handlers of stream operations are wrapped (:meth:`ServerAuth.wrap`) so that each item of a
batch is checked against the principal's ACL rules (carried in its token): items the rules deny
are answered AUTHORIZATION_FAILED in their place, the others run as if sent alone. Node tokens
pass every check.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sbpstream.auth import tokens
from sbpstream.auth.acl import Op, Permissions
from sbpstream.net.server import Handler, Request, Responder, ServerConnection
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    AuthenticationRequiredError,
    AuthorizationFailedError,
    ErrorCode,
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

MECH_TOKEN: Final = "TOKEN"

OPEN_OPCODES: Final = frozenset({Opcode.PING, Opcode.GOAWAY, Opcode.AUTHENTICATE})

PM_NODE_ONLY: Final = frozenset({Opcode.ALLOCATE_ID, Opcode.REPORT_METRICS})
"""On the PM: what only data nodes send (a DATA_NODE heartbeat is checked by its role)."""
DATANODE_NODE_ONLY: Final = frozenset({
    Opcode.SEAL_RANGES, Opcode.SYNC_RANGES, Opcode.TRIM_STREAMS, Opcode.DELETE_STREAMS,
    Opcode.LIST_RANGES,
})
"""On a data node: what only the PM and other data nodes send (replication APPEND is checked
by its flag; HEARTBEAT, which SDK clients send to declare their client id, by its role like on
the PM: a DATA_NODE heartbeat needs a node token)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def claims_of(conn: ServerConnection) -> tokens.Claims | None:
    c = conn.attributes.get(CONN_CLAIMS)
    return c if isinstance(c, tokens.Claims) else None


def set_claims(conn: ServerConnection, claims: tokens.Claims) -> None:
    conn.attributes[CONN_CLAIMS] = claims
    conn.attributes[CONN_PERMS] = Permissions(claims.acls)


def perms_of(conn: ServerConnection) -> Permissions:
    p = conn.attributes.get(CONN_PERMS)
    return p if isinstance(p, Permissions) else Permissions(())


def require_admin(conn: ServerConnection) -> tokens.Claims:
    claims = claims_of(conn)
    if claims is None:
        raise AuthenticationRequiredError()
    if not claims.is_node and not perms_of(conn).allows(Op.ADMIN):
        raise AuthorizationFailedError(f"{claims.principal} lacks the admin operation on *")
    return claims


ADMIN_OPCODES: Final = frozenset({
    Opcode.SET_QUOTAS, Opcode.DELETE_QUOTAS, Opcode.DELETE_GROUP, Opcode.RESET_OFFSETS,
})
"""What changes other principals' limits or a group's committed offsets: the admin operation."""


# --------------------------------------------------------------------------- per-item rules


@dataclass(frozen=True, slots=True)
class ItemRule:
    """How one batched opcode is checked item by item."""

    op: Op
    field: str  # the request's vector of items
    stream_id: Callable[[Any], int | None]  # None: the check is on "every stream" (CREATE)
    denied: Callable[[Any, m.Status], Any]  # the result answering a denied item
    payload_bytes: Callable[[Any], int] | None = None  # APPEND: each item's share of the payload
    streaming: bool = False  # several response frames: denied results go out in a frame first
    response_field: str = "items"


def _sid(attr: str = "stream_id") -> Callable[[Any], int | None]:
    return lambda it: int(getattr(it, attr))


PM_RULES: Final[Mapping[int, ItemRule]] = {
    Opcode.CREATE_STREAMS: ItemRule(
        Op.CREATE, "items", lambda it: None,
        lambda it, st: m.CreateStreamResult(None, it.replica_nums, it.retention_period_ms, st)),
    Opcode.DELETE_STREAMS: ItemRule(
        Op.DELETE, "items", _sid(), lambda it, st: m.StreamResult(m.Stream(it.stream_id), st)),
    Opcode.UPDATE_STREAMS: ItemRule(
        Op.UPDATE, "items", _sid(), lambda it, st: m.StreamResult(m.Stream(it.stream_id), st)),
    Opcode.DESCRIBE_STREAMS: ItemRule(
        Op.DESCRIBE, "stream_ids", int, lambda sid, st: m.StreamResult(m.Stream(sid), st)),
    Opcode.TRIM_STREAMS: ItemRule(
        Op.TRIM, "items", _sid(), lambda it, st: m.TrimResult(m.Stream(it.stream_id), st)),
    Opcode.SEAL_RANGES: ItemRule(  # a producer seals a full range: part of appending
        Op.APPEND, "items", _sid(), lambda it, st: m.SealResult(it.stream_id, st)),
    Opcode.DESCRIBE_RANGES: ItemRule(
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.DescribeRangeResult(it.stream_id, st)),
    Opcode.LIST_RANGES: ItemRule(
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.ListRangesResult(it.stream_id, st),
        streaming=True),
}

DATANODE_RULES: Final[Mapping[int, ItemRule]] = {
    Opcode.APPEND: ItemRule(
        Op.APPEND, "items", _sid(),
        lambda it, st: m.AppendResult(it.stream_id, it.request_index, status=st),
        payload_bytes=lambda it: int(it.batch_length)),
    Opcode.FETCH: ItemRule(
        Op.FETCH, "items", _sid(),
        lambda it, st: m.FetchResult(it.stream_id, it.request_index, 0, st), streaming=True),
    Opcode.DESCRIBE_RANGES: ItemRule(  # the SDK asks the primary for a writable range's end
        Op.DESCRIBE, "items", _sid(), lambda it, st: m.DescribeRangeResult(it.stream_id, st)),
}


class _Capture:
    """A Responder stand-in collecting the frames of a sub-request's answer."""

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
        body = bytes(payload) if isinstance(payload, bytes | bytearray | memoryview) \
            else b"".join(bytes(p) for p in payload)
        self.frames.append((bytes(header), body))
        self.frames_sent += 1
        self.finished = end

    async def send_error(self, code: int, message: str, detail: bytes = b"") -> None:
        self.finished = True
        raise error_for(code, message, detail)


# --------------------------------------------------------------------------- the gate


class ServerAuth:
    """Authentication and authorization of one server (PM or data node)."""

    def __init__(self, secret: bytes, node_only: frozenset[int],
                 item_rules: Mapping[int, ItemRule],
                 clock_ms: Callable[[], int] = now_ms) -> None:
        self.key = tokens.derive_key(secret)
        self.node_only = node_only
        self.item_rules = item_rules
        self.clock_ms = clock_ms

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
        return None

    # ---- AUTHENTICATE with a token (every server); the PM adds SCRAM (pmauth)
    def accept_token(self, conn: ServerConnection, token: bytes) -> m.AuthenticateResponse:
        claims = tokens.verify(token, self.key, self.clock_ms())
        set_claims(conn, claims)
        return m.AuthenticateResponse(expires_at_ms=claims.expires_ms,
                                      principal=claims.principal, done=True)

    async def authenticate(self, req: Request, resp: Responder) -> None:
        a = m.AuthenticateRequest.decode(req.header)
        if a.mechanism != MECH_TOKEN:
            raise InvalidRequestError(f"mechanism {a.mechanism!r}: this server takes TOKEN")
        await resp.send(self.accept_token(req.conn, a.data).encode())

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
        if rule is None:
            return handler

        async def gated(req: Request, resp: Responder) -> None:
            claims = claims_of(req.conn)
            if claims is None or claims.is_node:
                return await handler(req, resp)  # no auth on this connection's path, or a node
            await self._authorize_items(rule, handler, req, resp, claims)

        return gated

    def _heartbeat_gate(self, handler: Handler) -> Handler:
        async def gated(req: Request, resp: Responder) -> None:
            claims = claims_of(req.conn)
            if claims is not None and not claims.is_node:
                hb = m.HeartbeatRequest.decode(req.header)
                if hb.client_role == m.ClientRole.DATA_NODE:
                    raise AuthorizationFailedError("a DATA_NODE heartbeat needs a node token")
            await handler(req, resp)

        return gated

    async def _authorize_items(self, rule: ItemRule, handler: Handler, req: Request,
                               resp: Responder, claims: tokens.Claims) -> None:
        msg = m.decode_request(req.opcode, req.header)
        if getattr(msg, "replication", False):
            raise AuthorizationFailedError("replication APPEND is for data nodes only")
        items: tuple[Any, ...] = getattr(msg, rule.field)
        if rule.field == "items" and any(isinstance(it, m.DataNode) for it in items):
            raise AuthorizationFailedError("LIST_RANGES by data node is for PMs and nodes only")
        perms = perms_of(req.conn)
        if not items:  # a listing (DESCRIBE_STREAMS pages): answered, then filtered
            return await self._filtered_listing(rule, handler, req, resp, perms)
        allowed = [perms.allows(rule.op, rule.stream_id(it)) for it in items]
        if all(allowed):
            return await handler(req, resp)
        status = m.Status(int(ErrorCode.AUTHORIZATION_FAILED),
                          f"{claims.principal} may not {rule.op.value} this stream")
        denied = [rule.denied(it, status) for it, ok in zip(items, allowed, strict=True)
                  if not ok]
        resp_cls = m.RESPONSES[Opcode(req.opcode)]
        if not any(allowed):
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
        merged.extend(got)
        done: Any = out
        await resp.send(dataclasses.replace(done, **{rule.response_field: tuple(merged)})
                        .encode(), payload)
        return None

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

    @staticmethod
    async def _filtered_listing(rule: ItemRule, handler: Handler, req: Request,
                                resp: Responder, perms: Permissions) -> None:
        cap = _Capture(resp)
        await handler(req, cap)  # type: ignore[arg-type]
        resp_cls = m.RESPONSES[Opcode(req.opcode)]
        for i, (header, payload) in enumerate(cap.frames):
            out: Any = resp_cls.decode(header)
            kept = tuple(r for r in getattr(out, rule.response_field)
                         if perms.allows(rule.op, _result_sid(r)))
            await resp.send(dataclasses.replace(out, **{rule.response_field: kept}).encode(),
                            payload, end=i == len(cap.frames) - 1)


def _result_sid(result: Any) -> int | None:
    stream = getattr(result, "stream", None)
    if stream is not None:
        return int(stream.stream_id)
    sid = getattr(result, "stream_id", None)
    return None if sid is None else int(sid)

