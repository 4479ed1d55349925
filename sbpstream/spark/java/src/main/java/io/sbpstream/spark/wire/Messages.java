package io.sbpstream.spark.wire;

import com.google.flatbuffers.FlatBufferBuilder;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.List;

/** The few SBP extended headers the JVM reader speaks, hand-written from
 *  sbpstream/protocol/schema/sbp.fbs (field slots are the schema's field order). Requests are
 *  built with the FlatBuffers runtime; responses are read with the checked {@link FbTable}. */
public final class Messages {
  public static final int FETCH = 0x1002;
  public static final int LIST_RANGES = 0x2001;
  public static final int DESCRIBE_RANGES = 0x2004;
  public static final int DESCRIBE_STREAMS = 0x3004;
  /** RangeOwner union type of StreamOwner. */
  private static final byte OWNER_STREAM = 1;
  /** The protocol's MAX_ITEMS_PER_REQUEST. */
  public static final int MAX_ITEMS_PER_REQUEST = 10_000;

  private Messages() {}

  /** A stream as DESCRIBE_STREAMS describes it. */
  public static final class StreamInfo {
    public final long streamId;
    public final long startOffset;
    public final String name;

    StreamInfo(long streamId, long startOffset, String name) {
      this.streamId = streamId;
      this.startOffset = startOffset;
      this.name = name;
    }
  }

  /** One item of a DESCRIBE_STREAMS answer: the stream, or the status code why not. */
  public static final class StreamResult {
    public final StreamInfo stream;
    public final int code;
    public final String message;

    StreamResult(StreamInfo stream, int code, String message) {
      this.stream = stream;
      this.code = code;
      this.message = message;
    }
  }

  /** A range (sbp.fbs Range) with its replicas' addresses, the primary first. */
  public static final class RangeInfo implements Serializable {
    private static final long serialVersionUID = 1L;
    public final long streamId;
    public final int rangeIndex;
    public final long startOffset;
    public final long nextOffset;
    public final long endOffset;
    public final String[] replicas;

    RangeInfo(long streamId, int rangeIndex, long startOffset, long nextOffset, long endOffset,
        String[] replicas) {
      this.streamId = streamId;
      this.rangeIndex = rangeIndex;
      this.startOffset = startOffset;
      this.nextOffset = nextOffset;
      this.endOffset = endOffset;
      this.replicas = replicas;
    }

    public boolean sealed() {
      return endOffset >= 0;
    }
  }

  /** One FetchResult of a FETCH response frame. */
  public static final class FetchResult {
    public final long streamId;
    public final int batchLength;
    public final int code;
    public final String message;
    public final long startOffset;
    public final long rangeEndOffset;

    FetchResult(long streamId, int batchLength, int code, String message, long startOffset,
        long rangeEndOffset) {
      this.streamId = streamId;
      this.batchLength = batchLength;
      this.code = code;
      this.message = message;
      this.startOffset = startOffset;
      this.rangeEndOffset = rangeEndOffset;
    }
  }

  // ------------------------------------------------------------------------------ requests

