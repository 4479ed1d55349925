"""The Kafka gateway on a secure cluster (``up --secure --kafka-port``): a SASL_SSL listener,
SCRAM-SHA-256 relayed to the PM and PLAIN over TLS, each Kafka connection acting with its own
user's token, and the gateway's bounds (decompression, connections, pre-auth frames).

Real processes (a LocalCluster with TLS and auth, ``python -m sbpstream.kafka``) and real clients
(confluent-kafka, kafka-python); the raw-protocol tests speak Kafka over TLS with the gateway's
own codec to see exact error codes.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import lz4.frame
import pytest
from cluster_helpers import dev_certs
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from kafka import KafkaProducer
from scramp import ScramClient

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.config import CA_FILE
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.kafka import errors as E
from sbpstream.kafka.codec import INT32, decode, encode
from sbpstream.kafka.records import KAFKA_HEADER, MAX_INFLATED_BATCH_BYTES
from sbpstream.kafka.sasl import MAX_CONNECTIONS_PER_SOURCE, SASL_DEADLINE_S
from sbpstream.kafka.schemas import (
    API_VERSIONS,
    METADATA,
    PRODUCE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    SUPPORTED,
)

pytestmark = pytest.mark.timeout(300)

ADMIN = ("admin", "admin-pw")
ALICE = ("alice", "alice-pw")
TOKEN_TTL_S = 10
"""Short tokens, so a session's end is seen within a test (and the clients re-authenticate):
the PM's smallest ``--token-ttl-s``, as the session-lifetime test waits one out."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    d: Path = tmp_path_factory.mktemp("kafka-secure")
    with LocalCluster(d, datanodes=1, fsync="none", heartbeat_interval_ms=300,
                      node_timeout_ms=3000, secure=certs, kafka_port=0,
                      extra_pm_args=["--token-ttl-s", str(TOKEN_TTL_S)]) as c:
        asyncio.run(_setup(c, certs))
        yield c


async def _setup(c: LocalCluster, certs: Path) -> None:
    await bootstrap_admin(c.pm_address, certs, *ADMIN)
    async with AsyncClient(c.pm_address, user=ADMIN[0], password=ADMIN[1],
                           tls_ca=str(certs / CA_FILE)) as admin:
        await admin.add_user(*ALICE)
        await admin.add_user("bob", "bob-pw")  # no rules at all
        # topic T partition p is stream "T.p": prefix "orders." covers topic orders' streams
        await admin.add_acl("alice", "create,append,fetch,describe", "prefix:orders.")
        await admin.add_acl("alice", "fetch", "group:alice-group")
        await admin.create_streams(names=["payroll.0"])


def _addr(c: LocalCluster) -> str:
    assert c.kafka is not None
    return c.kafka.address


def _conf(c: LocalCluster, certs: Path, user: str, password: str,
          mechanism: str = "SCRAM-SHA-256") -> dict[str, Any]:
    return {"bootstrap.servers": _addr(c), "security.protocol": "SASL_SSL",
            "sasl.mechanisms": mechanism, "sasl.username": user, "sasl.password": password,
            "ssl.ca.location": str(certs / CA_FILE)}


# ------------------------------------------------------------------------ raw Kafka over TLS


