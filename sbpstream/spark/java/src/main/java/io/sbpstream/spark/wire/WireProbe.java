package io.sbpstream.spark.wire;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

/** Runs the wire decoders over many inputs in one call and renders each outcome as text, for
 *  the differential fuzz tests (tests/test_spark_jvm_fuzz.py, through py4j). Each outcome is
 *  {@code "ok\n<rendering>"}, {@code "error <class>: <message>"} for the IOExceptions the
 *  decoders are meant to raise, {@code "crash <class>: <message>"} for anything else thrown,
 *  or {@code "hang"} when a case runs past ``timeoutMs``. Not used by the reader itself. */
public final class WireProbe {
  private WireProbe() {}

  private interface Case {
    String run(byte[] input) throws Exception;
  }

  private static String[] each(byte[][] inputs, int timeoutMs, Case c) {
    String[] out = new String[inputs.length];
    ExecutorService ex = newExecutor();
    try {
      for (int i = 0; i < inputs.length; i++) {
        byte[] in = inputs[i];
        Future<String> f = ex.submit(() -> {
          try {
            return "ok\n" + c.run(in);
          } catch (IOException e) {
            return "error " + e.getClass().getSimpleName() + ": " + e.getMessage();
          } catch (Throwable e) { // what a decoder must never throw: reported, not hidden
            return "crash " + e.getClass().getName() + ": " + e.getMessage();
          }
        });
        try {
          out[i] = f.get(timeoutMs, TimeUnit.MILLISECONDS);
        } catch (TimeoutException e) {
          f.cancel(true);
          out[i] = "hang";
          ex.shutdownNow();
          ex = newExecutor();
        } catch (Exception e) {
          out[i] = "crash " + e;
        }
      }
    } finally {
      ex.shutdownNow();
    }
    return out;
  }

  private static ExecutorService newExecutor() {
    return Executors.newSingleThreadExecutor(r -> {
      Thread t = new Thread(r, "sbpstream-wire-probe");
      t.setDaemon(true);
      return t;
    });
  }

  private static String hex(byte[] b, int off, int len) {
    if (len < 0) {
      return "null";
    }
    StringBuilder sb = new StringBuilder(2 * len + 1).append('x');
    for (int i = off; i < off + len; i++) {
      sb.append(String.format("%02x", b[i] & 0xff));
    }
    return sb.toString();
  }

  /** {@link RecordBatches#decode} of each input over [from, until): one line per record
   *  ({@code offset timestamp key value header-key=header-value,...}, bytes in hex, "null"),
   *  then {@code next <offset returned>}. */
  public static String[] decodeBatches(byte[][] inputs, long from, long until, int timeoutMs) {
    return each(inputs, timeoutMs, in -> {
      StringBuilder sb = new StringBuilder();
      long next = RecordBatches.decode(in, 0, in.length, from, until, new RecordBatches.Sink() {
        @Override
        public void reserve(int n) {}

        @Override
        public void record(long offset, long ts, byte[] buf, int keyOff, int keyLen,
            int valueOff, int valueLen, int hdrCount, int[] hdr) {
          sb.append(offset).append(' ').append(ts).append(' ').append(hex(buf, keyOff, keyLen))
              .append(' ').append(hex(buf, valueOff, valueLen)).append(' ');
          for (int h = 0; h < hdrCount; h++) {
            sb.append(hex(buf, hdr[4 * h], hdr[4 * h + 1])).append('=')
                .append(hex(buf, hdr[4 * h + 2], hdr[4 * h + 3])).append(',');
          }
          sb.append('\n');
        }
      });
      return sb.append("next ").append(next).toString();
    });
  }

  private static String status(FbTable st) throws ProtocolException {
    return st == null ? "0 x" : Sbp.Status.code(st) + " " + utf8(Sbp.Status.message(st));
  }

