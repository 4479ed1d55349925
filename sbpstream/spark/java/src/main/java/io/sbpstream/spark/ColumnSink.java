package io.sbpstream.spark;

import io.sbpstream.spark.wire.ProtocolException;
import io.sbpstream.spark.wire.RecordBatches;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Decoded records written straight into Spark's on-heap column vectors of the scan's schema:
 *  {@link SbpstreamJvmSource#SCHEMA} or the columns a query needs of it (column pruning: a
 *  column not asked for is never filled, so {@code sum(length(value))} copies values only, and
 *  a count copies nothing). One {@link ColumnarBatch} reused for every FETCH answer. */
final class ColumnSink implements RecordBatches.Sink {
  /** Rows the vectors start with (they grow as a FETCH answer needs). */
  static final int INITIAL_CAPACITY = 4096;
  private static final long US_PER_MS = 1000;

  private final long streamId;
  private final OnHeapColumnVector[] cols;
  /** The vector of each source column (SCHEMA's order), null when the scan does not read it. */
  private final OnHeapColumnVector streamCol;
  private final OnHeapColumnVector offsetCol;
  private final OnHeapColumnVector tsCol;
  private final OnHeapColumnVector keyCol;
  private final OnHeapColumnVector valueCol;
  private final OnHeapColumnVector headersCol;
  private final WritableColumnVector elems;
  private final WritableColumnVector hKeys;
  private final WritableColumnVector hValues;
  final ColumnarBatch batch;
  int rows;
  private int headerElems;

  ColumnSink(long streamId, StructType schema) {
    this.streamId = streamId;
    cols = OnHeapColumnVector.allocateColumns(INITIAL_CAPACITY, schema);
    streamCol = column(schema, "stream_id");
    offsetCol = column(schema, "offset");
    tsCol = column(schema, "timestamp");
    keyCol = column(schema, "key");
    valueCol = column(schema, "value");
    headersCol = column(schema, "headers");
    elems = headersCol == null ? null : headersCol.arrayData();
    hKeys = elems == null ? null : elems.getChild(0);
    hValues = elems == null ? null : elems.getChild(1);
    batch = new ColumnarBatch(cols);
  }

  private OnHeapColumnVector column(StructType schema, String name) {
    String[] names = schema.fieldNames();
    for (int i = 0; i < names.length; i++) {
      if (names[i].equals(name)) {
        return cols[i];
      }
    }
    return null;
  }

  void reset() {
    for (OnHeapColumnVector c : cols) {
      c.reset();
    }
    rows = 0;
    headerElems = 0;
  }

  @Override
  public void reserve(int n) {
    int want = rows + n;
    for (OnHeapColumnVector c : cols) {
      c.reserve(want);
    }
  }

  @Override
  public void record(long offset, long timestampMs, byte[] buf, int keyOff, int keyLen,
      int valueOff, int valueLen, int hdrCount, int[] hdr) throws ProtocolException {
    int r = rows;
    if (timestampMs > Long.MAX_VALUE / US_PER_MS || timestampMs < Long.MIN_VALUE / US_PER_MS) {
      throw new ProtocolException("record at offset " + offset + " of stream " + streamId
          + " has timestamp_ms " + timestampMs + ", outside what a Spark timestamp holds");
    }
    if (offsetCol != null) {
      offsetCol.putLong(r, offset);
    }
    if (tsCol != null) {
      tsCol.putLong(r, timestampMs * US_PER_MS);
    }
    if (keyCol != null) {
      if (keyLen < 0) {
        keyCol.putNull(r);
      } else {
        keyCol.putByteArray(r, buf, keyOff, keyLen);
      }
    }
    if (valueCol != null) {
      if (valueLen < 0) {
        valueCol.putNull(r);
      } else {
        valueCol.putByteArray(r, buf, valueOff, valueLen);
      }
    }
    if (headersCol != null) {
      if (hdrCount > 0) {
        int need = headerElems + hdrCount;
        elems.reserve(need);
        hKeys.reserve(need);
        hValues.reserve(need);
        for (int h = 0; h < hdrCount; h++) {
          int e = headerElems + h;
          hKeys.putByteArray(e, buf, hdr[4 * h], hdr[4 * h + 1]);
          hValues.putByteArray(e, buf, hdr[4 * h + 2], hdr[4 * h + 3]);
        }
      }
      headersCol.putArray(r, headerElems, hdrCount);
      headerElems += hdrCount;
    }
    rows = r + 1;
  }

  /** The batch of the rows written since the last reset. */
  ColumnarBatch finish() {
    if (rows > 0 && streamCol != null) {
      streamCol.putLongs(0, rows, streamId);
    }
    batch.setNumRows(rows);
    return batch;
  }

  void close() {
    batch.close();
  }
}
