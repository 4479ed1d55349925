"""The JVM batch reader ``format("sbpstream-jvm")`` against the Python source, on a real
LocalCluster and a local[2] SparkSession: same rows, same options, errors not silent loss."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from spark_fixtures import cluster_fixture, spark_session_fixture  # noqa: F401

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.frame import encode_frame
from sbpstream.protocol.messages import FetchResponse, FetchResult
from sbpstream.protocol.opcodes import Opcode
from sbpstream.records import Record
from sbpstream.records.builder import build_batch

JVM = "sbpstream-jvm"
FAKE_STREAM = 987654
PY = "sbpstream"


@pytest.fixture(scope="module")
def jspark(spark: Any) -> Any:
    """The shared session, when it carries the reader's jar (tests/spark_fixtures.py)."""
    if not spark.conf.get("spark.jars", "") or not _formats(spark):
        pytest.skip("the sbpstream-jvm jar is not on the session's classpath (no JDK?)")
    return spark


def _formats(spark: Any) -> bool:
    """Whether the driver JVM sees the reader's classes."""
    try:
        spark._jvm.io.sbpstream.spark.SbpstreamJvmSource.NAME  # noqa: B018
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.pm_address) as c:
        yield c


def read(spark: Any, fmt: str, pm: str, **options: Any) -> Any:
    r = spark.read.format(fmt).option("pm", pm)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def rows(df: Any) -> list[Any]:
    return sorted(df.collect(), key=lambda r: (r.stream_id, r.offset))


def both(spark: Any, pm: str, **options: Any) -> list[Any]:
    """The rows of the same read through both sources; asserts they are equal and returns them."""
    py = rows(read(spark, PY, pm, **options))
    jv = rows(read(spark, JVM, pm, **options))
    assert jv == py
    return jv


def produce(c: Client, sid: int, n: int, tag: str, compression: Any = None) -> None:
    with c.producer(linger_ms=1, compression=compression) as p:
        futs = []
        for i in range(n):
            key = None if i % 5 == 0 else f"{tag}k{i}".encode()
            value = b"" if i % 7 == 0 else f"{tag}v{i}".encode() * (1 + i % 3)
            headers = (("h", str(i).encode()), ("e", b""), ("ü", b"\x00\xff")) if i % 4 == 0 \
                else ()
            futs.append(p.send(sid, value, key=key, headers=headers))
        for f in futs:
            f.result()


@pytest.fixture(scope="module")
def data(client: Client) -> dict[str, int]:
    """Two named streams (one sealed once, so two ranges; one zstd, one lz4) and one unnamed."""
    a = client.create_stream("jvm.orders")
    b = client.create_stream("jvm.users")
    (c,) = client.create_streams(1)
    produce(client, a, 300, "a", "zstd")
    produce(client, b, 120, "b", "lz4")
    produce(client, c, 50, "c")
    client._runner.run(client._async.routing.seal(a, 0))
    produce(client, a, 200, "d")
    assert len(client.list_ranges(a)) == 2
    return {"a": a, "b": b, "c": c}


def test_same_rows_as_python_source(jspark: Any, cluster: LocalCluster,
                                    data: dict[str, int]) -> None:
    pm = cluster.pm_address
    a, b, c = data["a"], data["b"], data["c"]
    assert read(jspark, JVM, pm, streams=str(a)).schema == read(jspark, PY, pm,
                                                                 streams=str(a)).schema
    got = both(jspark, pm, streams=f"{a},{b},{c}", minPartitions="7")
    assert len(got) == 670
    assert any(r.key is None for r in got) and any(r.value == b"" for r in got)
    assert any(len(r.headers) == 3 for r in got)
    assert {r.stream_id for r in got} == {a, b, c}
    # names, and a window across the seal by name and by id
    window = both(jspark, pm, streams=f"jvm.orders,{b}",
                  startingOffsets=json.dumps({"jvm.orders": 250, str(b): -2}),
                  endingOffsets=json.dumps({"jvm.orders": 350, str(b): 100}))
    assert [r.offset for r in window if r.stream_id == a] == list(range(250, 350))
    assert [r.offset for r in window if r.stream_id == b] == list(range(100))
    assert both(jspark, pm, streams=str(a), startingOffsets="latest") == []
    assert len(both(jspark, pm, streams=str(c), fetchMaxBytes="100")) == 50
    jdf = read(jspark, JVM, pm, streams=f"{a},{b}", minPartitions="6")
    assert jdf.rdd.getNumPartitions() >= 6


