package io.sbpstream.spark.wire;

import java.io.IOException;

/** An error answer from an sbpstream server (a status with a non-zero code), or a client-side
 *  failure with one of the client codes. Codes are {@code sbpstream.protocol.errors.ErrorCode}. */
public class SbpException extends IOException {
  private static final long serialVersionUID = 1L;

  public static final int PM_NOT_LEADER = 5;
  public static final int STREAM_NOT_FOUND = 30;
  public static final int STREAM_DELETED = 31;
  public static final int RANGE_NOT_FOUND = 32;
  public static final int NOT_PRIMARY = 34;
  public static final int OFFSET_OUT_OF_RANGE = 35;
  public static final int OFFSET_TRIMMED = 44;
  public static final int FENCED_LEADER = 64;
  public static final int AUTHENTICATION_REQUIRED = 80;

  /** Codes a retry (elsewhere or later) can cure, as in errors.py's RetriableError classes. */
  private static final int[] RETRIABLE = {7, 9, 11, 12, 13, 14, 32, 33, 34, 39, 40, 41, 45, 46,
      60, 63, 82};

  public final int code;
  public final byte[] detail;

  public SbpException(int code, String message, byte[] detail) {
    super(message == null || message.isEmpty() ? "error code " + code
        : message + " (error code " + code + ")");
    this.code = code;
    this.detail = detail == null ? new byte[0] : detail;
  }

  public boolean retriable() {
    for (int c : RETRIABLE) {
      if (c == code) {
        return true;
      }
    }
    return false;
  }

  public boolean redirect() {
    return code == PM_NOT_LEADER || code == FENCED_LEADER;
  }
}
