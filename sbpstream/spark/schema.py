"""The source's Spark schema and the Arrow record batches ``read()`` yields.

Spark checks that a yielded ``pyarrow.RecordBatch`` has *exactly* the Arrow schema of
``to_arrow_schema(schema, timezone="UTC")`` (nullability and list item names included), so the
batches are built against that very schema object rather than from inferred types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
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

from sbpstream.records import ColumnBuffers

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
    """``n`` empty header lists (one zeroed offsets buffer: no Python object per row)."""
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(bytes(4 * (n + 1)))])
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


US_PER_MS = 1000  # Spark's TimestampType is microseconds


def buffers_to_batch(stream_id: int, cb: ColumnBuffers, schema: Any) -> Any:
    """Records already in Arrow's layout (:func:`sbpstream.records.decode_column_buffers` with
    ``ts_scale=US_PER_MS``) as one record batch of ``schema``: the buffers are wrapped, not
    copied, and no Python object is made per record (headers aside, which are rare)."""
    n = cb.rows
    buf = pa.py_buffer

    def binary(t: Any, offsets: bytes, data: bytes, valid: bytes | None, nulls: int) -> Any:
        return pa.Array.from_buffers(t, n, [None if valid is None else buf(valid), buf(offsets),
                                            buf(data)], null_count=nulls)

    hdr_type = schema.field("headers").type
    if cb.headers:
        rows: list[tuple[tuple[str, bytes], ...]] = [()] * n
        for i, hs in cb.headers:
            rows[i] = hs
        headers = headers_array(rows, hdr_type)
    else:
        headers = empty_headers(n, hdr_type)
    arrays = [
        pa.repeat(pa.scalar(stream_id, pa.int64()), n) if n else pa.array([], pa.int64()),
        pa.Array.from_buffers(pa.int64(), n, [None, buf(cb.offsets)]),
        pa.Array.from_buffers(schema.field("timestamp").type, n, [None, buf(cb.timestamps)]),
        binary(schema.field("key").type, cb.key_offsets, cb.key_data, cb.key_validity,
               cb.key_nulls),
        binary(schema.field("value").type, cb.value_offsets, cb.value_data, cb.value_validity,
               cb.value_nulls),
        headers,
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
