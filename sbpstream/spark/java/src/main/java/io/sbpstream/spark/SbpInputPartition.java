package io.sbpstream.spark;

import org.apache.spark.sql.connector.read.InputPartition;

/** Records [fromOffset, untilOffset) of one range of one stream, and how to reach them: all a
 *  read needs, so reading costs no PM round trip unless the range moved. */
public final class SbpInputPartition implements InputPartition {
  private static final long serialVersionUID = 1L;

  public final String[] pm;
  public final long streamId;
  public final int rangeIndex;
  public final long fromOffset;
  public final long untilOffset;
  public final String[] replicas;
  public final boolean failOnDataLoss;
  public final int timeoutMs;
  public final int fetchMaxBytes;

  public SbpInputPartition(String[] pm, long streamId, int rangeIndex, long fromOffset,
      long untilOffset, String[] replicas, boolean failOnDataLoss, int timeoutMs,
      int fetchMaxBytes) {
    this.pm = pm;
    this.streamId = streamId;
    this.rangeIndex = rangeIndex;
    this.fromOffset = fromOffset;
    this.untilOffset = untilOffset;
    this.replicas = replicas;
    this.failOnDataLoss = failOnDataLoss;
    this.timeoutMs = timeoutMs;
    this.fetchMaxBytes = fetchMaxBytes;
  }

  @Override
  public String toString() {
    return "stream " + streamId + " range " + rangeIndex + " [" + fromOffset + ", "
        + untilOffset + ")";
  }
}
