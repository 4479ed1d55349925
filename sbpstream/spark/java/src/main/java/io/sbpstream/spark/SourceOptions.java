package io.sbpstream.spark;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.io.Serializable;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.regex.Pattern;
import java.util.regex.PatternSyntaxException;

/** The read options of {@code format("sbpstream-jvm")}: those of the Python source
 *  (sbpstream/spark/options.py), with the same names, defaults and one-line errors naming the
 *  option. Options the JVM reader lacks fail naming {@code format("sbpstream")}, which has
 *  them. */
public final class SourceOptions implements Serializable {
  private static final long serialVersionUID = 1L;

  public static final long EARLIEST = -2;
  public static final long LATEST = -1;
  public static final int DEFAULT_TIMEOUT_MS = 15_000;
  public static final int DEFAULT_FETCH_MAX_BYTES = 4 * 1024 * 1024;
  public static final int MAX_STREAMS = 10_000;
  /** Longest stream name (sbpstream.protocol.names.MAX_STREAM_NAME_LEN, Kafka's bound). */
  public static final int MAX_NAME_LENGTH = 249;
  private static final Pattern NAME_CHARS = Pattern.compile("[a-zA-Z0-9._-]+");

  static final String[] VALID = {"pm", "streams", "streamPattern", "startingOffsets",
      "endingOffsets", "maxOffsetsPerTrigger", "minPartitions", "failOnDataLoss", "timeoutMs",
      "fetchMaxBytes"};
  static final String[] SECURITY = {"user", "password", "tokenFile", "tlsCa"};
  static final String[] UNSUPPORTED = {"commitToGroup"};
  static final String[] SPARK = {"path", "checkpointlocation", "queryname"};

  /** A stream as option 'streams' names it: its id ({@link Long}) or its name ({@link String}). */
  public final String[] pm;
  public final List<Object> streams;
  public final String pattern;
  public final long patternStart;
  public final Map<Object, Long> starting;
  public final Map<Object, Long> ending;
  public final Integer minPartitions;
  /** readStream only: records per micro-batch at most (null: no limit). */
  public final Integer maxOffsetsPerTrigger;
  public final boolean failOnDataLoss;
  public final int timeoutMs;
  public final int fetchMaxBytes;

  private SourceOptions(String[] pm, List<Object> streams, String pattern, long patternStart,
      Map<Object, Long> starting, Map<Object, Long> ending, Integer minPartitions,
      Integer maxOffsetsPerTrigger, boolean failOnDataLoss, int timeoutMs, int fetchMaxBytes) {
    this.pm = pm;
    this.streams = streams;
    this.pattern = pattern;
    this.patternStart = patternStart;
    this.starting = starting;
    this.ending = ending;
    this.minPartitions = minPartitions;
    this.maxOffsetsPerTrigger = maxOffsetsPerTrigger;
    this.failOnDataLoss = failOnDataLoss;
    this.timeoutMs = timeoutMs;
    this.fetchMaxBytes = fetchMaxBytes;
  }

  private static String get(Map<String, String> o, String name) {
    String low = name.toLowerCase(Locale.ROOT);
    for (Map.Entry<String, String> e : o.entrySet()) {
      if (e.getKey().toLowerCase(Locale.ROOT).equals(low)) {
        return e.getValue();
      }
    }
    return null;
  }

  private static IllegalArgumentException bad(String msg) {
    return new IllegalArgumentException(msg);
  }

  /** Parse and check every read option; ``streaming`` for readStream (IllegalArgumentException
   *  naming the bad option). */
  public static SourceOptions parse(Map<String, String> o, boolean streaming) {
    checkNames(o);
    String[] pm = parsePm(get(o, "pm"));
    String pattern = get(o, "streamPattern");
    if (pattern != null) {
      if (pattern.isBlank()) {
        throw bad("option 'streamPattern' is empty");
      }
      try {
        Pattern.compile(pattern);
      } catch (PatternSyntaxException e) {
        throw bad("option 'streamPattern': bad regular expression '" + pattern + "': "
            + e.getDescription());
      }
    }
    List<Object> streams = parseStreams(get(o, "streams"), pattern != null);
    if (pattern != null && !streams.isEmpty()) {
      throw bad("options 'streams' and 'streamPattern' exclude each other (as Kafka's "
          + "subscribe and subscribePattern): give one");
    }
    long patternStart = EARLIEST;
    Map<Object, Long> starting = new LinkedHashMap<>();
    Map<Object, Long> ending = new LinkedHashMap<>();
    if (pattern != null) {
      String s = get(o, "startingOffsets");
      String low = s == null ? (streaming ? "latest" : "earliest")
          : s.strip().toLowerCase(Locale.ROOT);
      if (!low.equals("earliest") && !low.equals("latest")) {
        throw bad("option 'startingOffsets' with 'streamPattern': 'earliest' or 'latest' "
            + "(per-stream JSON needs option 'streams')");
      }
      patternStart = low.equals("earliest") ? EARLIEST : LATEST;
      String e = get(o, "endingOffsets");
      if (e != null && !e.equals("latest")) {
        throw bad("option 'endingOffsets' with 'streamPattern': only 'latest'");
      }
    } else {
      starting = parseOffsets("startingOffsets", get(o, "startingOffsets"), streams,
          streaming ? "latest" : "earliest", false);
    }
    String rawEnding = get(o, "endingOffsets");
    if (streaming && rawEnding != null) {
      throw bad("option 'endingOffsets' is for batch reads only, not readStream");
    }
    if (pattern == null) {
      ending = parseOffsets("endingOffsets", rawEnding, streams, "latest", true);
    }
    Integer maxPerTrigger = positiveInt(o, "maxOffsetsPerTrigger");
    if (maxPerTrigger != null && !streaming) {
      throw bad("option 'maxOffsetsPerTrigger' is for readStream only, not batch reads");
    }
    Integer timeout = positiveInt(o, "timeoutMs");
    Integer fetchMax = positiveInt(o, "fetchMaxBytes");
    return new SourceOptions(pm, streams, pattern, patternStart, starting, ending,
        positiveInt(o, "minPartitions"), maxPerTrigger, bool(o, "failOnDataLoss", true),
        timeout == null ? DEFAULT_TIMEOUT_MS : timeout,
        fetchMax == null ? DEFAULT_FETCH_MAX_BYTES : fetchMax);
  }

