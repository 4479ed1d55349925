"""A server's security, assembled from its :class:`~sbpstream.auth.config.SecurityConfig`: the
listener's TLS context, the auth gate, protected mode, and what its own outgoing connections (to
the PM, to other data nodes) use: TLS verified against the CA, and a node token."""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sbpstream.auth.client import Credentials
from sbpstream.auth.config import SecurityConfig, is_loopback_host
from sbpstream.auth.gate import ItemRule, ServerAuth
from sbpstream.net.tls import TlsConfig, client_context, server_context


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    ssl_context: ssl.SSLContext | None
    gate: ServerAuth | None
    protected: bool
    client_ssl: ssl.SSLContext | None
    credentials: Credentials | None


def server_security(cfg: SecurityConfig, host: str, node_only: frozenset[int],
                    rules: Mapping[int, ItemRule], principal: str,
                    pm: Sequence[str] = (), node_id: int | None = None,
                    cluster_only: frozenset[int] = frozenset()) -> ServerSecurity:
    """``node_id``: a data node's own token names one (-1 until it is allocated: see
    :meth:`Credentials.set_node_id`); None for the PM. ``cluster_only``: opcodes this server
    takes from the cluster's token alone (the PM's), not from a data node's."""
    cfg.validate(host)  # files, modes, and no auth in clear beyond loopback
    tls = cfg.tls
    if tls.server_enabled and not tls.ca:
        raise ValueError("--tls-cert needs --tls-ca too: PMs and data nodes verify each other")
    secret = cfg.secret() if cfg.secret_file else b""
    gate = ServerAuth(secret, node_only, rules, cluster_only=cluster_only) if cfg.auth else None
    # outgoing: verify peers against the CA; present our certificate (mutual TLS) when we have one
    client_ssl = client_context(TlsConfig(tls.cert, tls.key, tls.ca)) if tls.ca else None
    creds = Credentials(node_secret=secret, node_principal=principal, node_id=node_id, pm=pm,
                        tls=TlsConfig(tls.cert, tls.key, tls.ca)) if cfg.auth else None
    protected = (not cfg.auth and not cfg.allow_remote_unauthenticated
                 and not is_loopback_host(host))
    return ServerSecurity(server_context(tls), gate, protected, client_ssl, creds)
