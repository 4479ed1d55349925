package io.sbpstream.spark;

import io.sbpstream.spark.wire.Messages.RangeInfo;
import java.io.Closeable;
import java.io.IOException;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/** Driver-side planning, as sbpstream/spark/source.py's _Planner and offsets.py
 *  (spans_of_stream, split_spans) do it: resolve the streams, find where each starts and ends,
 *  check for data loss, cut [start, end) along the ranges and split big spans for option
 *  'minPartitions'. One instance per query (it keeps a PM connection: close it). */
public final class Planner implements Closeable {
  final SourceOptions o;
  final PmClient pm;
  /** Option 'streams' resolved once (id to the ref as given): a name keeps meaning that stream
   *  for the life of the query, as its offsets do. */
  private Map<Long, Object> refOf;
  /** Streams the pattern matched when the query began (they follow startingOffsets). */
  Set<Long> initial = new HashSet<>();

  public Planner(SourceOptions o) {
    this.o = o;
    this.pm = new PmClient(o.pm, o.timeoutMs);
  }

  /** Where a stream starts (its first readable offset) and ends (its next offset). */
  static final class State {
    final long start;
    final long end;
    final List<RangeInfo> ranges;

    State(long start, long end, List<RangeInfo> ranges) {
      this.start = start;
      this.end = end;
      this.ranges = ranges;
    }
  }

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

  /** The query's stream ids now: option 'streams' resolved (once), or what the pattern
   *  matches (looked up again at every call, so new streams join at the next trigger). */
  List<Long> streams() throws IOException {
    if (o.pattern != null) {
      return pm.matching(o.pattern);
    }
    if (refOf == null) {
      Map<Long, Object> out = new LinkedHashMap<>();
      for (Object ref : o.streams) {
        long sid = pm.resolve(ref);
        if (out.containsKey(sid)) {
          throw new IllegalArgumentException("option 'streams': '" + out.get(sid) + "' and '"
              + ref + "' are the same stream (" + sid + ")");
        }
        out.put(sid, ref);
      }
      refOf = out;
    }
    return new ArrayList<>(refOf.keySet());
  }

  /** The offset option ``which`` gives stream ``sid`` (keyed by its ref as given). */
  long spec(Map<Object, Long> which, long sid, long dflt) {
    if (o.pattern != null) {
      return initial.contains(sid) ? o.patternStart : SourceOptions.EARLIEST;
    }
    Object ref = refOf == null ? null : refOf.get(sid);
    Long v = ref == null ? null : which.get(ref);
    return v == null ? dflt : v;
  }

  /** Each stream's start and end (IllegalArgumentException naming option 'streams' for one
   *  that does not exist). */
  Map<Long, State> states(List<Long> ids) throws IOException {
    Map<Long, Long> trims = pm.describe(ids);
    Map<Long, List<RangeInfo>> ranges = pm.ranges(ids);
    Map<Long, State> out = new LinkedHashMap<>();
    for (long s : ids) {
      List<RangeInfo> rs = ranges.get(s);
      long first = Math.max(trims.get(s), rs.isEmpty() ? 0 : rs.get(0).startOffset);
      out.put(s, new State(first, pm.endOffset(s, rs), rs));
    }
    return out;
  }

  /** Where reading really begins per stream, after the data-loss check. */
  Map<Long, Long> readableFrom(Map<Long, Long> start, Map<Long, Long> trims) {
    Map<Long, Long> out = new LinkedHashMap<>();
    for (Map.Entry<Long, Long> e : start.entrySet()) {
      long s = e.getKey();
      long st = e.getValue();
      long first = trims.get(s);
      if (st == SourceOptions.LATEST || st >= first) {
        out.put(s, st);
        continue;
      }
      if (o.failOnDataLoss) {
        throw new IllegalStateException(dataLossMessage(s, st, first, "trimmed"));
      }
      out.put(s, first);
    }
    return out;
  }

  /** Partitions for [start, end); a stream in ``end`` but not in ``start`` (matched by the
   *  pattern since) is read from its earliest record. */
  List<SbpInputPartition> plan(Map<Long, Long> start, Map<Long, Long> end) throws IOException {
    Map<Long, Long> begin = new LinkedHashMap<>();
    List<Long> wanted = new ArrayList<>();
    for (long s : end.keySet()) {
      long b = start.getOrDefault(s, SourceOptions.EARLIEST);
      begin.put(s, b);
      if (b != SourceOptions.LATEST) {
        wanted.add(s);
      }
    }
    Map<Long, State> states = wanted.isEmpty() ? Map.of() : states(wanted);
    Map<Long, Long> trims = new LinkedHashMap<>();
    Map<Long, Long> from = new LinkedHashMap<>();
    for (long s : wanted) {
      long first = states.get(s).start;
      long b = begin.get(s) == SourceOptions.EARLIEST ? first : begin.get(s);
      if (end.get(s) > b) {
        trims.put(s, first);
        from.put(s, b);
      }
    }
    Map<Long, Long> froms = readableFrom(from, trims);
    List<Span> spans = new ArrayList<>();
    for (long s : trims.keySet()) {
      if (end.get(s) > froms.get(s)) {
        spans.addAll(spansOfStream(s, states.get(s).ranges, froms.get(s), end.get(s)));
      }
    }
    List<SbpInputPartition> out = new ArrayList<>();
    for (Span sp : splitSpans(spans, o.minPartitions)) {
      out.add(new SbpInputPartition(o.pm, sp.streamId, sp.rangeIndex, sp.from, sp.until,
          sp.replicas, o.failOnDataLoss, o.timeoutMs, o.fetchMaxBytes));
    }
    return out;
  }

  /** The batch read: [startingOffsets, endingOffsets) of each stream. */
  List<SbpInputPartition> planBatch() throws IOException {
    List<Long> ids = streams();
    initial = new HashSet<>(ids);
    Map<Long, State> states = states(ids);
    Map<Long, Long> start = new LinkedHashMap<>();
    Map<Long, Long> end = new LinkedHashMap<>();
    for (long s : ids) {
      State st = states.get(s);
      long sp = spec(o.starting, s, SourceOptions.EARLIEST);
      long wantEnd = o.pattern != null ? SourceOptions.LATEST
          : spec(o.ending, s, SourceOptions.LATEST);
      long b = sp == SourceOptions.EARLIEST ? st.start : sp == SourceOptions.LATEST ? st.end : sp;
      long e = wantEnd == SourceOptions.LATEST ? st.end : wantEnd;
      if (e > st.end) {
        throw new IllegalArgumentException("option 'endingOffsets': offset " + e + " of stream "
            + s + " is past its end " + st.end);
      }
      if (b > e) {
        throw new IllegalArgumentException("option 'startingOffsets': offset " + b
            + " of stream " + s + " is after the ending offset " + e);
      }
      start.put(s, b);
      end.put(s, e);
    }
    return plan(start, end);
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

  @Override
  public void close() {
    pm.close();
  }
}
