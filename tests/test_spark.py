"""The sbpstream Spark source and sink against a real LocalCluster on a local[2] SparkSession."""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from spark_fixtures import (  # noqa: F401
    cluster_fixture,
    drop_last_commit,
    spark_session_fixture,
)
from waiting import eventually

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port

Row = tuple[int, int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.pm_address) as c:
        yield c


def produce(c: Client, sid: int, n: int, *, tag: str = "", size: int = 0) -> list[Row]:
    """Append n records; return (stream, offset, key, value, headers) of each."""
    out: list[tuple[Any, bytes, bytes, tuple[tuple[str, bytes], ...]]] = []
    pad = b"x" * size
    with c.producer(linger_ms=1) as p:
        for i in range(n):
            key = f"{tag}k{i}".encode()
            value = f"{tag}v{i}".encode() + pad
            headers = (("h", str(i).encode()), ("e", b"")) if i % 4 == 0 else ()
            out.append((p.send(sid, value, key=key, headers=headers), key, value, headers))
    return [(sid, f.result(), k, v, h) for f, k, v, h in out]


def rows_of(df: Any) -> list[Row]:
    return sorted(
        (
            r.stream_id,
            r.offset,
            r.key,
            r.value,
            tuple((h.key, h.value) for h in r.headers),
        )
        for r in df.collect()
    )


def reader(spark: Any, cluster: LocalCluster, streams: list[int], **options: Any) -> Any:
    r = spark.read.format("sbpstream").option("pm", cluster.pm_address)
    r = r.option("streams", ",".join(map(str, streams)))
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def stream_reader(spark: Any, cluster: LocalCluster, streams: list[int], **options: Any) -> Any:
    r = spark.readStream.format("sbpstream").option("pm", cluster.pm_address)
    r = r.option("streams", ",".join(map(str, streams)))
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def offsets_in(spark: Any, path: Path) -> list[tuple[int, int]]:
    df = spark.read.parquet(str(path))
    return sorted((r.stream_id, r.offset) for r in df.select("stream_id", "offset").collect())


def to_parquet(df: Any, out: Path, checkpoint: Path, **trigger: Any) -> Any:
    return (
        df.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(**(trigger or {"availableNow": True}))
        .start()
    )


# -------------------------------------------------------------------------------- batch read


def test_batch_read_equals_produced_across_ranges(
    spark: Any, cluster: LocalCluster, client: Client
) -> None:
    s1, s2 = client.create_streams(2)
    produced = produce(client, s1, 300, tag="a") + produce(client, s2, 120, tag="b")
    sealed = client._async  # the PM's SEAL_RANGES through the client: range 0 -> range 1
    client._runner.run(sealed.routing.seal(s1, 0))
    produced += produce(client, s1, 200, tag="c")
    assert len(client.list_ranges(s1)) == 2

    from sbpstream.spark.options import parse_source_options
    from sbpstream.spark.schema import SOURCE_SCHEMA
    from sbpstream.spark.source import SbpstreamBatchReader

    options = {"pm": cluster.pm_address, "streams": f"{s1},{s2}", "minPartitions": "5"}
    plan = SbpstreamBatchReader(parse_source_options(options, streaming=False), SOURCE_SCHEMA)
    parts = plan.partitions()
    assert len(parts) >= 5
    assert {(p.stream_id, p.range_index) for p in parts} == {(s1, 0), (s1, 1), (s2, 0)}

    df = reader(spark, cluster, [s1, s2], minPartitions=5)
    assert df.schema.simpleString() == (
        "struct<stream_id:bigint,offset:bigint,timestamp:timestamp,key:binary,value:binary,"
        "headers:array<struct<key:string,value:binary>>>"
    )
    assert rows_of(df) == sorted(produced)

    part = reader(
        spark,
        cluster,
        [s1, s2],
        startingOffsets=json.dumps({str(s1): 250, str(s2): -2}),
        endingOffsets=json.dumps({str(s1): 350, str(s2): -1}),
    )
    got = rows_of(part)
    want = [r for r in produced if (r[0] == s1 and 250 <= r[1] < 350) or r[0] == s2]
    assert got == sorted(want)
    # explicit registration works as well as the pyspark_sbpstream auto-registration
    from sbpstream.spark import register

    register(spark)
    assert reader(spark, cluster, [s2]).count() == 120
    (empty,) = client.create_streams(1)
    assert reader(spark, cluster, [empty]).count() == 0


# ---------------------------------------------------------------------------- streaming read