def test_pruned_columns_give_the_same_answers(jspark: Any, cluster: LocalCluster,
                                              data: dict[str, int]) -> None:
    """The JVM reader fills only the columns a query uses (column pruning): every subset and
    the aggregates over it match the Python source, which always reads every column."""
    from pyspark.sql import functions as F

    pm = cluster.pm_address
    streams = ",".join(str(data[k]) for k in "abc")
    jv, py = read(jspark, JVM, pm, streams=streams), read(jspark, PY, pm, streams=streams)
    for cols in (["value"], ["key", "offset"], ["headers", "stream_id"], ["timestamp"]):
        assert sorted(map(repr, jv.select(*cols).collect())) == sorted(
            map(repr, py.select(*cols).collect())), cols
    agg = [F.sum(F.length("value")).alias("b"), F.count(F.lit(1)).alias("n"),
           F.count("key").alias("k")]
    assert jv.agg(*agg).collect() == py.agg(*agg).collect()
    assert jv.count() == py.count() == 670
    plan = jv.select("value")._jdf.queryExecution().executedPlan().toString()
    assert "headers" not in plan and "timestamp" not in plan, plan


def test_pattern(jspark: Any, cluster: LocalCluster, data: dict[str, int]) -> None:
    pm = cluster.pm_address
    got = both(jspark, pm, streamPattern=r"jvm\..*")
    assert {r.stream_id for r in got} == {data["a"], data["b"]}
    assert both(jspark, pm, streamPattern="jvm", startingOffsets="latest") == []
    assert both(jspark, pm, streamPattern=r"jvm\.users") == [
        r for r in got if r.stream_id == data["b"]]


def test_a_timestamp_spark_cannot_hold_is_an_error(jspark: Any, cluster: LocalCluster,
                                                  client: Client) -> None:
    """A record's timestamp_ms is any int64; Spark's timestamps are int64 microseconds. One
    that does not fit fails the read with a message naming it, in both readers (both wrapped
    it into a wrong time before)."""
    (sid,) = client.create_streams(1)
    big = 2**61
    with client.producer(linger_ms=1) as p:
        p.send(sid, b"far", timestamp_ms=big)
        p.flush()
    for fmt in (PY, JVM):
        with pytest.raises(Exception, match=f"timestamp_ms {big}, outside what"):
            read(jspark, fmt, cluster.pm_address, streams=str(sid)).collect()


@pytest.mark.parametrize(("options", "message"), [
    ({"streams": "987654"}, "option 'streams': stream 987654 does not exist"),
    ({"streams": "no.such.stream"}, "option 'streams': no stream is named 'no.such.stream'"),
    ({"streamPattern": "(unclosed"}, "option 'streamPattern': bad regular expression"),
    ({"streams": "1", "tokenFile": "/tmp/token"},
     r"option 'tokenFile' \(authentication/TLS\) is not supported by format\(\"sbpstream-jvm\"\); "
     r"use format\(\"sbpstream\"\)"),
    ({"streams": "1", "startingOffset": "earliest"}, "did you mean 'startingOffsets'"),
    ({"streams": "1", "maxOffsetsPerTrigger": "5"}, "is for readStream only"),
    ({"streams": "1", "commitToGroup": "g"},
     r"option 'commitToGroup' is not supported by format\(\"sbpstream-jvm\"\)"),
    ({"streams": "1", "startingOffsets": "{nope"}, "option 'startingOffsets': expected"),
    ({"streams": "1", "endingOffsets": "earliest"}, "'earliest' is not a valid ending offset"),
    ({"streams": "1", "minPartitions": "0"}, "option 'minPartitions' must be positive"),
    ({"streams": "1,1"}, "option 'streams': stream 1 is listed twice"),
    ({"streams": "bad/name"}, "option 'streams': stream name 'bad/name' has invalid characters"),
])
def test_option_errors(jspark: Any, cluster: LocalCluster, options: dict[str, str],
                       message: str) -> None:
    with pytest.raises(Exception, match=message):
        read(jspark, JVM, cluster.pm_address, **options).collect()


