package io.sbpstream.spark.wire;

import java.io.IOException;

/** Malformed bytes from the network: a frame, a FlatBuffers header or a record batch that does
 *  not decode. Nothing after it on the same connection can be trusted. */
public class ProtocolException extends IOException {
  private static final long serialVersionUID = 1L;

  public ProtocolException(String message) {
    super(message);
  }
}
