"""The first admin of a secure cluster, made with the cluster secret (``up --secure``, and
``sbpstream user add --secret-file``): a node token passes the admin check, so whoever holds
the secret can create users and rules without a user existing yet."""

from __future__ import annotations

from pathlib import Path

from sbpstream.auth.client import Credentials
from sbpstream.auth.config import CA_FILE, SECRET_FILE, TlsConfig, read_secret
from sbpstream.auth.tls import client_context
from sbpstream.net.client import Connection
from sbpstream.protocol import messages as m
from sbpstream.protocol.opcodes import Opcode

BOOTSTRAP_TIMEOUT_S = 10.0


async def bootstrap_admin(pm: str, certs: Path, user: str, password: str) -> None:
    """Add ``user`` with ``password`` and every operation on ``*``."""
    tls = TlsConfig(ca=str(certs / CA_FILE))
    creds = Credentials(node_secret=read_secret(str(certs / SECRET_FILE)),
                        node_principal="bootstrap", pm=(pm,), tls=tls)
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
