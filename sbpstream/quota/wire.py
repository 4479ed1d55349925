"""Reading ``throttle_time_ms`` off a response header without decoding the rest (no I/O).

APPEND and FETCH responses carry ``throttle_time_ms:int32`` as field 0 of their table
(schema/sbp.fbs); the SDK reads it on every response, so it reads that one field: the root
offset, the vtable, slot 0. A header too short or malformed for that reads as 0 (the full decode
of the caller reports what is wrong with it).
"""

from __future__ import annotations

import struct
from typing import Final

_U32: Final = struct.Struct("<I")
_I32: Final = struct.Struct("<i")
_U16: Final = struct.Struct("<H")


def throttle_time_ms_of(header: bytes | bytearray | memoryview) -> int:
    n = len(header)
    try:
        if n < 8:
            return 0
        table = _U32.unpack_from(header, 0)[0]
        vtable = table - _I32.unpack_from(header, table)[0]
        if not 0 <= vtable <= n - 6 or _U16.unpack_from(header, vtable)[0] < 6:
            return 0
        field = _U16.unpack_from(header, vtable + 4)[0]
        if field == 0:
            return 0
        return max(0, int(_I32.unpack_from(header, table + field)[0]))
    except struct.error:
        return 0
