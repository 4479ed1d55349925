"""The PM's side of auth: SCRAM logins that end in a token, and the admin opcodes.

AUTHENTICATE with ``SCRAM-SHA-256`` takes two round trips on one connection: the first carries
the client-first message and gets the server-first one; the second carries the client-final
message and gets the server-final message, a token signed with the cluster secret (the user's
ACL rules inside, valid ``token_ttl_s``) and ``done``. The connection is then authenticated as
the user; any server accepts the token (AUTHENTICATE with ``TOKEN``) until it expires.
MANAGE_USERS and MANAGE_ACLS need the ``admin`` operation on ``*``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Final

from sbpstream.auth import scram, tokens
from sbpstream.auth.acl import format_ops
from sbpstream.auth.gate import MECH_TOKEN, ServerAuth, require_admin, set_claims
from sbpstream.auth.logins import LoginThrottle, source_of
from sbpstream.auth.records import AuthRecords
from sbpstream.net.server import Handler, Request, Responder
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import AuthenticationFailedError, InvalidRequestError
from sbpstream.protocol.opcodes import Opcode

log = logging.getLogger("sbpstream.auth")
_PLAIN = re.compile(r"[A-Za-z0-9._@+:\[\]-]{1,64}")


def _field(text: str) -> str:
    """A log field value: as is when plain, else JSON-quoted (no spaces or newlines injected)."""
    return text if _PLAIN.fullmatch(text) else json.dumps(text[:256])

CONN_SCRAM: Final = "auth.scram"

ACTION_ADD: Final = 1
ACTION_DELETE: Final = 2
ACTION_LIST: Final = 3


class PmAuth:
    def __init__(self, gate: ServerAuth, records: AuthRecords, token_ttl_s: int) -> None:
        self.gate = gate
        self.records = records
        self.token_ttl_ms = token_ttl_s * 1000
        self.decoy_key = scram.decoy_key(gate.key)
        self.throttle = LoginThrottle()

    def handlers(self) -> dict[int, Handler]:
        return {Opcode.AUTHENTICATE: self.authenticate, Opcode.MANAGE_USERS: self.manage_users,
                Opcode.MANAGE_ACLS: self.manage_acls}

    async def authenticate(self, req: Request, resp: Responder) -> None:
        a = m.AuthenticateRequest.decode(req.header)
        if a.mechanism == MECH_TOKEN:
            await resp.send(self.gate.accept_token(req.conn, a.data).encode())
            return
        if a.mechanism != scram.MECHANISM:
            raise InvalidRequestError(
                f"mechanism {a.mechanism!r}: expected {scram.MECHANISM} or {MECH_TOKEN}")
        login = req.conn.attributes.pop(CONN_SCRAM, None)
        source = source_of(req.conn.peer)
        if not isinstance(login, scram.ScramLogin):  # a client-first message: a new login
            user = scram.client_first_user(a.data)
            await self._wait_turn(user, source)
            login = scram.ScramLogin(user, await self.records.credential(user), self.decoy_key)
            try:
                server_first = login.first(a.data)
            except AuthenticationFailedError:
                self._failed(user, req.conn.peer)
                raise
            req.conn.attributes[CONN_SCRAM] = login
            await resp.send(m.AuthenticateResponse(data=server_first).encode())
            return
        try:
            server_final = login.final(a.data)
        except AuthenticationFailedError:
            self._failed(login.user, req.conn.peer)
            raise
        now = self.gate.clock_ms()
        claims = tokens.Claims(login.user, tokens.KIND_USER, now, now + self.token_ttl_ms,
                               tuple(await self.records.rules(login.user)))
        set_claims(req.conn, claims)
        await resp.send(m.AuthenticateResponse(
            data=server_final, token=tokens.sign(claims, self.gate.key),
            expires_at_ms=claims.expires_ms, principal=claims.principal, done=True).encode())

    async def _wait_turn(self, user: str, source: str) -> None:
        """Delay a login from a source with recent failures (sbpstream.auth.logins); only this
        handler sleeps, the event loop and other sources go on."""
        wait = self.throttle.admit(source, asyncio.get_running_loop().time())
        if wait is None:
            log.warning("event=login_refused user=%s peer=%s reason=too_many_failures",
                        _field(user), _field(source))
            raise AuthenticationFailedError(
                f"too many failed logins from {source}; wait a few seconds and check the "
                "user name and password")
        if wait > 0:
            await asyncio.sleep(wait)

    def _failed(self, user: str, peer: str) -> None:
        failures, delay = self.throttle.failed(source_of(peer),
                                               asyncio.get_running_loop().time())
        log.warning("event=login_failed user=%s peer=%s failures=%d next_delay_ms=%d",
                    _field(user), _field(peer), failures, round(delay * 1000))

    async def manage_users(self, req: Request, resp: Responder) -> None:
        r = m.ManageUsersRequest.decode(req.header)
        require_admin(req.conn)
        if r.action == ACTION_ADD:
            await self.records.add_user(r.user, r.password)
        elif r.action == ACTION_DELETE:
            await self.records.delete_user(r.user)
        elif r.action != ACTION_LIST:
            raise InvalidRequestError(f"MANAGE_USERS action {r.action}: expected 1, 2 or 3")
        users = tuple(m.UserEntry(u) for u in await self.records.list_users())
        await resp.send(m.ManageUsersResponse(users=users).encode())

    async def manage_acls(self, req: Request, resp: Responder) -> None:
        r = m.ManageAclsRequest.decode(req.header)
        require_admin(req.conn)
        if r.action in (ACTION_ADD, ACTION_DELETE):
            if r.acl is None:
                raise InvalidRequestError("MANAGE_ACLS add/delete needs acl")
            if r.action == ACTION_ADD:
                await self.records.add_rule(r.acl.principal, r.acl.operations, r.acl.resource)
            else:
                await self.records.delete_rule(r.acl.principal, r.acl.operations,
                                               r.acl.resource)
        elif r.action != ACTION_LIST:
            raise InvalidRequestError(f"MANAGE_ACLS action {r.action}: expected 1, 2 or 3")
        rules = await self.records.rules(r.principal)
        await resp.send(m.ManageAclsResponse(acls=tuple(
            m.AclEntry(x.principal, format_ops(x.ops), x.resource) for x in rules)).encode())
