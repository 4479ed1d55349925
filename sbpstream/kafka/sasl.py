"""Listeners and SASL of the Kafka gateway: what each listener offers, the connection limits,
and the PLAIN message. No I/O (the exchange with the PM is :mod:`sbpstream.kafka.session`).

Listeners are Kafka's security protocols: ``PLAINTEXT`` (TCP), ``SSL`` (TLS), ``SASL_PLAINTEXT``
(SASL over TCP) and ``SASL_SSL`` (SASL over TLS). SASL mechanisms: ``SCRAM-SHA-256`` (relayed to
the PM, which holds the verifiers) on both SASL listeners, and ``PLAIN`` on ``SASL_SSL`` only (a
password in the clear must travel inside TLS). ``SCRAM-SHA-512`` is not offered: the PM keeps
SHA-256 verifiers only.
"""

from __future__ import annotations

from typing import Final

from sbpstream.auth.config import is_loopback_host

PLAINTEXT: Final = "PLAINTEXT"
SSL: Final = "SSL"
SASL_PLAINTEXT: Final = "SASL_PLAINTEXT"
SASL_SSL: Final = "SASL_SSL"
LISTENERS: Final = (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL)

MECH_SCRAM: Final = "SCRAM-SHA-256"
MECH_PLAIN: Final = "PLAIN"

MAX_CONNECTIONS: Final = 4096
"""Connections one gateway serves at once; a new one beyond is closed at once (each holds
buffers, readers and, on a SASL listener, an SBP client of its own)."""
MAX_CONNECTIONS_PER_SOURCE: Final = 256
"""Connections from one source address at once (Kafka's max.connections.per.ip): one client
host cannot take the whole :data:`MAX_CONNECTIONS`."""
SASL_DEADLINE_S: Final = 10.0
"""A connection on a SASL listener not authenticated this long after it opened is closed: a
login is two round trips, more is a client holding a slot."""
IDLE_TIMEOUT_S: Final = 600.0
"""A connection that sends nothing this long is closed (Kafka's connections.max.idle.ms)."""
MAX_PRE_AUTH_REQUEST_BYTES: Final = 64 * 1024
"""The largest request before authentication (ApiVersions, SaslHandshake, SaslAuthenticate are
a few hundred bytes; Kafka's SaslServer bounds them alike): an unauthenticated peer cannot make
the gateway buffer a 32 MiB frame."""
MAX_UNSENT_RESPONSE_BYTES: Final = 64 * 1024 * 1024
"""High-water mark of a connection's responses ready but not yet written: reading its requests
stops above it, so a client that does not read cannot make the gateway hold unbounded data."""


def mechanisms(listener: str) -> tuple[str, ...]:
    """The SASL mechanisms a listener offers (none on PLAINTEXT and SSL)."""
    if listener == SASL_SSL:
        return (MECH_SCRAM, MECH_PLAIN)
    if listener == SASL_PLAINTEXT:
        return (MECH_SCRAM,)
    return ()


def uses_tls(listener: str) -> bool:
    return listener in (SSL, SASL_SSL)


def listener_problem(listener: str, host: str, has_cert: bool,
                     allow_sasl_plaintext: bool) -> str | None:
    """Why the gateway may not start with this listener, or None."""
    if listener not in LISTENERS:
        return f"--listener {listener!r}: expected one of {', '.join(LISTENERS)}"
    if uses_tls(listener) and not has_cert:
        return f"--listener {listener} needs --tls-cert and --tls-key"
    if listener == SASL_PLAINTEXT and not is_loopback_host(host) and not allow_sasl_plaintext:
        return (f"--listener SASL_PLAINTEXT on {host} sends SCRAM logins and data in the clear "
                "beyond loopback: use SASL_SSL, or pass --allow-sasl-plaintext")
    return None


class SaslError(Exception):
    """A SASL message the gateway refuses; ``code`` is the Kafka error to answer."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_plain(data: bytes, code: int) -> tuple[str, str]:
    """(user, password) of a PLAIN message (RFC 4616: ``authzid NUL authcid NUL passwd``); an
    authorization id other than empty or the user is refused (no impersonation)."""
    parts = data.split(b"\x00")
    if len(parts) != 3:
        raise SaslError(code, "PLAIN: expected authzid NUL user NUL password")
    try:
        authzid, user, password = (p.decode() for p in parts)
    except UnicodeDecodeError:
        raise SaslError(code, "PLAIN: user and password must be UTF-8") from None
    if not user or not password:
        raise SaslError(code, "PLAIN: user and password may not be empty")
    if authzid and authzid != user:
        raise SaslError(code, "PLAIN: an authorization id other than the user is not allowed")
    return user, password
