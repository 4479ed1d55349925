"""Security settings shared by the PM, the data node and every client (docs/security.md)."""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

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
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.require_client_cert and not self.ca:
            raise ValueError("--tls-require-client-cert needs --tls-ca to verify clients")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """A server's security settings: TLS, auth on/off, the cluster secret, protected mode."""

    tls: TlsConfig = TlsConfig()
    auth: bool = False
    """On: every connection authenticates (SCRAM or a token) before anything but PING."""
    secret_file: str = ""
    """The cluster secret (hex) that signs and verifies tokens; PM and data nodes share it."""
    token_ttl_s: int = DEFAULT_TOKEN_TTL_S
    allow_remote_unauthenticated: bool = False
    """Protected mode off: with auth off, still serve clients beyond loopback."""

    def validate(self) -> None:
        self.tls.validate()
        if self.auth and not self.secret_file:
            raise ValueError("--auth needs --secret-file (the cluster secret signing tokens)")
        if self.secret_file and not Path(self.secret_file).is_file():
            raise ValueError(f"--secret-file {self.secret_file}: no such file")
        if self.token_ttl_s < 10:
            raise ValueError("--token-ttl-s must be >= 10")

    def secret(self) -> bytes:
        return read_secret(self.secret_file)


def read_secret(path: str) -> bytes:
    text = Path(path).read_text().strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError as e:
        raise ValueError(f"{path}: the cluster secret must be hex") from e
    if len(raw) < 16:
        raise ValueError(f"{path}: the cluster secret must be at least 16 bytes")
    return raw


def write_secret(path: Path) -> None:
    """A fresh random cluster secret, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach (``localhost`` counts)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
