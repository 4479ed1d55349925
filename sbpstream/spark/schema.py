"""The source's Spark schema and the Arrow record batches ``read()`` yields.

Spark checks that a yielded ``pyarrow.RecordBatch`` has *exactly* the Arrow schema of
``to_arrow_schema(schema, timezone="UTC")`` (nullability and list item names included), so the
batches are built against that very schema object rather than from inferred types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from sbpstream.records import Columns

HEADER_TYPE = StructType(
    [StructField("key", StringType(), False), StructField("value", BinaryType(), True)]
)

SOURCE_SCHEMA = StructType(
    [
        StructField("stream_id", LongType(), False),
        StructField("offset", LongType(), False),
        StructField("timestamp", TimestampType(), False),
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("headers", ArrayType(HEADER_TYPE, False), False),
    ]
)


_ARROW_SCHEMAS: dict[str, Any] = {}


def arrow_schema(schema: StructType = SOURCE_SCHEMA) -> Any:
    """The Arrow schema Spark expects for ``schema`` (cached per process)."""
    key = schema.json()
    got = _ARROW_SCHEMAS.get(key)
    if got is None:
        got = _ARROW_SCHEMAS[key] = to_arrow_schema(schema, timezone="UTC")
    return got


def check_source_schema(schema: StructType) -> None:
    """Refuse a user schema other than ours: the columns are fixed by the record format."""
    if schema.simpleString() != SOURCE_SCHEMA.simpleString():
        raise ValueError(
            "the sbpstream source has a fixed schema "
            f"({SOURCE_SCHEMA.simpleString()}); do not pass .schema(...), got "
            f"{schema.simpleString()}"
        )


def empty_headers(n: int, list_type: Any) -> Any:
    """``n`` empty header lists."""
    offsets = pa.array([0] * (n + 1), pa.int32())
    values = pa.array([], list_type.value_type)
    return pa.ListArray.from_arrays(offsets, values, type=list_type)


def headers_array(headers: Sequence[Sequence[tuple[str, bytes]]], list_type: Any) -> Any:
    """Header lists, built column-wise (no per-record dicts)."""
    if not any(headers):
        return empty_headers(len(headers), list_type)
    offsets = [0]
    keys: list[str] = []
    values: list[bytes] = []
    for hs in headers:
        for k, v in hs:
            keys.append(k)
            values.append(bytes(v))
        offsets.append(len(keys))
    struct_type = list_type.value_type
    structs = pa.StructArray.from_arrays(
        [pa.array(keys, struct_type.field(0).type), pa.array(values, struct_type.field(1).type)],
        fields=list(struct_type),
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, type=list_type)


def columns_to_batch(stream_id: int, cols: Columns, schema: Any) -> Any:
    """Decoded records of one stream as one Arrow record batch of ``schema``."""
    n = len(cols)
    ts_type = schema.field("timestamp").type
    ts_ms = pa.array(cols.timestamps, pa.int64())
    ts = pc.multiply(ts_ms, pa.scalar(1000, pa.int64())).cast(ts_type)
    arrays = [
        pa.repeat(pa.scalar(stream_id, pa.int64()), n) if n else pa.array([], pa.int64()),
        pa.array(cols.offsets, pa.int64()),
        ts,
        pa.array(cols.keys, schema.field("key").type),
        pa.array(cols.values, schema.field("value").type),
        headers_array(cols.headers, schema.field("headers").type),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