def test_available_now_read_limit_stop_and_restart(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    s1, s2 = client.create_streams(2)
    produce(client, s1, 200)
    produce(client, s2, 100)
    out, ck = tmp_path / "out", tmp_path / "ck"
    df = stream_reader(spark, cluster, [s1, s2], startingOffsets="earliest",
                       maxOffsetsPerTrigger=30)
    q = to_parquet(df, out, ck)
    eventually(lambda: len(q.recentProgress) >= 2, timeout=60)
    q.stop()
    first = q.recentProgress[0]
    assert first["numInputRows"] == 30
    assert json.loads(first["sources"][0]["endOffset"]) == {str(s1): 20, str(s2): 10}
    assert all(p["numInputRows"] <= 30 for p in q.recentProgress)

    produce(client, s2, 50)
    q = to_parquet(stream_reader(spark, cluster, [s1, s2], maxOffsetsPerTrigger=30), out, ck)
    q.awaitTermination(120)
    assert q.exception() is None
    assert all(p["numInputRows"] <= 30 for p in q.recentProgress)
    want = [(s1, i) for i in range(200)] + [(s2, i) for i in range(150)]
    assert offsets_in(spark, out) == want  # no gaps, no duplicates


def test_latest_is_stable_across_restart(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    from sbpstream.spark.options import parse_source_options
    from sbpstream.spark.schema import SOURCE_SCHEMA
    from sbpstream.spark.source import SbpstreamStreamReader

    (s,) = client.create_streams(1)
    produce(client, s, 40)
    opts = parse_source_options({"pm": cluster.pm_address, "streams": str(s)}, streaming=True)
    r1 = SbpstreamStreamReader(opts, SOURCE_SCHEMA)
    init = r1.initialOffset()
    produce(client, s, 10)
    r2 = SbpstreamStreamReader(opts, SOURCE_SCHEMA)  # a restart before the first batch
    assert r2.initialOffset() == init == {str(s): -1}
    end = r2.latestOffset(init, r2.getDefaultReadLimit())
    assert end == {str(s): 50}
    assert r2.partitions(init, end) == []  # the first batch (and its replay) reads nothing
    r1.stop()
    r2.stop()

    out, ck = tmp_path / "out", tmp_path / "ck"
    q = to_parquet(stream_reader(spark, cluster, [s]), out, ck)
    q.awaitTermination(60)
    assert q.recentProgress[0]["numInputRows"] == 0
    produce(client, s, 7)
    q = to_parquet(stream_reader(spark, cluster, [s]), out, ck)
    q.awaitTermination(60)
    assert q.exception() is None
    assert offsets_in(spark, out) == [(s, i) for i in range(50, 57)]


@pytest.mark.parametrize("fail", [True, False])
def test_trim_under_running_query(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path, fail: bool
) -> None:
    (s,) = client.create_streams(1)
    produce(client, s, 200)
    out, ck = tmp_path / "out", tmp_path / "ck"
    opts = {"startingOffsets": "earliest", "failOnDataLoss": str(fail).lower(),
            "maxOffsetsPerTrigger": "100"}
    # batch 0 reads [0, 100) at once; the next trigger comes 10 s after the start, and the trim
    # of [100, 150) lands in between, while the query runs
    q = to_parquet(stream_reader(spark, cluster, [s], **opts), out, ck, processingTime="10 seconds")
    try:
        eventually(lambda: any(p["numInputRows"] == 100 for p in q.recentProgress), timeout=60)
        client.trim_stream(s, 150)
        if fail:
            with pytest.raises(Exception, match="failOnDataLoss"):
                q.awaitTermination(60)
        else:
            eventually(lambda: sum(p["numInputRows"] for p in q.recentProgress) >= 150,
                       timeout=60)
            assert q.exception() is None
    finally:
        q.stop()
    want = [(s, i) for i in range(100)] + ([] if fail else [(s, i) for i in range(150, 200)])
    assert offsets_in(spark, out) == want


def test_trim_between_planning_and_reading(cluster: LocalCluster, client: Client,
                                           caplog: pytest.LogCaptureFixture) -> None:
    from sbpstream.spark.fetch import DataLossError, SpanRequest, read_span

    (s,) = client.create_streams(1)
    produce(client, s, 100)
    ranges = client.list_ranges(s)
    replicas = tuple(r.data_node.advertise_addr for r in ranges[0].replica_nodes)
    req = SpanRequest((cluster.pm_address,), s, 0, 10, 90, replicas, True, 10_000, 1 << 20)
    client.trim_stream(s, 60)
    with pytest.raises(DataLossError, match=r"records \[10, 60\)"):
        list(read_span(req, lambda cols: list(array("q", cols.offsets))))
    lenient = SpanRequest((cluster.pm_address,), s, 0, 10, 90, replicas, False, 10_000, 1 << 20)
    with caplog.at_level(logging.WARNING, logger="sbpstream.spark"):
        got = [o for b in read_span(lenient, lambda c: list(array("q", c.offsets))) for o in b]
    assert got == list(range(60, 90))
    assert "skipped" in caplog.text


# -------------------------------------------------------------------------------------- sink


def test_batch_write(spark: Any, cluster: LocalCluster, client: Client) -> None:
    (s,) = client.create_streams(1)
    rows = [(f"v{i}", f"k{i}" if i % 2 else None, [("h", f"{i}".encode())]) for i in range(500)]
    df = spark.createDataFrame(
        rows, "value string, key string, headers array<struct<key:string,value:binary>>"
    ).repartition(3)
    df.write.format("sbpstream").option("pm", cluster.pm_address).option("stream", s).mode(
        "append"
    ).save()
    got = reader(spark, cluster, [s]).collect()
    assert sorted(r.value.decode() for r in got) == sorted(v for v, _, _ in rows)
    assert sorted(r.offset for r in got) == list(range(500))
    by_value = {r.value.decode(): r for r in got}
    assert by_value["v3"].key == b"k3" and by_value["v4"].key is None
    assert [(h.key, h.value) for h in by_value["v7"].headers] == [("h", b"7")]

    with pytest.raises(Exception, match="append-only"):
        df.write.format("sbpstream").option("pm", cluster.pm_address).option(
            "stream", s
        ).mode("overwrite").save()
    with pytest.raises(Exception, match="'value' column"):
        spark.range(3).write.format("sbpstream").option("pm", cluster.pm_address).option(
            "stream", s
        ).mode("append").save()


def test_stream_sink_replay_appends_nothing_twice(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    src, dst = client.create_streams(2)
    produce(client, src, 300, size=40_000)  # 40 kB values: ~26 sink batches per micro-batch
    ck = tmp_path / "ck"

    def run() -> None:
        df = stream_reader(spark, cluster, [src], startingOffsets="earliest",
                           maxOffsetsPerTrigger=150)
        q = (
            df.select("key", "value", "headers")
            .writeStream.format("sbpstream")
            .option("pm", cluster.pm_address)
            .option("stream", dst)
            .option("checkpointLocation", str(ck))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        assert q.exception() is None

    run()
    assert client.end_offset(dst) == 300
    replayed = drop_last_commit(ck)  # Spark replays the last batch with the same batch id
    run()
    assert client.end_offset(dst) == 300, f"batch {replayed} was appended twice"

    client._runner.run(client._async.routing.seal(dst, client.list_ranges(dst)[-1].range_index))
    drop_last_commit(ck)  # a replay across a seal of the target's range
    run()
    assert client.end_offset(dst) == 300

    for _ in range(3):  # a replay across several seals: older sealed ranges answer too
        client._runner.run(client._async.routing.seal(dst, client.list_ranges(dst)[-1].range_index))
    drop_last_commit(ck)
    run()
    assert client.end_offset(dst) == 300, "a replay after several seals appended again"
    values = sorted(r.value for r in reader(spark, cluster, [dst]).select("value").collect())
    assert values == sorted(r.value for r in reader(spark, cluster, [src]).collect())


# ------------------------------------------------------------------------------------ misuse


def test_misuse_errors(spark: Any, cluster: LocalCluster, client: Client) -> None:
    (s,) = client.create_streams(1)
    with pytest.raises(Exception, match="option 'streams': stream 987654 does not exist"):
        reader(spark, cluster, [987654]).collect()
    with pytest.raises(Exception, match="option 'startingOffsets'"):
        reader(spark, cluster, [s], startingOffsets="{nope").collect()
    with pytest.raises(Exception, match="option 'pm' is required"):
        spark.read.format("sbpstream").option("streams", str(s)).load().collect()
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(Exception, match="option 'pm': no sbpstream placement manager"):
        spark.read.format("sbpstream").option("pm", dead).option("streams", "1").option(
            "timeoutMs", "1500"
        ).load().collect()
    q = stream_reader(spark, cluster, [s], endingOffsets="latest").writeStream.format(
        "noop"
    ).start()
    with pytest.raises(Exception, match="option 'endingOffsets'"):
        q.awaitTermination(60)
    q = stream_reader(spark, cluster, [987654]).writeStream.format("noop").start()
    with pytest.raises(Exception, match="option 'streams': stream 987654 does not exist"):
        q.awaitTermination(60)


# ---------------------------------------------------------------------------------- pipeline


def test_pipeline_command_end_to_end(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sbpstream import cli

    s1, s2 = client.create_streams(2)
    produced = produce(client, s1, 150) + produce(client, s2, 60)
    out, ck = tmp_path / "table", tmp_path / "ck"
    argv = ["pipeline", "--pm", cluster.pm_address, "--streams", f"{s1},{s2}", "--out", str(out),
            "--checkpoint", str(ck), "--max-offsets-per-trigger", "100"]
    with pytest.raises(SystemExit) as done:
        cli.main(argv)  # the CLI in this process: it reuses the session fixture's Spark
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "batch 0: 100 rows" in printed and "done: 210 rows" in printed
    produced += produce(client, s1, 25)
    with pytest.raises(SystemExit) as done:
        cli.main(argv)  # continues from the checkpoint
    assert done.value.code == 0
    table = spark.read.parquet(str(out))
    got = sorted((r.stream_id, r.offset) for r in table.select("stream_id", "offset").collect())
    assert got == sorted((r[0], r[1]) for r in produced)  # every record exactly once
    assert [p.name.split("=")[0] for p in out.iterdir() if p.is_dir() and "=" in p.name] == [
        "date"
    ]
    with pytest.raises(SystemExit) as bad:
        cli.main(["pipeline", "--pm", cluster.pm_address, "--streams", "424242", "--out",
                  str(out), "--checkpoint", str(tmp_path / "ck2")])
    assert bad.value.code == 1
    assert "option 'streams': stream 424242 does not exist" in capsys.readouterr().err