class Raw:
    """One TLS connection speaking Kafka frames (the gateway's own codec)."""

    def __init__(self, c: LocalCluster, certs: Path) -> None:
        host, port = _addr(c).rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=str(certs / CA_FILE))
        self.sock = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30),
                                    server_hostname=host)
        self.cid = 0

    def call(self, api_key: int, version: int, req: dict[str, Any]) -> dict[str, Any]:
        api = SUPPORTED[api_key]
        self.cid += 1
        head = struct.pack(">hhih", api_key, version, self.cid, 4) + b"test"
        flexible = version >= api.request.flexible
        body = b"".join(encode(api.request, version, req))
        raw = head + (b"\x00" if flexible else b"") + body
        self.sock.sendall(INT32.pack(len(raw)) + raw)
        resp = self.recv_frame()
        assert INT32.unpack(resp[:4])[0] == self.cid
        skip = 5 if flexible and api_key != API_VERSIONS else 4
        return decode(api.response, version, resp, skip)

    def recv_frame(self) -> bytes:
        size = INT32.unpack(self._recv(4))[0]
        return self._recv(size)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def closed(self, timeout_s: float = 30) -> bool:
        """True once the gateway closes the connection (within ``timeout_s``)."""
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, ssl.SSLError):
            return True

    def scram(self, user: str, password: str) -> dict[str, Any]:
        """A SCRAM-SHA-256 login; the last SaslAuthenticate answer (v1)."""
        hs = self.call(SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-256"})
        assert hs["error_code"] == 0 and "SCRAM-SHA-256" in hs["mechanisms"]
        sc = ScramClient(["SCRAM-SHA-256"], user, password)
        first = self.call(SASL_AUTHENTICATE, 1, {"auth_bytes": sc.get_client_first().encode()})
        if first["error_code"]:
            return first
        sc.set_server_first(first["auth_bytes"].decode())
        final = self.call(SASL_AUTHENTICATE, 1, {"auth_bytes": sc.get_client_final().encode()})
        if final["error_code"] == 0:
            sc.set_server_final(final["auth_bytes"].decode())  # the PM proved it knows alice
        return final

    def close(self) -> None:
        self.sock.close()


def _metadata(r: Raw, topics: list[str] | None) -> dict[str, Any]:
    return r.call(METADATA, 9, {"topics": None if topics is None else [
        {"name": t} for t in topics], "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False})


# ------------------------------------------------------------------------------ real clients


def test_alice_produces_and_consumes_orders_with_confluent_kafka(
        cluster: LocalCluster, certs: Path) -> None:
    p = Producer({**_conf(cluster, certs, *ALICE), "enable.idempotence": True})
    errors: list[Any] = []
    for i in range(20):
        p.produce("orders", b"order-%d" % i, key=b"k",
                  on_delivery=lambda err, msg: errors.append(err) if err else None)
    assert p.flush(60) == 0
    assert errors == []
    cons = Consumer({**_conf(cluster, certs, *ALICE), "group.id": "alice-group",
                     "auto.offset.reset": "earliest", "enable.auto.commit": False})
    cons.subscribe(["orders"])
    got: list[bytes] = []
    deadline = time.monotonic() + 90
    try:
        while len(got) < 20 and time.monotonic() < deadline:
            for m in cons.consume(100, 1.0):
                assert m.error() is None, m.error()
                got.append(m.value())
        cons.commit(asynchronous=False)
    finally:
        cons.close()
    assert got == [b"order-%d" % i for i in range(20)]


def test_alice_is_refused_payroll_and_sees_only_her_topics(
        cluster: LocalCluster, certs: Path) -> None:
    p = Producer({**_conf(cluster, certs, *ALICE), "message.timeout.ms": 20_000})
    errs: list[KafkaError] = []
    p.produce("payroll", b"raise", on_delivery=lambda err, msg: errs.append(err))
    p.flush(60)
    assert len(errs) == 1 and errs[0] is not None
    assert errs[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    r = Raw(cluster, certs)
    try:
        assert r.scram(*ALICE)["error_code"] == 0
        listed = {t["name"] for t in _metadata(r, None)["topics"]}
        assert "payroll" not in listed
        (pay,) = _metadata(r, ["payroll"])["topics"]
        assert pay["error_code"] == E.TOPIC_AUTHORIZATION_FAILED
    finally:
        r.close()


def test_plain_over_tls_with_kafka_python(cluster: LocalCluster, certs: Path) -> None:
    prod = KafkaProducer(bootstrap_servers=_addr(cluster), security_protocol="SASL_SSL",
                         sasl_mechanism="PLAIN", sasl_plain_username=ALICE[0],
                         sasl_plain_password=ALICE[1],
                         ssl_context=ssl.create_default_context(cafile=str(certs / CA_FILE)),
                         api_version=(2, 4, 0))
    try:
        md = prod.send("orders.plain", b"via-plain").get(timeout=60)
        assert md.topic == "orders.plain" and md.offset == 0
    finally:
        prod.close(10)


def test_wrong_password_is_sasl_authentication_failed(
        cluster: LocalCluster, certs: Path) -> None:
    r = Raw(cluster, certs)
    try:
        assert r.scram("alice", "wrong")["error_code"] == E.SASL_AUTHENTICATION_FAILED
        assert r.closed()
    finally:
        r.close()
    # and a real client reports an authentication error, never data
    seen: list[KafkaError] = []
    p = Producer({**_conf(cluster, certs, "alice", "wrong"), "error_cb": seen.append})
    with pytest.raises(KafkaException):
        p.list_topics(timeout=5)
    deadline = time.monotonic() + 60
    while not any(e.code() == KafkaError._AUTHENTICATION for e in seen):
        assert time.monotonic() < deadline, seen
        p.poll(0.5)
    assert "wrong password" in next(e.str() for e in seen
                                    if e.code() == KafkaError._AUTHENTICATION)


def test_connection_without_sasl_is_closed(cluster: LocalCluster, certs: Path) -> None:
    r = Raw(cluster, certs)
    try:
        versions = r.call(API_VERSIONS, 3, {"client_software_name": "t",
                                            "client_software_version": "1"})
        assert {SASL_HANDSHAKE, SASL_AUTHENTICATE} <= {k["api_key"]
                                                       for k in versions["api_keys"]}
        r.sock.sendall(_raw_frame(METADATA, 1, 7, b"\xff\xff\xff\xff"))  # all topics, no login
        assert r.closed()
    finally:
        r.close()
    r = Raw(cluster, certs)  # SaslAuthenticate before SaslHandshake: ILLEGAL_SASL_STATE
    try:
        out = r.call(SASL_AUTHENTICATE, 1, {"auth_bytes": b"n,,n=alice,r=abc"})
        assert out["error_code"] == E.ILLEGAL_SASL_STATE
        assert r.closed()
    finally:
        r.close()
    r = Raw(cluster, certs)
    try:
        hs = r.call(SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-512"})
        assert hs["error_code"] == E.UNSUPPORTED_SASL_MECHANISM
        assert hs["mechanisms"] == ["SCRAM-SHA-256", "PLAIN"]
    finally:
        r.close()


def test_bob_without_rules_gets_authorization_errors(cluster: LocalCluster, certs: Path
                                                     ) -> None:
    r = Raw(cluster, certs)
    try:
        assert r.scram("bob", "bob-pw")["error_code"] == 0
        assert _metadata(r, None)["topics"] == []  # describes nothing
        pid = r.call(22, 1, {"transactional_id": None, "transaction_timeout_ms": 1000})
        assert pid["error_code"] == E.CLUSTER_AUTHORIZATION_FAILED
        fc = r.call(10, 1, {"key": "alice-group", "key_type": 0})
        assert fc["error_code"] == E.GROUP_AUTHORIZATION_FAILED
    finally:
        r.close()


def _raw_frame(api_key: int, version: int, cid: int, body: bytes) -> bytes:
    raw = struct.pack(">hhih", api_key, version, cid, 4) + b"test" + body
    return INT32.pack(len(raw)) + raw


# ---------------------------------------------------------------------------------- sessions


def test_session_lifetime_is_reported_and_ends_the_connection(
        cluster: LocalCluster, certs: Path) -> None:
    r = Raw(cluster, certs)
    try:
        final = r.scram(*ALICE)
        assert final["error_code"] == 0
        lifetime = final["session_lifetime_ms"]
        assert 0 < lifetime <= TOKEN_TTL_S * 1000
        assert "brokers" in _metadata(r, None)  # served while the session lives
        # past the token's life the gateway closes the connection (the client did not
        # re-authenticate): within the lifetime plus a margin for a loaded machine
        assert r.closed(lifetime / 1000 + 30)
    finally:
        r.close()


def test_unauthenticated_connection_is_closed_after_the_deadline(
        cluster: LocalCluster, certs: Path) -> None:
    r = Raw(cluster, certs)
    try:
        r.call(SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-256"})
        assert r.closed(SASL_DEADLINE_S + 30)
    finally:
        r.close()


def test_big_frame_before_login_is_refused(cluster: LocalCluster, certs: Path) -> None:
    r = Raw(cluster, certs)
    try:
        r.sock.sendall(INT32.pack(1024 * 1024) + b"\x00" * 4096)
        assert r.closed()
    finally:
        r.close()


# ------------------------------------------------------------------------------------ bounds


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _lz4_bomb(target_bytes: int) -> bytes:
    """An lz4 frame of about ``target_bytes`` that inflates ~250 times: one compressed block of
    4 MiB of zeros, repeated (blocks independent, no checksums)."""
    one = lz4.frame.compress(b"\x00" * (4 << 20), block_size=lz4.frame.BLOCKSIZE_MAX4MB,
                             block_linked=False, content_checksum=False, store_size=False)
    header, block, end = one[:7], one[7:-4], one[-4:]
    return header + block * (target_bytes // len(block)) + end


def _batch(section: bytes, codec: int) -> bytes:
    fields = [0, 0, 0, 2, 0, codec, 0, 1_700_000_000_000, 1_700_000_000_000, -1, -1, -1, 1]
    raw = bytearray(KAFKA_HEADER.pack(*fields) + section)
    struct.pack_into(">i", raw, 8, len(raw) - 12)
    struct.pack_into(">I", raw, 17, crc32c.crc32c(bytes(raw[21:])))
    return bytes(raw)


def test_lz4_bomb_is_refused_without_inflating(cluster: LocalCluster, certs: Path) -> None:
    assert cluster.kafka is not None and cluster.kafka.proc is not None
    pid = cluster.kafka.proc.pid
    bomb = _batch(_lz4_bomb(31 << 20), 3)  # ~31 MiB that inflate to ~7.7 GiB
    assert len(bomb) > 30 << 20
    r = Raw(cluster, certs)
    try:
        assert r.scram(*ALICE)["error_code"] == 0
        before = _rss_kib(pid, "VmRSS")
        out = r.call(PRODUCE, 7, {"transactional_id": None, "acks": -1, "timeout_ms": 30000,
                                  "topic_data": [{"name": "orders", "partition_data": [
                                      {"index": 0, "records": bomb}]}]})
        code = out["responses"][0]["partition_responses"][0]["error_code"]
        assert code == E.MESSAGE_TOO_LARGE
        peak = _rss_kib(pid, "VmHWM")
        # the request (31 MiB, read and decoded) plus at most one batch's bound of output
        bound_kib = before + (4 * (31 << 20) + 2 * MAX_INFLATED_BATCH_BYTES) // 1024
        assert peak < bound_kib, (before, peak)
        assert _metadata(r, None)["brokers"]  # still serving this connection
    finally:
        r.close()


def test_connections_over_the_per_source_cap_are_closed(
        cluster: LocalCluster, certs: Path) -> None:
    held: list[Raw] = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_SOURCE):
            r = Raw(cluster, certs)
            held.append(r)
            r.call(API_VERSIONS, 0, {})  # served: the gateway counts it now
        extra = Raw(cluster, certs)
        try:
            assert extra.closed()
        finally:
            extra.close()
    finally:
        for r in held:
            r.close()
    # the cap counts open connections: once those close, a new one is served
    deadline = time.monotonic() + 30
    while True:
        r = Raw(cluster, certs)
        try:
            r.call(API_VERSIONS, 0, {})
            break
        except (ConnectionError, ssl.SSLError):
            assert time.monotonic() < deadline, "the cap was not released"
        finally:
            r.close()


# ---------------------------------------------------------------------------- startup, up


@pytest.mark.parametrize(("args", "says"), [
    (["--listener", "SASL_PLAINTEXT", "--host", "0.0.0.0"], "--allow-sasl-plaintext"),
    (["--listener", "SASL_SSL"], "--tls-cert and --tls-key"),
    (["--listener", "SSL", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"],
     "no such file"),
])
def test_gateway_refuses_unsafe_or_incomplete_listeners(args: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "sbpstream.kafka", "--port", "0", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert says in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_secure_cluster_prints_the_settings_its_gateway_takes(cluster: LocalCluster,
                                                              certs: Path) -> None:
    assert cluster.kafka is not None
    text = cluster.kafka_settings()
    ca = str((certs / CA_FILE).resolve())
    assert f"-X ssl.ca.location={ca}" in text and "security.protocol=SASL_SSL" in text
    assert "sasl.mechanisms=SCRAM-SHA-256" in text and f"-b {_addr(cluster)}" in text
    assert cluster.kafka.args[cluster.kafka.args.index("--listener") + 1] == "SASL_SSL"
