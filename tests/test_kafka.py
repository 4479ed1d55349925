"""The Kafka gateway with real Kafka clients from PyPI: confluent-kafka (librdkafka) and
kafka-python, against a LocalCluster running ``python -m sbpstream.kafka`` (``up --kafka-port``).

Topic T partition N is stream T.N; the offsets the clients see are the streams' offsets."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
from cluster_helpers import node_at
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer
from kafka import TopicPartition as KPTopicPartition
from waiting import eventually

from sbpstream.client import Client
from sbpstream.client.routing import primary_address
from sbpstream.cluster import LocalCluster
from sbpstream.kafka.codec import INT32, decode, encode
from sbpstream.kafka.groups import subscribed_topics
from sbpstream.kafka.records import encode_batch
from sbpstream.kafka.schemas import API_VERSIONS, JOIN_GROUP, PRODUCE, SUPPORTED

pytestmark = pytest.mark.timeout(300)

N = 100_000
T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("kafka"), datanodes=3, fsync="none",
                     heartbeat_interval_ms=200, node_timeout_ms=1500, kafka_port=0)
    with c:
        yield c


def _bootstrap(c: LocalCluster) -> str:
    assert c.kafka is not None
    return c.kafka.address


def _create(c: LocalCluster, topic: str, partitions: int, replicas: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": _bootstrap(c)})
    for f in admin.create_topics([NewTopic(topic, partitions, replicas)]).values():
        f.result(30)


def _consume_confluent(c: LocalCluster, topic: str, partitions: int, total: int
                       ) -> list[tuple[int, int, bytes | None, bytes | None, Any, int]]:
    cons = Consumer({"bootstrap.servers": _bootstrap(c), "group.id": "unused-assign",
                     "enable.auto.commit": False, "fetch.wait.max.ms": 100})
    cons.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: list[tuple[int, int, bytes | None, bytes | None, Any, int]] = []
    deadline = time.monotonic() + 120
    try:
        while len(out) < total and time.monotonic() < deadline:
            for m in cons.consume(10_000, 1.0):
                assert m.error() is None, m.error()
                out.append((m.partition(), m.offset(), m.key(), m.value(), m.headers(),
                            m.timestamp()[1]))
    finally:
        cons.close()
    return out


def test_confluent_100k_with_keys_and_headers_read_back_by_both_clients(
        cluster: LocalCluster) -> None:
    _create(cluster, "orders", 2)
    delivered: dict[int, tuple[int, int]] = {}
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            delivered[int(msg.key()[1:])] = (msg.partition(), msg.offset())

    p = Producer({"bootstrap.servers": _bootstrap(cluster), "linger.ms": 5,
                  "enable.idempotence": True})
    for i in range(N):
        while True:
            try:
                p.produce("orders", value=b"value-%d" % i, key=b"k%d" % i, partition=i % 2,
                          headers=[("i", str(i).encode()), ("kind", b"test")],
                          timestamp=T0 + i, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(120) == 0
    assert not errors and len(delivered) == N
    # per partition, the offsets are 0.. in send order
    for part in (0, 1):
        offs = [delivered[i][1] for i in range(part, N, 2)]
        assert offs == list(range(N // 2))

    got = _consume_confluent(cluster, "orders", 2, N)
    assert len(got) == N
    for part, off, key, value, headers, ts in got:
        assert key is not None
        i = int(key[1:])
        assert (part, off) == delivered[i]
        assert value == b"value-%d" % i
        assert headers == [("i", str(i).encode()), ("kind", b"test")]
        assert ts == T0 + i

    # kafka-python refuses frames over receive_message_max_bytes (1 MB by default) although a
    # Fetch of two partitions may bring max_partition_fetch_bytes (1 MiB) of each, from Kafka too
    kp = KafkaConsumer(bootstrap_servers=_bootstrap(cluster), enable_auto_commit=False,
                       consumer_timeout_ms=5000, fetch_max_wait_ms=100,
                       receive_message_max_bytes=8 * 1024 * 1024)
    kp.assign([KPTopicPartition("orders", 0), KPTopicPartition("orders", 1)])
    kp.seek_to_beginning()
    seen = 0
    for rec in kp:
        i = int(rec.key[1:])
        assert (rec.partition, rec.offset) == delivered[i]
        assert rec.value == b"value-%d" % i and rec.timestamp == T0 + i
        assert rec.headers == [("i", str(i).encode()), ("kind", b"test")]
        seen += 1
        if seen == N:
            break
    kp.close()
    assert seen == N

    # what `sbpstream consume` shows of stream orders.1: the same offsets and records
    out = subprocess.run(
        [sys.executable, "-m", "sbpstream.cli", "consume", "--stream", "orders.1",
         "--pm", cluster.pm_address, "--format", "json"],
        capture_output=True, check=True, timeout=120).stdout.decode().splitlines()
    rows = [json.loads(line) for line in out]
    assert len(rows) == N // 2
    for row in rows:
        i = int(row["key"][1:])
        assert (1, row["offset"]) == delivered[i]
        assert row["value"] == f"value-{i}" and row["timestamp_ms"] == T0 + i


def _frame(api_key: int, version: int, cid: int, body: list[bytes]) -> bytes:
    head = struct.pack(">hhih", api_key, version, cid, 4) + b"test"
    raw = head + b"".join(body)
    return INT32.pack(len(raw)) + raw


def _call(s: socket.socket, frame: bytes) -> bytes:
    s.sendall(frame)
    size = INT32.unpack(_recv(s, 4))[0]
    return _recv(s, size)


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _closed(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("garbage", [
    b"\xff\xff\xff\xff",  # negative size
    b"\x7f\x00\x00\x00",  # 2 GB frame
    INT32.pack(3) + b"\x00\x01\x00",  # shorter than any header
    INT32.pack(8) + struct.pack(">hhi", 999, 0, 1),  # unknown api key
    INT32.pack(8) + struct.pack(">hhi", 0, 99, 1),  # unsupported Produce version
    _frame(3, 1, 1, [b"\x00\x00\x00\x05\x00"]),  # Metadata with a truncated topics array
])
def test_bad_frames_close_the_connection_and_the_gateway_lives_on(
        cluster: LocalCluster, garbage: bytes) -> None:
    host, port = _bootstrap(cluster).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(garbage)
        assert _closed(s)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        api = SUPPORTED[API_VERSIONS]
        resp = _call(s, _frame(API_VERSIONS, 99, 5, []))  # an unknown ApiVersions version
        assert INT32.unpack(resp[:4])[0] == 5
        body = decode(api.response, 0, resp, 4)
        assert body["error_code"] == 35 and {k["api_key"] for k in body["api_keys"]} >= {0, 1}


def test_retried_idempotent_batch_is_stored_once(cluster: LocalCluster) -> None:
    """The same Produce (same producer id, epoch, sequences) sent twice: the second answer is
    the first's offset, and the stream holds the records once; a gap is refused."""
    _create(cluster, "retry", 1)
    host, port = _bootstrap(cluster).rsplit(":", 1)
    api = SUPPORTED[PRODUCE]

    def produce(s: socket.socket, cid: int, seq: int, n: int) -> tuple[int, int]:
        raw = bytearray(encode_batch(0, [(T0, b"k", b"v%d" % (seq + j), ()) for j in range(n)]))
        struct.pack_into(">qhi", raw, 43, 4242, 0, seq)
        struct.pack_into(">I", raw, 17, crc32c.crc32c(bytes(raw[21:])))
        body = encode(api.request, 7, {"transactional_id": None, "acks": -1, "timeout_ms": 30000,
                                       "topic_data": [{"name": "retry", "partition_data": [
                                           {"index": 0, "records": bytes(raw)}]}]})
        resp = decode(api.response, 7, _call(s, _frame(PRODUCE, 7, cid, body)), 4)
        pr = resp["responses"][0]["partition_responses"][0]
        return pr["error_code"], pr["base_offset"]

    with socket.create_connection((host, int(port)), timeout=30) as s:
        assert produce(s, 1, 0, 10) == (0, 0)
        assert produce(s, 2, 10, 5) == (0, 10)
        assert produce(s, 3, 0, 10) == (0, 0)  # a retry of the first: its offset, not stored
        assert produce(s, 4, 10, 5) == (0, 10)
        assert produce(s, 5, 20, 5)[0] == 45  # OUT_OF_ORDER_SEQUENCE_NUMBER: 15..19 missing
        assert produce(s, 6, 15, 5) == (0, 15)
    with Client(cluster.pm_address) as c:
        assert c.end_offset("retry.0") == 20


