package io.sbpstream.spark.wire;

import java.util.Arrays;
import net.jpountz.xxhash.XXHash32;
import net.jpountz.xxhash.XXHashFactory;

/** One lz4 frame (the lz4 frame format, version 01) decoded into one array, bounded. Blocks may
 *  be linked (each referring to the output before it, as python-lz4 writes a frame of more than
 *  one block) or independent; lz4-java's frame reader refuses linked blocks. The frame must
 *  fill its input exactly: a second frame, a skippable frame or trailing bytes are errors, as in
 *  compression.py. Header, block and content checksums are verified. */
final class Lz4Frame {
  static final int MAGIC = 0x184D2204;
  /** Window of a linked block's references into the output before it. */
  static final int WINDOW = 64 * 1024;
  private static final XXHash32 XXH = XXHashFactory.fastestJavaInstance().hash32();

  private Lz4Frame() {}

  private static ProtocolException bad(String why) {
    return new ProtocolException("cannot decompress records (codec 2): " + why);
  }

  private static int le32(byte[] b, int at) {
    return (b[at] & 0xff) | (b[at + 1] & 0xff) << 8 | (b[at + 2] & 0xff) << 16
        | (b[at + 3] & 0xff) << 24;
  }

  /** The frame ``b[off, off+len)`` decompressed, refusing more than ``max`` bytes. */
  static byte[] decompress(byte[] b, int off, int len, int max) throws ProtocolException {
    int end = off + len;
    if (len < 7 || le32(b, off) != MAGIC) {
      throw bad("not an lz4 frame");
    }
    int flg = b[off + 4] & 0xff;
    int bd = b[off + 5] & 0xff;
    boolean linked = (flg & 0x20) == 0;
    boolean blockSum = (flg & 0x10) != 0;
    boolean hasSize = (flg & 0x08) != 0;
    boolean contentSum = (flg & 0x04) != 0;
    if ((flg >>> 6) != 1 || (flg & 0x02) != 0 || (bd & 0x8f) != 0 || (bd >>> 4) < 4) {
      throw bad(String.format("bad frame descriptor 0x%02x 0x%02x", flg, bd));
    }
    if ((flg & 0x01) != 0) {
      throw bad("frame needs a dictionary");
    }
    int blockMax = 1 << (8 + 2 * (bd >>> 4));
    int p = off + 6;
    long declared = -1;
    if (hasSize) {
      if (end - p < 8) {
        throw bad("truncated frame header");
      }
      declared = (le32(b, p) & 0xffffffffL) | ((long) le32(b, p + 4) << 32);
      p += 8;
      if (declared < 0 || declared > max) {
        throw new ProtocolException("records decompress to " + Long.toUnsignedString(declared)
            + " bytes, over MAX_DECOMPRESSED_BYTES (" + max + ")");
      }
    }
    if (end - p < 1) {
      throw bad("truncated frame header");
    }
    if ((b[p] & 0xff) != ((XXH.hash(b, off + 4, p - off - 4, 0) >>> 8) & 0xff)) {
      throw bad("frame header checksum mismatch");
    }
    p++;
    byte[] out = new byte[(int) Math.min(max, declared >= 0 ? declared
        : Math.max(1024, Math.min((long) max, 4L * len)))];
    int n = 0;
    while (true) {
      if (end - p < 4) {
        throw bad("truncated frame");
      }
      int word = le32(b, p);
      p += 4;
      if (word == 0) {
        break; // EndMark
      }
      boolean raw = word < 0;
      int size = word & 0x7fffffff;
      if (size > blockMax || size > end - p - (blockSum ? 4 : 0)) {
        throw bad("block of " + size + " bytes past the frame or its maximum " + blockMax);
      }
      if (blockSum && XXH.hash(b, p, size, 0) != le32(b, p + size)) {
        throw bad("block checksum mismatch");
      }
      if (declared < 0 && out.length - n < blockMax && out.length < max) {
        out = Arrays.copyOf(out, (int) Math.min(max, Math.max((long) n + blockMax,
            2L * out.length)));
      }
      int limit = Math.min(out.length, n + blockMax);
      if (raw) {
        if (size > limit - n) {
          throw tooBig(max, declared);
        }
        System.arraycopy(b, p, out, n, size);
        n += size;
      } else {
        n = block(b, p, p + size, out, n, limit, linked ? Math.max(0, n - WINDOW) : n, max,
            declared);
      }
      p += size + (blockSum ? 4 : 0);
    }
    if (contentSum) {
      if (end - p < 4) {
        throw bad("truncated frame");
      }
      if (XXH.hash(out, 0, n, 0) != le32(b, p)) {
        throw bad("content checksum mismatch");
      }
      p += 4;
    }
    if (p != end) {
      throw new ProtocolException((end - p) + " bytes after the lz4 frame of the records "
          + "section");
    }
    if (declared >= 0 && declared != n) {
      throw new ProtocolException("lz4 frame holds " + n + " bytes, its header says "
          + declared);
    }
    return n == out.length ? out : Arrays.copyOf(out, n);
  }

  private static ProtocolException tooBig(int max, long declared) {
    return declared >= 0 ? bad("frame holds more than the " + declared + " bytes it declares")
        : new ProtocolException("records decompress to more than MAX_DECOMPRESSED_BYTES ("
            + max + ")");
  }

  /** One compressed block ``src[p, end)`` decoded at ``out[n, limit)``; matches may reach back
   *  to ``low``. Returns the output's new end. */
  private static int block(byte[] src, int p, int end, byte[] out, int n, int limit, int low,
      int max, long declared) throws ProtocolException {
    while (true) {
      if (p >= end) {
        throw bad("truncated block");
      }
      int token = src[p++] & 0xff;
      int lit = token >>> 4;
      if (lit == 15) {
        int x;
        do {
          if (p >= end) {
            throw bad("truncated block");
          }
          x = src[p++] & 0xff;
          lit += x;
        } while (x == 255 && lit < Integer.MAX_VALUE / 2);
      }
      if (lit > end - p) {
        throw bad("literals past the block");
      }
      if (lit > limit - n) {
        throw tooBig(max, declared);
      }
      System.arraycopy(src, p, out, n, lit);
      p += lit;
      n += lit;
      if (p == end) {
        return n; // the last sequence: literals only
      }
      if (end - p < 2) {
        throw bad("truncated block");
      }
      int offset = (src[p] & 0xff) | (src[p + 1] & 0xff) << 8;
      p += 2;
      if (offset == 0 || offset > n - low) {
        throw bad("match offset " + offset + " outside the window");
      }
      int len = token & 15;
      if (len == 15) {
        int x;
        do {
          if (p >= end) {
            throw bad("truncated block");
          }
          x = src[p++] & 0xff;
          len += x;
        } while (x == 255 && len < Integer.MAX_VALUE / 2);
      }
      len += 4;
      if (len > limit - n) {
        throw tooBig(max, declared);
      }
      int from = n - offset;
      if (offset >= len) {
        System.arraycopy(out, from, out, n, len);
      } else {
        for (int i = 0; i < len; i++) {
          out[n + i] = out[from + i];
        }
      }
      n += len;
    }
  }
}
