"""Spark's ``commitToGroup`` option: parsed and checked, and each finished micro-batch's end
offsets go to the group (a recording stand-in for the driver's client)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")

from spark_fixtures import cluster_fixture, spark_session_fixture  # noqa: F401

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import GroupNotEmptyError
from sbpstream.spark.options import parse_source_options
from sbpstream.spark.schema import SOURCE_SCHEMA
from sbpstream.spark.source import SbpstreamStreamReader

BASE = {"pm": "127.0.0.1:1", "streams": "7,8"}


class RecordingClient:
    def __init__(self, fail: bool = False) -> None:
        self.commits: list[tuple[str, dict[int | str, int]]] = []
        self.fail = fail

    def commit_offsets(self, group: str, offsets: dict[int | str, int]) -> None:
        if self.fail:
            raise GroupNotEmptyError("group 'g' has 1 live members")
        self.commits.append((group, offsets))


class FakeView:
    def __init__(self, client: RecordingClient) -> None:
        self.client = client

    def close(self) -> None:
        pass


def reader(options: dict[str, str], client: RecordingClient) -> SbpstreamStreamReader:
    r = SbpstreamStreamReader(parse_source_options(options, streaming=True), SOURCE_SCHEMA)
    view: Any = FakeView(client)
    r._view = view
    return r


def test_commit_to_group_commits_each_batch_end() -> None:
    client = RecordingClient()
    r = reader({**BASE, "commitToGroup": "lag-view"}, client)
    r.commit({"7": 10, "8": -1})  # -1: "latest" not resolved yet, nothing to commit there
    r.commit({"7": 12, "8": 3})
    assert client.commits == [("lag-view", {7: 10}), ("lag-view", {7: 12, 8: 3})]


def test_without_the_option_nothing_is_committed_and_failures_only_log(
        caplog: pytest.LogCaptureFixture) -> None:
    client = RecordingClient()
    reader(BASE, client).commit({"7": 10})
    assert client.commits == []
    failing = RecordingClient(fail=True)
    reader({**BASE, "commitToGroup": "g"}, failing).commit({"7": 10})
    assert "spark_group_commit_failed" in caplog.text


@pytest.mark.parametrize(("options", "streaming", "needle"), [
    ({**BASE, "commitToGroup": "a/b"}, True, "option 'commitToGroup': bad group name"),
    ({**BASE, "commitToGroup": "g"}, False, "for streaming reads"),
    ({**BASE, "commitToGrup": "g"}, True, "commitToGroup"),
])
def test_bad_options(options: dict[str, str], streaming: bool, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_source_options(options, streaming=streaming)


# ------------------------------------------------------------------ a real streaming query


def test_streaming_query_commits_each_batch_to_the_group(
        spark: Any, cluster: LocalCluster, tmp_path: Any) -> None:
    with Client(cluster.pm_address) as c:
        sid = c.create_stream()
        with c.producer(linger_ms=1) as p:
            for f in [p.send(sid, b"v%d" % i) for i in range(300)]:
                f.result()
        df = spark.readStream.format("sbpstream").option("pm", cluster.pm_address).option(
            "streams", str(sid)).option("startingOffsets", "earliest").option(
            "maxOffsetsPerTrigger", 100).option("commitToGroup", "spark-lag").load()
        q = (df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
        # three batches (100 records each); Spark tells the source a batch is done when it
        # plans the next one, so the group trails the query by its last batch
        assert c.committed_offsets("spark-lag") == {sid: 200}
        info = c.describe_group("spark-lag")
        assert [(s.stream_id, s.committed, s.lag) for s in info.streams] == [(sid, 200, 100)]
