"""The principal of a Kafka connection: its SASL exchange with the PM and its own SBP client.

The gateway holds no user's password. For ``SCRAM-SHA-256`` it relays the client's
client-first and client-final messages to a PM's AUTHENTICATE (on one SBP connection, as a login
takes) and hands back the PM's server-first and server-final messages; the PM, which holds the
verifiers, decides, and ends a good login with a token for that user. For ``PLAIN`` (over TLS
only) the gateway logs in to the PM with SCRAM using the password it was given, and forgets the
password after that exchange. Either way the connection then gets a :class:`Session`: an
:class:`~sbpstream.client.aclient.AsyncClient` of its own whose every connection presents that
token, so every SBP call made for the Kafka connection carries exactly its user's rights.

A token cannot be renewed without the password, so a session lives as long as its token (KIP-368:
SaslAuthenticate v1+ reports ``session_lifetime_ms``; the client re-authenticates on the same
connection before it ends, or the gateway closes the connection once it has).
"""

from __future__ import annotations

import contextlib
import ssl
import time
from typing import Final

from sbpstream.auth.acl import Op, Permissions
from sbpstream.auth.client import peek_claims, present_token, scram_login
from sbpstream.client.aclient import AsyncClient
from sbpstream.client.producer import AsyncProducer
from sbpstream.kafka import errors as E
from sbpstream.kafka.sasl import MECH_PLAIN, MECH_SCRAM, SaslError, parse_plain
from sbpstream.net.client import Connection
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import AuthenticationFailedError, SbpError
from sbpstream.protocol.opcodes import Opcode

PM_LOGIN_TIMEOUT_S: Final = 10.0
"""One relayed AUTHENTICATE round trip, and the connect to the PM before it."""
RETRY_DEADLINE_MS: Final = 60_000
"""Retry deadline of a session's SBP client (as the gateway's own)."""

NEW: Final = "new"
HANDSHAKEN: Final = "handshaken"
SCRAM_FIRST: Final = "scram-first"
DONE: Final = "done"
FAILED: Final = "failed"


def now_ms() -> int:
    return int(time.time() * 1000)


class SessionAuth:
    """The :class:`~sbpstream.net.client.Authenticator` of a session's pool: every connection
    presents the session's token, and again after a re-authentication replaced it."""

    def __init__(self, token: str, expires_ms: int) -> None:
        self.token = token
        self.expires_ms = expires_ms

    def due(self, conn: Connection) -> bool:
        return conn.auth_renew_at_ms != self.expires_ms

    async def authenticate(self, conn: Connection) -> None:
        await present_token(conn, self.token)
        conn.auth_renew_at_ms = self.expires_ms


def plain_client(pm: str | None, tls_ca: str) -> AsyncClient:
    """An SBP client with no credentials at all (not even the environment's): the gateway's own
    on a cluster without auth, where it acts for nobody in particular."""
    c = AsyncClient(pm, retry_deadline_ms=RETRY_DEADLINE_MS, tls_ca=tls_ca)
    c.act_as(None)  # no identity but the Kafka connection's
    return c


