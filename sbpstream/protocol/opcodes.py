"""SBP opcodes (the spec's 16 plus the project's BUFFER_ACK). No I/O."""

from __future__ import annotations

import enum


class Opcode(enum.IntEnum):
    PING = 0x0001
    GOAWAY = 0x0002
    HEARTBEAT = 0x0003
    ALLOCATE_ID = 0x0004
    APPEND = 0x1001
    FETCH = 0x1002
    BUFFER_ACK = 0x1003  # project opcode: flow control (design.md section 7)
    AUTHENTICATE = 0x1030  # project opcode: SCRAM-SHA-256 or a token (docs/security.md)
    MANAGE_USERS = 0x1031  # project opcode: add, delete, list users (admin)
    MANAGE_ACLS = 0x1032  # project opcode: add, delete, list ACL entries (admin)
    LIST_RANGES = 0x2001
    SEAL_RANGES = 0x2002
    SYNC_RANGES = 0x2003
    DESCRIBE_RANGES = 0x2004
    CREATE_STREAMS = 0x3001
    DELETE_STREAMS = 0x3002
    UPDATE_STREAMS = 0x3003
    DESCRIBE_STREAMS = 0x3004
    TRIM_STREAMS = 0x3005
    REPORT_METRICS = 0x4001


KNOWN_OPCODES: frozenset[int] = frozenset(int(o) for o in Opcode)
