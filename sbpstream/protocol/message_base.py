"""The hand-written side of the messages: what ``generated.py`` builds its classes on.

``generated.py`` (``python -m sbpstream.protocol.codegen``, from ``schema/sbp.fbs``) makes one
class per schema table. Each derives from :class:`~.fbtable.Table`, :class:`Header` or
:class:`Message` here, and from the mixin named ``<Table>Methods`` here when there is one: the
methods a class has beyond its fields (``Status.ok``, ``Range.sealed``, ``FetchResponse.chunks``).
A message class is registered for its opcode by :func:`request` / :func:`response`, which refuse
a second class for the same one. The vector fast paths (``rangelist``) and the bound on request
vectors are named here too, for the generated code to call. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, Self, TypeVar

from sbpstream.protocol.errors import LimitExceededError, SbpError, error_for
from sbpstream.protocol.fbtable import Table
from sbpstream.protocol.opcodes import Opcode

__all__ = [
    "MAX_ITEMS_PER_REQUEST", "REQUESTS", "RESPONSES", "FetchResponseMethods", "Header",
    "Message", "RangeMethods", "StatusMethods", "check_items", "request", "response",
    "status_omitted",
]  # fmt: skip

MAX_ITEMS_PER_REQUEST: Final = 10_000
"""Most items one batched request may name (appends, fetches, streams, ranges, stream ids).

Why: one header may be up to 16 MiB, enough to name about a million items, and a server does work
and keeps state per item; the bound caps what a single frame can make a server do or buffer. It is
far above real batches (an SDK batches tens to hundreds), and it is checked on decode, before any
item is built, and on encode, so a sender learns of it before the peer does.
"""


def check_items(n: int) -> None:
    """The bound on every vector of a request (checked on encode and on decode)."""
    if n > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(
            f"{n} items in one request; at most {MAX_ITEMS_PER_REQUEST} are accepted"
        )


class Header(Table):
    """A table that is a whole extended header."""

    __slots__ = ()


class Message(Header):
    """The header of one opcode's request or response."""

    __slots__ = ()
    OPCODE: ClassVar[Opcode]
    IS_RESPONSE: ClassVar[bool]


_M = TypeVar("_M", bound=Message)
MESSAGE_LIST: Final[list[type[Message]]] = []
"""Every message class, in registration (schema) order."""
REQUESTS: Final[dict[Opcode, type[Message]]] = {}
RESPONSES: Final[dict[Opcode, type[Message]]] = {}


def _register(opcode: Opcode, is_response: bool) -> Callable[[type[_M]], type[_M]]:
    registry = RESPONSES if is_response else REQUESTS

    def bind(cls: type[_M]) -> type[_M]:
        if opcode in registry:
            raise TypeError(f"two classes for {opcode!r}: {registry[opcode]} and {cls}")
        cls.OPCODE, cls.IS_RESPONSE = opcode, is_response
        registry[opcode] = cls
        MESSAGE_LIST.append(cls)
        return cls

    return bind


def request(opcode: Opcode) -> Callable[[type[_M]], type[_M]]:
    """Register the class as the request of ``opcode``."""
    return _register(opcode, False)


def response(opcode: Opcode) -> Callable[[type[_M]], type[_M]]:
    """Register the class as the response of ``opcode``."""
    return _register(opcode, True)


def status_omitted(s: Any) -> bool:
    """A status that is not written (OK: code 0, no message, no detail)."""
    return bool(s.code == 0 and s.message == "" and s.detail == b"")


# ------------------------------------------------------------------------ methods beyond fields


class StatusMethods:
    """A result: ``code`` is an :class:`~sbpstream.protocol.errors.ErrorCode` value (0 = OK)."""

    __slots__ = ()
    if TYPE_CHECKING:
        code: int
        message: str
        detail: bytes

        def __init__(self, code: int = 0, message: str = "", detail: bytes = b"") -> None: ...

    @property
    def ok(self) -> bool:
        return self.code == 0

    def error(self) -> SbpError:
        """The exception for this status (unknown codes give UnknownServerError)."""
        return error_for(self.code, self.message, self.detail)

    def raise_for_error(self) -> None:
        if self.code != 0:
            raise self.error()

    @classmethod
    def of(cls, exc: SbpError) -> Self:
        return cls(int(exc.code), exc.message, exc.detail)


class RangeMethods:
    """``[start_offset, end_offset)`` of a stream; ``end_offset = -1`` while writable."""

    __slots__ = ()
    if TYPE_CHECKING:
        end_offset: int

    @property
    def sealed(self) -> bool:
        return self.end_offset >= 0


class FetchItem(Protocol):
    """What :meth:`FetchResponseMethods.chunks` needs of an item (``FetchResult`` has it)."""

    @property
    def batch_length(self) -> int: ...


_Item = TypeVar("_Item", bound=FetchItem, covariant=True)


class HasFetchItems(Protocol[_Item]):
    @property
    def items(self) -> tuple[_Item, ...]: ...


_Got = TypeVar("_Got", bound=FetchItem)


class FetchResponseMethods:
    __slots__ = ()

    def chunks(
        self: HasFetchItems[_Got], payload: bytes | bytearray | memoryview
    ) -> Iterator[tuple[_Got, memoryview]]:
        """Each item with its slice of the frame's payload (the batches back to back, in item
        order, ``batch_length`` bytes each)."""
        mv = memoryview(payload)
        at = 0
        for item in self.items:
            yield item, mv[at : at + item.batch_length]
            at += item.batch_length
