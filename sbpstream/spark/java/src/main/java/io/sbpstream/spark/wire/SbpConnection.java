package io.sbpstream.spark.wire;

import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.Closeable;
import java.io.DataInputStream;
import java.io.EOFException;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.net.SocketTimeoutException;
import java.util.zip.CRC32;

/** A blocking SBP connection: one request at a time, its answer read frame by frame until the
 *  END flag. Every frame is checked (length bounds before the body is buffered, magic, header
 *  format, request id, payload CRC); anything malformed is a {@link ProtocolException} and the
 *  connection is unusable afterwards. Reads time out (``readTimeoutMs``), so a silent peer is an
 *  error, never a hang. No handshake: a cluster without authentication serves any connection. */
public final class SbpConnection implements Closeable {
  /** Wrong-magic frames skipped while waiting for one answer before giving up on the peer. */
  public static final int MAX_DISCARDED_FRAMES = 64;
  private static final int MAX_REQUEST_ID = Integer.MAX_VALUE;
  private static final int IO_BUFFER_BYTES = 64 * 1024;

  public final String address;
  private final Socket socket;
  private final DataInputStream in;
  private final OutputStream out;
  private byte[] rbuf = new byte[IO_BUFFER_BYTES];
  private int nextId = 1;
  /** The opcode of the requests sent: an answer frame of another opcode is not theirs. */
  private int sentOpcode = -1;
  private boolean broken;

  public SbpConnection(String address, int connectTimeoutMs, int readTimeoutMs)
      throws IOException {
    this.address = address;
    int colon = address.lastIndexOf(':');
    if (colon <= 0) {
      throw new IOException("bad address '" + address + "': expected host:port");
    }
    String host = address.substring(0, colon);
    if (host.startsWith("[") && host.endsWith("]")) {
      host = host.substring(1, host.length() - 1);
    }
    int port;
    try {
      port = Integer.parseInt(address.substring(colon + 1));
    } catch (NumberFormatException e) {
      throw new IOException("bad address '" + address + "': port is not a number");
    }
    Socket s = new Socket();
    try {
      s.setTcpNoDelay(true);
      s.setSoTimeout(readTimeoutMs);
      s.connect(new InetSocketAddress(host, port), connectTimeoutMs);
      in = new DataInputStream(new BufferedInputStream(s.getInputStream(), IO_BUFFER_BYTES));
      out = new BufferedOutputStream(s.getOutputStream(), IO_BUFFER_BYTES);
    } catch (IOException e) {
      s.close();
      throw new IOException("cannot connect to " + address + ": " + e.getMessage(), e);
    }
    socket = s;
  }

  public boolean usable() {
    return !broken && !socket.isClosed();
  }

  public void setReadTimeout(int ms) throws IOException {
    socket.setSoTimeout(ms);
  }

  /** Send one request frame; returns its request id. */
  public int send(int opcode, byte[] header) throws IOException {
    int id = nextId;
    nextId = nextId == MAX_REQUEST_ID ? 1 : nextId + 1;
    if (header.length > Frame.MAX_FRAME_LENGTH - Frame.MIN_FRAME_LENGTH) {
      throw new IOException("request header of " + header.length + " bytes is too large");
    }
    byte[] f = new byte[20 + header.length];
    putInt(f, 0, 16 + header.length);
    f[4] = (byte) Frame.MAGIC;
    f[5] = (byte) (opcode >>> 8);
    f[6] = (byte) opcode;
    f[7] = 0;
    putInt(f, 8, id);
    f[12] = (byte) Frame.HEADER_FORMAT_FLATBUFFERS;
    f[13] = (byte) (header.length >>> 16);
    f[14] = (byte) (header.length >>> 8);
    f[15] = (byte) header.length;
    System.arraycopy(header, 0, f, 16, header.length);
    // no payload: its CRC is 0, already in place
    sentOpcode = opcode;
    try {
      out.write(f);
      out.flush();
    } catch (IOException e) {
      broken = true;
      throw new IOException("cannot send to " + address + ": " + e.getMessage(), e);
    }
    return id;
  }

