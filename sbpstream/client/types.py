"""Public value types of the SDK: what its methods take and return. No I/O.

The stream and range descriptions are the protocol's own frozen dataclasses
(:class:`~sbpstream.protocol.messages.Stream`, :class:`~sbpstream.protocol.messages.Range`),
re-exported here so SDK users need not import the protocol package.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

from sbpstream.net.retry import RetryPolicy
from sbpstream.protocol.messages import (
    ProducerState,
    QuotaCountersResponse,
    Range,
    ReplicaNode,
    Stream,
)
from sbpstream.quota.model import QuotaKind, QuotaSpec
from sbpstream.records import CODEC_LZ4, CODEC_NONE, CODEC_ZSTD, Columns, Record

__all__ = [
    "DEFAULT_PM",
    "DEFAULT_RETENTION_MS",
    "PM_ENV",
    "ColumnBatch",
    "Compression",
    "ConsumedRecord",
    "DrainStatus",
    "GroupInfo",
    "GroupMemberInfo",
    "GroupStreamInfo",
    "Headers",
    "ProducerState",
    "QuotaCountersResponse",
    "QuotaKind",
    "QuotaSpec",
    "Range",
    "RebalanceEvent",
    "Record",
    "ReplicaNode",
    "RetryPolicy",
    "StartPosition",
    "Stream",
    "codec_of",
    "pm_addresses",
]

PM_ENV: Final = "SBPSTREAM_PM"
DEFAULT_PM: Final = "127.0.0.1:12378"
DEFAULT_RETENTION_MS: Final = 7 * 24 * 3600 * 1000  # one week

Headers = Sequence[tuple[str, bytes]]
Compression = Literal["none", "zstd", "lz4"]
StartPosition = Literal["earliest", "latest"] | int

_CODECS: Final = {"none": CODEC_NONE, "zstd": CODEC_ZSTD, "lz4": CODEC_LZ4}


def codec_of(compression: str | None) -> int:
    """The batch codec number of a compression name (``None`` or ``"none"``: no compression)."""
    try:
        return _CODECS[(compression or "none").lower()]
    except KeyError:
        raise ValueError(
            f"unknown compression {compression!r}: expected one of {', '.join(_CODECS)}"
        ) from None


def pm_addresses(pm: str | Sequence[str] | None) -> list[str]:
    """Normalise PM addresses: ``"h:p,h:p"``, a list, or None (``$SBPSTREAM_PM`` or the default)."""
    if pm is None:
        pm = os.environ.get(PM_ENV) or DEFAULT_PM
    parts = pm.split(",") if isinstance(pm, str) else [p for a in pm for p in a.split(",")]
    out = [p.strip() for p in parts if p.strip()]
    if not out:
        raise ValueError("no placement manager address given")
    from sbpstream.net.client import parse_address  # ValueError with a clear message

    for a in out:
        parse_address(a)
    return out


class ConsumedRecord(NamedTuple):
    """One record read back from a stream."""

    stream_id: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class ColumnBatch:
    """Records of one stream as columns (the bulk path, e.g. Spark).

    ``columns`` hold offsets ``[start_offset, next_offset)`` (fewer when the range is empty);
    ``high_watermark`` is the stream's readable end as the data node last reported it.
    """

    stream_id: int
    start_offset: int
    next_offset: int
    high_watermark: int
    columns: Columns

    def __len__(self) -> int:
        return len(self.columns)


# ------------------------------------------------------------------- consumer groups (issue 21)


@dataclass(frozen=True, slots=True)
class RebalanceEvent:
    """A group consumer's assignment changed: ``assigned`` streams are now read by it;
    ``revoked`` ones were committed and handed over; ``lost`` ones moved before it could commit
    them (it missed its session timeout): records past their last commit are read again
    elsewhere."""

    kind: Literal["assigned", "revoked", "lost"]
    stream_ids: tuple[int, ...]
    generation: int


@dataclass(frozen=True, slots=True)
class GroupMemberInfo:
    member_id: str
    client_id: str
    host: str
    stream_ids: tuple[int, ...]
    """The streams the member subscribed."""
    assigned: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GroupStreamInfo:
    """One stream of a group: its committed offset (-1: none), end offset, lag, reader."""

    stream_id: int
    committed: int
    end_offset: int
    lag: int
    """``end_offset - committed``; with nothing committed, the records from the stream's start."""
    member_id: str
    """The member it is assigned to ("" when none)."""


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group: str
    state: str
    """"stable", "rebalancing" or "empty"."""
    generation: int
    members: tuple[GroupMemberInfo, ...]
    streams: tuple[GroupStreamInfo, ...]


@dataclass(frozen=True, slots=True)
class DrainStatus:
    """A data node as a drain sees it (``client.admin.drain_status``; docs/operations.md,
    "Draining a data node")."""

    node_id: int
    address: str
    draining: bool
    live: bool
    ranges_left: int
    """Ranges whose replica set still lists the node."""
    writable_left: int
    """Of those, the writable ones (sealed and reopened elsewhere first)."""

    @property
    def complete(self) -> bool:
        """Draining and no range lists the node: it can be stopped and removed."""
        return self.draining and self.ranges_left == 0