  static void checkNames(Map<String, String> o) {
    for (String key : o.keySet()) {
      String low = key.toLowerCase(Locale.ROOT);
      if (contains(VALID, low) || contains(SPARK, low)) {
        continue;
      }
      if (contains(SECURITY, low)) {
        throw bad("option '" + key + "' (authentication/TLS) is not supported by "
            + "format(\"sbpstream-jvm\"); use format(\"sbpstream\"), which supports it");
      }
      if (contains(UNSUPPORTED, low)) {
        throw bad("option '" + key + "' is not supported by format(\"sbpstream-jvm\"); use "
            + "format(\"sbpstream\"), which supports it");
      }
      String close = closest(low);
      throw bad("option '" + key + "' is not an option of the sbpstream-jvm source"
          + (close == null ? "" : "; did you mean '" + close + "'?") + " (valid: "
          + String.join(", ", VALID) + ")");
    }
  }

  private static boolean contains(String[] names, String low) {
    for (String n : names) {
      if (n.toLowerCase(Locale.ROOT).equals(low)) {
        return true;
      }
    }
    return false;
  }

  /** The valid option nearest to ``low`` by edit distance (at most a third of its length). */
  private static String closest(String low) {
    String best = null;
    int bestD = Integer.MAX_VALUE;
    for (String v : VALID) {
      int d = distance(low, v.toLowerCase(Locale.ROOT));
      if (d < bestD) {
        bestD = d;
        best = v;
      }
    }
    return bestD <= Math.max(1, low.length() / 3) ? best : null;
  }

  private static int distance(String a, String b) {
    int[] prev = new int[b.length() + 1];
    int[] cur = new int[b.length() + 1];
    for (int j = 0; j <= b.length(); j++) {
      prev[j] = j;
    }
    for (int i = 1; i <= a.length(); i++) {
      cur[0] = i;
      for (int j = 1; j <= b.length(); j++) {
        int sub = prev[j - 1] + (a.charAt(i - 1) == b.charAt(j - 1) ? 0 : 1);
        cur[j] = Math.min(sub, Math.min(prev[j] + 1, cur[j - 1] + 1));
      }
      int[] t = prev;
      prev = cur;
      cur = t;
    }
    return prev[b.length()];
  }

  static String[] parsePm(String raw) {
    if (raw == null || raw.isBlank()) {
      throw bad("option 'pm' is required: the placement manager address(es), e.g. "
          + ".option('pm', '127.0.0.1:12378')");
    }
    List<String> out = new ArrayList<>();
    for (String a : raw.split(",")) {
      a = a.strip();
      if (a.isEmpty()) {
        continue;
      }
      int colon = a.lastIndexOf(':');
      boolean ok = colon > 0;
      if (ok) {
        try {
          int port = Integer.parseInt(a.substring(colon + 1));
          ok = port > 0 && port < 65536;
        } catch (NumberFormatException e) {
          ok = false;
        }
      }
      if (!ok) {
        throw bad("option 'pm': bad address '" + a + "' (expected host:port)");
      }
      out.add(a);
    }
    if (out.isEmpty()) {
      throw bad("option 'pm' is required: the placement manager address(es)");
    }
    return out.toArray(new String[0]);
  }

