package io.sbpstream.spark.wire;

import com.github.luben.zstd.Zstd;
import com.github.luben.zstd.ZstdInputStream;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.zip.CRC32C;

/** Record batches (design.md section 4, sbpstream/records/): a buffer of whole batches back to
 *  back, each CRC-32C checked, decompressed (bounded) and decoded record by record into a
 *  {@link Sink}. Every malformation is a {@link ProtocolException} naming what is wrong. */
public final class RecordBatches {
  public static final int HEADER_SIZE = 53;
  public static final int LENGTH_PREFIX_SIZE = 12;
  public static final int CRC_START = 17;
  public static final int BATCH_MAGIC = 2;
  public static final int CODEC_MASK = 0x07;
  public static final int CODEC_NONE = 0;
  public static final int CODEC_ZSTD = 1;
  public static final int CODEC_LZ4 = 2;
  public static final int MAX_BATCH_BYTES = 16 * 1024 * 1024 - 4096;
  public static final int MAX_DECOMPRESSED_BYTES = 4 * MAX_BATCH_BYTES;
  /** Smallest record: length, timestamp_delta, key_length, value_length, header_count. */
  public static final int MIN_RECORD_BYTES = 5;
  public static final int MAX_VARINT_BYTES = 10;

  private RecordBatches() {}

  /** Receives the records decoded; ``buf`` positions are valid during the call only. */
  public interface Sink {
    /** Room for ``n`` more records is about to be needed. */
    void reserve(int n);

    /** One record; ``keyLen``/``valueLen`` -1 for null. ``hdr`` holds ``hdrCount`` quadruples
     *  (key offset, key length, value offset, value length) into ``buf``. */
    void record(long offset, long timestampMs, byte[] buf, int keyOff, int keyLen, int valueOff,
        int valueLen, int hdrCount, int[] hdr) throws ProtocolException;
  }

  private static int be32(byte[] b, int at) {
    return ((b[at] & 0xff) << 24) | ((b[at + 1] & 0xff) << 16) | ((b[at + 2] & 0xff) << 8)
        | (b[at + 3] & 0xff);
  }

  private static long be64(byte[] b, int at) {
    return ((long) be32(b, at) << 32) | (be32(b, at + 4) & 0xffffffffL);
  }

  /** The offset after the last whole batch of ``buf[off, off+len)`` (headers only, nothing
   *  checked beyond the lengths), or -1 when it holds none. */
  public static long nextOffset(byte[] buf, int off, int len) {
    int pos = off;
    int end = off + len;
    long next = -1;
    while (end - pos >= HEADER_SIZE) {
      long total = LENGTH_PREFIX_SIZE + (long) be32(buf, pos + 8);
      if (total < HEADER_SIZE || total > end - pos) {
        break;
      }
      next = be64(buf, pos) + be32(buf, pos + 19);
      pos += (int) total;
    }
    return next;
  }

