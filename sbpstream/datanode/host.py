"""What replication and re-replication need of the data node they run in.

:class:`~sbpstream.datanode.context.NodeContext` owns the replicators and the re-replicator and
satisfies :class:`ReplicaHost`; they are typed against this protocol instead of importing the
context, so the context imports them and not the other way round (no import circle).
"""

from __future__ import annotations

from typing import Protocol

from sbpstream.datanode.pmclient import PmClient
from sbpstream.datanode.ranges import RangeTable
from sbpstream.net.client import ConnectionPool
from sbpstream.protocol.messages import Range, ReplicaNode
from sbpstream.store import Store


class ReplicaHost(Protocol):
    pool: ConnectionPool
    pm: PmClient
    table: RangeTable
    node_id: int
    closing: bool

    @property
    def store(self) -> Store: ...

    def is_me(self, replicas: tuple[ReplicaNode, ...]) -> bool: ...

    def adopt_range(self, r: Range) -> Range: ...

    def set_committed(self, stream_id: int, range_index: int, offset: int) -> None: ...

    def delete_stream(self, stream_id: int) -> None: ...
