package io.sbpstream.spark;

import io.sbpstream.spark.wire.ProtocolException;
import io.sbpstream.spark.wire.RecordBatches;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Decoded records written straight into Spark's on-heap column vectors of
 *  {@link SbpstreamJvmSource#SCHEMA}; one {@link ColumnarBatch} reused for every FETCH answer. */
final class ColumnSink implements RecordBatches.Sink {
  /** Rows the vectors start with (they grow as a FETCH answer needs). */
  static final int INITIAL_CAPACITY = 4096;
  private static final long US_PER_MS = 1000;

  private final long streamId;
  private final OnHeapColumnVector[] cols;
  private final WritableColumnVector elems;
  private final WritableColumnVector hKeys;
  private final WritableColumnVector hValues;
  final ColumnarBatch batch;
  int rows;
  private int headerElems;

  ColumnSink(long streamId) {
    this.streamId = streamId;
    cols = OnHeapColumnVector.allocateColumns(INITIAL_CAPACITY, SbpstreamJvmSource.SCHEMA);
    elems = cols[5].arrayData();
    hKeys = elems.getChild(0);
    hValues = elems.getChild(1);
    batch = new ColumnarBatch(cols);
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
    long micros;
    try {
      micros = Math.multiplyExact(timestampMs, US_PER_MS);
    } catch (ArithmeticException e) {
      throw new ProtocolException("record at offset " + offset + " of stream " + streamId
          + " has timestamp_ms " + timestampMs + ", outside what a Spark timestamp holds");
    }
    cols[1].putLong(r, offset);
    cols[2].putLong(r, micros);
    if (keyLen < 0) {
      cols[3].putNull(r);
    } else {
      cols[3].putByteArray(r, buf, keyOff, keyLen);
    }
    if (valueLen < 0) {
      cols[4].putNull(r);
    } else {
      cols[4].putByteArray(r, buf, valueOff, valueLen);
    }
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
    cols[5].putArray(r, headerElems, hdrCount);
    headerElems += hdrCount;
    rows = r + 1;
  }

  /** The batch of the rows written since the last reset. */
  ColumnarBatch finish() {
    if (rows > 0) {
      cols[0].putLongs(0, rows, streamId);
    }
    batch.setNumRows(rows);
    return batch;
  }

  void close() {
    batch.close();
  }
}