  /** Decode every batch of ``buf[off, off+len)``, keeping offsets in [from, until). Returns the
   *  offset after the last record kept, or ``from`` when none was. Offsets are dense: the
   *  records kept must be ``from``, ``from + 1``, ... in order, so a gap or an overlap in an
   *  answer is an error, never a silent loss. */
  public static long decode(byte[] buf, int off, int len, long from, long until, Sink sink)
      throws ProtocolException {
    int pos = off;
    int end = off + len;
    long[] expect = {from};
    int[] hdr = new int[16];
    while (pos < end) {
      if (end - pos < HEADER_SIZE) {
        throw new ProtocolException("truncated batch header: " + (end - pos) + " of "
            + HEADER_SIZE + " bytes");
      }
      long base = be64(buf, pos);
      int batchLength = be32(buf, pos + 8);
      int magic = buf[pos + 12];
      int crc = be32(buf, pos + 13);
      int attributes = ((buf[pos + 17] & 0xff) << 8) | (buf[pos + 18] & 0xff);
      int count = be32(buf, pos + 19);
      long firstTs = be64(buf, pos + 23);
      if (magic != BATCH_MAGIC) {
        throw new ProtocolException("bad batch magic " + magic + ", expected " + BATCH_MAGIC);
      }
      long total = LENGTH_PREFIX_SIZE + (long) batchLength;
      if (batchLength < HEADER_SIZE - LENGTH_PREFIX_SIZE || total > MAX_BATCH_BYTES) {
        throw new ProtocolException("bad batch_length " + batchLength);
      }
      if (count <= 0) {
        throw new ProtocolException("bad record_count " + count);
      }
      if (base > Long.MAX_VALUE - count) { // base + count would wrap: the batch looked skippable
        throw new ProtocolException("batch offsets past int64: base_offset " + base
            + ", record_count " + count);
      }
      int codec = attributes & CODEC_MASK;
      if (codec > CODEC_LZ4 || (attributes & ~CODEC_MASK) != 0) {
        throw new ProtocolException(String.format("bad attributes 0x%04x", attributes));
      }
      if (total > end - pos) {
        throw new ProtocolException("truncated batch at byte " + (pos - off) + ": "
            + (end - pos) + " of " + total + " bytes");
      }
      int batchEnd = pos + (int) total;
      if (base + count > expect[0] && base < until) {
        CRC32C c = new CRC32C();
        c.update(buf, pos + CRC_START, batchEnd - pos - CRC_START);
        if ((int) c.getValue() != crc) {
          throw new ProtocolException(String.format("batch CRC mismatch at offset %d: stored "
              + "0x%08x, computed 0x%08x", base, crc, (int) c.getValue()));
        }
        byte[] sec = buf;
        int secOff = pos + HEADER_SIZE;
        int secEnd = batchEnd;
        if (codec != CODEC_NONE) {
          sec = decompress(codec, buf, secOff, secEnd - secOff);
          secOff = 0;
          secEnd = sec.length;
        }
        if (count > (secEnd - secOff) / MIN_RECORD_BYTES) {
          throw new ProtocolException("record_count " + count + " cannot fit in "
              + (secEnd - secOff) + " bytes");
        }
        sink.reserve(count);
        hdr = section(sec, secOff, secEnd, count, base, firstTs, expect, until, sink, hdr);
      }
      pos = batchEnd;
    }
    return expect[0];
  }

  /** The next varint's position is kept in {@code cur[0]}. */
  private static long varint(byte[] b, int[] cur, int end) throws ProtocolException {
    int p = cur[0];
    long zz = 0;
    int shift = 0;
    int stop = Math.min(end, p + MAX_VARINT_BYTES);
    while (p < stop) {
      int x = b[p++];
      zz |= (long) (x & 0x7f) << shift;
      if (x >= 0) {
        cur[0] = p;
        return (zz >>> 1) ^ -(zz & 1);
      }
      shift += 7;
    }
    throw new ProtocolException("bad varint at byte " + cur[0]);
  }

  private static int[] section(byte[] b, int start, int end, int count, long base, long firstTs,
      long[] expect, long until, Sink sink, int[] hdr) throws ProtocolException {
    int[] cur = {start};
    for (int i = 0; i < count; i++) {
      long length = varint(b, cur, end);
      int recStart = cur[0];
      if (length < MIN_RECORD_BYTES - 1 || length > end - recStart) {
        throw new ProtocolException("record " + i + ": bad length " + length + " at byte "
            + (recStart - start));
      }
      int recEnd = recStart + (int) length;
      long delta = varint(b, cur, recEnd);
      long kn = varint(b, cur, recEnd);
      int keyOff = cur[0];
      if (kn >= 0 && kn <= recEnd - keyOff) {
        cur[0] += (int) kn;
      } else if (kn != -1) {
        throw new ProtocolException("record " + i + ": bad key length " + kn);
      }
      long vn = varint(b, cur, recEnd);
      int valOff = cur[0];
      if (vn >= 0 && vn <= recEnd - valOff) {
        cur[0] += (int) vn;
      } else if (vn != -1) {
        throw new ProtocolException("record " + i + ": bad value length " + vn);
      }
      long hn = varint(b, cur, recEnd);
      if (hn < 0 || hn > (recEnd - cur[0]) / 2) {
        throw new ProtocolException("record " + i + ": bad header count " + hn);
      }
      int nh = (int) hn;
      if (hdr.length < 4 * nh) {
        hdr = new int[4 * nh];
      }
      for (int h = 0; h < nh; h++) {
        long n = varint(b, cur, recEnd);
        if (n < 0 || n > recEnd - cur[0]) {
          throw new ProtocolException("record " + i + ": bad header key length " + n);
        }
        hdr[4 * h] = cur[0];
        hdr[4 * h + 1] = (int) n;
        cur[0] += (int) n;
        checkUtf8(b, hdr[4 * h], (int) n);
        n = varint(b, cur, recEnd);
        if (n < 0 || n > recEnd - cur[0]) {
          throw new ProtocolException("record " + i + ": bad header value length " + n);
        }
        hdr[4 * h + 2] = cur[0];
        hdr[4 * h + 3] = (int) n;
        cur[0] += (int) n;
      }
      if (cur[0] != recEnd) {
        throw new ProtocolException("record " + i + ": " + (recEnd - cur[0])
            + " bytes unaccounted for");
      }
      long ts = firstTs + delta;
      if (((firstTs ^ ts) & (delta ^ ts)) < 0) {
        throw new ProtocolException("record " + i + ": timestamp past int64 (first_timestamp "
            + firstTs + " + delta " + delta + ")");
      }
      long offset = base + i;
      if (offset >= expect[0] && offset < until) {
        if (offset != expect[0]) {
          throw new ProtocolException("records jump from offset " + expect[0] + " to " + offset);
        }
        expect[0]++;
        sink.record(offset, ts, b, keyOff, (int) kn, valOff, (int) vn, nh, hdr);
      }
    }
    if (cur[0] != end) {
      throw new ProtocolException((end - cur[0]) + " bytes after the last of " + count
          + " records");
    }
    return hdr;
  }