class Session:
    """An authenticated Kafka connection's principal: its token, rules and SBP client."""

    def __init__(self, pm: str | None, tls_ca: str, principal: str, token: str,
                 expires_ms: int) -> None:
        self.principal = principal
        self.auth = SessionAuth(token, expires_ms)
        self.perms = Permissions(peek_claims(token).acls)
        self.client = plain_client(pm, tls_ca)
        self.client.act_as(self.auth)
        self._producer: AsyncProducer | None = None

    @property
    def expires_ms(self) -> int:
        return self.auth.expires_ms

    def renew(self, token: str, expires_ms: int) -> None:
        """A re-authentication of the same principal: its new token from now on (rules too)."""
        self.auth.token, self.auth.expires_ms = token, expires_ms
        self.perms = Permissions(peek_claims(token).acls)

    def producer(self, linger_ms: float) -> AsyncProducer:
        if self._producer is None:
            self._producer = self.client.producer(linger_ms=linger_ms,
                                                  batch_max_bytes=1024 * 1024)
        return self._producer

    def may_group(self, op: Op, group: str) -> bool:
        return self.perms.allows_group(op, group)

    def may_append_somewhere(self) -> bool:
        """Kafka's idempotent-producer check (WRITE on some topic): ``append`` granted on some
        stream by some rule."""
        return any(Op.APPEND in r.ops for r in self.perms.rules)

    async def close(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.close()
        with contextlib.suppress(Exception):
            await self.client.close()


class Login:
    """A finished SASL exchange: who logged in, and the token the PM issued."""

    __slots__ = ("expires_ms", "principal", "token")

    def __init__(self, principal: str, token: str, expires_ms: int) -> None:
        self.principal, self.token, self.expires_ms = principal, token, expires_ms


class SaslExchange:
    """One connection's SASL state: SaslHandshake picks the mechanism, then SaslAuthenticate
    steps (two for SCRAM, one for PLAIN). A failure is final: the connection is closed."""

    def __init__(self, pm_addresses: list[str], pm_ssl: ssl.SSLContext | None,
                 offered: tuple[str, ...]) -> None:
        self.pm_addresses = pm_addresses
        self.pm_ssl = pm_ssl
        self.offered = offered
        self.state = NEW
        self.mechanism = ""
        self._pm: Connection | None = None

    def handshake(self, mechanism: str) -> int:
        """Choose ``mechanism``; the Kafka error code. After a login (state ``done``) this
        starts a re-authentication (KIP-368)."""
        if self.state in (HANDSHAKEN, SCRAM_FIRST, FAILED):
            self.state = FAILED
            return E.ILLEGAL_SASL_STATE
        if mechanism not in self.offered:
            self.state = FAILED
            return E.UNSUPPORTED_SASL_MECHANISM
        self.mechanism, self.state = mechanism, HANDSHAKEN
        return E.NONE

    async def step(self, data: bytes) -> tuple[bytes, Login | None]:
        """One SaslAuthenticate: (bytes for the client, the login when it is complete).
        SaslError (the exchange failed; the caller answers its code and closes)."""
        try:
            if self.state == HANDSHAKEN and self.mechanism == MECH_PLAIN:
                return b"", await self._plain(data)
            if self.state == HANDSHAKEN and self.mechanism == MECH_SCRAM:
                return await self._scram_first(data), None
            if self.state == SCRAM_FIRST:
                return await self._scram_final(data)
            raise SaslError(E.ILLEGAL_SASL_STATE,
                            f"SaslAuthenticate in state {self.state}: SaslHandshake first")
        except SaslError:
            self.state = FAILED
            await self.close()
            raise
        except AuthenticationFailedError as exc:
            self.state = FAILED
            await self.close()
            raise SaslError(E.SASL_AUTHENTICATION_FAILED,
                            f"Authentication failed with SASL mechanism {self.mechanism}: "
                            f"{exc.message}") from None
        except (SbpError, OSError, TimeoutError) as exc:
            self.state = FAILED
            await self.close()
            raise SaslError(E.SASL_AUTHENTICATION_FAILED,
                            f"the placement manager could not check the login: {exc}"
                            ) from None

    async def _open_pm(self) -> Connection:
        errors: list[str] = []
        for addr in self.pm_addresses:
            try:
                return await Connection.open(addr, connect_timeout_s=PM_LOGIN_TIMEOUT_S,
                                             ssl_context=self.pm_ssl)
            except AuthenticationFailedError:
                raise
            except SbpError as exc:
                errors.append(f"{addr}: {exc}")
        raise SaslError(E.SASL_AUTHENTICATION_FAILED,
                        "no placement manager reachable for the login: " + "; ".join(errors))

    async def _relay(self, data: bytes) -> m.AuthenticateResponse:
        assert self._pm is not None
        frame = await self._pm.request_one(
            Opcode.AUTHENTICATE, m.AuthenticateRequest(MECH_SCRAM, data).encode(),
            timeout_s=PM_LOGIN_TIMEOUT_S)
        out = m.AuthenticateResponse.decode(frame.header)
        out.status.raise_for_error()
        return out

    async def _scram_first(self, client_first: bytes) -> bytes:
        self._pm = await self._open_pm()
        out = await self._relay(client_first)
        self.state = SCRAM_FIRST
        return out.data

    async def _scram_final(self, client_final: bytes) -> tuple[bytes, Login]:
        out = await self._relay(client_final)
        await self.close()
        if not out.done or not out.token:
            raise AuthenticationFailedError("the SCRAM login ended without a token")
        self.state = DONE
        return out.data, Login(out.principal, out.token, out.expires_at_ms)

    async def _plain(self, data: bytes) -> Login:
        user, password = parse_plain(data, E.SASL_AUTHENTICATION_FAILED)
        self._pm = await self._open_pm()
        try:
            out = await scram_login(self._pm, user, password)
        finally:
            del password  # kept only for that exchange
            await self.close()
        self.state = DONE
        return Login(out.principal or user, out.token, out.expires_at_ms)

    async def close(self) -> None:
        if self._pm is not None:
            pm, self._pm = self._pm, None
            with contextlib.suppress(Exception):
                await pm.aclose()
