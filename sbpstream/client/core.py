"""What the SDK's parts need of the client: :class:`ClientCore` (issue 32, no import circle).

:class:`~sbpstream.client.aclient.AsyncClient` implements it; the producer, the consumers, the
group member and the admin calls (:mod:`sbpstream.client.admin`) are typed against it, so they
import this module and never ``aclient`` (which imports them). ``tests/test_import_graph.py``
checks that no module of ``sbpstream.client`` imports another in a circle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar, overload

from sbpstream.client.routing import RangeRouter
from sbpstream.client.types import RetryPolicy, Stream
from sbpstream.protocol.messages import Message

M = TypeVar("M", bound=Message)


class StreamNames:
    """Stream name -> id, as the PM answered (names are immutable while the stream lives; a
    deleted stream's entries are dropped by this client's deletes)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def get(self, name: str) -> int | None:
        return self._ids.get(name)

    def put(self, name: str, stream_id: int) -> None:
        self._ids[name] = stream_id

    def forget(self, name: str) -> None:
        self._ids.pop(name, None)

    def forget_ids(self, stream_ids: Iterable[int]) -> None:
        """Drop every name of the given (deleted) streams."""
        gone = set(stream_ids)
        for name in [n for n, sid in self._ids.items() if sid in gone]:
            del self._ids[name]


class ClientCore(Protocol):
    """The client as its producers, consumers, group members and admin calls see it."""

    @property
    def routing(self) -> RangeRouter:
        """The range cache and data-node requests."""

    @property
    def request_timeout_ms(self) -> int:
        """One attempt's bound, sent as the requests' timeout_ms."""

    @property
    def retry(self) -> RetryPolicy:
        """The retry deadline of RETRIABLE errors."""

    @property
    def client_id(self) -> str:
        """The id this client sends in HEARTBEAT (data nodes apply quotas per id)."""

    @property
    def stream_names(self) -> StreamNames:
        """The client's name -> id cache."""

    @overload
    async def pm_request(self, request: Message) -> Message: ...

    @overload
    async def pm_request(self, request: Message, response_cls: type[M]) -> M: ...

    async def pm_request(self, request: Message,
                         response_cls: type[Message] | None = None) -> Message:
        """The PM leader's answer to ``request`` (redirects and retries included)."""

    async def resolve_stream(self, stream: int | str, *, refresh: bool = False) -> int:
        """The id of a stream given by id or name."""

    async def resolve_streams(self, streams: Sequence[int | str]) -> list[int]:
        """The ids of streams given by id or name, in order."""

    async def describe_streams(self, stream_ids: Sequence[int | str]) -> list[Stream]:
        """The PM's description of each stream."""

    async def describe_stream(self, stream_id: int | str) -> Stream:
        """The PM's description of one stream."""

    async def start_offset(self, stream_id: int | str) -> int:
        """The stream's first readable offset."""

    async def end_offset(self, stream_id: int | str) -> int:
        """The offset after the stream's last committed record."""
