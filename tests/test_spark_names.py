"""Named streams in the Spark connector (issue 20), on local[2] against a real LocalCluster:
read and write by name, a pattern that picks up a stream created while the query runs, rows
routed by a ``stream`` column exactly once across a replayed micro-batch, and one-line errors
for bad names and patterns."""

from __future__ import annotations

import itertools
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

_n = itertools.count(1)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.pm_address) as c:
        yield c


def fresh(prefix: str) -> str:
    """A name no other test of the session uses (the cluster is shared)."""
    return f"{prefix}{next(_n)}"


def produce(c: Client, sid: int, n: int, tag: str = "") -> None:
    with c.producer(linger_ms=1) as p:
        for f in [p.send(sid, f"{tag}v{i}".encode()) for i in range(n)]:
            f.result()


def values(spark: Any, cluster: LocalCluster, stream: str) -> list[bytes]:
    df = spark.read.format("sbpstream").option("pm", cluster.pm_address).option(
        "streams", stream).load()
    return sorted(r.value for r in df.select("value").collect())


def test_read_and_write_by_name(spark: Any, cluster: LocalCluster, client: Client) -> None:
    src, dst = fresh("src."), fresh("dst.")
    sid = client.create_stream(src)
    client.create_stream(dst)
    produce(client, sid, 50)
    df = spark.read.format("sbpstream").option("pm", cluster.pm_address).option(
        "streams", f"{src}").option("startingOffsets", f'{{"{src}": 10}}').load()
    assert df.count() == 40
    df.select("value").write.format("sbpstream").option("pm", cluster.pm_address).option(
        "stream", dst).mode("append").save()
    assert values(spark, cluster, dst) == sorted(f"v{i}".encode() for i in range(10, 50))
    # a name and the same stream's id in one option is a mistake
    with pytest.raises(Exception, match=f"'{src}' and {sid} are the same stream"):
        values(spark, cluster, f"{src},{sid}")


def test_pattern_picks_up_a_stream_created_while_running(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    group = fresh("pat")
    first = client.create_stream(f"{group}.a")
    client.create_stream(fresh("other."))  # not matched
    produce(client, first, 5, "a")
    table = f"pattern_{group}"
    df = spark.readStream.format("sbpstream").option("pm", cluster.pm_address).option(
        "streamPattern", rf"{group}\..*").option("startingOffsets", "earliest").load()
    q = (df.select("stream_id", "value").writeStream.format("memory").queryName(table)
         .option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="500 milliseconds").start())
    try:
        def rows() -> list[tuple[int, bytes]]:
            return sorted((r.stream_id, bytes(r.value))
                          for r in spark.sql(f"SELECT * FROM {table}").collect())

        eventually(lambda: len(rows()) == 5, timeout=90, what="the first stream's rows")
        later = client.create_stream(f"{group}.b")  # created while the query runs
        produce(client, later, 3, "b")
        eventually(lambda: len(rows()) == 8, timeout=90, what="the new stream's rows")
        assert q.exception() is None
        assert {s for s, _ in rows()} == {first, later}
        assert sorted(v for s, v in rows() if s == later) == [b"bv0", b"bv1", b"bv2"]
    finally:
        q.stop()


def test_column_routing_is_exactly_once_across_a_replay(
    spark: Any, cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    src = client.create_stream(fresh("route.src"))
    left, right = fresh("route.l"), fresh("route.r")
    lid = client.create_stream(left)
    rid = client.create_stream(right)
    produce(client, src, 400)
    ck = tmp_path / "ck"

    def run() -> None:
        from pyspark.sql import functions as F

        df = spark.readStream.format("sbpstream").option("pm", cluster.pm_address).option(
            "streams", str(src)).option("startingOffsets", "earliest").option(
            "maxOffsetsPerTrigger", 200).load()
        # even offsets to the left stream by name, odd ones to the right one by id
        routed = df.select(
            F.when(F.col("offset") % 2 == 0, F.lit(left)).otherwise(F.lit(str(rid)))
            .alias("stream"), "value")
        q = (routed.writeStream.format("sbpstream").option("pm", cluster.pm_address)
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        q.awaitTermination(120)
        assert q.exception() is None

    run()
    assert (client.end_offset(lid), client.end_offset(rid)) == (200, 200)
    replayed = drop_last_commit(ck)  # Spark replays the last batch with the same batch id
    run()
    assert (client.end_offset(lid), client.end_offset(rid)) == (200, 200), (
        f"batch {replayed} was appended twice")
    expect = sorted(f"v{i}".encode() for i in range(0, 400, 2))
    assert values(spark, cluster, left) == expect


def test_bad_names_and_patterns_are_one_line_errors(
    spark: Any, cluster: LocalCluster, client: Client
) -> None:
    def load(**options: str) -> Any:
        r = spark.read.format("sbpstream").option("pm", cluster.pm_address)
        for k, v in options.items():
            r = r.option(k, v)
        return r.load().collect()

    cases = [
        ({"streams": "no such"}, "option 'streams': stream name 'no such' has invalid "
                                 "characters ' '"),
        ({"streams": fresh("absent")}, "option 'streams': no stream is named 'absent"),
        ({"streamPattern": "a(("}, "option 'streamPattern': bad regular expression"),
    ]
    for options, needle in cases:
        with pytest.raises(Exception) as info:
            load(**options)
        # the whole message on one line of Spark's error (not spread over a traceback)
        assert any(needle in ln for ln in str(info.value).splitlines()), str(info.value)
    df = spark.createDataFrame([("x", "v")], "stream string, value string")
    with pytest.raises(Exception, match="no stream is named 'x'"):
        df.write.format("sbpstream").option("pm", cluster.pm_address).mode("append").save()
    with pytest.raises(Exception, match="needs option 'stream' or a 'stream' column"):
        df.select("value").write.format("sbpstream").option("pm", cluster.pm_address).mode(
            "append").save()
