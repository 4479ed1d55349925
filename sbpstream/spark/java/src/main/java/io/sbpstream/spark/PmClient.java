package io.sbpstream.spark;

import io.sbpstream.spark.wire.FbTable;
import io.sbpstream.spark.wire.Frame;
import io.sbpstream.spark.wire.Messages;
import io.sbpstream.spark.wire.Messages.RangeInfo;
import io.sbpstream.spark.wire.Messages.RangeList;
import io.sbpstream.spark.wire.Messages.StreamResult;
import io.sbpstream.spark.wire.ProtocolException;
import io.sbpstream.spark.wire.SbpConnection;
import io.sbpstream.spark.wire.SbpException;
import java.io.Closeable;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/** The questions the reader asks the placement manager (and, for a writable range's end, its
 *  primary): the same messages as the Python client (sbpstream/client/aclient.py). Follows
 *  PM_NOT_LEADER redirects, retries retriable errors until the deadline ``timeoutMs``. */
public final class PmClient implements Closeable {
  /** Streams per DESCRIBE_STREAMS page when listing (the Python client's LIST_PAGE_SIZE). */
  public static final int LIST_PAGE_SIZE = 1000;
  public static final int MAX_REDIRECTS = 5;
  /** Frames one answer may span (a PM splits long lists); more is a misbehaving peer. */
  public static final int MAX_RESPONSE_FRAMES = 10_000;
  public static final int CONNECT_TIMEOUT_MS = 5_000;
  public static final int REQUEST_TIMEOUT_MS = 10_000;
  public static final long BACKOFF_MAX_MS = 1_000;

  private final String[] pm;
  private final int timeoutMs;
  private final Map<String, SbpConnection> conns = new HashMap<>();
  private String leader;

  public PmClient(String[] pm, int timeoutMs) {
    this.pm = pm;
    this.timeoutMs = timeoutMs;
  }

  private int requestTimeout() {
    return Math.min(timeoutMs, REQUEST_TIMEOUT_MS);
  }

  /** Send one request to ``addr`` and gather its answer's frames' headers. */
  public List<FbTable> call(String addr, int opcode, byte[] header) throws IOException {
    SbpConnection c = conns.get(addr);
    if (c == null || !c.usable()) {
      if (c != null) {
        c.close();
      }
      c = new SbpConnection(addr, Math.min(timeoutMs, CONNECT_TIMEOUT_MS), requestTimeout());
      conns.put(addr, c);
    }
    boolean ended = false;
    try {
      int id = c.send(opcode, header);
      List<FbTable> out = new ArrayList<>();
      while (true) {
        Frame f = c.read(id);
        ended = f.end();
        // the connection reads the next frame into the same buffer: keep a copy of this one's
        // header, or an answer of several frames would be read as its last frame several times
        FbTable h = FbTable.root(
            Arrays.copyOfRange(f.buf, f.headerOff, f.headerOff + f.headerLen), 0, f.headerLen);
        Messages.checkStatus(h, addr);
        out.add(h);
        if (ended) {
          return out;
        }
        if (out.size() >= MAX_RESPONSE_FRAMES) {
          throw new ProtocolException(addr + " answered with more than " + MAX_RESPONSE_FRAMES
              + " frames");
        }
      }
    } catch (IOException e) {
      // an error answer that ended the response leaves the connection in step; anything else
      // (a broken frame, frames of this answer still to come) does not
      if (!(e instanceof SbpException) || !ended) {
        c.close();
        conns.remove(addr);
      }
      throw e;
    }
  }

  /** A request to the PM leader, retried within the deadline. */
  public List<FbTable> pmCall(int opcode, byte[] header) throws IOException {
    long deadline = System.currentTimeMillis() + timeoutMs;
    int index = 0;
    int redirects = 0;
    int failures = 0;
    IOException last = null;
    while (true) {
      String addr = leader != null ? leader : pm[index % pm.length];
      try {
        List<FbTable> out = call(addr, opcode, header);
        leader = addr;
        return out;
      } catch (SbpException e) {
        last = e;
        leader = null;
        if (e.redirect()) {
          String to = new String(e.detail, StandardCharsets.UTF_8).strip();
          if (!to.isEmpty() && !to.equals(addr) && ++redirects <= MAX_REDIRECTS) {
            leader = to;
            continue;
          }
          index++;
        } else if (!e.retriable()) {
          throw e;
        } else {
          index++;
        }
      } catch (ProtocolException e) {
        throw e;
      } catch (IOException e) {
        last = e;
        leader = null;
        index++;
      }
      if (System.currentTimeMillis() >= deadline) {
        if (last instanceof SbpException) {
          throw last;
        }
        throw new NoPmReachable("option 'pm': no sbpstream placement manager reachable at "
            + String.join(",", pm) + " (" + last.getMessage() + ")");
      }
      if (index % pm.length == 0) {
        sleep(Math.min(BACKOFF_MAX_MS, 50L << Math.min(++failures, 5)));
      }
    }
  }

