"""What every family of the PM's behaviour shares: the service's state, the calls to data nodes
(:class:`DataNodeApi`, with the back-off of unreachable ones), waiting for placement after a
start, per-stream locks and the batch checks. The families build on :class:`ServiceBase`:
streams (:mod:`.service_streams`), ranges and seals (:mod:`.service_ranges`), nodes and clients
(:mod:`.service`, whose :class:`~sbpstream.pm.service.PmService` joins them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from sbpstream.pm.config import DEFAULT_HEARTBEAT_INTERVAL_MS
from sbpstream.pm.deadlines import call_timeout
from sbpstream.pm.metadata import (
    MetadataStore,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    StreamMeta,
)
from sbpstream.pm.placement import NodeRegistry, NodeState, Placer
from sbpstream.protocol.errors import (
    ClientTimeoutError,
    ConnectionClosedError,
    DataNodeNotFoundError,
    InvalidStreamConfigError,
    LimitExceededError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.messages import MAX_ITEMS_PER_REQUEST

log = logging.getLogger("sbpstream.pm")

T = TypeVar("T")

MAX_REPLICA_NUMS: Final = 7
"""Highest replica_nums a stream may ask for. Every acknowledged write waits for all replicas
(design.md section 5), so each copy adds a network round and a disk write to every append; past 7
copies nothing a stream store needs gets safer while appends get slower."""

SYNC_RANGES_CHUNK: Final = 1000
"""Ranges per SYNC_RANGES request to one data node, bounding the request frame."""

UNREACHABLE_BACKOFF_S: Final = 10.0
"""After a call to a data node fails to connect or times out, calls to it are skipped this long
(or until it heartbeats again): renewing thousands of ranges of a blackholed node must not pay a
connect timeout per range."""

PLACEMENT_WARMUP_S: Final = 3.0
"""A PM that just started or was just elected leader has heard no heartbeat yet, so every node
looks dead to placement. For this long (capped at node_timeout) a placement that finds too few
live nodes waits for the registered nodes' heartbeats instead of answering
NOT_ENOUGH_DATA_NODES at once; it ends early once every node with an address was heard. Data
nodes heartbeat every second by default: three intervals cover a slow first one."""

WARMUP_POLL_S: Final = 0.05
"""How often a placement waiting out the warm-up looks at the registry again."""



@dataclass(frozen=True, slots=True)
class DnSealReply:
    """A data node's answer to SEAL_RANGES: its end (local end for -1, the sealed end otherwise)
    and the highest sequence per idempotent producer below it."""

    end_offset: int
    producers: tuple[ProducerStateMeta, ...] = ()


class DataNodeApi(Protocol):
    """The PM's calls to one data node. Failures raise (SbpError, OSError, TimeoutError)."""

    async def sync_ranges(self, node: NodeState, ranges: Sequence[RangeMeta]) -> None: ...

    async def seal_range(self, node: NodeState, rng: RangeMeta, end_offset: int) -> DnSealReply: ...

    async def describe_range(self, node: NodeState, stream_id: int, range_index: int) -> int:
        """The node's next offset of that range."""

    async def trim_streams(self, node: NodeState, items: Sequence[tuple[int, int]]) -> None: ...

    async def delete_streams(self, node: NodeState, stream_ids: Sequence[int]) -> None: ...


