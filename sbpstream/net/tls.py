"""TLS for SBP listeners and connections, below every server and client: the PEM files a
server or client is given (:class:`TlsConfig`) and the SSL contexts made from them (TLS 1.2+;
1.3 where both ends have it).

A missing, unreadable or non-PEM CA, certificate or key raises :class:`TlsFileError` (a
ValueError) with one line naming the file and the fix, never a bare FileNotFoundError or
ssl.SSLError: the SDK, the CLI, the servers and the admin port all build their contexts here.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Final

from sbpstream.private_files import refuse_shared

__all__ = ["TLS_FILE_ROLES", "TlsConfig", "TlsFileError", "check_readable", "client_context",
           "server_context", "tls_file_error"]

TLS_FILE_ROLES: Final = {
    "ca": ("--tls-ca", "$SBPSTREAM_TLS_CA", "tls_ca=",
           "the CA that signed the servers' certificates (`sbpstream up --secure` prints its "
           "path; `sbpstream certs init DIR` writes DIR/ca.pem)"),
    "cert": ("--tls-cert", "$SBPSTREAM_TLS_CERT", "tls_cert=",
             "a PEM certificate chain (`sbpstream certs init DIR` writes DIR/server.pem)"),
    "key": ("--tls-key", "$SBPSTREAM_TLS_KEY", "tls_key=",
            "the PEM private key of the certificate (`sbpstream certs init DIR` writes "
            "DIR/server-key.pem)"),
}
"""For each TLS file: the flag, variable and SDK argument that name it, and what it should be;
an error about the file names all three, since any of them may have given the path."""


class TlsFileError(ValueError):
    """A TLS file (CA, certificate or key) is missing, unreadable or not PEM: the message is one
    line naming the file, where its path comes from and what to give instead."""


def tls_file_error(role: str, path: str, problem: str, server: bool = False) -> TlsFileError:
    """``server``: the path came from a server's flag (no SDK argument or variable there)."""
    flag, env, arg, wanted = TLS_FILE_ROLES[role]
    if server:
        return TlsFileError(f"{flag} {path}: {problem}; give {wanted}")
    what = {"ca": "CA", "cert": "certificate", "key": "key"}[role]
    return TlsFileError(f"TLS {what} file {path} (from {flag}, {env} or {arg}): {problem}; "
                        f"give {wanted}")


def check_readable(role: str, path: str, server: bool = False) -> None:
    """TlsFileError when the TLS file ``path`` (``role``: ca, cert or key) cannot be read."""
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise tls_file_error(role, path, "no such file", server) from None
    except IsADirectoryError:
        raise tls_file_error(role, path, "is a directory, not a file", server) from None
    except OSError as e:
        raise tls_file_error(role, path, f"cannot read it ({e.strerror})", server) from None


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM files. A server needs ``cert`` and ``key``; a client needs ``ca`` to verify servers.
    A server given ``ca`` and ``require_client_cert`` demands client certificates (mutual TLS);
    a client given ``cert`` and ``key`` presents one."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    require_client_cert: bool = False

    @property
    def server_enabled(self) -> bool:
        return bool(self.cert and self.key)

    @property
    def client_enabled(self) -> bool:
        return bool(self.ca)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        for role, path in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            if path:
                check_readable(role, path, server=True)
        if self.key:  # a private key others can read is no longer private
            refuse_shared(self.key, "--tls-key")
        if self.require_client_cert and not self.ca:
            raise ValueError("--tls-require-client-cert needs --tls-ca to verify clients")



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
