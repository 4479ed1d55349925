package io.sbpstream.spark.wire;

import com.google.flatbuffers.FlatBufferBuilder;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.List;

/** The few SBP extended headers the JVM reader speaks. The schema's side of them (field slots,
 *  vtable sizes, defaults, typed getters) is {@link Sbp}, generated from
 *  sbpstream/protocol/schema/sbp.fbs by `python -m sbpstream.protocol.codegen`; this class only
 *  says which fields the reader sends and keeps. Requests are built with the FlatBuffers runtime;
 *  responses are read with the checked {@link FbTable}. */
public final class Messages {
  public static final int FETCH = 0x1002;
  public static final int LIST_RANGES = 0x2001;
  public static final int DESCRIBE_RANGES = 0x2004;
  public static final int DESCRIBE_STREAMS = 0x3004;
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

  /** DescribeStreamsRequest{timeout_ms, stream_ids, limit, continuation, name}. */
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
    b.startTable(Sbp.DescribeStreamsRequest.SLOTS);
    b.addLong(Sbp.DescribeStreamsRequest.SLOT_CONTINUATION, continuation, -1L);
    b.addInt(Sbp.DescribeStreamsRequest.SLOT_TIMEOUT_MS, timeoutMs, 0);
    if (idsOff != 0) {
      b.addOffset(Sbp.DescribeStreamsRequest.SLOT_STREAM_IDS, idsOff, 0);
    }
    b.addInt(Sbp.DescribeStreamsRequest.SLOT_LIMIT, limit, 0);
    if (nameOff != 0) {
      b.addOffset(Sbp.DescribeStreamsRequest.SLOT_NAME, nameOff, 0);
    }
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** ListRangesRequest{timeout_ms, range_owners: [RangeOwnerEntry{StreamOwner}]}. */
  public static byte[] listRanges(int timeoutMs, long[] streamIds) {
    FlatBufferBuilder b = new FlatBufferBuilder(64 + 24 * streamIds.length);
    int[] entries = new int[streamIds.length];
    for (int i = 0; i < streamIds.length; i++) {
      b.startTable(Sbp.StreamOwner.SLOTS);
      b.addLong(Sbp.StreamOwner.SLOT_STREAM_ID, streamIds[i], 0L);
      int owner = b.endTable();
      b.startTable(Sbp.RangeOwnerEntry.SLOTS);
      b.addOffset(Sbp.RangeOwnerEntry.SLOT_OWNER, owner, 0);
      b.addByte(Sbp.RangeOwnerEntry.SLOT_OWNER_TYPE, Sbp.RANGE_OWNER_STREAM_OWNER, 0);
      entries[i] = b.endTable();
    }
    int vec = b.createVectorOfTables(entries);
    b.startTable(Sbp.ListRangesRequest.SLOTS);
    b.addInt(Sbp.ListRangesRequest.SLOT_TIMEOUT_MS, timeoutMs, 0);
    b.addOffset(Sbp.ListRangesRequest.SLOT_RANGE_OWNERS, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** DescribeRangesRequest{timeout_ms, ranges: [DescribeRangeItem{stream_id, range_index}]}. */
  public static byte[] describeRange(int timeoutMs, long streamId, int rangeIndex) {
    FlatBufferBuilder b = new FlatBufferBuilder(64);
    b.startTable(Sbp.DescribeRangeItem.SLOTS);
    b.addLong(Sbp.DescribeRangeItem.SLOT_STREAM_ID, streamId, 0L);
    b.addInt(Sbp.DescribeRangeItem.SLOT_RANGE_INDEX, rangeIndex, 0);
    int item = b.endTable();
    int vec = b.createVectorOfTables(new int[] {item});
    b.startTable(Sbp.DescribeRangesRequest.SLOTS);
    b.addInt(Sbp.DescribeRangesRequest.SLOT_TIMEOUT_MS, timeoutMs, 0);
    b.addOffset(Sbp.DescribeRangesRequest.SLOT_RANGES, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  /** FetchRequest{max_wait_ms, min_bytes, [FetchItem{stream_id, 0, fetch_offset,
   *  batch_max_bytes, range_index}]}, without a fetch session. */
  public static byte[] fetch(int maxWaitMs, long streamId, long offset, int maxBytes,
      int rangeIndex) {
    FlatBufferBuilder b = new FlatBufferBuilder(96);
    b.startTable(Sbp.FetchItem.SLOTS);
    b.addLong(Sbp.FetchItem.SLOT_STREAM_ID, streamId, 0L);
    b.addLong(Sbp.FetchItem.SLOT_FETCH_OFFSET, offset, 0L);
    b.addInt(Sbp.FetchItem.SLOT_REQUEST_INDEX, 0, 0);
    b.addInt(Sbp.FetchItem.SLOT_BATCH_MAX_BYTES, maxBytes, 0);
    b.addInt(Sbp.FetchItem.SLOT_RANGE_INDEX, rangeIndex, -1);
    int item = b.endTable();
    int vec = b.createVectorOfTables(new int[] {item});
    b.startTable(Sbp.FetchRequest.SLOTS);
    b.addInt(Sbp.FetchRequest.SLOT_MAX_WAIT_MS, maxWaitMs, 0);
    b.addInt(Sbp.FetchRequest.SLOT_MIN_BYTES, 1, 0);
    b.addOffset(Sbp.FetchRequest.SLOT_FETCH_REQUESTS, vec, 0);
    b.finish(b.endTable());
    return b.sizedByteArray();
  }

  // ----------------------------------------------------------------------------- responses

  /** The response's top-level status (slot 1 in every response here): thrown when not OK. */
  public static void checkStatus(FbTable resp, String context) throws java.io.IOException {
    if (resp == null) {
      return;
    }
    FbTable st = resp.table(Sbp.FetchResponse.SLOT_STATUS);
    if (Sbp.Status.code(st) != 0) {
      throw SbpConnection.status(st, context);
    }
  }

  public static List<StreamResult> streamResults(FbTable resp) throws ProtocolException {
    List<StreamResult> out = new ArrayList<>();
    int n = Sbp.DescribeStreamsResponse.describeResponsesLength(resp);
    for (int i = 0; i < n; i++) {
      FbTable r = Sbp.DescribeStreamsResponse.describeResponses(resp, i);
      FbTable st = Sbp.StreamResult.status(r);
      FbTable s = Sbp.StreamResult.stream(r);
      StreamInfo info = s == null ? null : new StreamInfo(Sbp.Stream.streamId(s),
          Sbp.Stream.startOffset(s), Sbp.Stream.name(s));
      out.add(new StreamResult(info, Sbp.Status.code(st), Sbp.Status.message(st)));
    }
    return out;
  }

  public static long continuation(FbTable resp) throws ProtocolException {
    return Sbp.DescribeStreamsResponse.continuation(resp);
  }

  public static RangeInfo range(FbTable r) throws ProtocolException {
    int n = Sbp.Range.replicaNodesLength(r);
    List<String> primary = new ArrayList<>();
    List<String> others = new ArrayList<>();
    for (int i = 0; i < n; i++) {
      FbTable rep = Sbp.Range.replicaNodes(r, i);
      String addr = Sbp.DataNode.advertiseAddr(Sbp.ReplicaNode.dataNode(rep));
      if (addr.isEmpty()) {
        continue;
      }
      (Sbp.ReplicaNode.isPrimary(rep) ? primary : others).add(addr);
    }
    primary.addAll(others);
    return new RangeInfo(Sbp.Range.streamId(r), Sbp.Range.rangeIndex(r),
        Sbp.Range.startOffset(r), Sbp.Range.nextOffset(r), Sbp.Range.endOffset(r),
        primary.toArray(new String[0]));
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
    int n = Sbp.ListRangesResponse.listResponsesLength(resp);
    for (int i = 0; i < n; i++) {
      FbTable r = Sbp.ListRangesResponse.listResponses(resp, i);
      FbTable st = Sbp.ListRangesResult.status(r);
      List<RangeInfo> ranges = new ArrayList<>();
      int m = Sbp.ListRangesResult.rangesLength(r);
      for (int j = 0; j < m; j++) {
        ranges.add(range(Sbp.ListRangesResult.ranges(r, j)));
      }
      out.add(new RangeList(Sbp.ListRangesResult.streamId(r), Sbp.Status.code(st),
          Sbp.Status.message(st), ranges));
    }
    return out;
  }

  /** The first DescribeRangeResult's range, or the status error of the item. */
  public static RangeInfo describedRange(FbTable resp, String context) throws java.io.IOException {
    if (Sbp.DescribeRangesResponse.describeResponsesLength(resp) == 0) {
      throw new SbpException(39, context + " described no range", null);
    }
    FbTable r = Sbp.DescribeRangesResponse.describeResponses(resp, 0);
    FbTable st = Sbp.DescribeRangeResult.status(r);
    if (Sbp.Status.code(st) != 0) {
      throw SbpConnection.status(st, context);
    }
    FbTable rng = Sbp.DescribeRangeResult.range(r);
    if (rng == null) {
      throw new SbpException(39, context + " described no range", null);
    }
    return range(rng);
  }

  public static List<FetchResult> fetchResults(FbTable resp) throws ProtocolException {
    List<FetchResult> out = new ArrayList<>();
    int n = Sbp.FetchResponse.fetchResponsesLength(resp);
    for (int i = 0; i < n; i++) {
      FbTable r = Sbp.FetchResponse.fetchResponses(resp, i);
      FbTable st = Sbp.FetchResult.status(r);
      int len = Sbp.FetchResult.batchLength(r);
      if (len < 0) {
        throw new ProtocolException("FETCH item with batch_length " + len);
      }
      out.add(new FetchResult(Sbp.FetchResult.streamId(r), len, Sbp.Status.code(st),
          Sbp.Status.message(st), Sbp.FetchResult.startOffset(r),
          Sbp.FetchResult.rangeEndOffset(r)));
    }
    return out;
  }
}
