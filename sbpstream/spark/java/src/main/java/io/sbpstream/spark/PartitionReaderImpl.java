package io.sbpstream.spark;

import io.sbpstream.spark.wire.FbTable;
import io.sbpstream.spark.wire.Frame;
import io.sbpstream.spark.wire.Messages;
import io.sbpstream.spark.wire.Messages.FetchResult;
import io.sbpstream.spark.wire.Messages.RangeInfo;
import io.sbpstream.spark.wire.ProtocolException;
import io.sbpstream.spark.wire.RecordBatches;
import io.sbpstream.spark.wire.SbpConnection;
import io.sbpstream.spark.wire.SbpException;
import java.io.IOException;
import java.util.List;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Reads one partition, [from, until) of one range, with FETCH from the range's replicas (the
 *  primary first, another after an error), as sbpstream/spark/fetch.py's SpanReader: the PM is
 *  asked only when every replica failed or the range was sealed before ``until``. One
 *  {@link ColumnarBatch} per FETCH answer. Records trimmed away before they were read are data
 *  loss: an error with failOnDataLoss (the default), skipped otherwise. */
public final class PartitionReaderImpl implements PartitionReader<ColumnarBatch> {
  /** Long poll when a replica has not yet learned the records are committed. */
  static final int FETCH_MAX_WAIT_MS = 500;
  /** Wait for a response frame beyond max_wait_ms and the option's timeout. */
  static final int FETCH_FRAME_MARGIN_MS = 5_000;
  static final long BACKOFF_MAX_MS = 1_000;

  private final SbpInputPartition p;
  private final ColumnSink sink;
  private long pos;
  private int rangeIndex;
  private String[] replicas;
  private int replica;
  private SbpConnection conn;
  /** A FETCH sent before the last answer was decoded (-1: none): its request id, position and
   *  range on ``conn``. The data node prepares it while this answer is decoded and consumed. */
  private int aheadId = -1;
  private long aheadPos;
  private int aheadRange;
  /** When the last batch was handed to Spark (0: none yet), for {@link ReadStats}. */
  private long handedAt;

  /** This replica cannot serve the read now: try another, then ask the PM. */
  private static final class Retry extends Exception {
    private static final long serialVersionUID = 1L;

    Retry(String m) {
      super(m);
    }
  }

  /** A reader of every column of {@link SbpstreamJvmSource#SCHEMA}. */
  public PartitionReaderImpl(SbpInputPartition p) {
    this(p, SbpstreamJvmSource.SCHEMA);
  }

  /** A reader filling the columns of ``schema`` (SCHEMA or a pruned part of it). */
  public PartitionReaderImpl(SbpInputPartition p, StructType schema) {
    this.p = p;
    this.pos = p.fromOffset;
    this.rangeIndex = p.rangeIndex;
    this.replicas = p.replicas;
    this.sink = new ColumnSink(p.streamId, schema);
    ReadStats.PARTITIONS.incrementAndGet();
  }

  @Override
  public boolean next() throws IOException {
    if (handedAt != 0) {
      ReadStats.CONSUME_NS.addAndGet(System.nanoTime() - handedAt);
      handedAt = 0;
    }
    long deadline = System.currentTimeMillis() + p.timeoutMs;
    int failures = 0;
    sink.reset();
    while (pos < p.untilOffset) {
      int rows;
      try {
        rows = fetchOnce();
      } catch (Retry e) {
        failures++;
        if (System.currentTimeMillis() >= deadline) {
          throw new IOException("option 'pm': cannot read stream " + p.streamId + " range "
              + rangeIndex + " at offset " + pos + " from any replica ("
              + String.join(",", replicas) + "): " + e.getMessage());
        }
        nextReplica(failures);
        continue;
      }
      if (rows > 0) {
        return true;
      }
      if (System.currentTimeMillis() >= deadline) {
        throw new IOException("stream " + p.streamId + ": offsets [" + pos + ", "
            + p.untilOffset + ") planned but not readable within " + p.timeoutMs
            + " ms (option 'timeoutMs')");
      }
    }
    // rows decoded before a round that then failed over and skipped the rest as lost (the
    // span ends there) are still this batch's: returning false would drop them silently
    return sink.rows > 0;
  }

