"""Pure tests of the quota model, Throttr-style counters and enforcer (no network, no clock)."""

from __future__ import annotations

import pytest

from sbpstream.protocol.errors import InvalidRequestError
from sbpstream.quota.counters import MAX_QUOTA_COUNTERS, OVERFLOW_KEY, CounterTable, TtlType
from sbpstream.quota.enforcer import FETCH, PRODUCE, REQUESTS, QuotaEnforcer
from sbpstream.quota.model import (
    MAX_BYTES_PER_S,
    UNLIMITED,
    QuotaKind,
    QuotaSpec,
    validate,
)

S = 1_000_000_000


def test_ttl_types_are_throttrs() -> None:
    assert [int(t) for t in TtlType] == [1, 2, 3, 4, 5, 6]
    assert TtlType.SECONDS.ns == S and TtlType.HOURS.ns == 3600 * S


def test_consume_within_quota_then_throttled_for_window_plus_debt() -> None:
    t = CounterTable()
    assert t.consume("k", 600, 1000, S, 0) == 0
    assert t.consume("k", 400, 1000, S, 0) == 0  # exactly the quota
    # 500 over a 1000/s quota: the window's rest (1 s) plus 0.5 s to earn the 500 back
    assert t.consume("k", 500, 1000, S, 0) == S + S // 2
    (view,) = t.query(0, TtlType.MILLISECONDS)
    assert (view.key, view.quota, view.ttl_type, view.ttl) == ("k", 0, TtlType.MILLISECONDS, 1500)


def test_rate_over_many_windows_is_the_quota() -> None:
    # A client sending 100-byte requests whenever allowed gets 1000 B/s, whatever its burst.
    t = CounterTable()
    now, sent = 0, 0
    while now < 20 * S:
        hold = t.consume("k", 100, 1000, S, now)
        sent += 100
        now += hold if hold else S // 1000
    assert abs(sent / (now / S) - 1000) <= 1000 * 0.06


def test_counters_expire() -> None:
    t = CounterTable()
    t.consume("a", 1, 10, S, 0)
    t.consume("b", 1, 10, 2 * S, 0)
    assert {v.key for v in t.query(S - 1)} == {"a", "b"}
    assert {v.key for v in t.query(S)} == {"b"}
    t.consume("c", 1, 10, S, S)  # a later call removes what expired
    assert len(t) == 2 and t.expired == 1
    assert t.consume("a", 10, 10, S, S) == 0  # a fresh window: the full quota again
    assert t.purge("a") and not t.purge("a")


def test_distinct_keys_flood_is_capped_and_charged_to_overflow() -> None:
    t = CounterTable(max_counters=100)
    for i in range(1000):
        t.consume(f"client-{i}", 1, 10, S, 0)
    assert len(t) == 100
    assert t.overflowed == 1000 - 99
    assert t.consume("another", 100, 10, S, 0) > 0  # the flood shares one quota
    assert any(v.key == OVERFLOW_KEY for v in t.query(0))


def test_100k_distinct_client_ids_keep_memory_bounded() -> None:
    # Records are fixed-size, so memory is bounded by their number: it never passes the cap,
    # and the ids beyond it are charged to the one overflow record.
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 1 << 20, 1 << 20, 1000)])
    most = 0
    for i in range(100_000):
        enf.charge(f"client-{i}", PRODUCE, 100, {}, i)  # all within one window: none expire
        if i % 1000 == 0:
            most = max(most, len(enf.counters))
    assert max(most, len(enf.counters)) <= MAX_QUOTA_COUNTERS
    assert enf.counters.overflowed > 100_000
    assert enf.charge("client-new", PRODUCE, 1 << 21, {}, 200) > 0  # overflow shares a quota


def test_idle_counters_expire_under_steady_new_keys() -> None:
    t = CounterTable(max_counters=1000)
    for i in range(50_000):
        t.consume(f"k{i}", 1, 10, S, i * (S // 100))  # 100 new keys per second, 1 s TTL
    assert len(t) <= 110 and t.overflowed == 0


def test_enforcer_client_default_and_stream_quotas() -> None:
    enf = QuotaEnforcer()
    assert enf.charge("x", PRODUCE, 10**9, {1: 10**9}, 0) == 0  # no quotas: nothing counted
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 1000),
              QuotaSpec(QuotaKind.CLIENT, "big", 10_000),
              QuotaSpec(QuotaKind.STREAM, "7", UNLIMITED, 500)])
    assert enf.charge("a", PRODUCE, 1000, {1: 1000}, 0) == 0
    assert enf.charge("a", PRODUCE, 1000, {1: 1000}, 0) == 2000  # per-client default
    assert enf.charge("b", PRODUCE, 1000, {1: 1000}, 0) == 0  # b has its own counter
    assert enf.charge("big", PRODUCE, 5000, {}, 0) == 0
    assert enf.charge("big", FETCH, 10**6, {3: 10**6}, 0) == 0  # no fetch quota for it
    assert enf.charge("c", FETCH, 600, {7: 600}, 0) == 1200  # the stream's fetch quota
    assert enf.throttled == 2


