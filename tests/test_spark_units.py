"""Unit tests of the Spark source's pure parts: options, offset math, planning, Arrow batches.

No cluster and no SparkSession: these run in milliseconds.
"""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from sbpstream.records import (  # noqa: E402
    ColumnBuffers,
    Record,
    build_batch,
    decode_column_buffers,
    patch_base_offset,
)
from sbpstream.spark.offsets import (  # noqa: E402
    PlannedRange,
    Span,
    next_offsets,
    offsets_from_json,
    offsets_to_json,
    spans_of_stream,
    split_read_limit,
    split_spans,
)
from sbpstream.spark.options import (  # noqa: E402
    EARLIEST,
    LATEST,
    parse_sink_options,
    parse_source_options,
)
from sbpstream.spark.schema import (  # noqa: E402
    SOURCE_SCHEMA,
    US_PER_MS,
    arrow_schema,
    buffers_to_batch,
)

PM = "127.0.0.1:1"


# ---------------------------------------------------------------------------------- options


def test_defaults_like_kafka() -> None:
    b = parse_source_options({"pm": PM, "streams": "3, 1"}, streaming=False)
    assert b.streams == (3, 1)
    assert b.starting == {3: EARLIEST, 1: EARLIEST}
    assert b.ending == {3: LATEST, 1: LATEST}
    assert b.fail_on_data_loss is True
    s = parse_source_options({"pm": PM, "streams": "1"}, streaming=True)
    assert s.starting == {1: LATEST}
    assert s.max_offsets_per_trigger is None


def test_options_are_case_insensitive_and_json_offsets() -> None:
    o = parse_source_options(
        {
            "PM": PM,
            "Streams": "1,2",
            "startingoffsets": json.dumps({"1": -2, "2": 17}),
            "maxOffsetsPerTrigger": "100",
            "minpartitions": "4",
            "failOnDataLoss": "false",
        },
        streaming=True,
    )
    assert o.starting == {1: EARLIEST, 2: 17}
    assert o.max_offsets_per_trigger == 100
    assert o.min_partitions == 4
    assert o.fail_on_data_loss is False


