"""Every protocol and connection limit, each with the reason it exists (design.md section 9).

Limits are checked as early as the bytes allow: the frame length as soon as its 4 bytes arrive,
item counts as soon as a header is decoded. Exceeding one is a clear error, never unbounded memory.
"""

from __future__ import annotations

from typing import Final

KiB: Final = 1024
MiB: Final = 1024 * KiB

# frame_length counts every byte after the length field: 16 bytes of fixed header, format byte and
# header length, then header, payload and the 4-byte CRC. 16 is the smallest legal frame.
MIN_FRAME_LENGTH: Final = 16
# 16 MiB bounds what one frame can make a peer buffer; batches are far smaller (MAX_BATCH_BYTES).
MAX_FRAME_LENGTH: Final = 16 * MiB
# The header length field is 24 bits wide.
MAX_HEADER_LENGTH: Final = (1 << 24) - 1
# A frame's request id (the spec's frame "stream_id") is client-chosen with the top bit clear
# (the spec says non-negative). Not to be confused with a data stream's id: MAX_STREAM_ID.
MAX_REQUEST_ID: Final = (1 << 31) - 1
# A data stream's id is int64 on the wire (Stream.stream_id, AppendItem.stream_id, ...).
MAX_STREAM_ID: Final = (1 << 63) - 1
# Idempotent producers number records with int32 sequences that wrap to 0 past 2**31 - 1
# (Kafka's rule): producer, data node and Spark sink all compute modulo this.
SEQUENCE_WRAP: Final = 1 << 31

# A connection may have this many requests being served at once; past it the server stops reading
# from the socket (TCP back-pressure) until one completes. Bounds handler tasks per connection.
MAX_IN_FLIGHT_REQUESTS: Final = 1024
# Response frames received but not yet consumed by the application, per client connection. Past
# it the client stops reading the socket, so a slow consumer cannot make us buffer without end.
MAX_BUFFERED_RESPONSE_BYTES: Final = 64 * MiB
# Transport write buffer high/low water marks: past HIGH a writer awaits drain (peer not reading).
WRITE_BUFFER_HIGH_WATER: Final = 4 * MiB
WRITE_BUFFER_LOW_WATER: Final = 1 * MiB
# A server keeps at most this many client connections; more are closed at accept with GOAWAY.
MAX_CONNECTIONS: Final = 10_000
# A connection with no frames and nothing in flight for this long is closed (GOAWAY first).
DEFAULT_IDLE_TIMEOUT_S: Final = 600.0
# How long a GOAWAY'd connection waits for in-flight requests before closing anyway.
DEFAULT_DRAIN_TIMEOUT_S: Final = 10.0
# Connect timeout of the client side.
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0

# ---- before authentication (auth on): a peer that has not proven who it is gets only what it pays
# for; docs/security.md "Pre-authentication limits".
# Before a connection authenticates it may send only PING, GOAWAY and AUTHENTICATE, all small (a
# SCRAM message or a token is under 2 KiB). A frame header declaring more is refused, and the
# connection closed, before its body is read: an unauthenticated peer cannot make the server
# buffer MAX_FRAME_LENGTH.
PREAUTH_MAX_FRAME_LENGTH: Final = 64 * KiB
# Before authentication a connection stops being read once this much of its output is unsent
# (answers to PINGs and refusals it does not read), and resumes below the low mark: an
# unauthenticated connection holds at most this much of the server's memory in output.
PREAUTH_WRITE_BUFFER_HIGH_WATER: Final = 64 * KiB
PREAUTH_WRITE_BUFFER_LOW_WATER: Final = 16 * KiB
# A connection that has not authenticated this long after it was accepted (TLS handshake
# included) is sent GOAWAY (AUTHENTICATION_REQUIRED) and closed: idle connections cannot be held
# for free. Logging in takes a round trip or two; 10 s leaves room for a slow network.
DEFAULT_AUTH_DEADLINE_S: Final = 10.0
# Connections from one peer IP address (loopback included): one host cannot take every slot of
# MAX_CONNECTIONS. A client process keeps one connection per server, so a host with 1,000 client
# processes (a test suite, a local ``up`` cluster with its loads) is far below it.
MAX_CONNECTIONS_PER_SOURCE: Final = 1_000
# Connections not yet authenticated (auth on), below MAX_CONNECTIONS so that authenticated ones
# always have room. When full, a new connection evicts the oldest unauthenticated one, so that a
# legitimate client can still log in while an attacker holds every unauthenticated slot.
MAX_UNAUTHENTICATED_CONNECTIONS: Final = 8_000