  /** A stream id (digits) or a name, as sbpstream.protocol.names.parse_stream_ref reads it
   *  (the same name rules, the same one-line problems). */
  static Object streamRef(String option, String text) {
    String t = text.strip();
    if (!t.isEmpty() && t.chars().allMatch(c -> c >= '0' && c <= '9')) {
      try {
        return Long.parseLong(t);
      } catch (NumberFormatException e) {
        throw bad("option '" + option + "': stream id " + t + " is out of range");
      }
    }
    String problem = null;
    if (t.isEmpty()) {
      problem = "a stream name must not be empty";
    } else if (t.length() > MAX_NAME_LENGTH) {
      problem = "stream name '" + t.substring(0, 40) + "'... is " + t.length()
          + " characters; at most " + MAX_NAME_LENGTH + " are allowed";
    } else if (!NAME_CHARS.matcher(t).matches()) {
      problem = "stream name '" + t + "' has invalid characters; only a-z A-Z 0-9 . _ - are "
          + "allowed";
    } else if (t.equals(".") || t.equals("..")) {
      problem = "stream name '" + t + "' is reserved";
    }
    if (problem != null) {
      throw bad("option '" + option + "': " + problem);
    }
    return t;
  }

  static List<Object> parseStreams(String raw, boolean havePattern) {
    List<Object> out = new ArrayList<>();
    if (raw == null || raw.isBlank()) {
      if (havePattern) {
        return out;
      }
      throw bad("option 'streams' (comma-separated stream names or ids, e.g. "
          + ".option('streams', 'orders,7')) or option 'streamPattern' is required");
    }
    for (String part : raw.split(",")) {
      if (part.isBlank()) {
        continue;
      }
      Object ref = streamRef("streams", part);
      if (out.contains(ref)) {
        throw bad("option 'streams': stream " + ref + " is listed twice");
      }
      out.add(ref);
    }
    if (out.isEmpty()) {
      throw bad("option 'streams' names no stream");
    }
    if (out.size() > MAX_STREAMS) {
      throw bad("option 'streams': " + out.size() + " streams, more than " + MAX_STREAMS);
    }
    return out;
  }

  static Map<Object, Long> parseOffsets(String name, String raw, List<Object> streams,
      String dflt, boolean ending) {
    String text = (raw != null ? raw : dflt).strip();
    String low = text.toLowerCase(Locale.ROOT);
    Map<Object, Long> spec = new LinkedHashMap<>();
    if (low.equals("latest") || low.equals("earliest")) {
      if (low.equals("earliest") && ending) {
        throw bad("option '" + name + "': 'earliest' is not a valid ending offset");
      }
      for (Object s : streams) {
        spec.put(s, low.equals("latest") ? LATEST : EARLIEST);
      }
      return spec;
    }
    JsonNode obj;
    try {
      obj = new ObjectMapper().readTree(text);
    } catch (IOException e) {
      throw bad("option '" + name + "': expected 'earliest', 'latest' or JSON like {\""
          + streams.get(0) + "\": 0}, got '" + text + "'");
    }
    if (obj == null || !obj.isObject()) {
      throw bad("option '" + name + "': JSON must be an object {\"<stream>\": offset}");
    }
    Map<Object, Long> got = new LinkedHashMap<>();
    for (Map.Entry<String, JsonNode> e : obj.properties()) {
      Object sid = streamRef(name, e.getKey());
      if (!streams.contains(sid)) {
        throw bad("option '" + name + "': stream " + sid + " is not in option 'streams'");
      }
      JsonNode v = e.getValue();
      if (!v.isIntegralNumber() || !v.canConvertToLong()) {
        throw bad("option '" + name + "': offset of stream " + sid + " must be an integer");
      }
      long value = v.asLong();
      if (value < (ending ? LATEST : EARLIEST)) {
        String allowed = ending ? "-1 (latest) or an offset" : "-2, -1 or an offset";
        throw bad("option '" + name + "': offset " + value + " of stream " + sid + ": use "
            + allowed);
      }
      got.put(sid, value);
    }
    List<String> missing = new ArrayList<>();
    for (Object s : streams) {
      if (!got.containsKey(s)) {
        missing.add(String.valueOf(s));
      } else {
        spec.put(s, got.get(s));
      }
    }
    if (!missing.isEmpty()) {
      throw bad("option '" + name + "': JSON must give every stream of option 'streams'; "
          + "missing " + String.join(", ", missing));
    }
    return spec;
  }

  static Integer positiveInt(Map<String, String> o, String name) {
    String raw = get(o, name);
    if (raw == null || raw.isBlank()) {
      return null;
    }
    long n;
    try {
      n = Long.parseLong(raw.strip());
    } catch (NumberFormatException e) {
      throw bad("option '" + name + "': '" + raw + "' is not an integer");
    }
    if (n <= 0) {
      throw bad("option '" + name + "' must be positive, not " + n);
    }
    if (n > Integer.MAX_VALUE) {
      throw bad("option '" + name + "': " + n + " is too large");
    }
    return (int) n;
  }

  static boolean bool(Map<String, String> o, String name, boolean dflt) {
    String raw = get(o, name);
    if (raw == null) {
      return dflt;
    }
    String low = raw.strip().toLowerCase(Locale.ROOT);
    if (low.equals("true") || low.equals("1") || low.equals("yes")) {
      return true;
    }
    if (low.equals("false") || low.equals("0") || low.equals("no")) {
      return false;
    }
    throw bad("option '" + name + "': '" + raw + "' is not true or false");
  }
}