  /** A response header read by {@link Messages} as the reader reads it: ``kind`` is "fetch",
   *  "ranges" or "streams". Strings are rendered as their UTF-8 bytes in hex. */
  public static String[] decodeHeaders(String kind, byte[][] inputs, int timeoutMs) {
    return each(inputs, timeoutMs, in -> {
      FbTable h = FbTable.root(in, 0, in.length);
      StringBuilder sb = new StringBuilder();
      sb.append("status ").append(status(Sbp.FetchResponse.status(h))).append('\n');
      switch (kind) {
        case "fetch":
          for (Messages.FetchResult r : Messages.fetchResults(h)) {
            sb.append(r.streamId).append(' ').append(r.batchLength).append(' ').append(r.code)
                .append(' ').append(utf8(r.message)).append(' ').append(r.startOffset)
                .append(' ').append(r.rangeEndOffset).append('\n');
          }
          break;
        case "ranges":
          for (Messages.RangeList rl : Messages.rangeLists(h)) {
            sb.append(rl.streamId).append(' ').append(rl.code).append(' ')
                .append(utf8(rl.message)).append('\n');
            for (Messages.RangeInfo r : rl.ranges) {
              sb.append("  ").append(r.streamId).append(' ').append(r.rangeIndex).append(' ')
                  .append(r.startOffset).append(' ').append(r.nextOffset).append(' ')
                  .append(r.endOffset);
              for (String a : r.replicas) {
                sb.append(' ').append(utf8(a));
              }
              sb.append('\n');
            }
          }
          break;
        case "streams":
          for (Messages.StreamResult r : Messages.streamResults(h)) {
            sb.append(r.code).append(' ').append(utf8(r.message));
            if (r.stream != null) {
              sb.append(' ').append(r.stream.streamId).append(' ').append(r.stream.startOffset)
                  .append(' ').append(utf8(r.stream.name));
            }
            sb.append('\n');
          }
          sb.append("continuation ").append(Messages.continuation(h)).append('\n');
          break;
        default:
          throw new IllegalArgumentException("kind " + kind);
      }
      return sb.toString();
    });
  }

  private static String utf8(String s) {
    byte[] b = s.getBytes(java.nio.charset.StandardCharsets.UTF_8);
    return hex(b, 0, b.length);
  }

  /** Each input sent by a loopback server as the whole answer to one request of an
   *  {@link SbpConnection} (then end of stream), read frame by frame until the END flag: one
   *  line per frame, {@code opcode flags request-id header payload}. */
  public static String[] readFrames(byte[][] inputs, int readTimeoutMs, int timeoutMs)
      throws IOException {
    try (ServerSocket server = new ServerSocket(0, 50, InetAddress.getLoopbackAddress())) {
      String addr = "127.0.0.1:" + server.getLocalPort();
      return each(inputs, timeoutMs, in -> {
        Thread peer = new Thread(() -> serve(server, in), "sbpstream-wire-probe-peer");
        peer.setDaemon(true);
        peer.start();
        StringBuilder sb = new StringBuilder();
        try (SbpConnection c = new SbpConnection(addr, 2000, readTimeoutMs)) {
          int id = c.send(Messages.FETCH, Messages.fetch(0, 1, 0, 1024, 0));
          for (int n = 0; ; n++) {
            Frame f = c.read(id);
            sb.append(f.opcode).append(' ').append(f.flags).append(' ').append(f.requestId)
                .append(' ').append(hex(f.buf, f.headerOff, f.headerLen)).append(' ')
                .append(hex(f.buf, f.payloadOff, f.payloadLen)).append('\n');
            if (f.end() || n > 1000) {
              break;
            }
          }
        } finally {
          peer.join(5000);
        }
        return sb.toString();
      });
    }
  }

  private static void serve(ServerSocket server, byte[] answer) {
    try (Socket s = server.accept()) {
      OutputStream o = s.getOutputStream();
      o.write(answer);
      o.flush();
      s.shutdownOutput();
      InputStream i = s.getInputStream();
      byte[] sink = new byte[4096];
      while (i.read(sink) >= 0) {
        // until the client closes: closing first could reset the connection under its reads
      }
    } catch (IOException e) {
      // the client gave up first
    }
  }

  /** The inputs of one probe call: one byte array of ``[u32 big-endian length][bytes]``
   *  items (one py4j transfer instead of one per input). */
  public static byte[][] unpack(byte[] blob) {
    java.nio.ByteBuffer bb = java.nio.ByteBuffer.wrap(blob);
    List<byte[]> out = new java.util.ArrayList<>();
    while (bb.hasRemaining()) {
      byte[] one = new byte[bb.getInt()];
      bb.get(one);
      out.add(one);
    }
    return out.toArray(new byte[0][]);
  }

  /** The outcomes of one probe call as one string, separated by NUL characters. */
  public static String join(String[] outcomes) {
    return String.join("\u0000", outcomes);
  }
}
