"""Tokens: signed claims any server verifies with the cluster secret, without a round trip.

A token is ``v1.<payload>.<mac>``: ``payload`` is base64url of compact JSON claims (principal,
kind, issued and expiry times, the principal's ACL rules), ``mac`` is base64url of
HMAC-SHA-256 over ``v1.<payload>`` with a key derived from the cluster secret. The PM issues user
tokens after a SCRAM login; PMs and data nodes mint node tokens for themselves. Every holder of
the secret can mint any token, so the secret goes only to PMs and data nodes (docs/security.md).
No I/O: the caller passes the time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Final

from sbpstream.auth.acl import AclRule
from sbpstream.protocol.errors import AuthenticationFailedError, TokenExpiredError

VERSION: Final = "v1"
MAX_TOKEN_BYTES: Final = 64 * 1024
"""A token carries its principal's ACL rules; bigger than this is refused before any parsing."""

KIND_USER: Final = "user"
KIND_NODE: Final = "node"
"""Node tokens are held by PMs and data nodes: cluster-internal opcodes and every stream. A data
node's names its node id (``node_id``; -1 before the PM allocated one): the servers check that
its DATA_NODE heartbeats, metrics and listings are about that node, and it may not send what
only the PM sends to data nodes (SEAL, SYNC, trims, deletes). A node token without a node id is
the PM's (or a tool's holding the secret, ``--secret-file``): the cluster itself."""


@dataclass(frozen=True, slots=True)
class Claims:
    principal: str
    kind: str
    issued_ms: int
    expires_ms: int
    acls: tuple[AclRule, ...] = ()
    node_id: int | None = None

    @property
    def is_node(self) -> bool:
        return self.kind == KIND_NODE

    @property
    def is_data_node(self) -> bool:
        """A data node's token: a node token naming a node id."""
        return self.kind == KIND_NODE and self.node_id is not None

    @property
    def is_cluster(self) -> bool:
        """The PM's token (or a tool's with the secret): a node token without a node id."""
        return self.kind == KIND_NODE and self.node_id is None


def derive_key(secret: bytes) -> bytes:
    """The token key: separate from the secret itself so the secret can key other things."""
    return hmac.new(secret, b"sbpstream token key v1", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(claims: Claims, key: bytes) -> str:
    body = {
        "p": claims.principal, "k": claims.kind, "iat": claims.issued_ms,
        "exp": claims.expires_ms, "acl": [r.to_json() for r in claims.acls],
    }
    if claims.node_id is not None:
        body["n"] = claims.node_id
    payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
    signed = f"{VERSION}.{payload}"
    mac = hmac.new(key, signed.encode(), hashlib.sha256).digest()
    return f"{signed}.{_b64(mac)}"


def verify(token: str | bytes, key: bytes, now_ms: int) -> Claims:
    """The claims of a genuine, unexpired token. AuthenticationFailedError for anything forged
    or malformed; TokenExpiredError for a genuine one past its expiry."""
    text = token.decode(errors="replace") if isinstance(token, bytes) else token
    if len(text) > MAX_TOKEN_BYTES:
        raise AuthenticationFailedError("token too long")
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise AuthenticationFailedError("malformed token")
    try:
        mac = _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise AuthenticationFailedError("malformed token") from None
    good = hmac.new(key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(mac, good):
        raise AuthenticationFailedError("token signature does not verify")
    try:
        body = json.loads(_unb64(parts[1]))
        claims = Claims(str(body["p"]), str(body["k"]), int(body["iat"]), int(body["exp"]),
                        tuple(AclRule.from_json(r) for r in body["acl"]),
                        None if body.get("n") is None else int(body["n"]))
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        raise AuthenticationFailedError(f"malformed token claims: {e}") from None
    if claims.kind not in (KIND_USER, KIND_NODE):
        raise AuthenticationFailedError(f"unknown token kind {claims.kind!r}")
    if claims.node_id is not None and claims.kind != KIND_NODE:
        raise AuthenticationFailedError("only a node token names a node id")
    if now_ms >= claims.expires_ms:
        raise TokenExpiredError(f"token of {claims.principal} expired at {claims.expires_ms}")
    return claims


def node_token(key: bytes, principal: str, now_ms: int, ttl_ms: int,
               node_id: int | None = None) -> str:
    """A node token: the cluster's (``node_id`` None) or data node ``node_id``'s."""
    return sign(Claims(principal, KIND_NODE, now_ms, now_ms + ttl_ms, (), node_id), key)


def peek(token: str) -> tuple[int, int]:
    """(issued_ms, expires_ms) of a token, unverified: what a client needs to renew in time
    (it holds no key; the servers verify)."""
    try:
        body = json.loads(_unb64(token.split(".")[1]))
        return int(body["iat"]), int(body["exp"])
    except (IndexError, ValueError, KeyError, TypeError, binascii.Error) as e:
        raise AuthenticationFailedError(f"malformed token: {e}") from None
