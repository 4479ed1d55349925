"""Security settings shared by the PM, the data node and every client (docs/security.md)."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sbpstream.net.tls import TlsConfig
from sbpstream.private_files import refuse_shared, write_private

DEFAULT_TOKEN_TTL_S: Final = 600
"""How long a token the PM issues stays valid. Short, because ACL changes and a deleted user
take effect at the next token; long enough that renewals (at 80% of it) are rare."""

CA_FILE: Final = "ca.pem"
SERVER_CERT: Final = "server.pem"
SERVER_KEY: Final = "server-key.pem"
CLIENT_CERT: Final = "client.pem"
CLIENT_KEY: Final = "client-key.pem"
SECRET_FILE: Final = "cluster.secret"
"""The files ``sbpstream certs init DIR`` writes (sbpstream.auth.certs)."""

SECRET_BYTES: Final = 32
"""The cluster secret: 256 bits, the key size of HMAC-SHA-256."""

@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """A server's security settings: TLS, auth on/off, the cluster secret, protected mode."""

    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: bool = False
    """On: every connection authenticates (SCRAM or a token) before anything but PING."""
    secret_file: str = ""
    """The cluster secret (hex) that signs and verifies tokens; PM and data nodes share it."""
    token_ttl_s: int = DEFAULT_TOKEN_TTL_S
    allow_remote_unauthenticated: bool = False
    """Protected mode off: with auth off, still serve clients beyond loopback."""
    allow_insecure_auth: bool = False
    """Serve auth without TLS on an address beyond loopback (passwords and tokens in clear)."""

    def validate(self, host: str | None = None) -> None:
        """ValueError, one line naming the fix, for settings a server must not start with.
        ``host``: the address it binds, for :func:`check_auth_transport`."""
        self.tls.validate()
        if self.auth and not self.secret_file:
            raise ValueError("--auth needs --secret-file (the cluster secret signing tokens)")
        if self.secret_file:
            read_secret(self.secret_file)  # present, private, well-formed
        if self.token_ttl_s < 10:
            raise ValueError("--token-ttl-s must be >= 10")
        if host is not None:
            check_auth_transport(self, host)

    def secret(self) -> bytes:
        return read_secret(self.secret_file)


def check_auth_transport(cfg: SecurityConfig, host: str) -> None:
    """The one place both launchers (``sbpstream pm|datanode`` and ``python -m
    sbpstream.pm|.datanode``) refuse auth without TLS on an address beyond loopback: SCRAM
    exchanges and tokens would cross the network in clear, and a token is a bearer credential.
    On loopback it is allowed (nothing leaves the machine); ``--allow-insecure-auth`` allows it
    anywhere."""
    if (cfg.auth and not cfg.tls.server_enabled and not cfg.allow_insecure_auth
            and not is_loopback_host(host)):
        raise ValueError(
            f"--auth without TLS on --host {host}: tokens and logins would cross the network "
            "in clear; add --tls-cert/--tls-key/--tls-ca (`sbpstream certs init DIR` makes "
            "them), bind 127.0.0.1, or pass --allow-insecure-auth")


def read_secret(path: str) -> bytes:
    """The cluster secret in ``path``: refused (ValueError naming the fix) when missing,
    readable by group or others, not hex or shorter than 16 bytes."""
    refuse_shared(path, "--secret-file")
    text = Path(path).read_text().strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError as e:
        raise ValueError(f"{path}: the cluster secret must be hex") from e
    if len(raw) < 16:
        raise ValueError(f"{path}: the cluster secret must be at least 16 bytes")
    return raw


def write_secret(path: Path) -> None:
    """A fresh random cluster secret, readable by its owner only (0600 whatever the umask)."""
    write_private(path, (secrets.token_hex(SECRET_BYTES) + "\n").encode())


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach (``localhost`` counts)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
