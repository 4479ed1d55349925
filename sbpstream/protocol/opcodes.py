"""SBP opcodes: the spec's 16 plus the project's (BUFFER_ACK; INFO, STATS, CONNECTIONS, WHOAMI;
consumer groups and committed offsets; DRAIN_NODE).

No I/O. Project opcodes are listed in docs/protocol.md.
"""

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
    SET_QUOTAS = 0x1020  # project opcode: quotas (issue 22), PM
    DELETE_QUOTAS = 0x1021  # project opcode: quotas, PM
    DESCRIBE_QUOTAS = 0x1022  # project opcode: quotas, PM (data nodes pull it)
    QUOTA_COUNTERS = 0x1023  # project opcode: a data node's live quota counters
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
    # project opcodes: introspection, after Throttr's (docs/protocol.md, "Introspection")
    INFO = 0x5001
    STATS = 0x5002
    CONNECTIONS = 0x5003
    WHOAMI = 0x5004
    # project opcodes: consumer groups and committed offsets (docs/protocol.md, "Consumer groups")
    JOIN_GROUP = 0x1040
    GROUP_HEARTBEAT = 0x1041
    LEAVE_GROUP = 0x1042
    OFFSET_COMMIT = 0x1043
    OFFSET_FETCH = 0x1044
    DESCRIBE_GROUPS = 0x1045
    LIST_GROUPS = 0x1046
    DELETE_GROUP = 0x1047
    RESET_OFFSETS = 0x1048
    # project opcode: draining and removing a data node (docs/operations.md), admin
    DRAIN_NODE = 0x1050


KNOWN_OPCODES: frozenset[int] = frozenset(int(o) for o in Opcode)
