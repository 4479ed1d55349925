package io.sbpstream.spark;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.connector.read.streaming.Offset;
import org.apache.spark.sql.connector.read.streaming.ReadLimit;
import org.apache.spark.sql.connector.read.streaming.ReadMaxRows;
import org.apache.spark.sql.connector.read.streaming.SupportsTriggerAvailableNow;

/** {@code spark.readStream.format("sbpstream-jvm")}: micro-batches exactly once from the
 *  checkpointed offsets, as sbpstream/spark/source.py's SbpstreamStreamReader. "latest" is
 *  kept as -1 in the initial offset and resolved by the first batch (offsets.py), so a restart
 *  replays the same first batch; availableNow caps every stream at its end when it starts. */
final class SbpMicroBatchStream implements MicroBatchStream, SupportsTriggerAvailableNow {
  private final Planner planner;
  /** The columns read (the scan's read schema). */
  private final org.apache.spark.sql.types.StructType schema;
  private boolean checked;
  /** availableNow: each stream's end when the trigger started. */
  private Map<Long, Long> cap;

  SbpMicroBatchStream(SourceOptions opts, org.apache.spark.sql.types.StructType schema) {
    this.schema = schema;
    this.planner = new Planner(opts);
  }

  private static RuntimeException unchecked(IOException e, SourceOptions o) {
    if (e instanceof PmClient.NoPmReachable) {
      return new IllegalStateException(e.getMessage());
    }
    return new UncheckedIOException("option 'pm': the sbpstream cluster at "
        + String.join(",", o.pm) + " did not answer (" + e.getMessage() + ")", e);
  }

  private List<Long> ids() throws IOException {
    List<Long> ids = planner.streams();
    if (!checked) {
      planner.pm.describe(ids); // IllegalArgumentException naming option 'streams'
      checked = true;
    }
    return ids;
  }

  @Override
  public Offset initialOffset() {
    try {
      List<Long> ids = planner.streams();
      planner.initial = new HashSet<>(ids);
      Map<Long, Planner.State> states = planner.states(ids);
      checked = true;
      Map<Long, Long> out = new LinkedHashMap<>();
      for (long s : ids) {
        long st = planner.spec(planner.o.starting, s, SourceOptions.LATEST);
        out.put(s, st == SourceOptions.EARLIEST ? states.get(s).start : st);
      }
      return new SbpOffset(out);
    } catch (IOException e) {
      throw unchecked(e, planner.o);
    }
  }

  @Override
  public Offset deserializeOffset(String json) {
    return SbpOffset.parse(json);
  }

  @Override
  public ReadLimit getDefaultReadLimit() {
    Integer n = planner.o.maxOffsetsPerTrigger;
    return n == null ? ReadLimit.allAvailable() : ReadLimit.maxRows(n);
  }

  @Override
  public void prepareForTriggerAvailableNow() {
    try {
      List<Long> ids = ids();
      Map<Long, Long> ends = new LinkedHashMap<>();
      for (Map.Entry<Long, Planner.State> e : planner.states(ids).entrySet()) {
        ends.put(e.getKey(), e.getValue().end);
      }
      cap = ends;
    } catch (IOException e) {
      throw unchecked(e, planner.o);
    }
  }

  @Override
  public Offset latestOffset() {
    throw new UnsupportedOperationException("latestOffset(start, limit) is the one to call");
  }

  @Override
  public Offset latestOffset(Offset startOffset, ReadLimit limit) {
    try {
      List<Long> ids = ids();
      Map<Long, Long> saved = startOffset == null ? Map.of() : ((SbpOffset) startOffset).offsets;
      if (planner.o.pattern == null) {
        for (long s : saved.keySet()) {
          if (!ids.contains(s)) {
            throw new IllegalArgumentException("the checkpoint names stream " + s + " that "
                + "option 'streams' does not list; a query's streams cannot change across "
                + "restarts");
          }
        }
      }
      // a stream that joined since starts at its spec, or its earliest (pattern)
      Map<Long, Long> begin = new LinkedHashMap<>();
      for (long s : ids) {
        Long v = saved.get(s);
        if (v == null) {
          long spec = planner.spec(planner.o.starting, s, SourceOptions.LATEST);
          v = spec >= 0 || spec == SourceOptions.EARLIEST ? spec : SourceOptions.LATEST;
        }
        begin.put(s, v);
      }
      Map<Long, Planner.State> states = planner.states(ids);
      Map<Long, Long> ends = new LinkedHashMap<>();
      for (long s : ids) {
        if (begin.get(s) == SourceOptions.EARLIEST) {
          begin.put(s, states.get(s).start);
        }
        ends.put(s, cap != null && cap.containsKey(s) ? cap.get(s) : states.get(s).end);
      }
      Map<Long, Long> trims = new LinkedHashMap<>();
      Map<Long, Long> from = new LinkedHashMap<>();
      for (long s : ids) {
        if (begin.get(s) != SourceOptions.LATEST) {
          trims.put(s, states.get(s).start);
          from.put(s, begin.get(s));
        }
      }
      Map<Long, Long> froms = planner.readableFrom(from, trims);
      Long maxRows = limit instanceof ReadMaxRows ? ((ReadMaxRows) limit).maxRows() : null;
      return new SbpOffset(nextOffsets(begin, froms, ends, maxRows));
    } catch (IOException e) {
      throw unchecked(e, planner.o);
    }
  }

