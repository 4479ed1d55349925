"""Security units, no network: tokens, ACL matching, SCRAM, the gate's refusals (issue 23)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from scramp import ScramClient

from sbpstream.auth import scram, tokens
from sbpstream.auth.acl import AclRule, Op, Permissions, check_resource, parse_ops
from sbpstream.auth.gate import (
    DATANODE_PM_ONLY,
    DATANODE_RULES,
    PM_NODE_ONLY,
    ServerAuth,
    check_data_node,
    set_claims,
)
from sbpstream.auth.names import StreamNames
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    AuthenticationRequiredError,
    AuthorizationFailedError,
    ErrorCode,
    InvalidRequestError,
    TokenExpiredError,
    kind_of,
)
from sbpstream.protocol.opcodes import Opcode

SECRET = b"s" * 32
KEY = tokens.derive_key(SECRET)
NOW = 1_700_000_000_000


def _claims(kind: str = tokens.KIND_USER, exp: int = NOW + 60_000,
            acls: tuple[AclRule, ...] = ()) -> tokens.Claims:
    return tokens.Claims("alice", kind, NOW, exp, acls)


def test_token_round_trip_and_refusals() -> None:
    rule = AclRule("alice", frozenset({Op.APPEND}), "stream:7")
    tok = tokens.sign(_claims(acls=(rule,)), KEY)
    assert tokens.verify(tok, KEY, NOW) == _claims(acls=(rule,))
    assert tokens.peek(tok) == (NOW, NOW + 60_000)
    with pytest.raises(AuthenticationFailedError):  # forged: another secret
        tokens.verify(tokens.sign(_claims(), tokens.derive_key(b"x" * 32)), KEY, NOW)
    head, payload, mac = tok.split(".")
    node = tokens.sign(_claims(kind=tokens.KIND_NODE), KEY).split(".")[1]
    with pytest.raises(AuthenticationFailedError):  # a user token promoted to node
        tokens.verify(f"{head}.{node}.{mac}", KEY, NOW)
    for bad in ("", "v1", "v2.a.b", f"{head}.{payload}", f"{head}.{payload}.!!", "x" * 70_000):
        with pytest.raises(AuthenticationFailedError):
            tokens.verify(bad, KEY, NOW)
    with pytest.raises(TokenExpiredError):
        tokens.verify(tok, KEY, NOW + 60_000)
    assert kind_of(ErrorCode.TOKEN_EXPIRED).value == "retriable"  # re-authenticate, retry


def test_acl_matching_by_stream_prefix_and_star() -> None:
    p = Permissions([
        AclRule("a", frozenset({Op.APPEND, Op.FETCH}), "stream:42"),
        AclRule("a", frozenset({Op.DESCRIBE}), "prefix:orders."),
    ])
    assert p.allows(Op.APPEND, 42) and p.allows(Op.FETCH, 42)
    assert not p.allows(Op.APPEND, 43) and not p.allows(Op.DELETE, 42)
    # prefix rules match stream names, never the decimal id; unnamed streams only by id or *
    assert p.allows(Op.DESCRIBE, 7, "orders.eu") and p.allows(Op.DESCRIBE, None, "orders.x")
    assert not p.allows(Op.DESCRIBE, 7, "payments") and not p.allows(Op.DESCRIBE, 7, "")
    assert not p.allows(Op.DESCRIBE, 7) and not p.allows(Op.DESCRIBE, 7, "orders")
    assert p.needs_name(Op.DESCRIBE, 7) and not p.needs_name(Op.APPEND, 7)
    assert p.allows(Op.DESCRIBE, 42)  # append and fetch imply describe, as in Kafka
    assert not p.allows(Op.CREATE) and not p.allows(Op.ADMIN)
    assert p.allows_pattern(Op.DESCRIBE, "orders.eu-") and not p.allows_pattern(Op.DESCRIBE, "o")
    digits = Permissions([AclRule("d", frozenset({Op.FETCH}), "prefix:1")])
    assert not digits.allows(Op.FETCH, 12) and not digits.allows(Op.FETCH, 12, "")
    star = Permissions([AclRule("b", frozenset({Op.CREATE, Op.ADMIN}), "*")])
    assert star.allows(Op.CREATE) and star.allows(Op.ADMIN) and not star.allows(Op.FETCH, 1)
    assert star.allows(Op.CREATE, None, "anything") and not star.needs_name(Op.CREATE, 3)
    prefix_admin = Permissions([AclRule("c", frozenset({Op.ADMIN}), "prefix:")])
    assert not prefix_admin.allows(Op.ADMIN)  # admin counts on * only
    assert Permissions([]).allows(Op.DESCRIBE, 1) is False  # default deny


def test_acl_groups() -> None:
    p = Permissions([
        AclRule("a", frozenset({Op.FETCH}), "group:etl"),
        AclRule("a", frozenset({Op.DESCRIBE}), "group-prefix:team-"),
    ])
    assert p.allows_group(Op.FETCH, "etl") and not p.allows_group(Op.FETCH, "etl2")
    assert p.allows_group(Op.DESCRIBE, "team-a") and not p.allows_group(Op.FETCH, "team-a")
    assert p.allows_group(Op.DESCRIBE, "etl")  # reading a group implies describing it
    assert not p.allows(Op.FETCH, 1, "etl")  # group rules say nothing about streams
    assert Permissions([AclRule("s", frozenset({Op.FETCH}), "*")]).allows_group(Op.FETCH, "x")
    assert not Permissions([AclRule("s", frozenset({Op.FETCH}), "prefix:x")]).allows_group(
        Op.FETCH, "x")
    assert check_resource("group:a*b") == "group:a*b"


def test_stream_names_cache_is_bounded_and_looks_up_once() -> None:
    asked: list[list[int]] = []

    async def lookup(ids: Sequence[int]) -> Mapping[int, str]:
        asked.append(list(ids))
        await asyncio.sleep(0)
        return {i: ("" if i == 3 else f"s{i}") for i in ids if i != 9}

    async def run() -> None:
        names = StreamNames(lookup, max_names=3)
        a, b = await asyncio.gather(names.resolve([1, 2, 3, 9]), names.resolve([2, 3]))
        assert a == {1: "s1", 2: "s2", 3: ""} and b == {2: "s2", 3: ""}
        assert asked == [[1, 2, 3, 9]]  # the second waited for the first's lookup
        assert await names.resolve([1, 9]) == {1: "s1"}
        assert asked[-1] == [9]  # unknown ids are not remembered
        await names.resolve([4])
        assert len(names) == 3  # least recently used dropped

    asyncio.run(run())


def test_acl_parsing() -> None:
    assert parse_ops("all") == frozenset(Op)
    assert parse_ops(" append , fetch ") == {Op.APPEND, Op.FETCH}
    assert check_resource("stream:007") == "stream:7"
    for bad_ops in ("", "read", "append,bogus"):
        with pytest.raises(InvalidRequestError):
            parse_ops(bad_ops)
    for bad_res in ("stream:x", "prefix:", "topic:a", "**"):
        with pytest.raises(InvalidRequestError):
            check_resource(bad_res)


def _scram(user: str, password: str, cred: scram.Credential | None) -> bytes:
    client = ScramClient([scram.MECHANISM], user, password)
    first = client.get_client_first().encode()
    login = scram.ScramLogin(scram.client_first_user(first), cred)
    client.set_server_first(login.first(first).decode())
    return login.final(client.get_client_final().encode())


def test_scram_exchange() -> None:
    cred = scram.make_credential("right")
    assert b"right" not in cred.to_json().encode()
    assert scram.Credential.from_json(cred.to_json()) == cred
    assert _scram("alice", "right", cred).startswith(b"v=")
    with pytest.raises(AuthenticationFailedError):
        _scram("alice", "wrong", cred)
    with pytest.raises(AuthenticationFailedError):  # unknown user: fails at the same step
        _scram("nobody", "right", None)
    assert scram.client_first_user(b"n,,n=a=2Cb=3Dc,r=xyz") == "a,b=c"


class _Conn:
    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}


def test_gate_refuses_before_any_handler() -> None:
    now = [NOW]
    gate = ServerAuth(SECRET, frozenset(), DATANODE_RULES, clock_ms=lambda: now[0],
                      cluster_only=DATANODE_PM_ONLY)
    conn: Any = _Conn()
    for op in (Opcode.PING, Opcode.GOAWAY, Opcode.AUTHENTICATE):
        assert gate.refuse(conn, op) is None
    for op in Opcode:
        if op not in (Opcode.PING, Opcode.GOAWAY, Opcode.AUTHENTICATE):
            assert isinstance(gate.refuse(conn, op), AuthenticationRequiredError), op
    set_claims(conn, _claims())
    assert gate.refuse(conn, Opcode.APPEND) is None
    for op in DATANODE_PM_ONLY:
        assert isinstance(gate.refuse(conn, op), AuthorizationFailedError), op
    node = dataclasses.replace(_claims(kind=tokens.KIND_NODE), node_id=2)
    set_claims(conn, node)  # another data node may not seal, sync, trim or delete here
    for op in DATANODE_PM_ONLY:
        assert isinstance(gate.refuse(conn, op), AuthorizationFailedError), op
    set_claims(conn, _claims(kind=tokens.KIND_NODE))  # the PM's token
    assert all(gate.refuse(conn, op) is None for op in DATANODE_PM_ONLY)
    now[0] = NOW + 60_000
    assert isinstance(gate.refuse(conn, Opcode.APPEND), TokenExpiredError)
    pm_gate = ServerAuth(SECRET, PM_NODE_ONLY, {}, clock_ms=lambda: NOW)
    user: Any = _Conn()
    set_claims(user, _claims())
    assert isinstance(pm_gate.refuse(user, Opcode.ALLOCATE_ID), AuthorizationFailedError)
    assert pm_gate.refuse(user, Opcode.CREATE_STREAMS) is None  # then checked per item


def test_node_tokens_name_their_node() -> None:
    tok = tokens.node_token(KEY, "datanode-4", NOW, 60_000, node_id=4)
    c = tokens.verify(tok, KEY, NOW)
    assert c.node_id == 4 and c.is_data_node and not c.is_cluster
    pm = tokens.verify(tokens.node_token(KEY, "pm", NOW, 60_000), KEY, NOW)
    assert pm.node_id is None and pm.is_cluster and not pm.is_data_node
    check_data_node(c, 4, "a heartbeat")
    for bad_claims, nid in ((c, 5), (pm, 4), (_claims(), 4)):
        with pytest.raises(AuthorizationFailedError):
            check_data_node(bad_claims, nid, "a heartbeat")
    with pytest.raises(AuthenticationFailedError):  # a user token naming a node is malformed
        tokens.verify(tokens.sign(dataclasses.replace(_claims(), node_id=4), KEY), KEY, NOW)


def test_accept_token_sets_the_principal() -> None:
    gate = ServerAuth(SECRET, PM_NODE_ONLY, {}, clock_ms=lambda: NOW)
    conn: Any = _Conn()
    out = gate.accept_token(conn, tokens.sign(_claims(), KEY).encode())
    assert out.done and out.principal == "alice" and out.expires_at_ms == NOW + 60_000
    other: Any = _Conn()
    with pytest.raises(AuthenticationFailedError):
        gate.accept_token(other, tokens.sign(_claims(), tokens.derive_key(b"y" * 32)).encode())
    assert gate.refuse(other, Opcode.CREATE_STREAMS) is not None  # still unauthenticated


def test_spark_security_options() -> None:
    from sbpstream.spark.options import parse_sink_options, parse_source_options

    base = {"pm": "127.0.0.1:1", "streams": "1"}
    opts = parse_source_options({**base, "user": "alice", "password": "pw", "tlsCa": "/ca.pem"},
                                streaming=False)
    assert opts.security.client_kwargs() == {"user": "alice", "password": "pw",
                                             "token_file": "", "tls_ca": "/ca.pem"}
    sink = parse_sink_options({"pm": "127.0.0.1:1", "stream": "1", "tokenfile": "/t"})
    assert sink.security.token_file == "/t" and not sink.security.user
    for bad in ({"user": "a"}, {"password": "p"}, {"user": "a", "password": "p",
                                                  "tokenFile": "/t"}):
        with pytest.raises(ValueError, match="option"):
            parse_source_options({**base, **bad}, streaming=False)
