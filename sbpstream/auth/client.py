"""The client side of auth: what the SDK, the CLI, Spark, the bench and the servers present.

:class:`Credentials` is the :class:`~sbpstream.net.client.Authenticator` of a connection pool.
It holds one token for the whole client, from one of

- a user name and password: a SCRAM-SHA-256 login at a PM (on the connection itself when it goes
  to a PM, else on a short connection to one), which answers a token;
- a token file (``tokenFile`` in Spark): re-read whenever the token is due;
- the cluster secret (PMs and data nodes only): a node token minted locally.

Every new connection presents the token (AUTHENTICATE ``TOKEN``), or logs in with it when the
login happens on that connection. A connection is due again once 80% of the token's life has
passed: the pool renews it before its next request, so a running client never meets
TOKEN_EXPIRED unless it sleeps through the whole remaining fifth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sbpstream.auth import tokens
from sbpstream.auth.config import is_loopback_host
from sbpstream.net.client import Connection
from sbpstream.net.tls import TlsConfig, client_context
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    NoPmReachableError,
    SbpError,
)
from sbpstream.protocol.limits import DEFAULT_CONNECT_TIMEOUT_S
from sbpstream.protocol.opcodes import Opcode

RENEW_AT_FRACTION: Final = 0.8
"""A token is renewed once this much of its life has passed."""
AUTH_TIMEOUT_S: Final = 10.0
"""One AUTHENTICATE round trip: PBKDF2 on the PM takes milliseconds; more is a stuck peer."""
NODE_TOKEN_TTL_MS: Final = 600_000

log = logging.getLogger("sbpstream.auth")


class InsecureCredentialsWarning(UserWarning):
    """Credentials (a password exchange or a token) go to a non-loopback address without TLS."""


_warned: set[str] = set()
"""Addresses already warned about, so each is said once per process."""


def _is_tls(conn: Connection) -> bool:
    t = conn.transport
    return t is not None and t.get_extra_info("ssl_object") is not None


def warn_if_clear(address: str, tls: bool, what: str) -> None:
    """Warn once per address before sending ``what`` in clear beyond loopback."""
    host = address.rpartition(":")[0].strip("[]") or address
    if tls or is_loopback_host(host) or address in _warned:
        return
    _warned.add(address)
    message = (f"sending {what} to {address} without TLS: anyone on the network path can read "
               "it; give a CA (tls_ca=, $SBPSTREAM_TLS_CA or --tls-ca) to use TLS")
    log.warning("event=credentials_in_clear address=%s", address)
    warnings.warn(message, InsecureCredentialsWarning, stacklevel=3)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _call(conn: Connection, req: m.AuthenticateRequest) -> m.AuthenticateResponse:
    frame = await conn.request_one(Opcode.AUTHENTICATE, req.encode(), timeout_s=AUTH_TIMEOUT_S)
    out = m.AuthenticateResponse.decode(frame.header)
    out.status.raise_for_error()
    return out


async def scram_login(conn: Connection, user: str, password: str) -> m.AuthenticateResponse:
    """Log in on ``conn`` (a PM); the answer carries the token."""
    from scramp import ScramClient, ScramException  # only a login needs it (0.05 s to import)

    from sbpstream.auth import scram

    try:
        client = ScramClient([scram.MECHANISM], user, password)
    except ScramException as e:  # SASLprep refuses the password (control characters, ...)
        raise AuthenticationFailedError(
            f"the password of {user!r} cannot be used for SCRAM ({e}): check "
            "SBPSTREAM_PASSWORD / --password (a stray newline or control character?)") from None
    first = await _call(conn, m.AuthenticateRequest(scram.MECHANISM,
                                                    client.get_client_first().encode()))
    try:
        client.set_server_first(first.data.decode(errors="replace"))
        final_msg: str = client.get_client_final()
    except ScramException as e:
        raise AuthenticationFailedError(f"SCRAM: {e}") from None
    final = await _call(conn, m.AuthenticateRequest(scram.MECHANISM, final_msg.encode()))
    try:
        client.set_server_final(final.data.decode(errors="replace"))
    except ScramException as e:  # the server does not know the password: not the real PM
        raise AuthenticationFailedError(f"SCRAM: the server did not prove itself: {e}") from None
    if not final.done or not final.token:
        raise AuthenticationFailedError("SCRAM login ended without a token")
    return final


@dataclass(slots=True)
class _Token:
    text: str
    issued_ms: int
    expires_ms: int

    @property
    def renew_at_ms(self) -> int:
        return self.issued_ms + int((self.expires_ms - self.issued_ms) * RENEW_AT_FRACTION)


class Credentials:
    """One client's identity; see the module docstring. Give exactly one of ``user`` (with
    ``password``), ``token_file``, ``token`` or ``node_secret``."""

    def __init__(self, *, user: str = "", password: str = "", token_file: str = "",
                 token: str = "", node_secret: bytes = b"", node_principal: str = "node",
                 node_id: int | None = None, pm: Sequence[str] = (),
                 tls: TlsConfig | None = None) -> None:
        given = [bool(user), bool(token_file), bool(token), bool(node_secret)]
        if sum(given) != 1:
            raise ValueError("credentials: give one of user (+password), token_file, token, "
                             "or the cluster secret")
        if user and not password:
            raise ValueError(f"credentials: user {user!r} needs a password")
        self.user = user
        self._password = password
        self.token_file = token_file
        self._node_key = tokens.derive_key(node_secret) if node_secret else b""
        self.node_principal = node_principal
        self.node_id = node_id
        self._floor_ms = 0  # connections authenticated with a token renewed before: due now
        self.pm = tuple(pm)
        self.ssl_context: ssl.SSLContext | None = client_context(tls) if tls else None
        self._token: _Token | None = None if not token else self._parse(token)
        self._lock = asyncio.Lock()

    @property
    def principal(self) -> str:
        return self.user or self.node_principal

    @staticmethod
    def _parse(text: str) -> _Token:
        issued, expires = tokens.peek(text)
        return _Token(text, issued, expires)

    def set_node_id(self, node_id: int) -> None:
        """A data node learned its id: its token names it from now on, and every connection
        authenticated with the old token presents the new one before its next request."""
        if node_id == self.node_id:
            return
        self.node_id = node_id
        self.node_principal = f"datanode-{node_id}"
        self._token = None
        self._floor_ms = 1 << 62  # everything authenticated so far is due ...

    # ---- Authenticator
    def due(self, conn: Connection) -> bool:
        at = conn.auth_renew_at_ms
        return at != 0 and (_now_ms() >= at or at < self._floor_ms)

    async def authenticate(self, conn: Connection) -> None:
        async with self._lock:
            tok = self._token
            fresh = tok is not None and _now_ms() < tok.renew_at_ms
            if not fresh and self.user and conn.address in self.pm:
                # a login on this very connection authenticates it as well
                warn_if_clear(conn.address, _is_tls(conn), "a password login")
                out = await scram_login(conn, self.user, self._password)
                self._token = self._parse(out.token)
                conn.auth_renew_at_ms = self._token.renew_at_ms
                return
            if not fresh:
                self._token = await self._fresh_token()
            tok = self._token
            assert tok is not None
        from sbpstream.auth.gate import MECH_TOKEN  # the gate imports the server side

        warn_if_clear(conn.address, _is_tls(conn), "an access token")
        await _call(conn, m.AuthenticateRequest(MECH_TOKEN, tok.text.encode()))
        conn.auth_renew_at_ms = tok.renew_at_ms

    async def token(self) -> str:
        """A valid token (logging in or renewing when due): e.g. to write a token file."""
        async with self._lock:
            if self._token is None or _now_ms() >= self._token.renew_at_ms:
                self._token = await self._fresh_token()
            return self._token.text

    async def _fresh_token(self) -> _Token:
        if self._node_key:
            now = _now_ms()
            tok = self._parse(tokens.node_token(self._node_key, self.node_principal, now,
                                                NODE_TOKEN_TTL_MS, self.node_id))
            if self._floor_ms > tok.renew_at_ms:  # ... until the first token naming the id
                self._floor_ms = tok.renew_at_ms
            return tok
        if self.token_file:
            try:
                text = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise AuthenticationFailedError(
                    f"token file {self.token_file} (from --token-file, $SBPSTREAM_TOKEN_FILE or "
                    f"token_file=): {e.strerror}; give a file holding a token "
                    "(Credentials.token() writes one)") from None
            return self._parse(text)
        if self.user:
            return self._parse(await self._login_at_pm())
        if self._token is not None:
            return self._token  # a fixed token: used until the servers refuse it
        raise AuthenticationFailedError("no credentials")

    async def _login_at_pm(self) -> str:
        errors: list[str] = []
        for addr in self.pm:
            try:
                conn = await Connection.open(addr, connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S,
                                             ssl_context=self.ssl_context)
            except AuthenticationFailedError:
                raise
            except SbpError as e:
                errors.append(f"{addr}: {e}")
                continue
            try:
                warn_if_clear(addr, _is_tls(conn), "a password login")
                return (await scram_login(conn, self.user, self._password)).token
            except AuthenticationFailedError:
                raise
            except SbpError as e:  # a follower PM, a closed connection: try the next
                errors.append(f"{addr}: {e}")
            finally:
                await conn.aclose()
        raise NoPmReachableError("no PM accepted the login: " + "; ".join(errors))


def client_security(pm: Sequence[str], *, user: str = "", password: str = "",
                    token_file: str = "", tls_ca: str = "", tls_cert: str = "",
                    tls_key: str = "") -> tuple[Credentials | None, ssl.SSLContext | None]:
    """An SDK's credentials and TLS context from its arguments, else from the environment
    (``SBPSTREAM_USER``, ``SBPSTREAM_PASSWORD``, ``SBPSTREAM_TOKEN_FILE``, ``SBPSTREAM_TLS_CA``,
    ``SBPSTREAM_TLS_CERT``, ``SBPSTREAM_TLS_KEY``). Neither: (None, None), plain and open."""
    env = os.environ.get
    if not (user or token_file):
        user = env("SBPSTREAM_USER", "")
        password = password or env("SBPSTREAM_PASSWORD", "")
        token_file = "" if user else env("SBPSTREAM_TOKEN_FILE", "")
    tls = TlsConfig(tls_cert or env("SBPSTREAM_TLS_CERT", ""),
                    tls_key or env("SBPSTREAM_TLS_KEY", ""),
                    tls_ca or env("SBPSTREAM_TLS_CA", ""))
    ctx = client_context(tls)
    creds = None
    if user or token_file:
        creds = Credentials(user=user, password=password, token_file=token_file, pm=pm, tls=tls)
    return creds, ctx


async def present_token(conn: Connection, token: str) -> None:
    """Authenticate ``conn`` with a token the PM issued (AUTHENTICATE ``TOKEN``): what a
    holder of someone's token (the Kafka gateway, for the user of a Kafka connection) does."""
    from sbpstream.auth.gate import MECH_TOKEN

    await _call(conn, m.AuthenticateRequest(MECH_TOKEN, token.encode()))


def peek_claims(token: str) -> tokens.Claims:
    """A token's claims, unverified (a client holds no key; the servers verify): what its
    holder may use to decide what to offer, never to grant anything."""
    import base64
    import json

    from sbpstream.auth.acl import AclRule

    try:
        body = token.split(".")[1]
        d = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return tokens.Claims(str(d["p"]), str(d["k"]), int(d["iat"]), int(d["exp"]),
                             tuple(AclRule.from_json(r) for r in d.get("acl", ())))
    except (IndexError, ValueError, KeyError, TypeError) as e:
        raise AuthenticationFailedError(f"malformed token: {e}") from None
