package io.sbpstream.spark;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.TreeMap;
import org.apache.spark.sql.connector.read.streaming.Offset;

/** A streaming position: one JSON object {"<stream_id>": next_offset}, keys in sorted string
 *  order (Spark compares offsets as JSON text), as sbpstream/spark/offsets.py writes it. -1
 *  (LATEST) marks a stream whose "latest" start the first batch resolves. */
public final class SbpOffset extends Offset {
  private static final ObjectMapper JSON = new ObjectMapper();

  final Map<Long, Long> offsets;
  private final String json;

  SbpOffset(Map<Long, Long> offsets) {
    this.offsets = new LinkedHashMap<>(offsets);
    TreeMap<String, Long> sorted = new TreeMap<>();
    for (Map.Entry<Long, Long> e : offsets.entrySet()) {
      sorted.put(String.valueOf(e.getKey()), e.getValue());
    }
    try {
      this.json = JSON.writeValueAsString(sorted);
    } catch (IOException e) {
      throw new IllegalStateException("cannot write offsets as JSON", e);
    }
  }

  static SbpOffset parse(String text) {
    JsonNode obj;
    try {
      obj = JSON.readTree(text);
    } catch (IOException e) {
      throw new IllegalArgumentException("bad sbpstream offsets in the checkpoint: " + text);
    }
    if (obj == null || !obj.isObject()) {
      throw new IllegalArgumentException("bad sbpstream offsets in the checkpoint: " + text);
    }
    Map<Long, Long> out = new LinkedHashMap<>();
    for (Map.Entry<String, JsonNode> e : obj.properties()) {
      long sid;
      try {
        sid = Long.parseLong(e.getKey());
      } catch (NumberFormatException x) {
        throw new IllegalArgumentException("bad offset key '" + e.getKey() + "' in " + text);
      }
      JsonNode v = e.getValue();
      if (!v.isIntegralNumber() || !v.canConvertToLong()) {
        throw new IllegalArgumentException("bad offset " + v + " for stream " + sid);
      }
      out.put(sid, v.asLong());
    }
    return new SbpOffset(out);
  }

  @Override
  public String json() {
    return json;
  }
}
