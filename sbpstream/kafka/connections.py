"""The Kafka gateway's connections: framing, limits, SASL, and requests in order.

Requests of a connection are read in order, Produce requests are queued in that order, and
responses are written in request order. A frame that cannot be decoded, an unknown API or an
unsupported version closes the connection (Kafka's behaviour); ApiVersions of an unknown version
is answered with UNSUPPORTED_VERSION and the versions served.

Limits (:mod:`sbpstream.kafka.sasl`): a new connection over :data:`MAX_CONNECTIONS` or over
:data:`MAX_CONNECTIONS_PER_SOURCE` from its address is closed at once; one that sends nothing
for :data:`IDLE_TIMEOUT_S` is closed; reading stops while its unsent responses exceed
:data:`MAX_UNSENT_RESPONSE_BYTES`. On a SASL listener a connection may send ApiVersions,
SaslHandshake and SaslAuthenticate only, each at most :data:`MAX_PRE_AUTH_REQUEST_BYTES`, until
it has authenticated, within :data:`SASL_DEADLINE_S`; anything else closes it. A failed login is
answered, then the connection is closed. Once the session's token expires the connection is
closed, unless it re-authenticated (KIP-368).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from sbpstream.client.aclient import AsyncClient
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.kafka import errors as E
from sbpstream.kafka.codec import (
    INT32,
    MAX_REQUEST_BYTES,
    KafkaDecodeError,
    decode,
    decode_header,
    encode,
    encode_response,
    peek_header,
)
from sbpstream.kafka.sasl import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_SOURCE,
    MAX_PRE_AUTH_REQUEST_BYTES,
    MAX_UNSENT_RESPONSE_BYTES,
    SASL_DEADLINE_S,
    SaslError,
)
from sbpstream.kafka.schemas import (
    API_VERSIONS,
    API_VERSIONS_RESP,
    PRODUCE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    SUPPORTED,
)
from sbpstream.kafka.session import SaslExchange, Session, now_ms

log = logging.getLogger("sbpstream.kafka")

MAX_IN_FLIGHT_REQUESTS: Final = 64
"""Requests of one connection being served at once; reading pauses beyond."""
FLUSH_ON_CLOSE_S: Final = 35.0
"""How long a closing connection still writes the responses it owes (a Fetch long-polls up to
30 s)."""

PRE_AUTH_APIS: Final = frozenset({API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE})


class CloseConnection(Exception):
    """The connection is closed after the responses already owed (logged with the reason)."""


@dataclass(slots=True)
class Reader:
    consumer: AsyncConsumer
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Conn:
    """Per-connection state: the principal's session, the SASL exchange, the partition readers,
    and the bytes of responses ready but unwritten."""

    def __init__(self, peer: str, host: str, sasl: SaslExchange | None) -> None:
        self.peer = peer
        self.host = host
        self.client_id = ""
        self.readers: OrderedDict[int, Reader] = OrderedDict()
        self.sasl = sasl
        self.session: Session | None = None
        self.raw_sasl = False  # after SaslHandshake v0: raw SASL tokens, no Kafka header
        self.closing = False
        self.opened = time.monotonic()
        self.unsent = 0
        self.drained = asyncio.Event()
        self.drained.set()

    def owe(self, n: int) -> None:
        self.unsent += n
        if self.unsent > MAX_UNSENT_RESPONSE_BYTES:
            self.drained.clear()

    def paid(self, n: int) -> None:
        self.unsent -= n
        if self.unsent <= MAX_UNSENT_RESPONSE_BYTES:
            self.drained.set()

    async def close(self) -> None:
        for r in self.readers.values():
            with contextlib.suppress(Exception):
                await r.consumer.close()
        self.readers.clear()
        if self.sasl is not None:
            await self.sasl.close()
        if self.session is not None:
            await self.session.close()


Handler = Callable[[Conn, int, dict[str, Any]], Awaitable[dict[str, Any] | None]]


async def _then(aw: Awaitable[dict[str, Any] | None],
                fn: Callable[[dict[str, Any] | None], bytes | None]) -> bytes | None:
    return fn(await aw)


def _done(value: bytes | None) -> asyncio.Future[bytes | None]:
    fut: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class Connections:
    """The connection side of :class:`~sbpstream.kafka.gateway.KafkaGateway` (a base class)."""

    client: AsyncClient
    pm: str | None
    tls_ca: str
    mechanisms: tuple[str, ...]
    _pm_ssl: ssl.SSLContext | None
    _handlers: dict[int, Handler]
    _conns: set[asyncio.Task[None]]
    _per_source: dict[str, int]

    async def _produce(self, conn: Conn, req: dict[str, Any]
                       ) -> Awaitable[dict[str, Any]] | None:
        raise NotImplementedError

    def _read_timeout(self, conn: Conn) -> tuple[float, str]:
        """(seconds the next read may wait, why the connection closes when it does)."""
        if conn.sasl is not None and conn.session is None:
            return conn.opened + SASL_DEADLINE_S - time.monotonic(), "not authenticated in time"
        if conn.session is not None:
            left = (conn.session.expires_ms - now_ms()) / 1000
            if left < IDLE_TIMEOUT_S:
                return left, "session lifetime over (re-authenticate, KIP-368)"
        return IDLE_TIMEOUT_S, "idle"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername)
        host = peername[0] if isinstance(peername, tuple) else peer
        if len(self._conns) >= MAX_CONNECTIONS or self._per_source.get(
                host, 0) >= MAX_CONNECTIONS_PER_SOURCE:
            log.warning("event=kafka_connection_refused peer=%s reason=connection_cap "
                        "total=%d from_source=%d", peer, len(self._conns),
                        self._per_source.get(host, 0))
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._per_source[host] = self._per_source.get(host, 0) + 1
        sasl = SaslExchange(self.client.pm_addresses, self._pm_ssl,
                            self.mechanisms) if self.mechanisms else None
        conn = Conn(peer, host, sasl)
        pending: asyncio.Queue[asyncio.Future[bytes | None] | None] = asyncio.Queue(
            MAX_IN_FLIGHT_REQUESTS)
        out = asyncio.create_task(self._write_responses(writer, pending, conn))
        frame = b""
        try:
            while not out.done() and not conn.closing:
                await conn.drained.wait()
                timeout, why = self._read_timeout(conn)
                try:
                    async with asyncio.timeout(max(timeout, 0)):
                        size = INT32.unpack(await reader.readexactly(4))[0]
                        limit = MAX_REQUEST_BYTES if (conn.sasl is None or conn.session
                                                      ) else MAX_PRE_AUTH_REQUEST_BYTES
                        if not 0 < size <= limit:
                            raise CloseConnection(f"frame of {size} bytes (limit {limit})")
                        frame = await reader.readexactly(size)
                except TimeoutError:
                    raise CloseConnection(why) from None
                fut = (self._raw_sasl(conn, frame) if conn.raw_sasl
                       else await self._dispatch(conn, frame))
                await pending.put(fut)
                if conn.sasl is not None and (conn.session is None or conn.raw_sasl):
                    # a login step: its outcome decides what the next frame may be
                    with contextlib.suppress(Exception):
                        await asyncio.shield(fut)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except CloseConnection as exc:
            log.info("event=kafka_connection_closed peer=%s reason=%s", peer, exc)
        except KafkaDecodeError as exc:
            log.info("event=kafka_bad_request peer=%s error=%s", peer, exc)
            log.debug("event=kafka_bad_request_bytes frame=%s", frame.hex() if frame else "")
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug: drop this connection, keep the gateway
            log.exception("event=kafka_connection_failed peer=%s", peer)
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                pending.put_nowait(None)
            if not out.done():
                # let the responses already owed go out (a client closing after its last
                # request still gets them), unless the connection is gone
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(out), FLUSH_ON_CLOSE_S)
            out.cancel()
            with contextlib.suppress(BaseException):
                await out
            await conn.close()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._conns.discard(task)
            left = self._per_source.get(host, 1) - 1
            if left > 0:
                self._per_source[host] = left
            else:
                self._per_source.pop(host, None)

    async def _write_responses(
        self, writer: asyncio.StreamWriter,
        pending: asyncio.Queue[asyncio.Future[bytes | None] | None], conn: Conn,
    ) -> None:
        while True:
            fut = await pending.get()
            if fut is None:
                return
            try:
                data = await fut
            except Exception:
                log.exception("event=kafka_request_failed")
                writer.close()
                return
            if data is not None:
                writer.write(data)
                await writer.drain()
                conn.paid(len(data))

    def _track(self, conn: Conn, fut: asyncio.Future[bytes | None]
               ) -> asyncio.Future[bytes | None]:
        """Count ``fut``'s response as owed from when it is ready until it is written."""
        def owed(f: asyncio.Future[bytes | None]) -> None:
            if not f.cancelled() and f.exception() is None and f.result() is not None:
                conn.owe(len(f.result() or b""))
        fut.add_done_callback(owed)
        return fut

    async def _dispatch(self, conn: Conn, frame: bytes) -> asyncio.Future[bytes | None]:
        """Decode a request; return the future of its response frame (None: no response).

        Produce is queued here, in request order; everything else runs in its own task."""
        api_key, version, correlation_id = peek_header(frame)
        api = SUPPORTED.get(api_key)
        if api is None:
            raise KafkaDecodeError(f"unknown api key {api_key}")
        if conn.sasl is not None and api_key not in PRE_AUTH_APIS:
            if conn.session is None:
                raise CloseConnection(f"{api.name} before SASL authentication")
            if now_ms() >= conn.session.expires_ms:
                raise CloseConnection(f"{api.name} after the session's lifetime (KIP-368)")
        if api_key == API_VERSIONS and not api.min_version <= version <= api.max_version:
            body = encode(API_VERSIONS_RESP, 0, {"error_code": E.UNSUPPORTED_VERSION,
                                                 "api_keys": self._api_keys()})
            return _done(encode_response(correlation_id, False, body))
        if not api.min_version <= version <= api.max_version:
            raise KafkaDecodeError(f"{api.name} v{version} is not served "
                                   f"(v{api.min_version}-v{api.max_version})")
        flexible = version >= api.request.flexible
        header = decode_header(frame, flexible)
        conn.client_id = header.client_id or ""
        req = decode(api.request, version, frame, header.body_offset)
        # ApiVersions answers with response header v0 whatever its version
        flexible_resp = flexible and api_key != API_VERSIONS

        def frame_of(resp: dict[str, Any] | None) -> bytes | None:
            if resp is None:
                return None
            return encode_response(correlation_id, flexible_resp,
                                   encode(api.response, version, resp))

        if api_key == API_VERSIONS:
            return _done(frame_of({"error_code": 0, "api_keys": self._api_keys()}))
        if api_key == SASL_HANDSHAKE:
            return _done(frame_of(self._sasl_handshake(conn, version, req)))
        if api_key == SASL_AUTHENTICATE:
            return self._track(conn, asyncio.ensure_future(
                _then(self._sasl_authenticate(conn, version, req), frame_of)))
        if api_key == PRODUCE:
            done = await self._produce(conn, req)
            if done is None:  # acks=0
                return _done(None)
            return self._track(conn, asyncio.ensure_future(
                _then(asyncio.ensure_future(done), frame_of)))
        handler = self._handlers[api_key]
        return self._track(conn, asyncio.ensure_future(
            _then(handler(conn, version, req), frame_of)))

    def _api_keys(self) -> list[dict[str, Any]]:
        served = [a for a in SUPPORTED.values()
                  if self.mechanisms or a.key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE)]
        return [{"api_key": a.key, "min_version": a.min_version, "max_version": a.max_version}
                for a in served]

    # --------------------------------------------------------------------------------- SASL

    def _sasl_handshake(self, conn: Conn, version: int, req: dict[str, Any]
                        ) -> dict[str, Any]:
        if conn.sasl is None:  # not a SASL listener
            conn.closing = True
            return {"error_code": E.ILLEGAL_SASL_STATE, "mechanisms": []}
        code = conn.sasl.handshake(req["mechanism"])
        if code != E.NONE:
            conn.closing = True  # Kafka closes after a refused handshake
            log.info("event=kafka_sasl_refused peer=%s mechanism=%s code=%d", conn.peer,
                     req["mechanism"], code)
        elif version == 0:
            conn.raw_sasl = True
        return {"error_code": code, "mechanisms": list(self.mechanisms)}

    async def _sasl_authenticate(self, conn: Conn, version: int, req: dict[str, Any]
                                 ) -> dict[str, Any]:
        data, code, message, lifetime = await self._sasl_step(conn, req["auth_bytes"])
        return {"error_code": code, "error_message": message, "auth_bytes": data,
                "session_lifetime_ms": lifetime}

    def _raw_sasl(self, conn: Conn, frame: bytes) -> asyncio.Future[bytes | None]:
        """A raw SASL token after SaslHandshake v0: answered raw; a failure closes."""
        async def step() -> bytes | None:
            data, code, _, _ = await self._sasl_step(conn, frame)
            if code != E.NONE:
                return None
            if conn.session is not None and conn.sasl is not None and \
                    conn.sasl.state == "done":
                conn.raw_sasl = False
            return INT32.pack(len(data)) + data
        return self._track(conn, asyncio.ensure_future(step()))

    async def _sasl_step(self, conn: Conn, data: bytes) -> tuple[bytes, int, str | None, int]:
        """(bytes for the client, error code, error message, session lifetime ms)."""
        if conn.sasl is None:
            conn.closing = True
            return b"", E.ILLEGAL_SASL_STATE, "this listener does not take SASL", 0
        try:
            out, login = await conn.sasl.step(data)
        except SaslError as exc:
            conn.closing = True
            log.info("event=kafka_sasl_failed peer=%s mechanism=%s code=%d error=%s",
                     conn.peer, conn.sasl.mechanism, exc.code, exc.message)
            return b"", exc.code, exc.message, 0
        if login is not None:
            if conn.session is None:
                conn.session = Session(self.pm, self.tls_ca, login.principal, login.token,
                                       login.expires_ms)
            elif conn.session.principal != login.principal:
                conn.closing = True  # KIP-368: a re-authentication keeps the principal
                return b"", E.SASL_AUTHENTICATION_FAILED, (
                    f"re-authentication as {login.principal!r} on a connection of "
                    f"{conn.session.principal!r}"), 0
            else:
                conn.session.renew(login.token, login.expires_ms)
            log.info("event=kafka_sasl_authenticated peer=%s principal=%s mechanism=%s",
                     conn.peer, login.principal, conn.sasl.mechanism)
            return out, E.NONE, None, max(0, login.expires_ms - now_ms())
        return out, E.NONE, None, 0