  /** offsets.py next_offsets: unresolved streams jump to their end and read nothing; the
   *  others share ``maxRows`` by backlog; an end never moves backwards. */
  static Map<Long, Long> nextOffsets(Map<Long, Long> start, Map<Long, Long> froms,
      Map<Long, Long> ends, Long maxRows) {
    Map<Long, Long> out = new LinkedHashMap<>();
    Map<Long, Long> backlogs = new LinkedHashMap<>();
    for (Map.Entry<Long, Long> e : start.entrySet()) {
      long s = e.getKey();
      if (e.getValue() == SourceOptions.LATEST) {
        out.put(s, Math.max(0, ends.get(s)));
      } else {
        backlogs.put(s, Math.max(0, ends.get(s) - froms.get(s)));
      }
    }
    Map<Long, Long> shares = maxRows == null ? backlogs : splitReadLimit(backlogs, maxRows);
    for (Map.Entry<Long, Long> e : shares.entrySet()) {
      long s = e.getKey();
      out.put(s, Math.max(start.get(s), froms.get(s) + e.getValue()));
    }
    Map<Long, Long> ordered = new LinkedHashMap<>();
    for (long s : start.keySet()) {
      ordered.put(s, out.get(s));
    }
    return ordered;
  }

  /** offsets.py split_read_limit: ``maxRows`` shared in proportion to each backlog, leftovers
   *  to the largest remainders (ties by stream id). */
  static Map<Long, Long> splitReadLimit(Map<Long, Long> backlogs, long maxRows) {
    long total = 0;
    for (long b : backlogs.values()) {
      total += Math.max(0, b);
    }
    Map<Long, Long> shares = new LinkedHashMap<>();
    if (total <= maxRows) {
      for (Map.Entry<Long, Long> e : backlogs.entrySet()) {
        shares.put(e.getKey(), Math.max(0, e.getValue()));
      }
      return shares;
    }
    List<long[]> rem = new ArrayList<>(); // (remainder, stream)
    long given = 0;
    for (Map.Entry<Long, Long> e : backlogs.entrySet()) {
      long b = Math.max(0, e.getValue());
      java.math.BigInteger[] qr = java.math.BigInteger.valueOf(b)
          .multiply(java.math.BigInteger.valueOf(maxRows))
          .divideAndRemainder(java.math.BigInteger.valueOf(total));
      shares.put(e.getKey(), qr[0].longValue());
      given += qr[0].longValue();
      rem.add(new long[] {qr[1].longValue(), e.getKey()});
    }
    rem.sort((x, y) -> x[0] != y[0] ? Long.compare(y[0], x[0]) : Long.compare(x[1], y[1]));
    long left = maxRows - given;
    for (long[] r : rem) {
      if (left <= 0) {
        break;
      }
      long s = r[1];
      if (shares.get(s) < Math.max(0, backlogs.get(s))) {
        shares.put(s, shares.get(s) + 1);
        left--;
      }
    }
    return shares;
  }

  @Override
  public InputPartition[] planInputPartitions(Offset start, Offset end) {
    SbpOffset s = (SbpOffset) start;
    SbpOffset e = (SbpOffset) end;
    if (s != null && s.json().equals(e.json())) {
      return new InputPartition[0];
    }
    try {
      return planner.plan(s == null ? Map.of() : s.offsets, e.offsets)
          .toArray(new InputPartition[0]);
    } catch (IOException x) {
      throw unchecked(x, planner.o);
    }
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new SbpstreamJvmSource.ReaderFactory(schema);
  }

  @Override
  public void commit(Offset end) {
    // the checkpoint is the only truth, as with Kafka
  }

  @Override
  public void stop() {
    planner.close();
  }
}
