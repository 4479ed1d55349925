"""One gate for every door (issue 31): the same principals asking the same operations through
each entrance of one secure cluster get the same answer.

Entrances: SBP (the SDK), the admin HTTP port, and the Kafka gateway (SASL_SSL, confluent-kafka).
Principals: ``admin`` (everything on ``*``), ``alice`` (one grant: create, append, fetch and
describe on ``prefix:orders.``), ``bob`` (no rule) and nobody (no credentials). Operations on a
stream alice's grant covers (``orders.0``, the Kafka topic ``orders``) and one it does not
(``payroll.0``, topic ``payroll``). A door that does not offer an operation (the admin port
does not append) is left out; every other cell is asked for real and checked.

tests/test_admin_gate.py walks the admin port's routes in depth, tests/test_kafka_security.py
the gateway's SASL and bounds, tests/test_security.py the SBP opcodes one by one.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import http.client
import json
import ssl
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    AuthenticationRequiredError,
    AuthorizationFailedError,
    SbpError,
)

pytestmark = pytest.mark.timeout(600)

PASSWORDS = {"admin": "admin-pw", "alice": "alice-pw", "bob": "bob-pw"}
PRINCIPALS = ("admin", "alice", "bob", None)
KAFKA_TIMEOUT_S = 20.0
"""A hang guard for one Kafka client call on a loaded machine, not a measurement."""
NOBODY_TIMEOUT_S = 5.0
"""How long a client without SASL is given: the gateway never answers it, so each of its cells
waits this out (a bound; a gateway that let it in would answer at once, and fail the cell)."""
HTTP_TIMEOUT_S = 20.0

OK, DENIED, UNAUTHENTICATED = "ok", "denied", "unauthenticated"

OPS = ("list", "describe", "append", "fetch", "create", "admin")
TARGETS = ("orders", "payroll")


def expected(who: str | None, op: str, target: str) -> str:
    """What the ACLs say, whatever the door."""
    if who is None:
        return UNAUTHENTICATED
    if who == "admin":
        return OK
    if op == "list":
        return OK  # a listing answers, filtered (checked separately: see ``listed``)
    if who == "alice" and target == "orders" and op != "admin":
        return OK
    return DENIED


def listed(who: str | None) -> set[str]:
    """The streams a listing shows the principal."""
    return {"admin": {"orders", "payroll"}, "alice": {"orders"}}.get(who or "", set())


@dataclass(slots=True)
class Env:
    cluster: LocalCluster
    certs: Path
    ids: dict[str, int]

    @property
    def ca(self) -> str:
        return str(self.certs / CA_FILE)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    certs: Path = tmp_path_factory.mktemp("certs")
    init_dev_certs(certs)
    d: Path = tmp_path_factory.mktemp("matrix")
    with LocalCluster(d, datanodes=1, fsync="none", heartbeat_interval_ms=300,
                      node_timeout_ms=3000, secure=certs, kafka_port=0,
                      metrics_port=free_port()) as c:
        ids = asyncio.run(_setup(c, certs))
        yield Env(c, certs, ids)


async def _setup(c: LocalCluster, certs: Path) -> dict[str, int]:
    await bootstrap_admin(c.pm_address, certs, "admin", PASSWORDS["admin"])
    async with AsyncClient(c.pm_address, user="admin", password=PASSWORDS["admin"],
                           tls_ca=str(certs / CA_FILE)) as admin:
        for user in ("alice", "bob"):
            await admin.add_user(user, PASSWORDS[user])
        await admin.add_acl("alice", "create,append,fetch,describe", "prefix:orders.")
        # a Kafka consumer names a group even when it only assigns partitions
        await admin.add_acl("alice", "fetch", "group-prefix:matrix-")
        # topic T partition p is the stream "T.p" (docs/kafka.md)
        created = await admin.create_streams(names=["orders.0", "payroll.0"])
        ids = {"orders": created[0], "payroll": created[1]}
        async with admin.producer(linger_ms=1) as p:
            for sid in ids.values():
                await (await p.send(sid, b"seed"))
    return ids


# ------------------------------------------------------------------------------------- SBP


async def _sbp(env: Env, who: str | None, op: str, target: str) -> tuple[str, set[str]]:
    creds: dict[str, Any] = {} if who is None else {"user": who, "password": PASSWORDS[who]}
    seen: set[str] = set()
    try:
        async with AsyncClient(env.cluster.pm_address, tls_ca=env.ca, retry_deadline_ms=10_000,
                               **creds) as c:
            sid = env.ids[target]
            if op == "list":
                seen = {s.name.split(".")[0] for s in await c.list_streams()}
            elif op == "describe":
                await c.describe_stream(sid)
            elif op == "append":
                async with c.producer(linger_ms=1) as p:
                    await (await p.send(sid, b"x"))
            elif op == "fetch":
                cons = c.consumer(sid, "earliest", end=1)
                try:
                    got: list[Any] = []
                    while not got:
                        got = await cons.poll(timeout_ms=5_000)
                finally:
                    await cons.close()
            elif op == "create":
                await c.create_stream(name=f"{target}.sbp-{uuid.uuid4().hex[:8]}")
            elif op == "admin":
                await c.add_user(f"u{uuid.uuid4().hex[:8]}", "pw-12345678")
    except (AuthenticationRequiredError, AuthenticationFailedError):
        return UNAUTHENTICATED, seen
    except AuthorizationFailedError:
        return DENIED, seen
    except SbpError as exc:  # anything else is a failure of the test, with its reason
        pytest.fail(f"SBP {op} {target} as {who}: {type(exc).__name__}: {exc}")
    return OK, seen


# ------------------------------------------------------------------------------- admin HTTP


def _http(env: Env, who: str | None, op: str, target: str) -> tuple[str, set[str]] | None:
    sid = env.ids[target]
    path = {"list": "/v1/streams?top=1000", "describe": f"/v1/streams/{sid}",
            "fetch": f"/v1/streams/{sid}/tail?n=1"}.get(op)
    if path is None:
        return None  # the admin port offers no append, create or user administration
    headers = {}
    if who is not None:
        basic = base64.b64encode(f"{who}:{PASSWORDS[who]}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    ctx = ssl.create_default_context(cafile=env.ca)
    assert env.cluster.metrics_port is not None
    conn = http.client.HTTPSConnection("127.0.0.1", env.cluster.metrics_port,
                                       context=ctx, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        status, body = resp.status, resp.read()
    finally:
        conn.close()
    if status == 401:
        return UNAUTHENTICATED, set()
    if status == 403:
        return DENIED, set()
    assert status == 200, (path, who, status, body[:300])
    seen: set[str] = set()
    if op == "list":
        by_id = {v: k for k, v in env.ids.items()}
        seen = {by_id[int(r["stream_id"])] for r in json.loads(body)["streams"]
                if int(r["stream_id"]) in by_id}
    return OK, seen


# ----------------------------------------------------------------------------- Kafka gateway


def _kafka_conf(env: Env, who: str | None) -> dict[str, Any]:
    assert env.cluster.kafka is not None
    conf: dict[str, Any] = {"bootstrap.servers": env.cluster.kafka.address,
                            "ssl.ca.location": env.ca}
    if who is None:
        conf["security.protocol"] = "SSL"  # TLS, no SASL: the gateway wants a login first
    else:
        conf.update({"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-256",
                     "sasl.username": who, "sasl.password": PASSWORDS[who]})
    return conf


def _kafka_code(err: KafkaError) -> str:
    code = err.code()
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                KafkaError.GROUP_AUTHORIZATION_FAILED):
        return DENIED
    if code in (KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION,
                KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
                KafkaError._MSG_TIMED_OUT):
        return UNAUTHENTICATED
    raise AssertionError(f"unexpected Kafka error {err}")


def _kafka(env: Env, who: str | None, op: str, target: str) -> tuple[str, set[str]] | None:
    if op == "admin":
        return None  # users and ACLs are not administered through Kafka
    conf = _kafka_conf(env, who)
    bound = KAFKA_TIMEOUT_S if who is not None else NOBODY_TIMEOUT_S
    errors: list[KafkaError] = []
    conf["error_cb"] = errors.append
    if op in ("list", "describe", "create"):
        admin = AdminClient(conf)
        try:
            if op == "create":
                name = f"{target}.k{uuid.uuid4().hex[:6]}"  # its stream: "orders.kXXXXXX.0"
                fut = admin.create_topics([NewTopic(name, 1, 1)],
                                          request_timeout=bound)[name]
                fut.result(timeout=bound)
                return OK, set()
            md = admin.list_topics(topic=None if op == "list" else target,
                                   timeout=bound)
        except KafkaException as exc:
            return _kafka_code(exc.args[0]), set()
        except concurrent.futures.TimeoutError:  # never logged in: no answer to the request
            assert who is None, (op, target, errors)
            return UNAUTHENTICATED, set()
        if op == "list":
            return OK, {t for t in md.topics if t in TARGETS}
        t = md.topics[target]
        return (OK, set()) if t.error is None else (_kafka_code(t.error), set())
    if op == "append":
        producer = Producer({**conf, "message.timeout.ms": int(bound * 1000)})
        result: list[str] = []

        def delivered(err: KafkaError | None, msg: Any) -> None:
            result.append(OK if err is None else _kafka_code(err))

        producer.produce(target, b"x", partition=0, on_delivery=delivered)
        producer.flush(bound * 2)
        assert result, f"no delivery report for {target} as {who}"
        return result[0], set()
    consumer = Consumer({**conf, "group.id": f"matrix-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        # subscribed topics get their authorization errors reported (assigned ones do not)
        consumer.subscribe([target])
        for _ in range(int(KAFKA_TIMEOUT_S)):
            msg = consumer.poll(1.0)
            if msg is not None:
                if msg.error() is None:
                    return OK, set()
                return _kafka_code(msg.error()), set()
            if errors:
                return _kafka_code(errors[-1]), set()
        raise AssertionError(f"no answer to a Kafka fetch of {target} as {who}")
    finally:
        consumer.close()


# ------------------------------------------------------------------------------------ matrix


Door = Callable[[Env, str | None, str, str], tuple[str, set[str]] | None]


def _sbp_door(env: Env, who: str | None, op: str, target: str) -> tuple[str, set[str]] | None:
    return asyncio.run(_sbp(env, who, op, target))


DOORS: dict[str, Door] = {"sbp": _sbp_door, "http": _http, "kafka": _kafka}

CELLS = [(door, who, op, target) for door in DOORS for who in PRINCIPALS for op in OPS
         for target in TARGETS if not (op in ("list", "admin") and target == "payroll")]


@pytest.mark.parametrize(("door", "who", "op", "target"), CELLS,
                         ids=[f"{d}-{w or 'nobody'}-{o}-{t}" for d, w, o, t in CELLS])
def test_every_door_answers_as_the_acls_say(env: Env, door: str, who: str | None, op: str,
                                            target: str) -> None:
    got = DOORS[door](env, who, op, target)
    if got is None:
        pytest.skip(f"the {door} door offers no {op}")
    outcome, seen = got
    assert outcome == expected(who, op, target), (door, who, op, target)
    if op == "list" and outcome == OK:
        assert seen == listed(who), (door, who, seen)