  /** No PM answered within the deadline. */
  public static final class NoPmReachable extends IOException {
    private static final long serialVersionUID = 1L;

    NoPmReachable(String m) {
      super(m);
    }
  }

  static void sleep(long ms) throws IOException {
    try {
      Thread.sleep(ms);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IOException("interrupted");
    }
  }

  /** Each ref of option 'streams' (id or name) to its id. */
  public long resolve(Object ref) throws IOException {
    if (ref instanceof Long) {
      return (Long) ref;
    }
    String name = (String) ref;
    List<StreamResult> items = new ArrayList<>();
    for (FbTable h : pmCall(Messages.DESCRIBE_STREAMS,
        Messages.describeStreams(requestTimeout(), new long[0], 0, -1, name))) {
      items.addAll(Messages.streamResults(h));
    }
    StreamResult r = items.isEmpty() ? null : items.get(0);
    if (r == null || r.code == SbpException.STREAM_NOT_FOUND || r.stream == null) {
      throw new IllegalArgumentException("option 'streams': no stream is named '" + name + "'");
    }
    if (r.code != 0) {
      throw new SbpException(r.code, r.message, null);
    }
    return r.stream.streamId;
  }

  /** Ids of the live named streams whose whole name matches ``pattern``, ascending. */
  public List<Long> matching(String pattern) throws IOException {
    java.util.regex.Pattern rx = java.util.regex.Pattern.compile(pattern);
    List<Long> out = new ArrayList<>();
    long continuation = -1;
    while (true) {
      List<StreamResult> items = new ArrayList<>();
      long next = -1;
      for (FbTable h : pmCall(Messages.DESCRIBE_STREAMS,
          Messages.describeStreams(requestTimeout(), new long[0], LIST_PAGE_SIZE, continuation,
              null))) {
        items.addAll(Messages.streamResults(h));
        next = Messages.continuation(h);
      }
      for (StreamResult r : items) {
        if (r.code == 0 && r.stream != null && !r.stream.name.isEmpty()
            && rx.matcher(r.stream.name).matches()) {
          out.add(r.stream.streamId);
        }
      }
      if (next < 0 || items.isEmpty()) {
        return out;
      }
      continuation = next;
    }
  }

  /** Each stream's trim point from DESCRIBE_STREAMS (IllegalArgumentException naming option
   *  'streams' for one that does not exist). */
  public Map<Long, Long> describe(List<Long> ids) throws IOException {
    Map<Long, Long> out = new HashMap<>();
    for (int at = 0; at < ids.size(); at += Messages.MAX_ITEMS_PER_REQUEST) {
      List<Long> part = ids.subList(at, Math.min(ids.size(), at + Messages.MAX_ITEMS_PER_REQUEST));
      long[] arr = part.stream().mapToLong(Long::longValue).toArray();
      List<StreamResult> items = new ArrayList<>();
      for (FbTable h : pmCall(Messages.DESCRIBE_STREAMS,
          Messages.describeStreams(requestTimeout(), arr, 0, -1, null))) {
        items.addAll(Messages.streamResults(h));
      }
      for (int i = 0; i < arr.length; i++) {
        StreamResult r = i < items.size() ? items.get(i) : null;
        if (r == null) {
          throw new ProtocolException("DESCRIBE_STREAMS answered " + items.size() + " of "
              + arr.length + " streams");
        }
        if (r.code == SbpException.STREAM_NOT_FOUND || r.code == SbpException.STREAM_DELETED
            || (r.code == 0 && r.stream == null)) {
          throw new IllegalArgumentException("option 'streams': stream " + arr[i]
              + " does not exist");
        }
        if (r.code != 0) {
          throw new SbpException(r.code, r.message, null);
        }
        out.put(arr[i], r.stream.startOffset);
      }
    }
    return out;
  }