def test_user_quota_precedence_user_client_over_user_over_client_over_default() -> None:
    """Kafka's order, per rate: user+client id > user > client id > default."""
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 100, 100),
              QuotaSpec(QuotaKind.CLIENT, "app", 1_000, UNLIMITED, 7),
              QuotaSpec(QuotaKind.USER, "", 10_000, user="alice"),
              QuotaSpec(QuotaKind.CLIENT, "app", 100_000, user="alice")])
    book = enf.book
    assert book.resolve("alice", "app", PRODUCE) == ("u/alice,c/app/produce", 100_000)
    assert book.resolve("alice", "other", PRODUCE) == ("u/alice/produce", 10_000)
    assert book.resolve("bob", "app", PRODUCE) == ("c/app/produce", 1_000)
    assert book.resolve("", "app", PRODUCE) == ("c/app/produce", 1_000)  # no principal
    assert book.resolve("bob", "other", PRODUCE) == ("c/other/produce", 100)  # default
    # a rate the specific quota leaves unset falls through to the next level
    assert book.resolve("alice", "app", FETCH) == ("c/app/fetch", 100)  # default's fetch
    assert book.resolve("alice", "app", REQUESTS) == ("c/app/requests", 7)


def test_a_user_quota_is_shared_by_all_its_client_ids() -> None:
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.USER, "", 1000, user="alice"),
              QuotaSpec(QuotaKind.DEFAULT, "", 10**6)])
    assert enf.charge("a-1", PRODUCE, 600, {}, 0, user="alice") == 0
    assert enf.charge("a-2", PRODUCE, 600, {}, 0, user="alice") > 0  # same user, other id
    assert enf.charge("a-2", PRODUCE, 600, {}, 0, user="bob") == 0  # bob: the default
    assert enf.charge("a-3", PRODUCE, 600, {}, 0) == 0  # no principal: the default
    keys = {v.key for v in enf.counters.query(0)}
    assert keys == {"u/alice/produce", "c/a-2/produce", "c/a-3/produce"}
    # a reload drops the remembered resolutions: the user quota is gone, the default applies
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 10**6)])
    assert enf.charge("a-9", PRODUCE, 600, {}, 0, user="alice") == 0
    assert "c/a-9/produce" in {v.key for v in enf.counters.query(0)}


def test_user_and_client_id_counter_keys_never_collide() -> None:
    # a principal holds no ',': user "a" with client id "b,c/x" and user "a,b" cannot exist both
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.CLIENT, "c/x", 10, user="a"),
              QuotaSpec(QuotaKind.CLIENT, "a", 10),
              QuotaSpec(QuotaKind.USER, "", 10, user="c")])
    enf.charge("c/x", PRODUCE, 5, {}, 0, user="a")
    enf.charge("a", PRODUCE, 5, {}, 0)
    enf.charge("z", PRODUCE, 5, {}, 0, user="c")
    assert len({v.key for v in enf.counters.query(0)}) == 3


def test_a_remembered_record_is_left_once_it_expires_or_is_purged() -> None:
    # the enforcer's meters keep their live record: after its TTL, a purge or a clear, the
    # next charge must open a fresh record in the table, never count into the dead one
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 1000)])
    assert enf.charge("a", PRODUCE, 900, {}, 0) == 0
    assert enf.charge("a", PRODUCE, 900, {}, S) == 0  # the first window ended at S
    assert enf.counters.purge("c/a/produce")
    assert enf.charge("a", PRODUCE, 900, {}, S + 1) == 0  # a fresh record, a full quota
    assert [v.quota for v in enf.counters.query(S + 1)] == [100]
    enf.counters.clear()
    assert enf.charge("a", PRODUCE, 900, {}, S + 2) == 0
    assert enf.charge("a", PRODUCE, 200, {}, S + 3) > 0  # still counted in the table's record
    assert len(enf.counters) == 1


def test_a_key_charged_to_the_overflow_record_gets_its_own_when_there_is_room() -> None:
    enf = QuotaEnforcer(max_counters=4)
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 1000)])
    for cid in "abc":  # the table is full: three records, the last place is the overflow's
        enf.charge(cid, PRODUCE, 1, {}, 0)
    enf.charge("d", PRODUCE, 1, {}, 0)
    enf.charge("d", PRODUCE, 1, {}, 0)
    assert enf.counters.overflowed == 2
    assert enf.counters.purge("c/a/produce") and enf.counters.purge("c/b/produce")
    enf.charge("d", PRODUCE, 1, {}, 1)
    assert "c/d/produce" in {v.key for v in enf.counters.query(1)}


def test_reloading_the_same_quotas_keeps_plans_and_another_set_drops_them() -> None:
    enf = QuotaEnforcer()
    specs = [QuotaSpec(QuotaKind.DEFAULT, "", 1000, UNLIMITED, 10)]
    enf.load(specs)
    version, plan = enf.version, enf.plan("", "a")
    enf.load(list(specs))
    assert enf.version == version and enf.plan("", "a") is plan
    enf.load([QuotaSpec(QuotaKind.DEFAULT, "", 2000)])
    assert enf.version == version + 1
    assert [(m.key, m.quota) for m in enf.plan("", "a")[PRODUCE]] == [("c/a/produce", 2000)]
    enf.load([])
    assert enf.empty and enf.charge("a", PRODUCE, 10**9, {}, 0) == 0