  /** The next frame answering ``requestId``. A system error frame is thrown as an
   *  {@link SbpException}; a GOAWAY is an IOException (the server is closing this connection).
   *  A frame that is not a response of the opcode sent (an unknown opcode, a request from the
   *  peer) is discarded, as a wrong magic is (docs/protocol.md section 1): its header is not the
   *  answer's and must not be read as if it were. */
  public Frame read(int requestId) throws IOException {
    try {
      for (int discarded = 0; ; discarded++) {
        Frame f = readFrame();
        if (f != null && f.opcode == Frame.OPCODE_GOAWAY
            && (f.flags & Frame.FLAG_RESPONSE) == 0) {
          broken = true;
          throw new IOException(address + " closes the connection (GOAWAY)");
        }
        if (f == null || f.opcode != sentOpcode || (f.flags & Frame.FLAG_RESPONSE) == 0) {
          if (discarded >= MAX_DISCARDED_FRAMES) {
            throw new ProtocolException(address + " sent " + discarded + " frames with a bad "
                + "magic or that answer no request of opcode " + sentOpcode);
          }
          continue;
        }
        if (f.requestId != requestId) {
          throw new ProtocolException(address + " answered request id " + f.requestId
              + ", expected " + requestId);
        }
        if ((f.flags & Frame.FLAG_SYSTEM_ERROR) != 0) {
          FbTable h = f.header();
          FbTable st = Sbp.SystemErrorResponse.status(h);
          throw status(st, "system error from " + address);
        }
        return f;
      }
    } catch (SbpException e) {
      throw e;
    } catch (SocketTimeoutException e) {
      broken = true;
      throw new IOException(address + " did not answer within " + socket.getSoTimeout() + " ms");
    } catch (IOException e) {
      broken = true;
      throw e;
    }
  }

  /** One frame off the wire, or null for a frame with a bad magic (discarded, per the spec). */
  private Frame readFrame() throws IOException {
    int length;
    try {
      length = in.readInt();
    } catch (EOFException e) {
      throw new IOException(address + " closed the connection");
    }
    if (length < Frame.MIN_FRAME_LENGTH || length > Frame.MAX_FRAME_LENGTH) {
      throw new ProtocolException("framing error from " + address + ": frame_length " + length
          + " outside [" + Frame.MIN_FRAME_LENGTH + ", " + Frame.MAX_FRAME_LENGTH + "]");
    }
    if (rbuf.length < length) {
      rbuf = new byte[Math.max(length, Math.min(Frame.MAX_FRAME_LENGTH, rbuf.length * 2))];
    }
    try {
      in.readFully(rbuf, 0, length);
    } catch (EOFException e) {
      throw new ProtocolException(address + " closed the connection inside a frame");
    }
    byte[] b = rbuf;
    int magic = b[0] & 0xff;
    int opcode = ((b[1] & 0xff) << 8) | (b[2] & 0xff);
    int flags = b[3] & 0xff;
    int requestId = getInt(b, 4);
    int format = b[8] & 0xff;
    int headerLen = ((b[9] & 0xff) << 16) | ((b[10] & 0xff) << 8) | (b[11] & 0xff);
    if (headerLen > length - 16) {
      throw new ProtocolException("framing error from " + address + ": header_length "
          + headerLen + " > frame_length - 16");
    }
    if (magic != Frame.MAGIC) {
      return null;
    }
    int payloadOff = 12 + headerLen;
    int payloadLen = length - 16 - headerLen;
    int crc = getInt(b, length - 4);
    int actual = 0;
    if (payloadLen > 0) {
      CRC32 c = new CRC32();
      c.update(b, payloadOff, payloadLen);
      actual = (int) c.getValue();
    }
    if (crc != actual) {
      throw new ProtocolException(String.format("payload CRC mismatch from %s: frame says 0x%08x, "
          + "payload has 0x%08x", address, crc, actual));
    }
    if (format != Frame.HEADER_FORMAT_FLATBUFFERS && headerLen > 0) {
      throw new ProtocolException(address + " sent header format " + format);
    }
    return new Frame(opcode, flags, requestId, b, 12, headerLen, payloadOff, payloadLen);
  }

  static SbpException status(FbTable st, String context) throws ProtocolException {
    if (st == null) {
      return new SbpException(1, context + " without a status", null);
    }
    return new SbpException(Sbp.Status.code(st), Sbp.Status.message(st), Sbp.Status.detail(st));
  }

  @Override
  public void close() {
    broken = true;
    try {
      socket.close();
    } catch (IOException e) {
      // closing: nothing more to do
    }
  }

  private static void putInt(byte[] b, int at, int v) {
    b[at] = (byte) (v >>> 24);
    b[at + 1] = (byte) (v >>> 16);
    b[at + 2] = (byte) (v >>> 8);
    b[at + 3] = (byte) v;
  }

  private static int getInt(byte[] b, int at) {
    return ((b[at] & 0xff) << 24) | ((b[at + 1] & 0xff) << 16) | ((b[at + 2] & 0xff) << 8)
        | (b[at + 3] & 0xff);
  }
}