  @Override
  public ColumnarBatch get() {
    ColumnarBatch b = sink.finish();
    ReadStats.ROWS.addAndGet(b.numRows());
    handedAt = System.nanoTime();
    return b;
  }

  private void nextReplica(int failures) throws IOException {
    replica++;
    closeConn();
    if (replica % Math.max(1, replicas.length) == 0) {
      PmClient.sleep(Math.min(BACKOFF_MAX_MS, 50L << Math.min(failures, 6)));
      locate();
    }
  }

  /** Ask the PM which range holds ``pos`` now, and its replicas. */
  private void locate() throws IOException {
    try (PmClient pm = new PmClient(p.pm, p.timeoutMs)) {
      List<RangeInfo> ranges = pm.ranges(List.of(p.streamId)).get(p.streamId);
      for (RangeInfo r : ranges) {
        if (r.startOffset <= pos && (!r.sealed() || pos < r.endOffset)) {
          rangeIndex = r.rangeIndex;
          replicas = r.replicas;
          return;
        }
      }
      if (!ranges.isEmpty() && pos < ranges.get(0).startOffset) {
        lost(ranges.get(0).startOffset, "trimmed");
      }
    } catch (IllegalArgumentException e) {
      throw new IOException(e.getMessage());
    }
  }

  private void lost(long newStart, String why) throws IOException {
    long hi = Math.min(newStart, p.untilOffset);
    if (p.failOnDataLoss) {
      throw new IOException(Planner.dataLossMessage(p.streamId, pos, hi, why));
    }
    pos = Math.max(pos, hi);
  }

  private void onLoss(int code, long start) throws IOException, Retry {
    String why = code == SbpException.OFFSET_TRIMMED ? "offset_trimmed"
        : code == SbpException.STREAM_DELETED ? "stream_deleted"
        : code == SbpException.STREAM_NOT_FOUND ? "stream_not_found" : "offset_out_of_range";
    if (code == SbpException.STREAM_NOT_FOUND || code == SbpException.STREAM_DELETED) {
      lost(p.untilOffset, why);
      return;
    }
    if (start <= pos) { // the node did not say where the stream starts now: ask the PM
      try (PmClient pm = new PmClient(p.pm, p.timeoutMs)) {
        List<RangeInfo> rs = pm.ranges(List.of(p.streamId)).get(p.streamId);
        long trim = pm.describe(List.of(p.streamId)).get(p.streamId);
        start = Math.max(trim, rs.isEmpty() ? 0 : rs.get(0).startOffset);
      }
    }
    if (start <= pos) {
      throw new Retry("offset " + pos + " reported " + why + ", but the stream starts at "
          + start);
    }
    lost(start, why);
  }

