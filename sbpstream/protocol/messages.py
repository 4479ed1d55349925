"""Typed SBP extended headers: one frozen dataclass per request and response of every opcode.

The wire format is the FlatBuffers schema ``schema/sbp.fbs``, and it is the only statement of it:
the classes are generated from it into ``generated.py`` by ``python -m sbpstream.protocol.codegen``
(with the JVM reader's accessors; ``tests/test_codegen.py`` fails while either is stale), and
re-exported here, the module the rest of the code imports. Their methods beyond the fields
(``Status.ok``, ``Range.sealed``, ``FetchResponse.chunks``...) and the opcode registries are
hand-written in :mod:`.message_base`. The flatc-generated code in ``tests/sbp_fbs/`` is not
imported here: the tests use it as an independent reader of what this module writes.

Every table has

- ``encode() -> bytes``: the table as a FlatBuffers root (no size prefix, no file identifier);
  for a message, the extended header, and
- ``decode(buf) -> Self``: the inverse. An empty buffer (``header_length = 0``) gives every field
  its default; anything undecodable raises :class:`BadHeaderError`, a batched request naming more
  than :data:`MAX_ITEMS_PER_REQUEST` items raises :class:`LimitExceededError`. Nothing else.

Messages are plain data: no I/O, sequences are tuples. ``REQUESTS`` and ``RESPONSES`` map each
opcode to its class, ``MESSAGES`` lists them in schema order. Per-item results carry their own
:class:`Status`; an OK status (code 0, no message, no detail) is not written at all, so the common
case costs no bytes and decodes to the shared :data:`STATUS_OK`. The items of APPEND and FETCH
are written by a fixed-layout fast path (``py_fixed`` in the schema, see
:class:`.fbtable.FixedLayout`).
"""

from __future__ import annotations

from typing import Final

from sbpstream.protocol import generated
from sbpstream.protocol.generated import *  # noqa: F403  (the classes: generated.__all__)
from sbpstream.protocol.generated import CODEC as _CODEC  # noqa: F401  (for the fast paths' tests)
from sbpstream.protocol.generated import omitted_Status as _status_omitted  # noqa: F401
from sbpstream.protocol.message_base import (
    MAX_ITEMS_PER_REQUEST,
    MESSAGE_LIST,
    REQUESTS,
    RESPONSES,
    Header,
    Message,
    request,  # noqa: F401  (register a message class for its opcode)
    response,  # noqa: F401
)
from sbpstream.protocol.opcodes import Opcode

__all__ = [
    "MAX_ITEMS_PER_REQUEST", "MESSAGES", "REQUESTS", "RESPONSES", "Header", "Message",
    "decode_request", "decode_response",
]  # fmt: skip
__all__ += generated.__all__  # the classes, the enum, the union and STATUS_OK

MESSAGES: Final[tuple[type[Message], ...]] = tuple(MESSAGE_LIST)
if set(REQUESTS) != set(Opcode) or set(RESPONSES) != set(Opcode):
    raise TypeError("every opcode needs a request and a response class")


def decode_request(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a request header; an opcode without a request class raises KeyError."""
    return REQUESTS[Opcode(opcode)].decode(buf)


def decode_response(opcode: int, buf: bytes | bytearray | memoryview) -> Message:
    """Decode a response header; an opcode without a response class raises KeyError.

    A system error frame (flag 0x04) carries :class:`SystemErrorResponse` whatever the opcode:
    decode it with ``SystemErrorResponse.decode``.
    """
    return RESPONSES[Opcode(opcode)].decode(buf)
