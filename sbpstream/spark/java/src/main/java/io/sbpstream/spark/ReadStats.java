package io.sbpstream.spark;

import java.util.concurrent.atomic.AtomicLong;

/** Where the JVM reader's time goes, summed over every partition read in this JVM since the
 *  last {@link #reset}: planning (PM lookups, on the driver), waiting for FETCH answers (the
 *  network and the data node), decoding them into column vectors, and Spark's own work on the
 *  batches between two {@code next()} calls. In {@code local[*]} the executors are this JVM,
 *  so a benchmark reads one sum (bench/bench_spark.py); elsewhere each executor keeps its own.
 *  Costs two {@code System.nanoTime()} per FETCH answer. */
public final class ReadStats {
  static final AtomicLong PLAN_NS = new AtomicLong();
  static final AtomicLong PLANS = new AtomicLong();
  static final AtomicLong FETCH_NS = new AtomicLong();
  static final AtomicLong FETCHES = new AtomicLong();
  static final AtomicLong DECODE_NS = new AtomicLong();
  static final AtomicLong ROWS = new AtomicLong();
  static final AtomicLong CONSUME_NS = new AtomicLong();
  static final AtomicLong PARTITIONS = new AtomicLong();

  private ReadStats() {}

  /** Clear every counter. */
  public static void reset() {
    for (AtomicLong a : new AtomicLong[] {PLAN_NS, PLANS, FETCH_NS, FETCHES, DECODE_NS, ROWS,
        CONSUME_NS, PARTITIONS}) {
      a.set(0);
    }
  }

  /** plan_ns, plans, fetch_ns, fetches, decode_ns, rows, consume_ns, partitions. */
  public static long[] snapshot() {
    return new long[] {PLAN_NS.get(), PLANS.get(), FETCH_NS.get(), FETCHES.get(),
        DECODE_NS.get(), ROWS.get(), CONSUME_NS.get(), PARTITIONS.get()};
  }
}
