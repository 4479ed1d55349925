"""SCRAM-SHA-256 (RFC 5802/7677) with ``scramp``: credentials and the server side of a login.

The PM keeps, per user, only what RFC 5802 section 3 calls the salted, hashed verifier: salt,
StoredKey, ServerKey and the iteration count. A login takes two AUTHENTICATE round trips on one
connection (client-first -> server-first, client-final -> server-final). No I/O: the caller
fetches the user's credential before handing the client-first message over.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Final

from scramp import ScramException, ScramMechanism

from sbpstream.protocol.errors import AuthenticationFailedError, InvalidRequestError

MECHANISM: Final = "SCRAM-SHA-256"
ITERATIONS: Final = 4096
"""RFC 7677's minimum: one login costs a few milliseconds of PBKDF2 on either side."""
MAX_SCRAM_MESSAGE_BYTES: Final = 4096
"""Real SCRAM messages are around 100 bytes; more is refused before parsing."""

_MECH: Final = ScramMechanism(MECHANISM)


@dataclass(frozen=True, slots=True)
class Credential:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def to_json(self) -> str:
        return json.dumps({
            "mechanism": MECHANISM, "iterations": self.iterations,
            "salt": base64.b64encode(self.salt).decode(),
            "stored_key": base64.b64encode(self.stored_key).decode(),
            "server_key": base64.b64encode(self.server_key).decode(),
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Credential:
        d = json.loads(text)
        return cls(base64.b64decode(d["salt"]), base64.b64decode(d["stored_key"]),
                   base64.b64decode(d["server_key"]), int(d["iterations"]))


def make_credential(password: str, iterations: int = ITERATIONS) -> Credential:
    if not password:
        raise InvalidRequestError("a password may not be empty")
    salt, stored, server, n = _MECH.make_auth_info(password, iteration_count=iterations,
                                                   salt=os.urandom(SALT_BYTES))
    return Credential(salt, stored, server, n)


SALT_BYTES: Final = 16
"""The salt of a stored credential (``make_credential``) and of a decoy: the same length, so a
server-first message does not tell a decoy from a real user by its size."""
DECOY_LABEL: Final = b"sbpstream scram decoy v1"
"""Separates the decoy key from every other use of the token key (token MACs)."""


def decoy_key(token_key: bytes) -> bytes:
    """The key decoys are derived with, from the cluster's token key (itself from the secret)."""
    return hmac.new(token_key, DECOY_LABEL, hashlib.sha256).digest()


def decoy_credential(key: bytes, user: str) -> Credential:
    """What a login of the unknown ``user`` is answered with: a salt (and keys) derived from
    the cluster secret and the name, HMAC(key, user). The same name always gets the same salt,
    as a real user does, and two names get different ones, so the server-first message does
    not tell whether a user exists (one shared decoy salt would: it is the odd one out)."""
    name = user.encode(errors="replace")

    def part(label: bytes, n: int) -> bytes:
        return hmac.new(key, label + b"\0" + name, hashlib.sha256).digest()[:n]

    return Credential(part(b"salt", SALT_BYTES), part(b"stored", 32), part(b"server", 32),
                      ITERATIONS)


_PROCESS_DECOY_KEY: Final = os.urandom(32)
"""For a login without a cluster secret at hand (tests): stable for this process only."""


def client_first_user(message: bytes) -> str:
    """The user a client-first message names (``n,,n=USER,r=NONCE``); RFC 5802 escapes ``,``
    and ``=`` as ``=2C`` and ``=3D``."""
    if len(message) > MAX_SCRAM_MESSAGE_BYTES:
        raise InvalidRequestError("SCRAM message too long")
    text = message.decode(errors="replace")
    for part in text.split(","):
        if part.startswith("n="):
            return part[2:].replace("=2C", ",").replace("=3D", "=")
    raise AuthenticationFailedError("SCRAM client-first message names no user")


class ScramLogin:
    """The server side of one login: :meth:`first` then :meth:`final`. An unknown user
    (``credential`` None) is answered with :func:`decoy_credential` under ``decoy``, the key
    from :func:`decoy_key`, and fails at the last step like a wrong password."""

    def __init__(self, user: str, credential: Credential | None,
                 decoy: bytes = _PROCESS_DECOY_KEY) -> None:
        self.user = user
        self.known = credential is not None
        cred = credential or decoy_credential(decoy, user)
        info = (cred.salt, cred.stored_key, cred.server_key, cred.iterations)
        self._server = _MECH.make_server(lambda _name: info)

    def first(self, client_first: bytes) -> bytes:
        try:
            self._server.set_client_first(client_first.decode(errors="replace"))
            first: str = self._server.get_server_first()
            return first.encode()
        except ScramException as e:
            raise AuthenticationFailedError(f"SCRAM: {e}") from None

    def final(self, client_final: bytes) -> bytes:
        if len(client_final) > MAX_SCRAM_MESSAGE_BYTES:
            raise InvalidRequestError("SCRAM message too long")
        try:
            self._server.set_client_final(client_final.decode(errors="replace"))
            final: str = self._server.get_server_final()
            server_final = final.encode()
        except ScramException:
            raise AuthenticationFailedError("unknown user or wrong password") from None
        if not self.known:
            raise AuthenticationFailedError("unknown user or wrong password")
        return server_final


def check_password(user: str, password: str, credential: Credential | None) -> None:
    """Check a password given whole (HTTP Basic, the console's login) against the stored
    verifier: a SCRAM exchange run in-process, so the same code decides as for a wire login.
    AuthenticationFailedError (one message for an unknown user and a wrong password)."""
    from scramp import ScramClient

    if len(user) > MAX_SCRAM_MESSAGE_BYTES or len(password) > MAX_SCRAM_MESSAGE_BYTES:
        raise AuthenticationFailedError("unknown user or wrong password")
    login = ScramLogin(user, credential)
    try:
        client = ScramClient([MECHANISM], user, password)
        server_first = login.first(client.get_client_first().encode())
        client.set_server_first(server_first.decode())
        login.final(client.get_client_final().encode())
    except ScramException:
        raise AuthenticationFailedError("unknown user or wrong password") from None