  /** DescribeStreamsRequest{timeout_ms, stream_ids, limit, continuation, name, name_prefix}. */
  public static byte[] describeStreams(int timeoutMs, long[] ids, int limit, long continuation,
      String name) {
    FlatBufferBuilder b = new FlatBufferBuilder(64 + 8 * ids.length);
    int nameOff = name == null || name.isEmpty() ? 0 : b.createString(name);
    int idsOff = 0;
    if (ids.length > 0) {
      b.startVector(8, ids.length, 8);
      for (int i = ids.length - 1; i >= 0; i--) {
        b.addLong(ids[i]);
      }
      idsOff = b.endVector();
    }
    b.startTable(6);
    b.addLong(3, continuation, -1L);
    b.addInt(0, timeoutMs, 0);
    if (idsOff != 0) {
      b.addOffset(1, idsOff, 0);
    }
    b.addInt(2, limit, 0);
    if (nameOff != 0) {
      b.addOffset(4, nameOff, 0);
    }
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** ListRangesRequest{timeout_ms, range_owners: [RangeOwnerEntry{StreamOwner}]}. */
  public static byte[] listRanges(int timeoutMs, long[] streamIds) {
    FlatBufferBuilder b = new FlatBufferBuilder(64 + 24 * streamIds.length);
    int[] entries = new int[streamIds.length];
    for (int i = 0; i < streamIds.length; i++) {
      b.startTable(1);
      b.addLong(0, streamIds[i], 0L);
      int owner = b.endTable();
      b.startTable(2);
      b.addOffset(1, owner, 0);
      b.addByte(0, OWNER_STREAM, 0);
      entries[i] = b.endTable();
    }
    int vec = b.createVectorOfTables(entries);
    b.startTable(2);
    b.addInt(0, timeoutMs, 0);
    b.addOffset(1, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** DescribeRangesRequest{timeout_ms, ranges: [DescribeRangeItem{stream_id, range_index}]}. */
  public static byte[] describeRange(int timeoutMs, long streamId, int rangeIndex) {
    FlatBufferBuilder b = new FlatBufferBuilder(64);
    b.startTable(4);
    b.addLong(0, streamId, 0L);
    b.addInt(1, rangeIndex, 0);
    int item = b.endTable();
    int vec = b.createVectorOfTables(new int[] {item});
    b.startTable(2);
    b.addInt(0, timeoutMs, 0);
    b.addOffset(1, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** FetchRequest{max_wait_ms, min_bytes, [FetchItem{stream_id, 0, fetch_offset,
   *  batch_max_bytes, range_index}]}, without a fetch session. */
  public static byte[] fetch(int maxWaitMs, long streamId, long offset, int maxBytes,
      int rangeIndex) {
    FlatBufferBuilder b = new FlatBufferBuilder(96);
    b.startTable(5);
    b.addLong(0, streamId, 0L);
    b.addLong(2, offset, 0L);
    b.addInt(1, 0, 0);
    b.addInt(3, maxBytes, 0);
    b.addInt(4, rangeIndex, -1);
    int item = b.endTable();
    int vec = b.createVectorOfTables(new int[] {item});
    b.startTable(7);
    b.addInt(0, maxWaitMs, 0);
    b.addInt(1, 1, 0);
    b.addOffset(2, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  // ----------------------------------------------------------------------------- responses

  /** The response's top-level status (slot 1 in every response here): thrown when not OK. */
  public static void checkStatus(FbTable resp, String context) throws java.io.IOException {
    if (resp == null) {
      return;
    }
    FbTable st = resp.table(1);
    if (st != null && st.getShort(0, (short) 0) != 0) {
      throw SbpConnection.status(st, context);
    }
  }

  public static List<StreamResult> streamResults(FbTable resp) throws ProtocolException {
    List<StreamResult> out = new ArrayList<>();
    if (resp == null) {
      return out;
    }
    int n = resp.vectorLength(2, 4);
    for (int i = 0; i < n; i++) {
      FbTable r = resp.tableAt(2, i);
      FbTable st = r.table(1);
      int code = st == null ? 0 : st.getShort(0, (short) 0);
      String msg = st == null ? "" : st.string(1);
      FbTable s = r.table(0);
      StreamInfo info = s == null ? null
          : new StreamInfo(s.getLong(0, 0L), s.getLong(3, 0L), s.string(4));
      out.add(new StreamResult(info, code, msg));
    }
    return out;
  }

  public static long continuation(FbTable resp) throws ProtocolException {
    return resp == null ? -1L : resp.getLong(3, -1L);
  }

  public static RangeInfo range(FbTable r) throws ProtocolException {
    int n = r.vectorLength(5, 4);
    List<String> primary = new ArrayList<>();
    List<String> others = new ArrayList<>();
    for (int i = 0; i < n; i++) {
      FbTable rep = r.tableAt(5, i);
      FbTable dn = rep.table(0);
      String addr = dn == null ? "" : dn.string(1);
      if (addr.isEmpty()) {
        continue;
      }
      (rep.getBool(1) ? primary : others).add(addr);
    }
    primary.addAll(others);
    return new RangeInfo(r.getLong(0, 0L), r.getInt(1, 0), r.getLong(2, 0L), r.getLong(3, 0L),
        r.getLong(4, -1L), primary.toArray(new String[0]));
  }

  /** ListRangesResult items: (stream_id, status code, message, ranges). */
  public static final class RangeList {
    public final long streamId;
    public final int code;
    public final String message;
    public final List<RangeInfo> ranges;

    RangeList(long streamId, int code, String message, List<RangeInfo> ranges) {
      this.streamId = streamId;
      this.code = code;
      this.message = message;
      this.ranges = ranges;
    }
  }

  public static List<RangeList> rangeLists(FbTable resp) throws ProtocolException {
    List<RangeList> out = new ArrayList<>();
    if (resp == null) {
      return out;
    }
    int n = resp.vectorLength(2, 4);
    for (int i = 0; i < n; i++) {
      FbTable r = resp.tableAt(2, i);
      FbTable st = r.table(1);
      List<RangeInfo> ranges = new ArrayList<>();
      int m = r.vectorLength(2, 4);
      for (int j = 0; j < m; j++) {
        ranges.add(range(r.tableAt(2, j)));
      }
      out.add(new RangeList(r.getLong(0, 0L), st == null ? 0 : st.getShort(0, (short) 0),
          st == null ? "" : st.string(1), ranges));
    }
    return out;
  }

  /** The first DescribeRangeResult's range, or the status error of the item. */
  public static RangeInfo describedRange(FbTable resp, String context) throws java.io.IOException {
    if (resp == null || resp.vectorLength(2, 4) == 0) {
      throw new SbpException(39, context + " described no range", null);
    }
    FbTable r = resp.tableAt(2, 0);
    FbTable st = r.table(1);
    if (st != null && st.getShort(0, (short) 0) != 0) {
      throw SbpConnection.status(st, context);
    }
    FbTable rng = r.table(2);
    if (rng == null) {
      throw new SbpException(39, context + " described no range", null);
    }
    return range(rng);
  }

  public static List<FetchResult> fetchResults(FbTable resp) throws ProtocolException {
    List<FetchResult> out = new ArrayList<>();
    if (resp == null) {
      return out;
    }
    int n = resp.vectorLength(2, 4);
    for (int i = 0; i < n; i++) {
      FbTable r = resp.tableAt(2, i);
      FbTable st = r.table(3);
      int len = r.getInt(2, 0);
      if (len < 0) {
        throw new ProtocolException("FETCH item with batch_length " + len);
      }
      out.add(new FetchResult(r.getLong(0, 0L), len, st == null ? 0 : st.getShort(0, (short) 0),
          st == null ? "" : st.string(1), r.getLong(4, -1L), r.getLong(6, -1L)));
    }
    return out;
  }
}