  /** One FETCH round; the rows it added (0: none yet, or the position moved otherwise). */
  private int fetchOnce() throws IOException, Retry {
    if (replicas.length == 0) {
      locate();
      if (replicas.length == 0) {
        throw new Retry("stream " + p.streamId + " range " + rangeIndex + " has no replica");
      }
    }
    String addr = replicas[replica % replicas.length];
    long rangeEnd = -1;
    int lossCode = 0;
    long lossStart = -1;
    try {
      int id;
      boolean ahead = aheadId >= 0 && conn != null && conn.usable() && conn.address.equals(addr)
          && aheadPos == pos && aheadRange == rangeIndex;
      if (ahead) {
        id = aheadId;
      } else {
        if (aheadId >= 0) {
          closeConn(); // an answer this reader will not read is on its way: drop the connection
        }
        if (conn == null || !conn.usable() || !conn.address.equals(addr)) {
          closeConn();
          conn = new SbpConnection(addr, Math.min(p.timeoutMs, PmClient.CONNECT_TIMEOUT_MS),
              FETCH_MAX_WAIT_MS + p.timeoutMs + FETCH_FRAME_MARGIN_MS);
        }
        id = conn.send(Messages.FETCH,
            Messages.fetch(FETCH_MAX_WAIT_MS, p.streamId, pos, p.fetchMaxBytes, rangeIndex));
      }
      aheadId = -1;
      while (true) {
        long t0 = System.nanoTime();
        Frame f = conn.read(id);
        long t1 = System.nanoTime();
        ReadStats.FETCH_NS.addAndGet(t1 - t0);
        ReadStats.FETCHES.incrementAndGet();
        FbTable h = f.header();
        Messages.checkStatus(h, addr);
        List<FetchResult> items = Messages.fetchResults(h);
        if (f.end()) {
          fetchAhead(f, items);
        }
        int at = f.payloadOff;
        int payloadEnd = f.payloadOff + f.payloadLen;
        for (FetchResult item : items) {
          if (item.batchLength > payloadEnd - at) {
            throw new ProtocolException("FETCH answer from " + addr + ": items claim more bytes "
                + "than the frame's payload of " + f.payloadLen);
          }
          int code = item.code;
          if (item.streamId != p.streamId) {
            throw new ProtocolException("FETCH answer from " + addr + " for stream "
                + item.streamId + ", asked " + p.streamId);
          }
          if (code == SbpException.OFFSET_TRIMMED || code == SbpException.STREAM_NOT_FOUND
              || code == SbpException.STREAM_DELETED
              || (code == SbpException.OFFSET_OUT_OF_RANGE && item.startOffset > pos)) {
            lossCode = code;
            lossStart = item.startOffset;
          } else if (code != 0) {
            throw new SbpException(code, item.message, null);
          } else {
            if (item.rangeEndOffset >= 0) {
              rangeEnd = item.rangeEndOffset;
            }
            if (item.batchLength > 0) {
              pos = RecordBatches.decode(f.buf, at, item.batchLength, pos, p.untilOffset, sink);
            }
          }
          at += item.batchLength;
        }
        ReadStats.DECODE_NS.addAndGet(System.nanoTime() - t1);
        if (f.end()) {
          break;
        }
      }
    } catch (ProtocolException e) {
      closeConn();
      throw new IOException("corrupt answer reading stream " + p.streamId + " range "
          + rangeIndex + " at offset " + pos + ": " + e.getMessage(), e);
    } catch (SbpException e) {
      if (e.retriable() || e.code == SbpException.RANGE_NOT_FOUND
          || e.code == SbpException.NOT_PRIMARY) {
        closeConn();
        throw new Retry(e.getMessage());
      }
      throw e;
    } catch (IOException e) {
      closeConn();
      throw new Retry(e.getMessage());
    }
    if (lossCode != 0) {
      onLoss(lossCode, lossStart);
      return 0;
    }
    if (sink.rows > 0) {
      return sink.rows;
    }
    if (rangeEnd >= 0 && pos >= rangeEnd) {
      locate(); // sealed before `until`: the rest is in the next range
    }
    return 0;
  }

  /** Send the next FETCH now, from the end of the last whole batch of this final answer frame,
   *  before the frame is decoded, unless the span or the range ends there. A failure to send
   *  is left to the round that would use it (it sends again). */
  private void fetchAhead(Frame f, List<FetchResult> items) {
    long next = -1;
    long rangeEnd = -1;
    int at = f.payloadOff;
    int end = f.payloadOff + f.payloadLen;
    for (FetchResult item : items) {
      if (item.code != 0 || item.batchLength > end - at) {
        return;
      }
      if (item.rangeEndOffset >= 0) {
        rangeEnd = item.rangeEndOffset;
      }
      long n = RecordBatches.nextOffset(f.buf, at, item.batchLength);
      if (n >= 0) {
        next = n;
      }
      at += item.batchLength;
    }
    if (next <= pos || next >= p.untilOffset || (rangeEnd >= 0 && rangeEnd <= next)) {
      return;
    }
    try {
      aheadId = conn.send(Messages.FETCH,
          Messages.fetch(FETCH_MAX_WAIT_MS, p.streamId, next, p.fetchMaxBytes, rangeIndex));
      aheadPos = next;
      aheadRange = rangeIndex;
    } catch (IOException e) {
      aheadId = -1;
    }
  }

  private void closeConn() {
    aheadId = -1;
    if (conn != null) {
      conn.close();
      conn = null;
    }
  }

  @Override
  public void close() {
    closeConn();
    sink.close();
  }
}
