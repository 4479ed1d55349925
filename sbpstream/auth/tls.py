"""SSL contexts for SBP listeners and connections (TLS 1.2+; 1.3 where both ends have it).

A missing, unreadable or non-PEM CA, certificate or key raises :class:`TlsFileError` (a
ValueError) with one line naming the file and the fix, never a bare FileNotFoundError or
ssl.SSLError: the SDK, the CLI and the servers all build their contexts here.
"""

from __future__ import annotations

import ssl

from sbpstream.auth.config import TlsConfig, TlsFileError, check_readable, tls_file_error

__all__ = ["TlsFileError", "client_context", "server_context"]


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    check_readable("cert", cert)
    check_readable("key", key)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise TlsFileError(f"TLS certificate {cert} with key {key}: not a PEM certificate chain "
                           f"and its private key ({e.reason or e}); give the pair "
                           "`sbpstream certs init DIR` writes (server.pem, server-key.pem)"
                           ) from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    check_readable("ca", ca)
    try:
        ctx.load_verify_locations(ca)
    except ssl.SSLError as e:
        raise tls_file_error("ca", ca, f"not a PEM CA certificate ({e.reason or e})") from None


def server_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The listener's context; None when TLS is off. With ``ca`` set, client certificates are
    verified when presented, and demanded with ``require_client_cert`` (mutual TLS)."""
    if not cfg.server_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cfg.cert, cfg.key)
    if cfg.ca:
        _load_ca(ctx, cfg.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """A context verifying servers against ``ca`` (certificate chain and host name); None when
    no CA is given (plain TCP). Presents ``cert``/``key`` when given (mutual TLS)."""
    if not cfg.client_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, cfg.ca)
    if cfg.cert and cfg.key:
        _load_chain(ctx, cfg.cert, cfg.key)
    return ctx
