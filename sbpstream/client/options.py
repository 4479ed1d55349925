"""The options of producers and consumers, each default stated once.

:meth:`AsyncClient.producer` and :meth:`AsyncClient.consumer` (and the sync twins) take these
fields as keyword arguments and build the dataclass; an options object may be passed instead
(``options=``), with keyword arguments overriding its fields. Each field's documentation is the
string after it; docs/client.md's option tables are rendered from them (:func:`options_table`,
checked by tests/test_client_options.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from sbpstream.client.types import Compression, RebalanceEvent, StartPosition
from sbpstream.protocol.errors import InvalidRequestError

__all__ = [
    "DEFAULT_IN_FLIGHT_PER_STREAM",
    "DEFAULT_WINDOW_BYTES",
    "MAX_IN_FLIGHT_PER_STREAM",
    "ConsumerOptions",
    "ProducerOptions",
    "options_table",
]

Opts = TypeVar("Opts", "ProducerOptions", "ConsumerOptions")

MAX_IN_FLIGHT_PER_STREAM: Final = 5
"""Batches of one stream in flight at once at most: a data node remembers a producer's last 5
batches per range (Kafka's window), so a resend of any of up to 5 unacknowledged batches is
recognised as a duplicate: never more in flight."""

DEFAULT_IN_FLIGHT_PER_STREAM: Final = 4
"""Batches of one stream in flight at once by default: the group-commit fsync of one overlaps
the transfer and write of the next (with 1, a stream's rate is one batch per round trip)."""

DEFAULT_WINDOW_BYTES: Final = 8 * 1024 * 1024
"""A subscription's window: payload the node may send before the consumer acks. Also bounds
what one feed leaves in the consumer's buffer (acks follow the application taking records)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerOptions:
    """How an :class:`~sbpstream.client.producer.AsyncProducer` batches and sends."""

    linger_ms: float = 5.0
    """How long a batch waits for more records before it is sent."""
    batch_max_bytes: int = 512 * 1024
    """A batch is sent when it reaches this size."""
    buffer_max_bytes: int = 64 * 1024 * 1024
    """``send`` awaits while this much is unacknowledged (at least one batch)."""
    compression: Compression | None = None
    """``"zstd"``, ``"lz4"``, or None / ``"none"``."""
    producer_id: int | None = None
    """Idempotence id (random 63 bits when None); reuse it with a higher epoch to fence an
    older instance."""
    producer_epoch: int = 0
    """With ``producer_id``: appends of an older epoch are refused PRODUCER_FENCED."""
    max_in_flight_per_node: int = 16
    """APPEND requests in flight per data node."""
    primary_retry_ms: int = 15_000
    """How long to retry an unreachable primary of a single-replica range before asking the PM
    to seal it (no replica could report the range's end meanwhile)."""
    max_in_flight_per_stream: int = DEFAULT_IN_FLIGHT_PER_STREAM
    """Batches of one stream sent before the first is acknowledged (1..5; more overlap the data
    node's fsync with the next transfer)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_in_flight_per_stream <= MAX_IN_FLIGHT_PER_STREAM:
            raise InvalidRequestError(
                f"max_in_flight_per_stream must be in [1, {MAX_IN_FLIGHT_PER_STREAM}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConsumerOptions:
    """What and how an :class:`~sbpstream.client.consumer.AsyncConsumer` reads."""

    start: StartPosition = "earliest"
    """``"earliest"``, ``"latest"`` or an offset, for every stream (a group member starts a
    stream there only when the group has no committed offset for it)."""
    end: int | None = None
    """One stream only: stop before this offset (else wait for new records forever)."""
    max_wait_ms: int = 500
    """How long one fetch round waits for records."""
    batch_max_bytes: int = 1024 * 1024
    """Bytes asked for per stream per fetch."""
    auto_reset: str | None = None
    """``"earliest"``: a position whose records were trimmed jumps to the stream's start
    (else OffsetTrimmedError)."""
    subscribe: bool = True
    """The data nodes push records (a subscription); False: long polls."""
    window_bytes: int = DEFAULT_WINDOW_BYTES
    """A subscription's unacknowledged payload per data node."""
    group: str | None = None
    """Read as a member of this consumer group (``streams`` may then hold names and one
    pattern)."""
    auto_commit: bool = True
    """Group: commit the offsets of the records handed out, periodically and at close (at
    least once)."""
    auto_commit_interval_ms: int = 5_000
    """Group: how often auto-commit commits."""
    session_timeout_ms: int = 10_000
    """Group: a member silent this long is dropped and its streams reassigned."""
    heartbeat_interval_ms: int = 1_000
    """Group: how often the member heartbeats."""
    on_rebalance: Callable[[RebalanceEvent], None] | None = None
    """Group: called on the event loop with each :class:`RebalanceEvent`."""


def build(cls: type[Opts], options: Opts | None, overrides: Mapping[str, Any]) -> Opts:
    """``options`` (default: ``cls()``) with ``overrides``; an unknown name is one
    InvalidRequestError line naming the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise InvalidRequestError(
            f"unknown {cls.__name__} field(s) {', '.join(unknown)}: valid are "
            f"{', '.join(sorted(names))}")
    if options is None:
        return cls(**overrides)
    return dataclasses.replace(options, **overrides) if overrides else options


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: the string literal after it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for st, nxt in itertools.pairwise(body):
        if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            out[st.target.id] = " ".join(str(nxt.value.value).split())
    return out


def options_table(cls: type[ProducerOptions] | type[ConsumerOptions]) -> str:
    """A markdown table of the fields: name, default, meaning (docs/client.md holds it)."""
    docs = field_docs(cls)
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        meaning = re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", docs[f.name]).replace("``", "`")
        rows.append(f"| `{f.name}` | `{f.default!r}` | {meaning} |")
    return "\n".join(rows)
