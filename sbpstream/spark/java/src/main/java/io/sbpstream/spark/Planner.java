package io.sbpstream.spark;

import io.sbpstream.spark.wire.Messages.RangeInfo;
import java.io.IOException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/** Driver-side planning of a batch read, as sbpstream/spark/source.py's SbpstreamBatchReader
 *  and offsets.py (spans_of_stream, split_spans) do it: resolve the streams, find where each
 *  starts and ends, check for data loss, cut [start, end) along the ranges and split big spans
 *  for option 'minPartitions'. */
public final class Planner {
  private Planner() {}

  /** A span: records [from, until) of one range. */
  static final class Span {
    final long streamId;
    final int rangeIndex;
    final long from;
    final long until;
    final String[] replicas;

    Span(long streamId, int rangeIndex, long from, long until, String[] replicas) {
      this.streamId = streamId;
      this.rangeIndex = rangeIndex;
      this.from = from;
      this.until = until;
      this.replicas = replicas;
    }

    long size() {
      return until - from;
    }
  }

  public static String dataLossMessage(long streamId, long lo, long hi, String why) {
    return "failOnDataLoss: records [" + lo + ", " + hi + ") of stream " + streamId
        + " are gone (" + why + ") before the query read them; set option failOnDataLoss=false "
        + "to skip lost records";
  }

  public static List<SbpInputPartition> plan(SourceOptions o) throws IOException {
    try (PmClient pm = new PmClient(o.pm, o.timeoutMs)) {
      Map<Long, Object> refOf = new LinkedHashMap<>();
      List<Long> ids = new ArrayList<>();
      if (o.pattern != null) {
        ids.addAll(pm.matching(o.pattern));
      } else {
        for (Object ref : o.streams) {
          long sid = pm.resolve(ref);
          if (refOf.containsKey(sid)) {
            throw new IllegalArgumentException("option 'streams': '" + refOf.get(sid)
                + "' and '" + ref + "' are the same stream (" + sid + ")");
          }
          refOf.put(sid, ref);
          ids.add(sid);
        }
      }
      Map<Long, Long> trims = pm.describe(ids);
      Map<Long, List<RangeInfo>> ranges = pm.ranges(ids);
      List<Span> spans = new ArrayList<>();
      for (long s : ids) {
        List<RangeInfo> rs = ranges.get(s);
        long first = Math.max(trims.get(s), rs.isEmpty() ? 0 : rs.get(0).startOffset);
        long endOffset = pm.endOffset(s, rs);
        long st = o.pattern != null ? o.patternStart : o.starting.get(refOf.get(s));
        long wantEnd = o.pattern != null ? SourceOptions.LATEST : o.ending.get(refOf.get(s));
        long start = st == SourceOptions.EARLIEST ? first : st == SourceOptions.LATEST
            ? endOffset : st;
        long end = wantEnd == SourceOptions.LATEST ? endOffset : wantEnd;
        if (end > endOffset) {
          throw new IllegalArgumentException("option 'endingOffsets': offset " + end
              + " of stream " + s + " is past its end " + endOffset);
        }
        if (start > end) {
          throw new IllegalArgumentException("option 'startingOffsets': offset " + start
              + " of stream " + s + " is after the ending offset " + end);
        }
        if (end <= start) {
          continue;
        }
        if (start < first) {
          String msg = dataLossMessage(s, start, first, "trimmed");
          if (o.failOnDataLoss) {
            throw new IllegalStateException(msg);
          }
          start = first;
        }
        if (end > start) {
          spans.addAll(spansOfStream(s, rs, start, end));
        }
      }
      List<SbpInputPartition> out = new ArrayList<>();
      for (Span sp : splitSpans(spans, o.minPartitions)) {
        out.add(new SbpInputPartition(o.pm, sp.streamId, sp.rangeIndex, sp.from, sp.until,
            sp.replicas, o.failOnDataLoss, o.timeoutMs, o.fetchMaxBytes));
      }
      return out;
    }
  }

  static List<Span> spansOfStream(long sid, List<RangeInfo> ranges, long from, long until) {
    List<Span> out = new ArrayList<>();
    for (RangeInfo r : ranges) {
      long end = r.endOffset < 0 ? until : r.endOffset;
      long lo = Math.max(from, r.startOffset);
      long hi = Math.min(until, end);
      if (lo < hi) {
        out.add(new Span(sid, r.rangeIndex, lo, hi, r.replicas));
      }
    }
    return out;
  }

  /** At least ``minPartitions`` spans: each gets max(1, round(size / total * min)) parts of
   *  near-equal size (Python's round: half to even, as Math.rint). */
  static List<Span> splitSpans(List<Span> spans, Integer minPartitions) {
    List<Span> live = new ArrayList<>();
    for (Span s : spans) {
      if (s.size() > 0) {
        live.add(s);
      }
    }
    if (minPartitions == null || live.size() >= minPartitions) {
      return live;
    }
    long total = 0;
    for (Span s : live) {
      total += s.size();
    }
    List<Span> out = new ArrayList<>();
    for (Span s : live) {
      long parts = Math.min(s.size(),
          Math.max(1, (long) Math.rint((double) s.size() * minPartitions / total)));
      for (long i = 0; i < parts; i++) {
        long lo = s.from + s.size() * i / parts;
        long hi = s.from + s.size() * (i + 1) / parts;
        out.add(new Span(s.streamId, s.rangeIndex, lo, hi, s.replicas));
      }
    }
    return out;
  }
}