  private static void checkUtf8(byte[] b, int off, int len) throws ProtocolException {
    try {
      StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(b, off, len));
    } catch (CharacterCodingException e) {
      throw new ProtocolException("header key is not UTF-8");
    }
  }

  /** The records section decompressed, refusing more than MAX_DECOMPRESSED_BYTES. The section
   *  is exactly one frame, as compression.py reads it: a second frame, a skippable frame or any
   *  byte after the first is an error (the Python reader refuses them too). lz4 frames are read
   *  by {@link Lz4Frame}, which follows linked blocks: python-lz4 writes a frame of more than
   *  one block (a section over 64 KiB) with each block referring to the ones before. */
  static byte[] decompress(int codec, byte[] b, int off, int len) throws ProtocolException {
    if (codec == CODEC_LZ4) {
      try {
        return Lz4Frame.decompress(b, off, len, MAX_DECOMPRESSED_BYTES);
      } catch (RuntimeException e) { // none expected: every bound is checked; named if any
        throw new ProtocolException("cannot decompress records (codec " + codec + "): " + e);
      }
    }
    long frame;
    try {
      frame = Zstd.findFrameCompressedSize(b, off, len);
    } catch (RuntimeException e) { // ZstdException: not a whole frame
      throw new ProtocolException("cannot decompress records (codec " + codec + "): " + e);
    }
    if (Zstd.isError(frame)) {
      throw new ProtocolException("cannot decompress records (codec " + codec + "): "
          + Zstd.getErrorName(frame));
    }
    if (frame != len) {
      throw new ProtocolException((len - frame) + " bytes after the zstd frame of the "
          + "records section");
    }
    try (InputStream in = new ZstdInputStream(new ByteArrayInputStream(b, off, len))) {
      byte[] out = new byte[Math.max(1024, Math.min(MAX_DECOMPRESSED_BYTES, len * 4))];
      int n = 0;
      while (true) {
        if (n == out.length) {
          if (out.length > MAX_DECOMPRESSED_BYTES) {
            throw new ProtocolException("records decompress to more than "
                + "MAX_DECOMPRESSED_BYTES (" + MAX_DECOMPRESSED_BYTES + ")");
          }
          out = java.util.Arrays.copyOf(out, Math.min(MAX_DECOMPRESSED_BYTES + 1,
              out.length * 2));
        }
        int r = in.read(out, n, out.length - n);
        if (r < 0) {
          break;
        }
        n += r;
      }
      return n == out.length ? out : java.util.Arrays.copyOf(out, n);
    } catch (ProtocolException e) {
      throw e;
    } catch (IOException | RuntimeException e) {
      throw new ProtocolException("cannot decompress records (codec " + codec + "): " + e);
    }
  }
}
