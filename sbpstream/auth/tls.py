"""SSL contexts for SBP listeners and connections (TLS 1.2+; 1.3 where both ends have it)."""

from __future__ import annotations

import ssl

from sbpstream.auth.config import TlsConfig


def server_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The listener's context; None when TLS is off. With ``ca`` set, client certificates are
    verified when presented, and demanded with ``require_client_cert`` (mutual TLS)."""
    if not cfg.server_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.cert, cfg.key)
    if cfg.ca:
        ctx.load_verify_locations(cfg.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """A context verifying servers against ``ca`` (certificate chain and host name); None when
    no CA is given (plain TCP). Presents ``cert``/``key`` when given (mutual TLS)."""
    if not cfg.client_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cfg.ca)
    if cfg.cert and cfg.key:
        ctx.load_cert_chain(cfg.cert, cfg.key)
    return ctx
