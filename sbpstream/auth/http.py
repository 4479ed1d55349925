"""Who is asking on the admin HTTP port (``/metrics``, ``/v1/...``, the console), with auth on.

Every request authenticates, as on the SBP port, with one of

- ``Authorization: Bearer TOKEN``: a token from AUTHENTICATE (or from ``POST /v1/login``),
  verified with the cluster secret exactly as the SBP gate verifies it (:func:`tokens.verify`
  with the gate's key and clock), on the PM and on data nodes alike;
- ``Authorization: Basic ...`` (over TLS only: it carries the password): on the PM, checked
  against the SCRAM verifier the PM keeps (:func:`scram.check_password`, the same exchange as a
  wire login), the user's ACL rules read as a wire login reads them; on a data node, which keeps
  no verifiers, by a SCRAM login at the PM on the caller's behalf (the token the PM answers is
  then verified like a Bearer one).

A successful Basic check is remembered (:data:`MAX_REMEMBERED_LOGINS`, keyed by an HMAC of user
and password under a key of this process, never the password) until 80% of its token's life,
as a client renews: a changed password or rule takes effect within ``--token-ttl-s``, as for
tokens. Failed logins are logged (``event=admin_login_failed``) and never remembered.

The caller then holds a token (its own, or one the PM signed for it after the Basic check):
routes that make SBP calls for it present that token, and its rules are checked with the same
code as the SBP gate (:class:`~sbpstream.auth.acl.Permissions`, names resolved by
:meth:`ServerAuth.allowed`). No I/O here beyond what the caller's hooks do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sbpstream.auth import scram, tokens
from sbpstream.auth.acl import Op, Permissions
from sbpstream.auth.gate import ServerAuth
from sbpstream.net.admin import HttpRequest, HttpResponse
from sbpstream.protocol.errors import AuthenticationFailedError, SbpError, TokenExpiredError

if TYPE_CHECKING:
    from sbpstream.auth.records import AuthRecords

log = logging.getLogger("sbpstream.auth.http")

WWW_AUTHENTICATE: Final = 'Basic realm="sbpstream", Bearer'
MAX_REMEMBERED_LOGINS: Final = 1024
"""Basic logins remembered per server (a few hundred bytes each): a scraper and a few operators
need a handful; the bound keeps many distinct users from growing memory."""
REMEMBER_FRACTION: Final = 0.8
"""A remembered login is used until this much of its token's life has passed (a client's
renewal point, sbpstream.auth.client.RENEW_AT_FRACTION)."""

PmLogin = Callable[[str, str], Awaitable[str]]
"""A data node's SCRAM login at the PM for a user and password: the token the PM answers."""


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated HTTP caller: its claims, its rules, and a token acting as it."""

    claims: tokens.Claims
    perms: Permissions
    token: str

    @property
    def principal(self) -> str:
        return self.claims.principal


class HttpDenied(Exception):
    """A 401 (no or bad credentials) or 403 (not allowed) with its reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def response(self) -> HttpResponse:
        if self.status == 401:
            return HttpResponse.json({"error": "unauthorized", "reason": self.reason}, 401,
                                     (("WWW-Authenticate", WWW_AUTHENTICATE),))
        return HttpResponse.json({"error": "forbidden", "reason": self.reason}, self.status)


def unauthorized(reason: str) -> HttpDenied:
    return HttpDenied(401, reason)


def forbidden(reason: str) -> HttpDenied:
    return HttpDenied(403, reason)


