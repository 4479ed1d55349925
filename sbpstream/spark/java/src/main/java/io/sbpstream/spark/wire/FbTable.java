package io.sbpstream.spark.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;

/** A bounds-checked reader of one FlatBuffers table (little-endian, no size prefix, no file
 *  identifier, as docs/protocol.md section 2 says). Every offset is checked against the buffer
 *  before it is followed, so a malformed header is a {@link ProtocolException}, never an
 *  IndexOutOfBoundsException or a huge allocation. */
public final class FbTable {
  private final ByteBuffer bb;
  private final int pos;
  private final int vt;
  private final int vtLen;
  private final int tableLen;

  private FbTable(ByteBuffer bb, int pos) throws ProtocolException {
    this.bb = bb;
    this.pos = pos;
    need(pos, 4);
    long vtPos = (long) pos - bb.getInt(pos);
    if (vtPos < 0 || vtPos > bb.limit() - 4) {
      throw bad("vtable out of bounds");
    }
    vt = (int) vtPos;
    vtLen = bb.getShort(vt) & 0xffff;
    tableLen = bb.getShort(vt + 2) & 0xffff;
    if (vtLen < 4 || (vtLen & 1) != 0 || vt + vtLen > bb.limit() || tableLen < 4
        || (long) pos + tableLen > bb.limit()) {
      throw bad("bad vtable");
    }
  }

  /** The root table of a header; an empty header is a table with every field at its default. */
  public static FbTable root(byte[] buf, int off, int len) throws ProtocolException {
    if (len == 0) {
      return null;
    }
    ByteBuffer bb = ByteBuffer.wrap(buf, off, len).slice().order(ByteOrder.LITTLE_ENDIAN);
    if (len < 4) {
      throw bad("header of " + len + " bytes");
    }
    long root = bb.getInt(0) & 0xffffffffL;
    if (root > len - 4) {
      throw bad("root offset out of bounds");
    }
    return new FbTable(bb, (int) root);
  }

  private static ProtocolException bad(String why) {
    return new ProtocolException("undecodable FlatBuffers header: " + why);
  }

  private void need(long at, long size) throws ProtocolException {
    if (at < 0 || size < 0 || at + size > bb.limit()) {
      throw bad("read of " + size + " bytes at " + at + " past the end (" + bb.limit() + ")");
    }
  }

  /** The field's position in the buffer, or -1 when it is absent. */
  private int field(int slot, int size) throws ProtocolException {
    int vo = 4 + 2 * slot;
    if (vo + 2 > vtLen) {
      return -1;
    }
    int off = bb.getShort(vt + vo) & 0xffff;
    if (off == 0) {
      return -1;
    }
    if (off + size > tableLen) {
      throw bad("field " + slot + " outside its table");
    }
    return pos + off;
  }

  public long getLong(int slot, long dflt) throws ProtocolException {
    int p = field(slot, 8);
    return p < 0 ? dflt : bb.getLong(p);
  }

  public int getInt(int slot, int dflt) throws ProtocolException {
    int p = field(slot, 4);
    return p < 0 ? dflt : bb.getInt(p);
  }

  public short getShort(int slot, short dflt) throws ProtocolException {
    int p = field(slot, 2);
    return p < 0 ? dflt : bb.getShort(p);
  }

  public byte getByte(int slot, byte dflt) throws ProtocolException {
    int p = field(slot, 1);
    return p < 0 ? dflt : bb.get(p);
  }

  public boolean getBool(int slot) throws ProtocolException {
    int p = field(slot, 1);
    return p >= 0 && bb.get(p) != 0;
  }

  /** Where the uoffset at field ``slot`` points, or -1 when the field is absent. */
  private int target(int slot) throws ProtocolException {
    int p = field(slot, 4);
    if (p < 0) {
      return -1;
    }
    long t = p + (bb.getInt(p) & 0xffffffffL);
    need(t, 4);
    return (int) t;
  }

  public FbTable table(int slot) throws ProtocolException {
    int t = target(slot);
    return t < 0 ? null : new FbTable(bb, t);
  }

  public byte[] bytes(int slot) throws ProtocolException {
    int t = target(slot);
    if (t < 0) {
      return new byte[0];
    }
    int n = bb.getInt(t);
    need(t + 4L, n);
    byte[] out = new byte[n];
    bb.get(t + 4, out);
    return out;
  }

  public String string(int slot) throws ProtocolException {
    byte[] raw = bytes(slot);
    try {
      CharBuffer cb = StandardCharsets.UTF_8.newDecoder()
          .onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT)
          .decode(ByteBuffer.wrap(raw));
      return cb.toString();
    } catch (CharacterCodingException e) {
      throw bad("string field " + slot + " is not UTF-8");
    }
  }

  /** The number of elements of a vector field (0 when absent), each ``elemSize`` bytes. */
  public int vectorLength(int slot, int elemSize) throws ProtocolException {
    int t = target(slot);
    if (t < 0) {
      return 0;
    }
    int n = bb.getInt(t);
    if (n < 0) {
      throw bad("negative vector length");
    }
    need(t + 4L, (long) n * elemSize);
    return n;
  }

  private int element(int slot, int i, int elemSize) throws ProtocolException {
    int n = vectorLength(slot, elemSize);
    if (i < 0 || i >= n) {
      throw bad("vector index " + i + " of " + n);
    }
    return target(slot) + 4 + i * elemSize;
  }

  public FbTable tableAt(int slot, int i) throws ProtocolException {
    int p = element(slot, i, 4);
    long t = p + (bb.getInt(p) & 0xffffffffL);
    need(t, 4);
    return new FbTable(bb, (int) t);
  }

  public long longAt(int slot, int i) throws ProtocolException {
    return bb.getLong(element(slot, i, 8));
  }
}
