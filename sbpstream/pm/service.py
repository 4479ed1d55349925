"""What the Placement Manager does, independent of the wire.

:class:`PmService` holds the PM's behaviour (registration, liveness, stream and range operations,
seal-and-new, trim/delete forwarding). It speaks to the metadata store through
:class:`~sbpstream.pm.metadata.MetadataStore` and to data nodes through :class:`DataNodeApi`, so
it is tested without sockets; :mod:`sbpstream.pm.server` adapts it to SBP frames.

Every batched operation returns one outcome per item, in order: a result or an
:class:`~sbpstream.protocol.errors.SbpError`. One bad item never fails the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from sbpstream.pm.config import DEFAULT_HEARTBEAT_INTERVAL_MS
from sbpstream.pm.liveness import NodeLiveness, registry_liveness, stored_liveness
from sbpstream.pm.metadata import (
    CreatedStream,
    DeleteOutcome,
    MetadataStore,
    NewStream,
    NodeMetrics,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    SealOutcome,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.placement import NodeRegistry, NodeState, Placer
from sbpstream.protocol.errors import (
    ClientTimeoutError,
    ConnectionClosedError,
    DataNodeNotFoundError,
    InvalidRequestError,
    InvalidStreamConfigError,
    LimitExceededError,
    MetadataError,
    NotEnoughDataNodesError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
    ReplicaUnavailableError,
    RequestTimeoutError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.messages import MAX_ITEMS_PER_REQUEST
from sbpstream.protocol.names import name_problem, validate_name_prefix, validate_stream_name

log = logging.getLogger("sbpstream.pm")

T = TypeVar("T")

RETENTION_UNCHANGED: Final = -1
"""UPDATE_STREAMS' retention_period_ms meaning "keep the current retention" (0 means keep
records forever, and a negative retention is otherwise invalid)."""

MAX_REPLICA_NUMS: Final = 7
"""Highest replica_nums a stream may ask for. Every acknowledged write waits for all replicas
(design.md section 5), so each copy adds a network round and a disk write to every append; past 7
copies nothing a stream store needs gets safer while appends get slower."""


DESCRIBE_STREAMS_PAGE_MAX: Final = 1000
"""Default and largest page of DESCRIBE_STREAMS without ids (about 40 KiB of response)."""

LIST_RANGES_FRAME_MAX: Final = 5000
"""Ranges per LIST_RANGES response frame (~150 bytes each: under 1 MiB a frame), so listing every
range of a big data node streams in bounded frames instead of one oversize frame."""

SYNC_RANGES_CHUNK: Final = 1000
"""Ranges per SYNC_RANGES request to one data node, bounding the request frame."""

DN_CALL_TIMEOUT_S: Final = 2.0
"""A PM -> data node call (SYNC/SEAL/TRIM/DELETE/DESCRIBE) gives up after this. Short, because a
writer's SEAL_RANGES waits on it, and a node that slow is treated as unreachable."""

UNREACHABLE_BACKOFF_S: Final = 10.0
RENEW_RETRY_S: Final = UNREACHABLE_BACKOFF_S
"""A dead node whose writable ranges could not all be sealed (no replica answered) is tried
again after this long, not at every sweep: listing and retrying a node's ranges costs the PM work
in proportion to how many it holds (a node may hold a million)."""
"""After a call to a data node fails to connect or times out, calls to it are skipped this long
(or until it heartbeats again): renewing thousands of ranges of a blackholed node must not pay a
connect timeout per range."""

SWEEP_CONCURRENCY: Final = 32
"""Ranges of dead nodes renewed at once: bounds the burst of data node calls and transactions."""

PLACEMENT_WARMUP_S: Final = 3.0
"""A PM that just started or was just elected leader has heard no heartbeat yet, so every node
looks dead to placement. For this long (capped at node_timeout) a placement that finds too few
live nodes waits for the registered nodes' heartbeats instead of answering
NOT_ENOUGH_DATA_NODES at once; it ends early once every node with an address was heard. Data
nodes heartbeat every second by default: three intervals cover a slow first one."""

WARMUP_POLL_S: Final = 0.05
"""How often a placement waiting out the warm-up looks at the registry again."""