class HttpAuth:
    """Authentication and authorization of one server's admin HTTP requests (auth on).

    ``records``: the PM's users and rules (Basic checked here); ``pm_login``: a data node's
    login at the PM (Basic checked there). Neither: Basic is refused with 401 naming Bearer.
    """

    def __init__(self, gate: ServerAuth, *, records: AuthRecords | None = None,
                 token_ttl_s: int = 0, pm_login: PmLogin | None = None) -> None:
        self.gate = gate
        self.records = records
        self.token_ttl_ms = token_ttl_s * 1000
        self.pm_login = pm_login
        self._memo_key = os.urandom(32)
        self._remembered: OrderedDict[bytes, Caller] = OrderedDict()

    # ------------------------------------------------------------------ authentication
    async def authenticate(self, req: HttpRequest) -> Caller:
        """The caller of ``req``, or HttpDenied(401) saying why not."""
        header = req.headers.get("authorization", "")
        scheme, _, cred = header.strip().partition(" ")
        scheme, cred = scheme.lower(), cred.strip()
        if not header:
            raise unauthorized("credentials needed: send Authorization: Bearer TOKEN (from "
                               "AUTHENTICATE or POST /v1/login) or Basic user:password over "
                               "HTTPS")
        if scheme == "bearer":
            return self._bearer(req, cred)
        if scheme == "basic":
            if not req.tls:
                self._failed(req, "", "basic", "Basic over plain HTTP")
                raise unauthorized("Basic sends the password: it is taken over HTTPS only "
                                   "(serve the admin port with --tls-cert); use a Bearer token")
            try:
                user, sep, password = base64.b64decode(cred, validate=True).decode() \
                    .partition(":")
            except (binascii.Error, ValueError):
                sep = ""
            if not sep:
                self._failed(req, "", "basic", "malformed")
                raise unauthorized("malformed Basic credentials: base64 of user:password")
            return await self.login(req, user, password, "basic")
        self._failed(req, "", scheme, "unknown scheme")
        raise unauthorized(f"Authorization scheme {scheme!r}: expected Bearer or Basic")

    def _bearer(self, req: HttpRequest, token: str) -> Caller:
        try:
            claims = tokens.verify(token, self.gate.key, self.gate.clock_ms())
        except TokenExpiredError as e:
            self._failed(req, "", "bearer", "expired")
            raise unauthorized(f"{e.message}: log in again for a new token") from None
        except AuthenticationFailedError as e:
            self._failed(req, "", "bearer", e.message)
            raise unauthorized(f"bad token: {e.message}") from None
        return Caller(claims, Permissions(claims.acls), token)

    async def login(self, req: HttpRequest, user: str, password: str, how: str, *,
                    fresh: bool = False) -> Caller:
        """A user's password checked (Basic, the console's login): its caller, with a token.
        ``fresh``: check again even when remembered (a login hands out a token of full life)."""
        memo = hmac.new(self._memo_key, f"{user}\0{password}".encode(), hashlib.sha256).digest()
        now = self.gate.clock_ms()
        got = None if fresh else self._remembered.get(memo)
        if got is not None:
            c = got.claims
            if now < c.issued_ms + int((c.expires_ms - c.issued_ms) * REMEMBER_FRACTION):
                self._remembered.move_to_end(memo)
                return got
            del self._remembered[memo]
        caller = await self._check_password(req, user, password, how)
        self._remembered[memo] = caller
        while len(self._remembered) > MAX_REMEMBERED_LOGINS:
            self._remembered.popitem(last=False)
        return caller

    async def _check_password(self, req: HttpRequest, user: str, password: str,
                              how: str) -> Caller:
        if self.records is not None:  # the PM: its own verifiers and rules
            try:
                scram.check_password(user, password, await self.records.credential(user))
            except SbpError as e:
                self._failed(req, user, how, e.message)
                raise unauthorized("unknown user or wrong password") from None
            now = self.gate.clock_ms()
            claims = tokens.Claims(user, tokens.KIND_USER, now, now + self.token_ttl_ms,
                                   tuple(await self.records.rules(user)))
            return Caller(claims, Permissions(claims.acls), tokens.sign(claims, self.gate.key))
        if self.pm_login is not None:  # a data node: the PM checks
            try:
                token = await self.pm_login(user, password)
            except AuthenticationFailedError as e:
                self._failed(req, user, how, e.message)
                raise unauthorized("unknown user or wrong password") from None
            except SbpError as e:
                self._failed(req, user, how, f"PM unreachable: {e.message}")
                raise HttpDenied(503, f"the PM that checks passwords did not answer: "
                                 f"{e.message}; retry, or use a Bearer token") from None
            return self._bearer(req, token)
        self._failed(req, user, how, "no verifiers here")
        raise unauthorized("this server keeps no passwords: use a Bearer token (AUTHENTICATE "
                           "at the PM, or POST /v1/login on the PM's admin port)")

    @staticmethod
    def _failed(req: HttpRequest, user: str, scheme: str, why: str) -> None:
        log.warning("event=admin_login_failed peer=%s user=%r scheme=%s path=%s reason=%r",
                    req.peer, user, scheme, req.path, why)

    # ------------------------------------------------------------------ authorization
    @staticmethod
    def sees_cluster(caller: Caller) -> bool:
        """Cluster-wide figures (nodes, connections, INFO, /metrics): ``describe`` on ``*`` or
        ``admin``, like DESCRIBE_QUOTAS on the wire; node tokens pass as at the gate."""
        return caller.claims.is_node or caller.perms.allows(Op.DESCRIBE) \
            or caller.perms.allows(Op.ADMIN)

    def require_cluster(self, caller: Caller, what: str) -> None:
        if not self.sees_cluster(caller):
            raise forbidden(f"{caller.principal} may not see {what}: it needs describe on * "
                            "(or admin)")

    async def allowed(self, caller: Caller, op: Op,
                      keys: Sequence[tuple[int, str | None]]) -> list[bool]:
        """Per (stream id, name or None when not at hand): may the caller do ``op`` on it? The
        SBP gate's check (names looked up where only a ``prefix:`` rule could grant it)."""
        if caller.claims.is_node:
            return [True] * len(keys)
        got = await self.gate.allowed(caller.perms, (op,), list(keys), caller.claims)
        return [v is None for v in got]

    async def require_stream(self, caller: Caller, op: Op, stream_id: int) -> None:
        (ok,) = await self.allowed(caller, op, [(stream_id, None)])
        if not ok:
            raise forbidden(f"{caller.principal} may not {op.value} stream {stream_id}")