def test_offset_errors_and_missing_pm(jspark: Any, cluster: LocalCluster,
                                      data: dict[str, int]) -> None:
    pm, c = cluster.pm_address, data["c"]
    with pytest.raises(Exception, match=f"offset 9999 of stream {c} is past its end 50"):
        read(jspark, JVM, pm, streams=str(c), endingOffsets=json.dumps({str(c): 9999})).collect()
    with pytest.raises(Exception, match="option 'pm' is required"):
        jspark.read.format(JVM).option("streams", "1").load().collect()
    with pytest.raises(Exception, match="option 'pm': no sbpstream placement manager"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        read(jspark, JVM, dead, streams="1", timeoutMs="1500").collect()


def test_trimmed_records_are_data_loss(jspark: Any, cluster: LocalCluster,
                                       client: Client) -> None:
    (s,) = client.create_streams(1)
    produce(client, s, 100, "t")
    client.trim_stream(s, 60)
    pm = cluster.pm_address
    start = json.dumps({str(s): 10})
    with pytest.raises(Exception, match=r"records \[10, 60\) of stream .* are gone"):
        read(jspark, JVM, pm, streams=str(s), startingOffsets=start).collect()
    lenient = both(jspark, pm, streams=str(s), startingOffsets=start, failOnDataLoss="false")
    assert [r.offset for r in lenient] == list(range(60, 100))


# ---------------------------------------------------------------------- readStream, availableNow


def available_now(spark: Any, pm: str, out: Path, checkpoint: Path, **options: Any) -> Any:
    r = spark.readStream.format(JVM).option("pm", pm)
    for k, v in options.items():
        r = r.option(k, v)
    q = (r.load().writeStream.format("parquet").option("path", str(out))
         .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    assert q.awaitTermination(120), "the availableNow query did not finish"
    return q


def test_available_now_exactly_once_across_restarts(jspark: Any, cluster: LocalCluster,
                                                    client: Client, tmp_path: Path) -> None:
    pm = cluster.pm_address
    a = client.create_stream("jvm.live")
    (b,) = client.create_streams(1)
    produce(client, a, 90, "x")
    produce(client, b, 40, "y")
    streams = f"jvm.live,{b}"
    out, ck = tmp_path / "out", tmp_path / "ck"
    q = available_now(jspark, pm, out, ck, streams=streams, startingOffsets="earliest",
                      maxOffsetsPerTrigger="50")
    assert sum(1 for p in q.recentProgress if p["numInputRows"]) >= 3  # 130 rows, 50 a batch
    want = rows(read(jspark, JVM, pm, streams=streams))
    assert len(want) == 130
    assert rows(jspark.read.parquet(str(out))) == want
    # a restart from the checkpoint reads only what came since, once
    produce(client, a, 10, "z")
    client._runner.run(client._async.routing.seal(b, 0))
    produce(client, b, 5, "w")
    available_now(jspark, pm, out, ck, streams=streams, startingOffsets="earliest")
    got = rows(jspark.read.parquet(str(out)))
    assert got == rows(read(jspark, JVM, pm, streams=streams))
    assert len(got) == 145


def test_available_now_latest_and_errors(jspark: Any, cluster: LocalCluster, client: Client,
                                         tmp_path: Path) -> None:
    pm = cluster.pm_address
    (s,) = client.create_streams(1)
    produce(client, s, 20, "l")
    out, ck = tmp_path / "out", tmp_path / "ck"
    q = available_now(jspark, pm, out, ck, streams=str(s))  # default start: latest
    assert sum(p["numInputRows"] for p in q.recentProgress) == 0
    produce(client, s, 7, "m")
    available_now(jspark, pm, out, ck, streams=str(s))
    assert [r.offset for r in rows(jspark.read.parquet(str(out)))] == list(range(20, 27))
    with pytest.raises(Exception, match="option 'endingOffsets' is for batch reads only"):
        available_now(jspark, pm, tmp_path / "o2", tmp_path / "c2", streams=str(s),
                      endingOffsets="latest")
    with pytest.raises(Exception, match="option 'streams': stream 987654 does not exist"):
        available_now(jspark, pm, tmp_path / "o3", tmp_path / "c3", streams="987654")


# ------------------------------------------------------------- a corrupt or silent data node


class FakeDataNode:
    """Answers every request on one connection with ``answer(request_id)`` (None: silence);
    with ``requests``, closes the connection after answering that many."""

    def __init__(self, answer: Any, requests: int | None = None) -> None:
        self.answer = answer
        self.requests = requests
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            answered = 0
            while self.requests is None or answered < self.requests:
                answered += 1
                head = _recv(conn, 4)
                if head is None:
                    return
                (length,) = struct.unpack(">I", head)
                body = _recv(conn, length)
                if body is None:
                    return
                (request_id,) = struct.unpack(">I", body[4:8])
                out = self.answer(request_id)
                if out is not None:
                    conn.sendall(out)

    def close(self) -> None:
        self.sock.close()


def _recv(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf


def _fetch_answer(request_id: int, payload: bytes, *, corrupt_crc: bool = False) -> bytes:
    item = FetchResult(stream_id=FAKE_STREAM, batch_length=len(payload))
    header = FetchResponse(items=(item,)).encode()
    frame = bytearray(encode_frame(Opcode.FETCH, request_id, 0x03, header, payload))
    if corrupt_crc:
        frame[-1] ^= 0xFF
    return bytes(frame)


def _read_partition(spark: Any, pm: str, node: str, timeout_ms: int) -> int:
    """Read [0, 3) of stream FAKE_STREAM (not in the cluster) from ``node`` with the JVM
    reader itself (py4j); the number of rows read."""
    jvm, gw = spark._jvm, spark.sparkContext._gateway

    def strings(*xs: str) -> Any:
        arr = gw.new_array(jvm.java.lang.String, len(xs))
        for i, x in enumerate(xs):
            arr[i] = x
        return arr

    part = jvm.io.sbpstream.spark.SbpInputPartition(
        strings(pm), FAKE_STREAM, 0, 0, 3, strings(node), True, timeout_ms, 1 << 20)
    reader = jvm.io.sbpstream.spark.PartitionReaderImpl(part)
    try:
        n = 0
        while reader.next():
            n += reader.get().numRows()
        return n
    finally:
        reader.close()


def _batch(corrupt: bool, base: int = 0) -> bytes:
    raw = bytearray(build_batch([Record(value=b"v%d" % i) for i in range(3)]))
    raw[0:8] = base.to_bytes(8, "big")  # the base offset, as a data node numbers it
    if corrupt:
        raw[-1] ^= 0x01  # a flipped bit in the last record: the CRC-32C must catch it
    return bytes(raw)


@pytest.mark.parametrize(("answer", "message"), [
    (lambda rid: _fetch_answer(rid, _batch(False)), None),
    (lambda rid: _fetch_answer(rid, _batch(True)), "batch CRC mismatch"),
    (lambda rid: _fetch_answer(rid, _batch(False), corrupt_crc=True), "payload CRC mismatch"),
    (lambda rid: struct.pack(">I", 1 << 30), "framing error"),
    (lambda rid: _fetch_answer(rid, _batch(False)[:40]), "truncated batch header"),
    (lambda rid: _fetch_answer(rid, _batch(False, base=1)), "records jump from offset 0 to 1"),
])
def test_corrupt_answer_is_an_error(jspark: Any, cluster: LocalCluster, answer: Any,
                                    message: str | None) -> None:
    node = FakeDataNode(answer)
    try:
        if message is None:
            assert _read_partition(jspark, cluster.pm_address, node.address, 5000) == 3
        else:
            with pytest.raises(Exception, match=message):
                _read_partition(jspark, cluster.pm_address, node.address, 5000)
    finally:
        node.close()


def _ranges_answer(request_id: int) -> bytes:
    """LIST_RANGES answered in two frames, one stream each (the PM cuts a large answer into
    frames of at most LIST_RANGES_FRAME_MAX ranges)."""
    from sbpstream.protocol.messages import ListRangesResponse, ListRangesResult, Range

    frames = b""
    for i, sid in enumerate((1, 2)):
        rng = Range(stream_id=sid, range_index=0, start_offset=0, next_offset=10 * sid,
                    end_offset=-1)
        header = ListRangesResponse(items=(ListRangesResult(stream_id=sid, ranges=(rng,)),))
        frames += encode_frame(Opcode.LIST_RANGES, request_id, 0x03 if i else 0x01,
                               header.encode())
    return frames


@contextlib.contextmanager
def _pm_client(spark: Any, answer: Any) -> Iterator[tuple[Any, str]]:
    """The JVM reader's PmClient (py4j) talking to a fake PM that answers with ``answer``, and
    the fake PM's address."""
    pm = FakeDataNode(answer)
    jvm, gw = spark._jvm, spark.sparkContext._gateway
    try:
        addrs = gw.new_array(jvm.java.lang.String, 1)
        addrs[0] = pm.address
        client = jvm.io.sbpstream.spark.PmClient(addrs, 5000)
        try:
            yield client, pm.address
        finally:
            client.close()
    finally:
        pm.close()


def test_pm_answer_of_several_frames_keeps_every_frame(jspark: Any) -> None:
    """The connection reuses its receive buffer: the planner's PM client must keep each frame's
    items, not read the last frame's bytes through the earlier frames' tables (stream 1's
    ranges would then be lost: a silent gap in the plan)."""
    from py4j.java_gateway import get_field

    from sbpstream.protocol.messages import ListRangesRequest, StreamOwner

    messages = jspark._jvm.io.sbpstream.spark.wire.Messages
    request = ListRangesRequest(timeout_ms=5000, items=(
        StreamOwner(stream_id=1), StreamOwner(stream_id=2))).encode()
    with _pm_client(jspark, _ranges_answer) as (client, address):
        tables = client.call(address, int(Opcode.LIST_RANGES), request)
        got = [(get_field(rl, "streamId"),
                [get_field(r, "nextOffset") for r in get_field(rl, "ranges")])
               for h in tables for rl in messages.rangeLists(h)]
    assert got == [(1, [10]), (2, [20])]


def _gapped_ranges_answer(request_id: int) -> bytes:
    """LIST_RANGES of one stream whose second range does not start where the first ends."""
    from sbpstream.protocol.messages import ListRangesResponse, ListRangesResult, Range

    sid = GAPPED_STREAM
    ranges = (Range(stream_id=sid, range_index=0, start_offset=0, next_offset=10, end_offset=10),
              Range(stream_id=sid, range_index=1, start_offset=15, next_offset=20,
                    end_offset=-1))
    header = ListRangesResponse(items=(ListRangesResult(stream_id=sid, ranges=ranges),))
    return encode_frame(Opcode.LIST_RANGES, request_id, 0x03, header.encode())


GAPPED_STREAM = 2**32 + 5  # over int32: py4j passes it to Java as a Long


def test_ranges_that_do_not_follow_each_other_are_an_error(jspark: Any) -> None:
    """Metadata with a hole between two ranges is refused when planned, never read as a plan
    that skips the hole (offsets.py's spans_of_stream refuses it too)."""
    ids = jspark._jvm.java.util.ArrayList()
    ids.add(GAPPED_STREAM)
    refused = pytest.raises(Exception, match=f"stream {GAPPED_STREAM}: its ranges do not "
                            "follow each other .range 0 ends at 10, range 1 starts at 15")
    with _pm_client(jspark, _gapped_ranges_answer) as (client, _), refused:
        client.ranges(ids)


def test_silent_data_node_times_out(jspark: Any, cluster: LocalCluster) -> None:
    node = FakeDataNode(lambda rid: None)
    try:
        with pytest.raises(Exception, match="did not answer within"):
            _read_partition(jspark, cluster.pm_address, node.address, 1000)
    finally:
        node.close()


# ------------------------------------------------------------------ a data node down, restarted


def test_data_node_down_then_restarted(jspark: Any, cluster: LocalCluster,
                                       client: Client) -> None:
    """The primary of a sealed range is down: the read goes to the other replica and loses
    nothing; after the node restarts it reads from it again. (Last in the module: it stops a
    node of the shared cluster, and waits for it to be back.)"""
    (s,) = client.create_streams(1, replica_nums=2)
    produce(client, s, 200, "r")
    client._runner.run(client._async.routing.seal(s, 0))
    (sealed,) = [r for r in client.list_ranges(s) if r.range_index == 0]
    primary = next(r.data_node.advertise_addr for r in sealed.replica_nodes if r.is_primary)
    (node,) = [n for n in cluster.datanodes if n.address == primary]
    pm = cluster.pm_address
    before = rows(read(jspark, JVM, pm, streams=str(s)))
    assert [r.offset for r in before] == list(range(200))
    node.stop()
    try:
        during = rows(read(jspark, JVM, pm, streams=str(s), timeoutMs="4000"))
    finally:
        node.start()
        node.wait_ready()
    assert during == before
    assert rows(read(jspark, JVM, pm, streams=str(s))) == before


def test_rows_read_before_a_failover_survive_a_loss_that_ends_the_span(jspark: Any,
                                                                       cluster: LocalCluster
                                                                       ) -> None:
    """Offsets 0 and 1 arrive in the first frame of an answer, the connection then drops; the
    other replica says the stream is deleted (failOnDataLoss=false: the rest is skipped). The
    two rows read must still be returned, not dropped with the span's end."""
    from sbpstream.protocol.messages import Status

    two = bytearray(build_batch([Record(value=b"v0"), Record(value=b"v1")]))
    two[0:8] = bytes(8)  # base offset 0
    first = bytearray(_fetch_answer(1, bytes(two)))
    first[7] = 0x01  # flags: a response frame, but not the answer's end
    deleted = FetchResponse(items=(FetchResult(stream_id=FAKE_STREAM, status=Status(code=31)),))
    a = FakeDataNode(lambda rid: bytes(first), requests=1)  # then it hangs up
    b = FakeDataNode(lambda rid: encode_frame(Opcode.FETCH, rid, 0x03, deleted.encode()))
    jvm, gw = jspark._jvm, jspark.sparkContext._gateway
    try:
        strings = gw.new_array(jvm.java.lang.String, 2)
        strings[0], strings[1] = a.address, b.address
        pm = gw.new_array(jvm.java.lang.String, 1)
        pm[0] = cluster.pm_address
        part = jvm.io.sbpstream.spark.SbpInputPartition(
            pm, FAKE_STREAM, 0, 0, 3, strings, False, 5000, 1 << 20)
        reader = jvm.io.sbpstream.spark.PartitionReaderImpl(part)
        try:
            offsets = []
            while reader.next():
                batch = reader.get()
                offsets += [batch.column(1).getLong(i) for i in range(batch.numRows())]
        finally:
            reader.close()
        assert offsets == [0, 1]
    finally:
        a.close()
        b.close()