@pytest.mark.parametrize(
    ("options", "streaming", "needle"),
    [
        ({"streams": "1"}, False, "option 'pm'"),
        ({"pm": PM}, False, "option 'streams'"),
        ({"pm": PM, "streams": "x y"}, False, "option 'streams': stream name"),
        ({"pm": PM, "streamPattern": "("}, False, "option 'streamPattern': bad regular"),
        ({"pm": PM, "streams": "a", "streamPattern": "a.*"}, False, "exclude each other"),
        ({"pm": PM, "streamPattern": "a.*", "startingOffsets": "{}"}, True, "per-stream JSON"),
        ({"pm": PM, "streams": "1,1"}, False, "listed twice"),
        ({"pm": "nohost", "streams": "1"}, False, "option 'pm'"),
        ({"pm": PM, "streams": "1", "startingOffsets": "{bad"}, False, "option 'startingOffsets'"),
        ({"pm": PM, "streams": "1", "startingOffsets": "[1]"}, False, "option 'startingOffsets'"),
        ({"pm": PM, "streams": "1", "startingOffsets": '{"2": 0}'}, False, "not in option"),
        ({"pm": PM, "streams": "1,2", "startingOffsets": '{"1": 0}'}, False, "missing 2"),
        ({"pm": PM, "streams": "1", "startingOffsets": '{"1": -3}'}, False, "startingOffsets"),
        ({"pm": PM, "streams": "1", "startingOffsets": '{"1": "0"}'}, False, "integer"),
        ({"pm": PM, "streams": "1", "endingOffsets": "earliest"}, False, "endingOffsets"),
        ({"pm": PM, "streams": "1", "endingOffsets": '{"1": -2}'}, False, "endingOffsets"),
        ({"pm": PM, "streams": "1", "endingOffsets": "latest"}, True, "endingOffsets"),
        ({"pm": PM, "streams": "1", "maxOffsetsPerTrigger": "0"}, True, "maxOffsetsPerTrigger"),
        ({"pm": PM, "streams": "1", "maxOffsetsPerTrigger": "5"}, False, "maxOffsetsPerTrigger"),
        ({"pm": PM, "streams": "1", "minPartitions": "a"}, False, "minPartitions"),
        ({"pm": PM, "streams": "1", "failOnDataLoss": "maybe"}, False, "failOnDataLoss"),
    ],
)
def test_misuse_names_the_option(options: dict[str, str], streaming: bool, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        parse_source_options(options, streaming=streaming)
    assert "\n" not in str(info.value)


def test_sink_options() -> None:
    o = parse_sink_options({"pm": PM, "stream": "7"})
    assert o.stream == 7
    assert parse_sink_options({"pm": PM, "stream": "orders"}).stream == "orders"
    assert parse_sink_options({"pm": PM}).stream is None  # routed by a 'stream' column
    with pytest.raises(ValueError, match="option 'streams' is for reading"):
        parse_sink_options({"pm": PM, "streams": "7"})
    with pytest.raises(ValueError, match="option 'stream'"):
        parse_sink_options({"pm": PM, "stream": "se ven"})
    with pytest.raises(ValueError, match="option 'pm'"):
        parse_sink_options({"stream": "7"})
    with pytest.raises(ValueError, match="option 'compression'"):
        parse_sink_options({"pm": PM, "stream": "7", "compression": "gzip"})


# ------------------------------------------------------------------------------ offset math


def test_offsets_json_keys_sorted_as_strings() -> None:
    d = offsets_to_json({10: 5, 9: 1, 100: 2})
    assert list(d) == ["10", "100", "9"]
    assert json.dumps(d) == json.dumps(offsets_to_json({100: 2, 9: 1, 10: 5}))
    assert offsets_from_json(d, [9, 10, 100]) == {9: 1, 10: 5, 100: 2}
    with pytest.raises(ValueError, match="cannot change"):
        offsets_from_json({"11": 0}, [9])


def test_split_read_limit_proportional() -> None:
    assert split_read_limit({1: 10, 2: 20}, 100) == {1: 10, 2: 20}
    assert split_read_limit({1: 100, 2: 300}, 40) == {1: 10, 2: 30}
    shares = split_read_limit({1: 1, 2: 1, 3: 1}, 2)
    assert sum(shares.values()) == 2 and max(shares.values()) == 1
    shares = split_read_limit({1: 7, 2: 0, 3: 1000}, 10)
    assert sum(shares.values()) == 10 and shares[2] == 0


def test_split_read_limit_invariants() -> None:
    import random

    rnd = random.Random(7)
    for _ in range(500):
        n = rnd.randint(1, 6)
        backlogs = {s: rnd.choice([0, 1, 3, rnd.randrange(10_000)]) for s in range(n)}
        limit = rnd.randrange(0, 20_000)
        shares = split_read_limit(backlogs, limit)
        assert sum(shares.values()) == min(limit, sum(backlogs.values()))
        assert all(0 <= shares[s] <= backlogs[s] for s in backlogs)
        assert shares == split_read_limit(dict(reversed(list(backlogs.items()))), limit)


def test_next_offsets_latest_sentinel_and_limit() -> None:
    start = {1: LATEST, 2: 0, 3: 50}
    ends = {1: 500, 2: 100, 3: 150}
    assert next_offsets(start, {1: LATEST, 2: 0, 3: 50}, ends, None) == {1: 500, 2: 100, 3: 150}
    got = next_offsets(start, {1: LATEST, 2: 0, 3: 50}, ends, 20)
    assert got == {1: 500, 2: 10, 3: 60}
    # data loss skipped: reading starts at the trim point 80 of stream 2
    got = next_offsets({2: 0}, {2: 80}, {2: 100}, 5)
    assert got == {2: 85}
    # an end never moves backwards
    assert next_offsets({2: 90}, {2: 90}, {2: 40}, None) == {2: 90}


def test_spans_follow_ranges_and_split() -> None:
    ranges = [
        PlannedRange(0, 0, 100, ("a:1",)),
        PlannedRange(1, 100, 250, ("b:1", "a:1")),
        PlannedRange(2, 250, -1, ("c:1",)),
    ]
    spans = spans_of_stream(7, ranges, 50, 300)
    assert spans == [
        Span(7, 0, 50, 100, ("a:1",)),
        Span(7, 1, 100, 250, ("b:1", "a:1")),
        Span(7, 2, 250, 300, ("c:1",)),
    ]
    assert spans_of_stream(7, ranges, 300, 300) == []
    parts = split_spans(spans, 10)
    assert len(parts) >= 10
    covered = sorted((p.from_offset, p.until_offset) for p in parts)
    assert covered[0][0] == 50 and covered[-1][1] == 300
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    assert all(p.size > 0 for p in parts)
    assert split_spans(spans, 2) == spans
    # ranges that do not follow each other are an error, never a gap or an overlap in the plan
    for bad in ([ranges[0], PlannedRange(1, 120, 250, ("b:1",)), ranges[2]],
                [ranges[0], PlannedRange(1, 90, 250, ("b:1",)), ranges[2]],
                [PlannedRange(0, 0, -1, ("a:1",)), PlannedRange(1, 100, -1, ("b:1",))]):
        with pytest.raises(ValueError, match="stream 7: its ranges do not follow each other"):
            spans_of_stream(7, bad, 50, 300)
    tiny = [Span(1, 0, 0, 2, ())]
    assert len(split_spans(tiny, 10)) == 2


# ------------------------------------------------------------------------------- Arrow batch


def _buffers(recs: list[Record], base: int) -> ColumnBuffers:
    batch = bytearray(build_batch(recs)) if recs else bytearray()
    if recs:
        patch_base_offset(batch, base)
    return decode_column_buffers(bytes(batch), ts_scale=US_PER_MS)


def test_buffers_to_batch_matches_spark_schema() -> None:
    schema = arrow_schema(SOURCE_SCHEMA)
    recs = [Record(value=b"a", key=None, timestamp_ms=1000),
            Record(value=None, key=b"k", headers=(("h", b"1"), ("i", b"")), timestamp_ms=2000),
            Record(value=b"c", key=b"", timestamp_ms=3000)]
    batch = buffers_to_batch(9, _buffers(recs, 5), schema)
    assert batch.schema.equals(schema)
    batch.validate(full=True)
    rows = batch.to_pylist()
    assert [r["stream_id"] for r in rows] == [9, 9, 9]
    assert [r["offset"] for r in rows] == [5, 6, 7]
    assert [(r["key"], r["value"]) for r in rows] == [(None, b"a"), (b"k", None), (b"", b"c")]
    assert rows[1]["headers"] == [{"key": "h", "value": b"1"}, {"key": "i", "value": b""}]
    assert rows[0]["headers"] == []
    assert rows[0]["timestamp"].timestamp() == 1.0
    empty = buffers_to_batch(9, _buffers([], 0), schema)
    assert empty.num_rows == 0 and empty.schema.equals(schema)
    no_headers = buffers_to_batch(9, _buffers([Record(value=b"x", timestamp_ms=1)], 1), schema)
    assert no_headers.schema.equals(schema)
    no_headers.validate(full=True)
    assert no_headers.to_pylist()[0]["headers"] == []


@pytest.mark.parametrize(("options", "typo", "meant"), [
    ({"pm": "h:1", "streams": "1", "startingofsets": "earliest"}, "startingofsets",
     "startingOffsets"),
    ({"pm": "h:1", "stream": "1"}, "stream", "streams"),
    ({"pm": "h:1", "streams": "1", "maxOffsetPerTrigger": "5"}, "maxOffsetPerTrigger",
     "maxOffsetsPerTrigger"),
])
def test_unknown_source_option_names_the_closest(options: dict[str, str], typo: str,
                                                 meant: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_source_options(options, streaming=True)
    msg = str(e.value)
    assert msg.startswith(f"option '{typo}' is not an option") and f"did you mean '{meant}'" in msg
    assert "\n" not in msg


def test_unknown_sink_option_and_spark_own_options() -> None:
    with pytest.raises(ValueError, match="did you mean 'compression'"):
        parse_sink_options({"pm": "h:1", "stream": "1", "compresion": "lz4"})
    # Spark's own options reach the source too and are not ours to refuse
    parse_sink_options({"pm": "h:1", "stream": "1", "checkpointLocation": "/tmp/x", "path": "p"})
    with pytest.raises(ValueError, match="^option 'zzz' is not an option of the sbpstream "
                                         r"source \(valid"):
        parse_source_options({"pm": "h:1", "streams": "1", "zzz": "1"}, streaming=False)