def test_every_charge_is_counted_by_rate() -> None:
    enf = QuotaEnforcer()
    enf.load([QuotaSpec(QuotaKind.STREAM, "7", 10**6, 10**6, 10**6)])
    for _ in range(3):
        enf.charge("a", PRODUCE, 100, {7: 100}, 0)
    enf.charge("a", FETCH, 0, {}, 0)
    assert enf.charged == [3, 1]
    assert {v.key: v.quota for v in enf.counters.query(0)} == {
        "s/7/produce": 10**6 - 300, "s/7/requests": 10**6 - 3}


@pytest.mark.parametrize(("spec", "message"), [
    (QuotaSpec(QuotaKind.CLIENT, "a", 0), "= 0 would stop all traffic"),
    (QuotaSpec(QuotaKind.CLIENT, "a", -5), "is negative"),
    (QuotaSpec(QuotaKind.CLIENT, "a", UNLIMITED, MAX_BYTES_PER_S + 1), "above the largest"),
    (QuotaSpec(QuotaKind.CLIENT, "a", UNLIMITED, UNLIMITED, 10**12), "above the largest"),
    (QuotaSpec(QuotaKind.CLIENT, "a"), "at least one of"),
    (QuotaSpec(QuotaKind.CLIENT, "", 5), "non-empty client id"),
    (QuotaSpec(QuotaKind.CLIENT, "x" * 300, 5), "at most 255"),
    (QuotaSpec(QuotaKind.STREAM, "abc", 5), "positive stream id"),
    (QuotaSpec(QuotaKind.STREAM, "0", 5), "positive stream id"),
    (QuotaSpec(QuotaKind.DEFAULT, "x", 5), "takes no name"),
    (QuotaSpec(QuotaKind.USER, "", 5), "needs a user"),
    (QuotaSpec(QuotaKind.USER, "app", 5, user="alice"), "takes no client id"),
    (QuotaSpec(QuotaKind.USER, "", 5, user="a,b"), "no ','"),
    (QuotaSpec(QuotaKind.STREAM, "7", 5, user="alice"), "takes no user"),
    (QuotaSpec(QuotaKind.DEFAULT, "", 5, user="alice"), "takes no user"),
])
def test_hostile_quota_values_are_refused_clearly(spec: QuotaSpec, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate(spec)


def test_valid_quota_is_normalized() -> None:
    assert validate(QuotaSpec(QuotaKind.STREAM, "007", 5)).name == "7"
    assert validate(QuotaSpec(QuotaKind.DEFAULT, "", MAX_BYTES_PER_S)).key == "default"
    assert validate(QuotaSpec(QuotaKind.USER, "", 5, user="alice")).key == "user/alice"
    assert validate(QuotaSpec(QuotaKind.CLIENT, "app", 5, user="alice")).key == \
        "user/alice,client/app"


def test_throttle_time_is_read_off_response_headers() -> None:
    from sbpstream.protocol import messages as m
    from sbpstream.quota.wire import throttle_time_ms_of

    for resp in (m.AppendResponse(1234, items=(m.AppendResult(1, 2, 3),)),
                 m.FetchResponse(77), m.AppendResponse(0), m.FetchResponse()):
        assert throttle_time_ms_of(resp.encode()) == resp.throttle_time_ms
    for junk in (b"", b"\x00" * 3, b"\xff" * 16, bytes(range(40))):
        assert throttle_time_ms_of(junk) >= 0  # never raises; malformed reads as some count


def test_a_connections_plan_follows_its_client_id_claims_and_the_quota_set() -> None:
    from sbpstream.auth.gate import CONN_CLAIMS
    from sbpstream.auth.tokens import KIND_USER, Claims
    from sbpstream.datanode.quota import NodeQuotas
    from sbpstream.net.server import Server, ServerConnection

    nq = NodeQuotas()
    nq.enforcer.load([QuotaSpec(QuotaKind.DEFAULT, "", UNLIMITED, UNLIMITED, 10**6),
                      QuotaSpec(QuotaKind.USER, "", UNLIMITED, UNLIMITED, 10**6, user="alice")])
    conn = ServerConnection(Server({}))
    conn.client_id = "one"
    nq.charge(conn, PRODUCE, 10, {})
    conn.client_id = "two"  # a later HEARTBEAT declares another client id
    nq.charge(conn, PRODUCE, 10, {})
    conn.attributes[CONN_CLAIMS] = Claims("alice", KIND_USER, 0, 1 << 50)  # authenticated
    nq.charge(conn, PRODUCE, 10, {})
    nq.enforcer.load([QuotaSpec(QuotaKind.CLIENT, "two", UNLIMITED, UNLIMITED, 10**6)])
    nq.charge(conn, PRODUCE, 10, {})
    left = {v.key: v.quota for v in nq.enforcer.counters.query(0)}
    assert left == {"c/one/requests": 10**6 - 1, "u/alice/requests": 10**6 - 1,
                    "c/two/requests": 10**6 - 2}