CLIENTS_MAX: Final = 10_000
"""Live SDK clients remembered (by client_id, least recently seen dropped first): the table is
for introspection, and a flood of client ids must not grow the PM without bound."""

CLIENT_TIMEOUT_FACTOR: Final = 3
"""A client is live while its last HEARTBEAT is at most node_timeout * this old (SDK clients
heartbeat less often than data nodes: see client.HEARTBEAT_INTERVAL_S)."""

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "pm_request_deadline", default=None)


@contextlib.contextmanager
def request_deadline(timeout_ms: int) -> Iterator[None]:
    """Within this block, calls to data nodes end by the request's deadline (``timeout_ms`` from
    now; <= 0 sets none). Tasks started inside inherit it (contextvars)."""
    token = _deadline.set(time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None)
    try:
        yield
    finally:
        _deadline.reset(token)


@contextlib.asynccontextmanager
async def within(timeout_ms: int, what: str) -> AsyncIterator[None]:
    """Honour a request's ``timeout_ms`` (<= 0: none): the work inside is cancelled at the
    deadline and the request is answered TIMEOUT (retriable); calls to data nodes made inside
    take their bound from the same deadline (service.call_timeout)."""
    if timeout_ms <= 0:
        yield
        return
    with request_deadline(timeout_ms):
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                yield
        except TimeoutError:
            raise RequestTimeoutError(
                f"{what} did not finish within its timeout_ms {timeout_ms}") from None


DEADLINE_GRACE_S: Final = 0.05
"""A call bounded by its request's deadline ends this much after it, so that the request's own
deadline (``within``) fires first and the request is answered TIMEOUT, rather than the call
running out a moment earlier and the request answering a per-item error of that call."""


def call_timeout(default_s: float = 0.0) -> float:
    """The bound of one internal call: ``default_s`` (DN_CALL_TIMEOUT_S if 0), or less when the
    request that caused it has less time left (then just past its deadline: DEADLINE_GRACE_S;
    never below 1 ms)."""
    bound = default_s or DN_CALL_TIMEOUT_S
    deadline = _deadline.get()
    if deadline is None:
        return bound
    return max(0.001, min(bound, deadline - time.monotonic() + DEADLINE_GRACE_S))


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """An SDK client the PM heard a HEARTBEAT from."""

    client_id: str
    peer: str
    last_seen: float
    """Monotonic seconds."""


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


class _KeyedLocks:
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


def _as_error(e: BaseException) -> SbpError:
    return e if isinstance(e, SbpError) else MetadataError(str(e))


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


