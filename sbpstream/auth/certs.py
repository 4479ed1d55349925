"""``sbpstream certs init DIR``: a development CA and certificates (the ``cryptography`` library).

Writes into DIR: ``ca.pem`` (the CA every client trusts: ``--tls-ca``), ``ca-key.pem``,
``server.pem``/``server-key.pem`` (for every PM and data node: ``--tls-cert``/``--tls-key``;
names: localhost, 127.0.0.1, ::1, this host's name, and any ``--host`` given),
``client.pem``/``client-key.pem`` (for mutual TLS), and ``cluster.secret`` (the token key shared
by PMs and data nodes: ``--secret-file``). Keys are ECDSA P-256, private files 0600 in a
0700 directory whatever the umask. Development only:
the CA key sits next to the certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sbpstream.auth.config import (
    CA_FILE,
    CLIENT_CERT,
    CLIENT_KEY,
    SECRET_FILE,
    SERVER_CERT,
    SERVER_KEY,
    write_secret,
)
from sbpstream.private_files import private_dir, write_private

CERT_VALIDITY_DAYS: Final = 365
"""Development certificates: a year, so a dev cluster does not expire mid-project."""

PUBLIC_FILE_MODE: Final = 0o644
"""Certificates are public: anyone may read them (the directory is 0700 all the same)."""


def _write(path: Path, data: bytes, private: bool) -> None:
    if private:
        write_private(path, data)  # 0600 whatever the umask
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PUBLIC_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sbpstream dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _sans(hosts: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, cn: str,
           hosts: Sequence[str], usages: Sequence[x509.ObjectIdentifier]
           ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False))
    if hosts:
        b = b.add_extension(x509.SubjectAlternativeName(_sans(hosts)), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def init_dev_certs(directory: Path, hosts: Sequence[str] = ()) -> list[Path]:
    """Make a CA, a server and a client certificate and a cluster secret in ``directory``."""
    private_dir(directory)  # 0700: it holds the CA key and the cluster secret
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("sbpstream dev CA")
    now = datetime.datetime.now(datetime.UTC)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), *hosts]
    # servers are clients too (data node to PM and to each other): both usages
    server, server_key = _issue(ca_key, ca_name, "sbpstream server", names,
                                (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH))
    client, client_key = _issue(ca_key, ca_name, "sbpstream client", (),
                                (ExtendedKeyUsageOID.CLIENT_AUTH,))
    pem = serialization.Encoding.PEM
    files = {
        CA_FILE: (ca.public_bytes(pem), False),
        "ca-key.pem": (_key_pem(ca_key), True),
        SERVER_CERT: (server.public_bytes(pem) + ca.public_bytes(pem), False),
        SERVER_KEY: (_key_pem(server_key), True),
        CLIENT_CERT: (client.public_bytes(pem) + ca.public_bytes(pem), False),
        CLIENT_KEY: (_key_pem(client_key), True),
    }
    out = []
    for name, (data, private) in files.items():
        _write(directory / name, data, private)
        out.append(directory / name)
    write_secret(directory / SECRET_FILE)
    out.append(directory / SECRET_FILE)
    return out