  /** The ranges of each stream, by range index (one LIST_RANGES per 1,000 streams). */
  public Map<Long, List<RangeInfo>> ranges(List<Long> ids) throws IOException {
    Map<Long, List<RangeInfo>> out = new HashMap<>();
    for (int at = 0; at < ids.size(); at += LIST_PAGE_SIZE) {
      long[] arr = ids.subList(at, Math.min(ids.size(), at + LIST_PAGE_SIZE)).stream()
          .mapToLong(Long::longValue).toArray();
      for (FbTable h : pmCall(Messages.LIST_RANGES,
          Messages.listRanges(requestTimeout(), arr))) {
        for (RangeList rl : Messages.rangeLists(h)) {
          if (rl.code == SbpException.STREAM_NOT_FOUND || rl.code == SbpException.STREAM_DELETED) {
            throw new IllegalArgumentException("option 'streams': stream " + rl.streamId
                + " does not exist");
          }
          if (rl.code != 0) {
            throw new SbpException(rl.code, rl.message, null);
          }
          out.computeIfAbsent(rl.streamId, k -> new ArrayList<>()).addAll(rl.ranges);
        }
      }
      for (long s : arr) {
        List<RangeInfo> rs = out.computeIfAbsent(s, k -> new ArrayList<>());
        rs.sort((a, b) -> Integer.compare(a.rangeIndex, b.rangeIndex));
        for (int i = 1; i < rs.size(); i++) { // as offsets.py spans_of_stream: never a gap
          RangeInfo a = rs.get(i - 1);
          RangeInfo b = rs.get(i);
          if (a.endOffset != b.startOffset) {
            throw new IllegalStateException("stream " + s + ": its ranges do not follow each "
                + "other (range " + a.rangeIndex + " ends at " + a.endOffset + ", range "
                + b.rangeIndex + " starts at " + b.startOffset + "); the PM's metadata is "
                + "inconsistent");
          }
        }
      }
    }
    return out;
  }

  /** The offset after the stream's last committed record: a sealed last range's end, else
   *  what the writable range's primary (or, failing it, another replica) describes. */
  public long endOffset(long streamId, List<RangeInfo> ranges) throws IOException {
    long deadline = System.currentTimeMillis() + timeoutMs;
    int failures = 0;
    while (true) {
      if (ranges.isEmpty()) {
        return 0;
      }
      RangeInfo last = ranges.get(ranges.size() - 1);
      if (last.sealed()) {
        return last.endOffset;
      }
      IOException err = new SbpException(39, "range " + streamId + "/" + last.rangeIndex
          + " has no primary", null);
      if (last.replicas.length > 0) {
        try {
          return describedEnd(last.replicas[0], streamId, last.rangeIndex);
        } catch (ProtocolException e) {
          throw e;
        } catch (IOException e) {
          err = e;
        }
      }
      if (System.currentTimeMillis() >= deadline) {
        // the primary did not answer in time: the highest end another replica knows, never
        // a guess when none answers (a reader must not take an unknown end for an empty one)
        long known = -1;
        for (int i = 1; i < last.replicas.length; i++) {
          try {
            known = Math.max(known, describedEnd(last.replicas[i], streamId, last.rangeIndex));
          } catch (ProtocolException e) {
            throw e;
          } catch (IOException e) {
            // that replica cannot say either
          }
        }
        if (known >= 0) {
          return Math.max(known, last.nextOffset);
        }
        throw new IOException("cannot learn where stream " + streamId + " ends: "
            + err.getMessage(), err);
      }
      sleep(Math.min(BACKOFF_MAX_MS, 50L << Math.min(++failures, 5)));
      ranges = ranges(List.of(streamId)).get(streamId);
    }
  }

  private long describedEnd(String addr, long streamId, int rangeIndex) throws IOException {
    List<FbTable> hs = call(addr, Messages.DESCRIBE_RANGES,
        Messages.describeRange(requestTimeout(), streamId, rangeIndex));
    RangeInfo r = Messages.describedRange(hs.get(hs.size() - 1), addr);
    return r.sealed() ? r.endOffset : r.nextOffset;
  }

  @Override
  public void close() {
    for (SbpConnection c : conns.values()) {
      c.close();
    }
    conns.clear();
  }
}
