package io.sbpstream.spark.wire;

/** One received frame (docs/protocol.md section 1). ``buf`` may be the connection's reusable
 *  receive buffer: read ``header``/``payload`` before reading the next frame. */
public final class Frame {
  public static final int MAGIC = 23;
  public static final int MIN_FRAME_LENGTH = 16;
  public static final int MAX_FRAME_LENGTH = 16 * 1024 * 1024;
  public static final int HEADER_FORMAT_FLATBUFFERS = 1;
  public static final int FLAG_RESPONSE = 0x01;
  public static final int FLAG_END = 0x02;
  public static final int FLAG_SYSTEM_ERROR = 0x04;
  public static final int OPCODE_GOAWAY = 0x0002;

  public final int opcode;
  public final int flags;
  public final int requestId;
  public final byte[] buf;
  public final int headerOff;
  public final int headerLen;
  public final int payloadOff;
  public final int payloadLen;

  Frame(int opcode, int flags, int requestId, byte[] buf, int headerOff, int headerLen,
      int payloadOff, int payloadLen) {
    this.opcode = opcode;
    this.flags = flags;
    this.requestId = requestId;
    this.buf = buf;
    this.headerOff = headerOff;
    this.headerLen = headerLen;
    this.payloadOff = payloadOff;
    this.payloadLen = payloadLen;
  }

  public boolean end() {
    return (flags & FLAG_END) != 0;
  }

  public FbTable header() throws ProtocolException {
    return FbTable.root(buf, headerOff, headerLen);
  }
}