class PmService:
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
        self.placer = Placer(self.registry, suspect=self._suspect)
        self._locks = _KeyedLocks()
        self._renewed_dead: set[int] = set()
        self._renew_retry_at: dict[int, float] = {}
        self._unreachable_until: dict[int, float] = {}
        self._sweep_lock = asyncio.Lock()
        self._alloc_lock = asyncio.Lock()
        self._clients: OrderedDict[str, ClientInfo] = OrderedDict()
        self.placement_warmup_s = PLACEMENT_WARMUP_S

    async def start(self) -> None:
        """Load nodes and placement counts from metadata (the store must be open). Liveness
        starts afresh: placement waits out PLACEMENT_WARMUP_S for the nodes' heartbeats."""
        self.registry = NodeRegistry(self.node_timeout_ms, self.clock())
        self.registry.load(await self.meta.list_nodes())
        self.placer = Placer(self.registry, suspect=self._suspect)
        self.placer.reset_counts(await self.meta.writable_range_counts())
        log.info("event=pm_state_loaded nodes=%d", len(self.registry.all()))

    # ------------------------------------------------------------------ nodes
    async def allocate_node_id(self, host: str) -> int:
        """Idempotent per host: a host (a data node's advertise address) that already has an
        id gets that id again, so a node that lost the answer (or its id file before its first
        heartbeat) does not register twice."""
        async with self._alloc_lock:
            for st in self.registry.all():
                if host and st.host == host:
                    log.info("event=node_id_reallocated node_id=%d host=%s", st.node_id, host)
                    return st.node_id
            node_id = await self.meta.allocate_node_id(host, self.wall_ms())
            self.registry.add(node_id, host)
        log.info("event=node_id_allocated node_id=%d host=%s", node_id, host)
        return node_id

    # ------------------------------------------------------------------ SDK clients
    def client_seen(self, client_id: str, peer: str) -> None:
        """An SDK client's HEARTBEAT: remember it (bounded, see CLIENTS_MAX)."""
        self._clients.pop(client_id, None)
        self._clients[client_id] = ClientInfo(client_id, peer, self.clock())
        while len(self._clients) > CLIENTS_MAX:
            self._clients.popitem(last=False)

    def live_clients(self) -> list[ClientInfo]:
        """SDK clients heard from within node_timeout * CLIENT_TIMEOUT_FACTOR, by client id."""
        limit = self.registry.node_timeout_s * CLIENT_TIMEOUT_FACTOR
        now = self.clock()
        for cid in [c for c, info in self._clients.items() if now - info.last_seen > limit]:
            del self._clients[cid]
        return sorted(self._clients.values(), key=lambda c: c.client_id)

    def _known_node(self, node_id: int) -> NodeState:
        st = self.registry.get(node_id)
        if st is None:
            raise DataNodeNotFoundError(
                f"data node {node_id} is unknown to this PM; allocate an id with ALLOCATE_ID"
            )
        return st

    async def node_seen(
        self, node_id: int, advertise_addr: str,
        committed: Sequence[tuple[int, int, int]] = (),
    ) -> NodeState:
        """A heartbeat (or metrics report) from a data node: it is alive at this address.
        ``committed``: (stream_id, range_index, committed next offset) of its writable ranges
        that moved; LIST_RANGES and DESCRIBE_RANGES answer with them (never lowered)."""
        st = self._known_node(node_id)
        if committed:
            await self.meta.record_next_offsets(committed)
        was_live = self.registry.is_live(node_id, self.clock())
        if self.registry.heartbeat(node_id, advertise_addr, self.clock()):
            await self.meta.update_node_address(node_id, advertise_addr)
            log.info("event=node_address node_id=%d advertise_addr=%s", node_id, advertise_addr)
        await self.meta.record_heartbeat(node_id, self.wall_ms())
        self._unreachable_until.pop(node_id, None)
        self._renew_retry_at.pop(node_id, None)
        if not was_live:
            self._renewed_dead.discard(node_id)
            log.info("event=node_live node_id=%d advertise_addr=%s", node_id, st.advertise_addr)
        return st

    async def report_metrics(self, node_id: int, advertise_addr: str, m: NodeMetrics) -> None:
        await self.node_seen(node_id, advertise_addr)
        self.registry.set_metrics(node_id, m)
        await self.meta.record_metrics(node_id, m, self.wall_ms())

    async def node_liveness(self) -> list[NodeLiveness]:
        """Every data node's liveness as this PM can tell (:mod:`sbpstream.pm.liveness`):
        first hand when it leads, else from the heartbeat times the leader persisted."""
        if self.leading():
            return registry_liveness(self.registry, self.clock())
        return stored_liveness(await self.meta.list_nodes(), self.wall_ms(),
                               self.node_timeout_ms, self.heartbeat_interval_ms)

    def node_address(self, node_id: int) -> str:
        st = self.registry.get(node_id)
        return st.advertise_addr if st is not None else ""

    # ------------------------------------------------------------------ streams
    async def create_streams(
        self, items: Sequence[tuple[int, int]], names: Sequence[str] = ()
    ) -> list[CreatedStream | SbpError]:
        """(replica_nums, retention_period_ms) items: validate, place, persist, tell the nodes.
        ``names``, when given, names each item ("" = unnamed; rules in protocol/names.py)."""
        check_batch(len(items))
        names = list(names) or [""] * len(items)
        out: list[CreatedStream | SbpError | None] = [None] * len(items)
        valid: list[int] = []
        for i, (replica_nums, retention_ms) in enumerate(items):
            try:
                validate_stream_config(replica_nums, retention_ms)
                if names[i]:
                    validate_stream_name(names[i])
            except SbpError as e:
                out[i] = e
                continue
            valid.append(i)
        if valid:
            await self._warm_up(max(items[i][0] for i in valid))
        placed = self.placer.place_many([items[i][0] for i in valid], self.clock())
        todo: list[tuple[int, NewStream]] = []
        for i, replicas in zip(valid, placed, strict=True):
            if isinstance(replicas, SbpError):
                out[i] = replicas
            else:
                todo.append((i, NewStream(items[i][0], items[i][1], replicas, names[i])))
        try:
            results = await self.meta.create_streams([ns for _, ns in todo], self.wall_ms())
        except SbpError as e:
            if e.redirect:
                raise  # not the leader (etcd backend): the whole request goes to the leader
            results = [e] * len(todo)
        fresh: list[RangeMeta] = []
        for (i, ns), res in zip(todo, results, strict=True):
            out[i] = res
            if isinstance(res, CreatedStream):
                fresh.append(res.first_range)
            else:
                self.placer.closed(r.node_id for r in ns.replicas)
        if fresh:
            log.info("event=streams_created count=%d first=%d last=%d", len(fresh),
                     fresh[0].stream_id, fresh[-1].stream_id)
            await self._sync_ranges(fresh)
        return [o for o in out if o is not None]

    async def describe_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | SbpError]:
        check_batch(len(stream_ids))
        found = await self.meta.get_streams(stream_ids)
        return [self._live_or_error(sid, s) for sid, s in zip(stream_ids, found, strict=True)]

    async def describe_stream_named(self, name: str) -> StreamMeta | SbpError:
        """The live stream holding ``name``, or StreamNotFoundError."""
        problem = name_problem(name)
        if problem is not None:
            return InvalidRequestError(problem)
        s = await self.meta.get_stream_by_name(name)
        return s if s is not None else StreamNotFoundError(f"no stream is named {name!r}")

    async def list_streams_by_prefix(
        self, prefix: str, continuation: int, limit: int
    ) -> tuple[list[StreamMeta], int]:
        """:meth:`list_streams` restricted to the streams named ``prefix...``."""
        validate_name_prefix(prefix)
        if limit <= 0 or limit > DESCRIBE_STREAMS_PAGE_MAX:
            limit = DESCRIBE_STREAMS_PAGE_MAX
        page = await self.meta.list_streams_by_prefix(prefix, max(continuation, 0), limit + 1)
        if len(page) > limit:
            page = page[:limit]
            return page, page[-1].stream_id
        return page, -1

    @staticmethod
    def _live_or_error(stream_id: int, s: StreamMeta | None) -> StreamMeta | SbpError:
        if s is None:
            return StreamNotFoundError(f"stream {stream_id} does not exist")
        if s.deleted:
            return StreamDeletedError(f"stream {stream_id} was deleted")
        return s

    async def list_streams(self, continuation: int, limit: int) -> tuple[list[StreamMeta], int]:
        """A page of live streams after ``continuation`` (-1 = from the start) and the next
        continuation (-1 = no more)."""
        if limit <= 0 or limit > DESCRIBE_STREAMS_PAGE_MAX:
            limit = DESCRIBE_STREAMS_PAGE_MAX
        page = await self.meta.list_streams(max(continuation, 0), limit + 1)
        if len(page) > limit:
            page = page[:limit]
            return page, page[-1].stream_id
        return page, -1

    async def update_streams(
        self, items: Sequence[tuple[int, int, int]]
    ) -> list[StreamMeta | SbpError]:
        """(stream_id, replica_nums, retention_period_ms). An absent field keeps its current
        value: replica_nums 0 (the wire default) and retention_period_ms -1
        (RETENTION_UNCHANGED). A new count applies from the stream's next range."""
        check_batch(len(items))
        current = await self.meta.get_streams([sid for sid, _, _ in items])
        out: list[StreamMeta | SbpError | None] = [None] * len(items)
        todo: list[tuple[int, StreamUpdate]] = []
        for i, ((sid, rn, ret), cur) in enumerate(zip(items, current, strict=True)):
            s = self._live_or_error(sid, cur)
            if isinstance(s, SbpError):
                out[i] = s
                continue
            replica_nums = rn if rn != 0 else s.replica_nums
            retention = s.retention_period_ms if ret == RETENTION_UNCHANGED else ret
            try:
                validate_stream_config(replica_nums, retention)
            except SbpError as e:
                out[i] = e
                continue
            todo.append((i, StreamUpdate(sid, replica_nums, retention)))
        results = await self._guarded(
            self.meta.update_streams([u for _, u in todo], self.wall_ms()), len(todo)
        )
        for (i, _), res in zip(todo, results, strict=True):
            out[i] = res
        return [o for o in out if o is not None]

    async def _guarded(self, call: Awaitable[list[T | SbpError]], n: int) -> list[T | SbpError]:
        """A whole-batch metadata failure becomes that failure in every item's slot."""
        try:
            return await call
        except SbpError as e:
            if e.redirect:
                raise  # not the leader (etcd backend): the whole request goes to the leader
            return [e] * n

    async def delete_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | SbpError]:
        check_batch(len(stream_ids))
        async with self._locks.hold(stream_ids):
            results = await self._guarded(
                self.meta.delete_streams(stream_ids, self.wall_ms()), len(stream_ids)
            )
        forward: dict[int, list[int]] = {}
        out: list[StreamMeta | SbpError] = []
        for res in results:
            if not isinstance(res, DeleteOutcome):
                out.append(res)
                continue
            out.append(res.stream)
            for r in res.removed:
                if r.writable:
                    self.placer.closed(r.node_ids)
                for nid in r.node_ids:
                    forward.setdefault(nid, []).append(res.stream.stream_id)
            log.info("event=stream_deleted stream_id=%d ranges=%d", res.stream.stream_id,
                     len(res.removed))
        await self._each_node(
            {n: sorted(set(ids)) for n, ids in forward.items()}, self.dn.delete_streams,
            "delete_streams",
        )
        return out

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], from_data_node: bool
    ) -> list[TrimOutcome | SbpError]:
        """(stream_id, trim_offset). From users: checked against the stream's end, then forwarded
        to every data node that held a range of the stream. From data nodes (retention): only
        the metadata moves."""
        check_batch(len(items))
        out: list[TrimOutcome | SbpError | None] = [None] * len(items)
        async with self._locks.hold(sid for sid, _ in items):
            todo: list[tuple[int, tuple[int, int]]] = []
            for i, (sid, off) in enumerate(items):
                try:
                    if off < 0:
                        raise InvalidRequestError(f"trim offset {off} is negative")
                    if not from_data_node:
                        await self._check_trim_offset(sid, off)
                except SbpError as e:
                    out[i] = e
                    continue
                todo.append((i, (sid, off)))
            results = await self._guarded(
                self.meta.trim_streams([it for _, it in todo], self.wall_ms()), len(todo)
            )
        trimmed: list[TrimOutcome] = []
        for (i, (sid, _)), res in zip(todo, results, strict=True):
            out[i] = res
            if isinstance(res, TrimOutcome):
                trimmed.append(res)
                log.info("event=stream_trimmed stream_id=%d start_offset=%d dropped=%d "
                         "source=%s", sid, res.stream.start_offset, len(res.dropped),
                         "data_node" if from_data_node else "client")
        if trimmed and not from_data_node:
            await self._forward_trims(trimmed)
        return [o for o in out if o is not None]

    async def _forward_trims(self, trimmed: Sequence[TrimOutcome]) -> None:
        """Every node that held a range of the stream (dropped or left) drops what is below."""
        left = await self.meta.list_ranges([t.stream.stream_id for t in trimmed])
        forward: dict[int, list[tuple[int, int]]] = {}
        for t, ranges in zip(trimmed, left, strict=True):
            nodes = {n for r in (*t.dropped, *ranges) for n in r.node_ids}
            for nid in nodes:
                forward.setdefault(nid, []).append((t.stream.stream_id, t.stream.start_offset))
        await self._each_node(forward, self.dn.trim_streams, "trim_streams")

    async def _check_trim_offset(self, stream_id: int, trim_offset: int) -> None:
        """A user may not trim past the stream's end. The PM's knowledge of the writable range's
        end may be stale, so past it, ask the primary once before refusing."""
        ranges = (await self.meta.list_ranges([stream_id]))[0]
        if not ranges:
            return  # unknown / deleted: the metadata trim reports it
        last = ranges[-1]
        known_end = last.end_offset if not last.writable else max(last.next_offset,
                                                                   last.start_offset)
        if trim_offset <= known_end:
            return
        if last.writable:
            known_end = max(known_end, await self._fresh_next_offset(last))
        if trim_offset > known_end:
            raise OffsetOutOfRangeError(
                f"trim offset {trim_offset} is past the end {known_end} of stream {stream_id}"
            )

    async def _fresh_next_offset(self, rng: RangeMeta) -> int:
        pid = rng.primary_node_id
        st = self.registry.get(pid) if pid is not None else None
        if st is None or not self.registry.is_live(st.node_id, self.clock()):
            return rng.next_offset
        try:
            nxt = await asyncio.wait_for(
                self.dn.describe_range(st, rng.stream_id, rng.range_index), call_timeout()
            )
        except (SbpError, OSError, TimeoutError) as e:
            log.warning("event=describe_range_failed node_id=%d stream_id=%d range_index=%d "
                        "error=%r", st.node_id, rng.stream_id, rng.range_index, str(e))
            return rng.next_offset
        await self.meta.record_next_offsets([(rng.stream_id, rng.range_index, nxt)])
        return nxt

    # ------------------------------------------------------------------ ranges
    async def list_stream_ranges(
        self, stream_ids: Sequence[int]
    ) -> list[list[RangeMeta] | SbpError]:
        check_batch(len(stream_ids))
        streams = await self.meta.get_streams(stream_ids)
        ranges = await self.meta.list_ranges(stream_ids)
        out: list[list[RangeMeta] | SbpError] = []
        for sid, s, rs in zip(stream_ids, streams, ranges, strict=True):
            checked = self._live_or_error(sid, s)
            out.append(checked if isinstance(checked, SbpError) else rs)
        return out

    async def list_node_ranges(self, node_id: int) -> list[RangeMeta]:
        self._known_node(node_id)
        return await self.meta.list_node_ranges(node_id)

    async def describe_ranges(
        self, items: Sequence[tuple[int, int]]
    ) -> list[RangeMeta | SbpError]:
        """From metadata and last reports (the primary data node answers authoritatively)."""
        check_batch(len(items))
        out: list[RangeMeta | SbpError] = []
        for sid, idx in items:
            rng = await self.meta.get_range(sid, idx)
            if rng is None:
                out.append(await self._missing_range_error(sid, idx))
            else:
                out.append(rng)
        return out

    async def _missing_range_error(self, stream_id: int, range_index: int) -> SbpError:
        (s,) = await self.meta.get_streams([stream_id])
        checked = self._live_or_error(stream_id, s)
        if isinstance(checked, SbpError):
            return checked
        return RangeNotFoundError(f"stream {stream_id} has no range {range_index}")

    async def seal_ranges(self, items: Sequence[tuple[int, int]]) -> list[SealOutcome | SbpError]:
        """SEAL_AND_NEW for (stream_id, range_index) items, concurrently per stream."""
        check_batch(len(items))
        sem = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def one(sid: int, idx: int) -> SealOutcome | SbpError:
            async with sem:
                try:
                    return await self.seal_and_new(sid, idx, reason="writer")
                except SbpError as e:
                    if e.redirect:
                        raise  # not the leader (etcd backend): redirect the whole request
                    return e

        return list(await asyncio.gather(*(one(s, i) for s, i in items)))

    async def seal_and_new(self, stream_id: int, range_index: int, reason: str) -> SealOutcome:
        """Seal a writable range at the end its reachable replicas can tell, and open the next
        range. The seal never waits for placement: with too few live nodes for the next range
        the range is sealed alone (``new`` is None; readers get its end at once) and a later
        call opens the successor once enough nodes are live (NotEnoughDataNodesError until then).
        """
        async with self._locks.hold((stream_id,)):
            cur = await self.meta.get_range(stream_id, range_index)
            if cur is None:
                raise await self._missing_range_error(stream_id, range_index)
            (found,) = await self.meta.get_streams([stream_id])
            stream = self._live_or_error(stream_id, found)
            if isinstance(stream, SbpError):
                raise stream
            if not cur.writable:
                if await self.meta.get_range(stream_id, range_index + 1) is not None:
                    # Idempotent: the pair already made, never a third range.
                    return await self.meta.seal_and_new(stream_id, range_index, cur.end_offset,
                                                        (), ())
                result = await self._open_successor(stream, cur)
            else:
                result = await self._seal_writable(stream, cur)
        if result.created:
            log.info("event=range_sealed stream_id=%d range_index=%d end_offset=%d "
                     "new_nodes=%s reason=%s", stream_id, range_index, result.sealed.end_offset,
                     "-" if result.new is None else ",".join(map(str, result.new.node_ids)),
                     reason)
        if result.created and result.new is not None:
            await self._sync_ranges([result.new])
        return result

    async def _seal_writable(self, stream: StreamMeta, cur: RangeMeta) -> SealOutcome:
        # Stop the replicas first (end -1): a replica that cannot be reached is then known as
        # unreachable and the next range is not placed on it. Then seal at what the stopped
        # replicas hold, whether or not the next range can be placed.
        first = await self._stop_replicas(cur)
        try:
            new_replicas: tuple[ReplicaMeta, ...] = self.placer.place(
                stream.replica_nums, self.clock())
        except NotEnoughDataNodesError as e:
            new_replicas = ()
            log.warning("event=seal_without_successor stream_id=%d range_index=%d error=%r",
                        cur.stream_id, cur.range_index, str(e))
        new_ids = [r.node_id for r in new_replicas]
        try:
            end, producers = await self._finish_seal(cur, first)
            result = await self.meta.seal_and_new(
                cur.stream_id, cur.range_index, end, new_replicas, producers
            )
        except BaseException:
            self.placer.closed(new_ids)
            raise
        if result.created:
            self.placer.closed(cur.node_ids)
        if not result.created or result.new is None or result.new.node_ids != tuple(
                sorted_replicas_ids(new_replicas)):
            self.placer.closed(new_ids)
        return result

    async def _open_successor(self, stream: StreamMeta, cur: RangeMeta) -> SealOutcome:
        """The successor of a range sealed while too few nodes were live for it."""
        new_replicas = await self._place(stream.replica_nums)
        new_ids = [r.node_id for r in new_replicas]
        try:
            result = await self.meta.seal_and_new(cur.stream_id, cur.range_index,
                                                  cur.end_offset, new_replicas, ())
        except BaseException:
            self.placer.closed(new_ids)
            raise
        if result.new is None or result.new.node_ids != tuple(sorted_replicas_ids(new_replicas)):
            self.placer.closed(new_ids)
        return result

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

    async def _stop_replicas(self, rng: RangeMeta) -> list[tuple[NodeState, DnSealReply]]:
        """Ask every replica that may be called to stop (-1); the ones that answered."""
        nodes = [
            st for st in (self.registry.get(n) for n in rng.node_ids)
            if st is not None and self._may_call(st)
        ]
        return await self._seal_calls(nodes, rng, -1)

    async def _finish_seal(
        self, rng: RangeMeta, first: list[tuple[NodeState, DnSealReply]]
    ) -> tuple[int, tuple[ProducerStateMeta, ...]]:
        """Seal at the minimum end the stopped replicas reported and tell them."""
        if not first:
            # No replica answered. Sealing at the last *reported* next offset could cut off
            # records that were acknowledged after that report (a single-replica range on a
            # crashed node): durability first, the range stays writable-but-stopped and the
            # seal is retried (by the writer, or by the next liveness sweep) once a replica is
            # back. design.md section 5: every acknowledged record survives a seal.
            raise ReplicaUnavailableError(
                f"no replica of range {rng.stream_id}/{rng.range_index} answered; it cannot be "
                "sealed without risking acknowledged records: retry once a replica is back")
        end = max(rng.start_offset, min(reply.end_offset for _, reply in first))
        second = await self._seal_calls([st for st, _ in first], rng, end)
        replies = [r for _, r in second] or [r for _, r in first if r.end_offset == end]
        return end, _merge_producers(replies)

    async def _seal_calls(
        self, nodes: Sequence[NodeState], rng: RangeMeta, end_offset: int
    ) -> list[tuple[NodeState, DnSealReply]]:
        async def call(st: NodeState) -> tuple[NodeState, DnSealReply] | None:
            try:
                reply = await asyncio.wait_for(
                    self.dn.seal_range(st, rng, end_offset), call_timeout()
                )
            except RangeNotFoundError:
                # The node never heard of the range, so it holds nothing of it.
                return st, DnSealReply(rng.start_offset)
            except (SbpError, OSError, TimeoutError) as e:
                self._call_failed(st, e)
                log.warning("event=dn_seal_failed node_id=%d stream_id=%d range_index=%d "
                            "end_offset=%d error=%r", st.node_id, rng.stream_id,
                            rng.range_index, end_offset, str(e))
                return None
            return st, reply

        got = await asyncio.gather(*(call(st) for st in nodes))
        return [g for g in got if g is not None]

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

    # ------------------------------------------------------------------ liveness
    async def sweep_dead_nodes(self) -> int:
        """Seal and renew, on live nodes, the writable ranges of nodes past the timeout.
        Returns how many ranges were renewed. Failed ones are retried at the next sweep."""
        if self._sweep_lock.locked():
            return 0
        async with self._sweep_lock:
            renewed = 0
            now = self.clock()
            for st in self.registry.all():
                nid = st.node_id
                if nid in self._renewed_dead or not self.registry.is_dead(nid, now):
                    continue
                if self._renew_retry_at.get(nid, 0.0) > now:
                    continue
                renewed += await self._renew_node(nid)
            return renewed

    async def _renew_node(self, node_id: int) -> int:
        ranges = await self.meta.list_node_ranges(node_id, writable_only=True)
        if not ranges:
            self._renewed_dead.add(node_id)
            return 0
        log.warning("event=node_dead node_id=%d writable_ranges=%d", node_id, len(ranges))
        sem = asyncio.Semaphore(SWEEP_CONCURRENCY)

        async def one(r: RangeMeta) -> SbpError | None:
            async with sem:
                if r.node_ids and all(self._suspect(n) for n in r.node_ids):
                    # every replica just failed a call: a seal could not learn the end (and
                    # would be refused); skip the round trips, retry after RENEW_RETRY_S
                    return ReplicaUnavailableError(
                        f"no replica of range {r.stream_id}/{r.range_index} is reachable")
                try:
                    await self.seal_and_new(r.stream_id, r.range_index, reason="node_dead")
                except (StreamDeletedError, StreamNotFoundError):
                    return None  # deleted meanwhile: nothing to renew
                except SbpError as e:
                    return e
            return None

        errors = [e for e in await asyncio.gather(*(one(r) for r in ranges)) if e is not None]
        if errors:
            self._renew_retry_at[node_id] = self.clock() + RENEW_RETRY_S
            log.warning("event=node_renew_incomplete node_id=%d failed=%d first_error=%r "
                        "retry_in_s=%.0f", node_id, len(errors), str(errors[0]), RENEW_RETRY_S)
        else:
            self._renewed_dead.add(node_id)
        return len(ranges) - len(errors)


def sorted_replicas_ids(replicas: Iterable[ReplicaMeta]) -> list[int]:
    """Node ids in the order metadata keeps replicas: primary first, then by node id."""
    return [r.node_id for r in sorted(replicas, key=lambda r: (not r.is_primary, r.node_id))]


def _merge_producers(replies: Sequence[DnSealReply]) -> tuple[ProducerStateMeta, ...]:
    """Highest sequence per producer across the replicas' answers (they agree below the end)."""
    best: dict[int, ProducerStateMeta] = {}
    for reply in replies:
        for p in reply.producers:
            cur = best.get(p.producer_id)
            if cur is None or (p.producer_epoch, p.last_sequence) > (
                cur.producer_epoch, cur.last_sequence
            ):
                best[p.producer_id] = p
    return tuple(best[k] for k in sorted(best))


__all__ = [
    "DESCRIBE_STREAMS_PAGE_MAX",
    "DN_CALL_TIMEOUT_S",
    "LIST_RANGES_FRAME_MAX",
    "MAX_ITEMS_PER_REQUEST",
    "MAX_REPLICA_NUMS",
    "DataNodeApi",
    "DnSealReply",
    "PmService",
]
