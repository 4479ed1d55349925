package io.sbpstream.spark;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.EnumSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.ArrayType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.Metadata;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** {@code spark.read.format("sbpstream-jvm")} and {@code readStream}: the reads of the Python
 *  source {@code format("sbpstream")} (same schema, options and rows) in the JVM, with no
 *  Python process. Registered by META-INF/services; the jar is built by sbpstream/spark/jvm.py. */
public final class SbpstreamJvmSource implements TableProvider, DataSourceRegister {
  public static final String NAME = "sbpstream-jvm";

  /** sbpstream/spark/schema.py SOURCE_SCHEMA. */
  public static final StructType SCHEMA = new StructType(new StructField[] {
      new StructField("stream_id", DataTypes.LongType, false, Metadata.empty()),
      new StructField("offset", DataTypes.LongType, false, Metadata.empty()),
      new StructField("timestamp", DataTypes.TimestampType, false, Metadata.empty()),
      new StructField("key", DataTypes.BinaryType, true, Metadata.empty()),
      new StructField("value", DataTypes.BinaryType, true, Metadata.empty()),
      new StructField("headers", new ArrayType(new StructType(new StructField[] {
          new StructField("key", DataTypes.StringType, false, Metadata.empty()),
          new StructField("value", DataTypes.BinaryType, true, Metadata.empty())}), false),
          false, Metadata.empty())});

  @Override
  public String shortName() {
    return NAME;
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return SCHEMA;
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning,
      Map<String, String> properties) {
    if (!schema.simpleString().equals(SCHEMA.simpleString())) {
      throw new IllegalArgumentException("the sbpstream source has a fixed schema ("
          + SCHEMA.simpleString() + "); do not pass .schema(...), got " + schema.simpleString());
    }
    return new SbpTable();
  }

  static final class SbpTable implements Table, SupportsRead {
    @Override
    public String name() {
      return NAME;
    }

    @Override
    @SuppressWarnings("deprecation")
    public StructType schema() {
      return SCHEMA;
    }

    @Override
    public Set<TableCapability> capabilities() {
      return EnumSet.of(TableCapability.BATCH_READ, TableCapability.MICRO_BATCH_READ);
    }

    @Override
    public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
      Map<String, String> raw = new java.util.HashMap<>(options.asCaseSensitiveMap());
      SourceOptions.checkNames(raw);
      return new SbpScanBuilder(raw);
    }
  }

  /** Column pruning: a batch read fills only the columns the query uses. */
  static final class SbpScanBuilder implements ScanBuilder, SupportsPushDownRequiredColumns {
    private final Map<String, String> raw;
    private StructType required = SCHEMA;

    SbpScanBuilder(Map<String, String> raw) {
      this.raw = raw;
    }

    @Override
    public void pruneColumns(StructType requiredSchema) {
      required = requiredSchema;
    }

    @Override
    public Scan build() {
      return new SbpScan(raw, required);
    }
  }

  static final class SbpScan implements Scan, Batch {
    private final Map<String, String> raw;
    private final StructType schema;
    private SourceOptions opts;
    private InputPartition[] planned;

    SbpScan(Map<String, String> raw, StructType schema) {
      this.raw = raw;
      this.schema = schema;
    }

    @Override
    public StructType readSchema() {
      return schema;
    }

    @Override
    public String description() {
      return NAME;
    }

    @Override
    public Batch toBatch() {
      opts = SourceOptions.parse(raw, false);
      return this;
    }

    @Override
    public MicroBatchStream toMicroBatchStream(String checkpointLocation) {
      return new SbpMicroBatchStream(SourceOptions.parse(raw, true), schema);
    }

    @Override
    public InputPartition[] planInputPartitions() {
      if (planned == null) {
        try {
          if (opts == null) {
            opts = SourceOptions.parse(raw, false);
          }
          long t0 = System.nanoTime();
          try (Planner planner = new Planner(opts)) {
            planned = planner.planBatch().toArray(new InputPartition[0]);
          }
          ReadStats.PLAN_NS.addAndGet(System.nanoTime() - t0);
          ReadStats.PLANS.incrementAndGet();
        } catch (PmClient.NoPmReachable e) {
          throw new IllegalStateException(e.getMessage());
        } catch (IOException e) {
          throw new UncheckedIOException("option 'pm': the sbpstream cluster at "
              + String.join(",", opts.pm) + " did not answer (" + e.getMessage() + ")", e);
        }
      }
      return planned;
    }

    @Override
    public PartitionReaderFactory createReaderFactory() {
      return new ReaderFactory(schema);
    }
  }

  static final class ReaderFactory implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;
    /** The columns read: SCHEMA, or the ones a batch query kept. */
    private final StructType schema;

    ReaderFactory(StructType schema) {
      this.schema = schema;
    }

    @Override
    public boolean supportColumnarReads(InputPartition partition) {
      return true;
    }

    @Override
    public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
      return new PartitionReaderImpl((SbpInputPartition) partition, schema);
    }

    @Override
    public PartitionReader<InternalRow> createReader(InputPartition partition) {
      throw new UnsupportedOperationException("the sbpstream-jvm reader is columnar");
    }
  }
}
