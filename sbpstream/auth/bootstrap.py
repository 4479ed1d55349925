"""The first admin of a secure cluster, made with the cluster secret (``up --secure``, and
``sbpstream user add --secret-file``).

Node tokens may not administer users, ACLs or quotas (auth/gate.py, ``require_admin``), so
whoever holds the secret acts as a **bootstrap user** instead: a short-lived *user* token
(:data:`BOOTSTRAP_TOKEN_TTL_MS`) for the principal :data:`BOOTSTRAP_PRINCIPAL`, minted locally
from the secret, whose only rule is ``admin`` on ``*``. It is not a node token: it cannot send
cluster-internal opcodes, and it reads or writes no stream. The PM needs no user to exist for
it, which is how the first admin is made.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

from sbpstream.auth import tokens
from sbpstream.auth.acl import AclRule, Op
from sbpstream.auth.client import Credentials
from sbpstream.auth.config import CA_FILE, SECRET_FILE, read_secret
from sbpstream.net.client import Connection
from sbpstream.net.tls import TlsConfig, client_context
from sbpstream.protocol import messages as m
from sbpstream.protocol.opcodes import Opcode

BOOTSTRAP_TIMEOUT_S: Final = 10.0
"""One MANAGE_USERS / MANAGE_ACLS round trip to the PM."""
BOOTSTRAP_TOKEN_TTL_MS: Final = 300_000
"""A bootstrap token lives 5 minutes: long enough for one CLI command's retries, short enough
that one left in a temporary file is soon useless."""
BOOTSTRAP_PRINCIPAL: Final = "bootstrap"
"""The principal a bootstrap token names (it shows in the PM's logs and refusals)."""


def bootstrap_token(secret: bytes, now_ms: int | None = None,
                    ttl_ms: int = BOOTSTRAP_TOKEN_TTL_MS) -> str:
    """A user token for :data:`BOOTSTRAP_PRINCIPAL` granting ``admin`` on ``*`` only."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rule = AclRule(BOOTSTRAP_PRINCIPAL, frozenset({Op.ADMIN}), "*")
    return tokens.sign(tokens.Claims(BOOTSTRAP_PRINCIPAL, tokens.KIND_USER, now, now + ttl_ms,
                                     (rule,)), tokens.derive_key(secret))


async def bootstrap_admin(pm: str, certs: Path, user: str, password: str) -> None:
    """Add ``user`` with ``password`` and every operation on ``*``."""
    tls = TlsConfig(ca=str(certs / CA_FILE))
    creds = Credentials(token=bootstrap_token(read_secret(str(certs / SECRET_FILE))),
                        pm=(pm,), tls=tls)
    conn = await Connection.open(pm, ssl_context=client_context(tls), authenticator=creds)
    try:
        for op, req, resp_cls in (
            (Opcode.MANAGE_USERS, m.ManageUsersRequest(1, user, password),
             m.ManageUsersResponse),
            (Opcode.MANAGE_ACLS, m.ManageAclsRequest(1, m.AclEntry(user, "all", "*")),
             m.ManageAclsResponse),
        ):
            frame = await conn.request_one(op, req.encode(), timeout_s=BOOTSTRAP_TIMEOUT_S)
            resp_cls.decode(frame.header).status.raise_for_error()
    finally:
        await conn.aclose()