class KeyedLocks:
    """One asyncio.Lock per stream id, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, keys: Iterable[int]) -> AsyncIterator[None]:
        ordered = sorted(set(keys))  # one global order: no deadlock between batches
        for k in ordered:
            lock, users = self._locks.get(k, (asyncio.Lock(), 0))
            self._locks[k] = (lock, users + 1)
        acquired: list[int] = []
        try:
            for k in ordered:
                await self._locks[k][0].acquire()
                acquired.append(k)
            yield
        finally:
            for k in acquired:
                self._locks[k][0].release()
            for k in ordered:
                lock, users = self._locks[k]
                if users <= 1:
                    del self._locks[k]
                else:
                    self._locks[k] = (lock, users - 1)


def check_batch(n: int) -> None:
    if n > MAX_ITEMS_PER_REQUEST:
        raise LimitExceededError(
            f"{n} items in one request; at most {MAX_ITEMS_PER_REQUEST} (MAX_ITEMS_PER_REQUEST)"
        )


def validate_stream_config(replica_nums: int, retention_period_ms: int) -> None:
    if replica_nums < 1:
        raise InvalidStreamConfigError(f"replica_nums must be >= 1, got {replica_nums}")
    if replica_nums > MAX_REPLICA_NUMS:
        raise InvalidStreamConfigError(
            f"replica_nums {replica_nums}: at most {MAX_REPLICA_NUMS} replicas are supported"
        )
    if retention_period_ms < 0:
        raise InvalidStreamConfigError(
            f"retention_period_ms must be >= 0, got {retention_period_ms}"
        )


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """An SDK client the PM heard a HEARTBEAT from."""

    client_id: str
    peer: str
    last_seen: float
    """Monotonic seconds."""


class ServiceBase:
    def __init__(
        self,
        meta: MetadataStore,
        dn: DataNodeApi,
        node_timeout_ms: int,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
    ) -> None:
        self.meta = meta
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.leading: Callable[[], bool] = lambda: True
        """False while this PM follows another (etcd): it hears no heartbeats then."""
        self.dn = dn
        self.clock = clock
        self.wall_ms = wall_ms
        self.node_timeout_ms = node_timeout_ms
        self.registry = NodeRegistry(node_timeout_ms, clock())
        self.draining: set[int] = set()
        """Nodes being drained (durable in the metadata; pm/drain.py): placement skips them."""
        self.placer = Placer(self.registry, suspect=self._suspect, draining=self.draining)
        self._locks = KeyedLocks()
        self._renewed_dead: set[int] = set()
        self._renew_retry_at: dict[int, float] = {}
        self._unreachable_until: dict[int, float] = {}
        self._sweep_lock = asyncio.Lock()
        self._alloc_lock = asyncio.Lock()
        self._clients: OrderedDict[str, ClientInfo] = OrderedDict()
        self.placement_warmup_s = PLACEMENT_WARMUP_S

    def _known_node(self, node_id: int) -> NodeState:
        st = self.registry.get(node_id)
        if st is None:
            raise DataNodeNotFoundError(
                f"data node {node_id} is unknown to this PM; allocate an id with ALLOCATE_ID"
            )
        return st

    @staticmethod
    def _live_or_error(stream_id: int, s: StreamMeta | None) -> StreamMeta | SbpError:
        if s is None:
            return StreamNotFoundError(f"stream {stream_id} does not exist")
        if s.deleted:
            return StreamDeletedError(f"stream {stream_id} was deleted")
        return s

    # ------------------------------------------------------------------ placement
    async def _place(self, count: int) -> tuple[ReplicaMeta, ...]:
        await self._warm_up(count)
        return self.placer.place(count, self.clock())

    async def _warm_up(self, count: int) -> None:
        """Just started or elected: wait (at most PLACEMENT_WARMUP_S) until ``count`` nodes are
        live or every node with an address was heard, so placement does not answer
        NOT_ENOUGH_DATA_NODES only because heartbeats have not arrived yet."""
        window = min(self.placement_warmup_s, self.registry.node_timeout_s)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + window
        while self.clock() - self.registry.started_at < window and loop.time() < give_up:
            now = self.clock()
            if len(self.placer.loads(now)) >= count:
                return
            if all(st.last_seen is not None for st in self.registry.all() if st.advertise_addr):
                return
            await asyncio.sleep(WARMUP_POLL_S)

    # ------------------------------------------------------------------ calls to data nodes
    def _may_call(self, st: NodeState) -> bool:
        """Has an address, and no recent connect failure or timeout (see UNREACHABLE_BACKOFF_S).
        Heartbeat silence alone does not stop calls: a silent node may still answer a seal."""
        if not st.advertise_addr:
            return False
        until = self._unreachable_until.get(st.node_id)
        return until is None or self.clock() >= until

    def _suspect(self, node_id: int) -> bool:
        """A node whose last call failed to connect or timed out gets no new ranges for
        UNREACHABLE_BACKOFF_S, even before its heartbeats are overdue."""
        return self._unreachable_until.get(node_id, 0.0) > self.clock()

    def _call_failed(self, st: NodeState, e: BaseException) -> None:
        if isinstance(e, OSError | TimeoutError | ConnectionClosedError | ClientTimeoutError):
            self._unreachable_until[st.node_id] = self.clock() + UNREACHABLE_BACKOFF_S

    async def _sync_ranges(self, ranges: Sequence[RangeMeta]) -> None:
        by_node: dict[int, list[RangeMeta]] = {}
        for r in ranges:
            for nid in r.node_ids:
                by_node.setdefault(nid, []).append(r)
        await self._each_node(by_node, self.dn.sync_ranges, "sync_ranges",
                              chunk=SYNC_RANGES_CHUNK)

    async def _each_node(
        self,
        work: dict[int, list[T]],
        fn: Callable[[NodeState, Sequence[T]], Awaitable[None]],
        what: str,
        chunk: int = MAX_ITEMS_PER_REQUEST,
    ) -> None:
        """Send each node its items, concurrently; a node that cannot be told is logged (it
        learns the state from LIST_RANGES when it restarts or meets an unknown range)."""

        async def one(nid: int, items: list[T]) -> None:
            st = self.registry.get(nid)
            if st is None or not self._may_call(st):
                log.warning("event=%s_skipped node_id=%d reason=unreachable items=%d",
                            what, nid, len(items))
                return
            for i in range(0, len(items), chunk):
                part = items[i : i + chunk]
                try:
                    await asyncio.wait_for(fn(st, part), call_timeout())
                except (SbpError, OSError, TimeoutError) as e:
                    self._call_failed(st, e)
                    log.warning("event=%s_failed node_id=%d advertise_addr=%s items=%d "
                                "error=%r", what, nid, st.advertise_addr, len(part), str(e))
                    return

        await asyncio.gather(*(one(n, items) for n, items in sorted(work.items())))
