"""The security flags every server takes (``python -m sbpstream.pm``/``.datanode``)."""

from __future__ import annotations

import argparse

from sbpstream.auth.config import DEFAULT_TOKEN_TTL_S, SecurityConfig, TlsConfig


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (docs/security.md)")
    g.add_argument("--tls-cert", default="", help="PEM certificate chain of this server")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="",
                   help="PEM CA that peers' certificates are verified against")
    g.add_argument("--tls-require-client-cert", action="store_true",
                   help="mutual TLS: refuse clients without a certificate from --tls-ca")
    g.add_argument("--auth", action="store_true",
                   help="authenticate every connection (SCRAM or token) and apply ACLs")
    g.add_argument("--secret-file", default="",
                   help="the cluster secret (hex) that signs tokens; PMs and data nodes only")
    g.add_argument("--token-ttl-s", type=int, default=DEFAULT_TOKEN_TTL_S,
                   help="lifetime of the tokens the PM issues")
    g.add_argument("--allow-remote-unauthenticated", action="store_true",
                   help="protected mode off: serve clients beyond loopback with auth off")
    g.add_argument("--allow-insecure-auth", action="store_true",
                   help="serve --auth without TLS on an address beyond loopback (logins and "
                   "tokens in clear)")


def security_from_args(a: argparse.Namespace) -> SecurityConfig:
    return SecurityConfig(
        tls=TlsConfig(a.tls_cert, a.tls_key, a.tls_ca, a.tls_require_client_cert),
        auth=a.auth, secret_file=a.secret_file, token_ttl_s=a.token_ttl_s,
        allow_remote_unauthenticated=a.allow_remote_unauthenticated,
        allow_insecure_auth=a.allow_insecure_auth)