def test_idempotent_producer_across_a_data_node_sigkill_leaves_no_duplicates(
        cluster: LocalCluster) -> None:
    total = 20_000
    _create(cluster, "failover", 1, replicas=2)
    p = Producer({"bootstrap.servers": _bootstrap(cluster), "enable.idempotence": True,
                  "linger.ms": 5, "request.timeout.ms": 3000, "message.timeout.ms": 120_000,
                  "retry.backoff.ms": 100})
    acked: list[int] = []
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            acked.append(msg.offset())

    def send_all() -> None:
        for i in range(total):
            while True:
                try:
                    p.produce("failover", value=b"%d" % i, partition=0, on_delivery=on_delivery)
                    break
                except BufferError:
                    p.poll(0.05)
            p.poll(0)
            if i % 200 == 0:
                time.sleep(0.02)  # spread the load (~2 s) so the kill lands mid-stream
        p.flush(180)

    sender = threading.Thread(target=send_all)
    sender.start()
    eventually(lambda: len(acked) >= total // 4, timeout=60, what="a quarter acknowledged")
    with Client(cluster.pm_address) as c:
        rng = c.list_ranges("failover.0")[-1]
    addr = primary_address(rng)
    assert addr is not None
    node_at(cluster, addr).kill()  # SIGKILL
    at_kill = len(acked)
    sender.join(240)
    assert not sender.is_alive()
    assert not errors, errors[:3]
    assert len(acked) == total
    assert at_kill < total  # the kill landed while records were still being produced
    got = _consume_confluent(cluster, "failover", 1, total)
    values = [int(v) for _, _, _, v, _, _ in got if v is not None]
    assert values == list(range(total))  # each once, in order: no duplicates, no loss
    assert [off for _, off, *_ in got] == list(range(total))


def test_up_kafka_port_is_documented_in_help() -> None:
    out = subprocess.run([sys.executable, "-m", "sbpstream.cli", "up", "--help"],
                         capture_output=True, check=True, timeout=60, text=True).stdout
    assert "--kafka-port" in out
    assert Path(__file__).parent.parent.joinpath("docs", "kafka.md").is_file()


# ------------------------------------------------------------------------------ consumer groups


def _produce_keyed(c: LocalCluster, topic: str, partitions: int, total: int) -> None:
    errors: list[str] = []
    p = Producer({"bootstrap.servers": _bootstrap(c), "linger.ms": 5, "enable.idempotence": True})
    for i in range(total):
        while True:
            try:
                p.produce(topic, value=b"v%d" % i, key=b"k%d" % i, partition=i % partitions,
                          headers=[("i", str(i).encode())],
                          on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(120) == 0 and not errors


def _committed_sbp(c: LocalCluster, group: str, streams: list[str]) -> dict[str, int]:
    with Client(c.pm_address) as sdk:
        ids = [sdk.resolve_stream(s) for s in streams]
        got = sdk.committed_offsets(group, ids)
    return {s: got.get(sid, -1) for s, sid in zip(streams, ids, strict=True)}


def test_group_subscription_commits_and_a_second_consumer_resumes_there(
        cluster: LocalCluster) -> None:
    """confluent-kafka reads part of a topic by group subscription and commits; the
    sbpstream group of the same name holds those offsets; `sbpstream consume --group` resumes
    there and commits; kafka-python in the same group resumes after that: every record once."""
    topic, group, parts = "grouped", "kgroup", 2
    _create(cluster, topic, parts)
    _produce_keyed(cluster, topic, parts, N)
    streams = [f"{topic}.{p}" for p in range(parts)]

    a = Consumer({"bootstrap.servers": _bootstrap(cluster), "group.id": group,
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "fetch.wait.max.ms": 100, "session.timeout.ms": 6000,
                  "heartbeat.interval.ms": 500})
    a.subscribe([topic])
    seen: dict[tuple[int, int], bytes] = {}
    deadline = time.monotonic() + 120
    try:
        while len(seen) < 60_000 and time.monotonic() < deadline:
            for m in a.consume(5_000, 1.0):
                assert m.error() is None, m.error()
                key = m.key()
                assert key is not None and m.value() == b"v" + key[1:]
                assert m.headers() == [("i", key[1:])] and int(key[1:]) % parts == m.partition()
                assert (m.partition(), m.offset()) not in seen
                seen[(m.partition(), m.offset())] = key
        assert len(seen) >= 60_000
        a.commit(asynchronous=False)
        committed = {tp.partition: tp.offset for tp in
                     a.committed([TopicPartition(topic, p) for p in range(parts)], timeout=30)}
    finally:
        a.close()
    # what the consumer handed out per partition is 0..committed-1
    for p in range(parts):
        assert sorted(o for (pp, o) in seen if pp == p) == list(range(committed[p]))
    assert _committed_sbp(cluster, group, streams) == {
        f"{topic}.{p}": committed[p] for p in range(parts)}

    # the sbpstream CLI, as a member of the same group, resumes at the committed offset
    rows = [json.loads(line) for line in subprocess.run(
        [sys.executable, "-m", "sbpstream.cli", "consume", "--stream", streams[0], "--group",
         group, "--count", "10", "--pm", cluster.pm_address, "--format", "json"],
        capture_output=True, check=True, timeout=120).stdout.decode().splitlines()]
    assert [r["offset"] for r in rows] == list(range(committed[0], committed[0] + 10))
    for r in rows:
        seen[(0, r["offset"])] = r["key"].encode()
    assert _committed_sbp(cluster, group, streams)[streams[0]] == committed[0] + 10

    # kafka-python in the same group resumes after both
    b = KafkaConsumer(topic, bootstrap_servers=_bootstrap(cluster), group_id=group,
                      enable_auto_commit=False, auto_offset_reset="earliest",
                      consumer_timeout_ms=10_000, fetch_max_wait_ms=100,
                      receive_message_max_bytes=8 * 1024 * 1024)
    first: dict[int, int] = {}
    try:
        for rec in b:
            first.setdefault(rec.partition, rec.offset)
            assert (rec.partition, rec.offset) not in seen
            assert rec.value == b"v" + rec.key[1:] and rec.headers == [("i", rec.key[1:])]
            seen[(rec.partition, rec.offset)] = rec.key
            if len(seen) == N:
                break
        b.commit()
    finally:
        b.close()
    resume = {0: committed[0] + 10, 1: committed[1]}
    assert first == {p: o for p, o in resume.items() if o < N // parts}  # where records were left
    assert len(seen) == N and sorted(int(k[1:]) for k in seen.values()) == list(range(N))
    assert _committed_sbp(cluster, group, streams) == {s: N // parts for s in streams}


def _member(c: LocalCluster, group: str, topic: str, stop: threading.Event,
            assignment: list[set[int]], got: list[tuple[int, int]]) -> None:
    cons = Consumer({"bootstrap.servers": _bootstrap(c), "group.id": group,
                     "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100,
                     "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})
    cons.subscribe([topic])
    try:
        while not stop.is_set():
            for m in cons.consume(1000, 0.2):
                if m.error() is None:
                    got.append((m.partition(), m.offset()))
            assignment[0] = {tp.partition for tp in cons.assignment()}
    finally:
        cons.close()  # leaves the group
        assignment[0] = set()


def test_two_members_split_the_partitions_and_one_takes_all_when_the_other_leaves(
        cluster: LocalCluster) -> None:
    topic, group, parts = "split", "ksplit", 4
    _create(cluster, topic, parts)
    _produce_keyed(cluster, topic, parts, 400)
    stops = [threading.Event(), threading.Event()]
    assigned: list[list[set[int]]] = [[set()], [set()]]
    got: list[list[tuple[int, int]]] = [[], []]
    threads = [threading.Thread(target=_member, args=(cluster, group, topic, stops[i],
                                                      assigned[i], got[i]), daemon=True)
               for i in range(2)]
    try:
        threads[0].start()
        eventually(lambda: assigned[0][0] == set(range(parts)), timeout=60,
                   what="the first member owns every partition")
        threads[1].start()
        eventually(lambda: len(assigned[0][0]) == len(assigned[1][0]) == parts // 2
                   and assigned[0][0] | assigned[1][0] == set(range(parts)), timeout=60,
                   what=lambda: f"two members split the partitions: {assigned}")
        # the sbpstream group shows ONE member, the gateway, holding every partition's stream
        with Client(cluster.pm_address) as sdk:
            ids = {sdk.resolve_stream(f"{topic}.{p}") for p in range(parts)}
            eventually(lambda: [(mb.client_id, set(mb.stream_ids), set(mb.assigned))
                                for mb in sdk.describe_group(group).members]
                       == [("kafka-gateway", ids, ids)], timeout=30,
                       what=lambda: f"the gateway in the group: {sdk.describe_group(group)}")
        stops[1].set()
        threads[1].join(30)
        eventually(lambda: assigned[0][0] == set(range(parts)), timeout=60,
                   what=lambda: f"the member left takes every partition back: {assigned}")
        eventually(lambda: {(p, o) for g in got for (p, o) in g} == {
            (p, o) for p in range(parts) for o in range(100)}, timeout=60,
            what="every record read")
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(30)


def test_snappy_compressed_produce_is_stored_and_read_back(cluster: LocalCluster) -> None:
    _create(cluster, "snappy", 1)
    p = Producer({"bootstrap.servers": _bootstrap(cluster), "compression.type": "snappy",
                  "linger.ms": 20})
    for i in range(2000):
        p.produce("snappy", value=b"value-%d" % i * 5, key=b"k%d" % i, headers=[("h", b"x")])
    assert p.flush(60) == 0
    got = _consume_confluent(cluster, "snappy", 1, 2000)
    assert [(o, k, v, h) for _, o, k, v, h, _ in got] == [
        (i, b"k%d" % i, b"value-%d" % i * 5, [("h", b"x")]) for i in range(2000)]


# ------------------------------------------------------------------------- offsets by time


def test_offsets_for_times_by_both_clients(cluster: LocalCluster) -> None:
    """ListOffsets by timestamp: the first offset whose record timestamp is >= the asked one,
    with that record's timestamp; past the last timestamp, none (librdkafka: offset -1 (end),
    kafka-python: None). Records 0..1999 have timestamps T0 + 10*i, in many batches."""
    topic, total = "times", 2000
    _create(cluster, topic, 1)
    p = Producer({"bootstrap.servers": _bootstrap(cluster), "linger.ms": 1,
                  "batch.num.messages": 37})
    for i in range(total):
        p.produce(topic, value=b"v%d" % i, partition=0, timestamp=T0 + 10 * i)
        if i % 150 == 0:
            p.flush(30)
    assert p.flush(30) == 0
    with Client(cluster.pm_address) as sdk:  # several batches, so the search has work to do
        assert sdk.end_offset(sdk.resolve_stream(f"{topic}.0")) == total
    asks = {T0 - 5: 0, T0: 0, T0 + 1: 1, T0 + 10 * 777: 777, T0 + 10 * 777 + 9: 778,
            T0 + 10 * (total - 1): total - 1}

    cons = Consumer({"bootstrap.servers": _bootstrap(cluster), "group.id": "unused-times"})
    try:
        for ts, want in asks.items():
            (tp,) = cons.offsets_for_times([TopicPartition(topic, 0, ts)], timeout=30)
            assert (tp.error, tp.offset) == (None, want), ts
        (tp,) = cons.offsets_for_times([TopicPartition(topic, 0, T0 + 10 * total)], timeout=30)
        assert tp.offset == -1  # librdkafka's OFFSET_END: no record at or after it
    finally:
        cons.close()

    kp = KafkaConsumer(bootstrap_servers=_bootstrap(cluster))
    try:
        tp = KPTopicPartition(topic, 0)
        for ts, want in asks.items():
            got = kp.offsets_for_times({tp: ts})[tp]
            assert got is not None and (got.offset, got.timestamp) == (want, T0 + 10 * want)
        assert kp.offsets_for_times({tp: T0 + 10 * total})[tp] is None
    finally:
        kp.close()


# ------------------------------------------------------------- Kafka and SDK members, fenced


def _kafka_join(c: LocalCluster, group: str, topic: str) -> int:
    """One raw JoinGroup (v5) of a new member subscribing ``topic``: its error code."""
    host, port = _bootstrap(c).rsplit(":", 1)
    api = SUPPORTED[JOIN_GROUP]
    meta = struct.pack(">hih", 0, 1, len(topic)) + topic.encode() + struct.pack(">i", -1)
    assert subscribed_topics("consumer", meta) == [topic]
    body = encode(api.request, 5, {"group_id": group, "session_timeout_ms": 6000,
                                   "rebalance_timeout_ms": 6000, "member_id": "",
                                   "group_instance_id": None, "protocol_type": "consumer",
                                   "protocols": [{"name": "range", "metadata": meta}]})
    with socket.create_connection((host, int(port)), timeout=30) as s:
        resp = decode(api.response, 5, _call(s, _frame(JOIN_GROUP, 5, 9, body)), 4)
    code: int = resp["error_code"]
    return code


def test_a_group_is_read_by_kafka_or_sdk_members_never_both(cluster: LocalCluster) -> None:
    """While a Kafka consumer is a member, the gateway is the sbpstream group's member holding
    the topic's streams, so an SDK consumer of the group is handed none; once the Kafka one
    leaves, the SDK one gets them at the committed offsets; while it is a member, a Kafka
    JoinGroup is refused with INCONSISTENT_GROUP_PROTOCOL."""
    topic, group, parts = "fenced", "kfenced", 2
    _create(cluster, topic, parts)
    _produce_keyed(cluster, topic, parts, 200)
    stop = threading.Event()
    assigned: list[set[int]] = [set()]
    got: list[tuple[int, int]] = []
    kafka = threading.Thread(target=_member, args=(cluster, group, topic, stop, assigned, got),
                             daemon=True)
    kafka.start()
    try:
        eventually(lambda: assigned[0] == {0, 1} and len(got) == 200, timeout=60,
                   what="the Kafka member reads every record")
        with Client(cluster.pm_address) as sdk:
            ids = {sdk.resolve_stream(f"{topic}.{p}") for p in range(parts)}
            sc = sdk.consumer([f"{topic}.{p}" for p in range(parts)], group=group,
                              heartbeat_interval_ms=200, session_timeout_ms=6000)
            try:
                def members() -> dict[str, tuple[set[int], set[int]]]:
                    return {mb.client_id: (set(mb.stream_ids), set(mb.assigned))
                            for mb in sdk.describe_group(group).members}

                read: list[Any] = []

                def polled() -> bool:  # the group consumer joins on its first poll
                    read.extend(sc.poll(timeout_ms=100))
                    return True

                # the SDK member joined and was handed nothing: the gateway holds both streams
                # (the PM's even split targets one of them at the SDK member, but a stream held
                # by another member is never assigned; the gateway's own `assigned` shows that
                # split after its next heartbeat, so it is not what this checks)
                eventually(lambda: polled() and len(sdk.describe_group(group).members) == 2
                           and members()["kafka-gateway"][0] == ids
                           and all(a == set() for cid, (_, a) in members().items()
                                   if cid != "kafka-gateway"), timeout=30,
                           what=lambda: f"both members, the SDK one without streams: "
                                        f"{sdk.describe_group(group)}")
                read.extend(sc.poll(timeout_ms=1000))
                assert read == [] and sc.assignment == ()
                stop.set()
                kafka.join(30)  # the Kafka member commits and leaves: so does the gateway
                eventually(lambda: polled() and set(sc.assignment) == ids, timeout=30,
                           what=lambda: f"the SDK member gets the streams: {sc.assignment}")
                committed = sdk.committed_offsets(group, sorted(ids))
                assert committed == {sid: 100 for sid in ids}
                assert [mb.client_id for mb in sdk.describe_group(group).members] != [
                    "kafka-gateway"]
                # and now a Kafka member is refused while the SDK one is live
                assert _kafka_join(cluster, group, topic) == 23  # INCONSISTENT_GROUP_PROTOCOL
                # the SDK member reads what comes next, from the offsets the Kafka one committed
                assert read == []
                _produce_keyed(cluster, topic, parts, 10)
                eventually(lambda: polled() and len(read) >= 10, timeout=30,
                           what=lambda: f"the SDK member reads the new records: {read}")
                assert sorted((r.stream_id, r.offset) for r in read) == sorted(
                    (sid, o) for sid in ids for o in range(100, 105))
            finally:
                sc.close()
    finally:
        stop.set()
        kafka.join(30)
