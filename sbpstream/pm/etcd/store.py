"""The etcd store: :class:`~sbpstream.pm.metadata.MetadataStore` for several PMs, one leader.

Every PM keeps the whole metadata prefix in memory (:class:`~sbpstream.pm.etcd.cache.Cache`),
loaded once at a pinned revision and then kept current by one watch on the prefix. Reads are
served from that cache; followers keep it warm, so a newly elected leader serves at once.

Writes come only from the leader and are **fenced**: every write transaction compares the leader
key's ``create_revision`` with the token this PM got when it won the election
(:mod:`sbpstream.pm.leader`). A deposed leader's write fails as a whole, with
:class:`~sbpstream.protocol.errors.FencedLeaderError`. Besides the fence, each transaction
compares the ``mod_revision`` of every key it overwrites with the revision the cache holds
(optimistic concurrency), so a stale cache can never silently overwrite newer data.

A write is acknowledged only after its transaction succeeded (etcd has made it durable on a
quorum) *and* the watch has applied it to the cache, so the leader reads its own writes.

What an item does is a rule of :mod:`sbpstream.pm.rules`, planned against the cache plus the
writes staged by earlier items (:mod:`sbpstream.pm.staging`); this module only decides how the
staged writes become fenced transactions. Batched calls keep the interface's contract with
etcd's limits: items are packed into
transactions of at most ``max_txn_ops`` operations and :data:`MAX_TXN_BYTES` bytes; an item is
never split across transactions, so each item stays all-or-nothing. Items of one call see the
effects of earlier items (as in SQLite); an item that touches a key an earlier item of the same
transaction touched starts a new transaction, because etcd refuses a key twice in one txn.

Key layout (``P`` is the prefix, ``/sbpstream`` by default; numbers zero-padded so keys sort
numerically): see :class:`~sbpstream.pm.etcd.keys.Keys` and docs/etcd.md.
"""


from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeVar

from aetcd import rpc

from sbpstream.pm import rules
from sbpstream.pm.etcd.cache import Cache, CacheReader
from sbpstream.pm.etcd.client import EtcdClient, cmp_create, cmp_mod, get_op, put_op
from sbpstream.pm.etcd.codec import decode_leader
from sbpstream.pm.etcd.keys import COUNTER_FIRST, Keys, prefix_end
from sbpstream.pm.etcd.txn import MAX_TXN_BYTES, TxnOps
from sbpstream.pm.etcd.url import EtcdSettings, parse_etcd_url
from sbpstream.pm.metadata import (
    CreatedStream,
    DeleteOutcome,
    NewStream,
    NodeMeta,
    NodeMetrics,
    OffsetMeta,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    SealOutcome,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
)
from sbpstream.pm.rules import COUNTER_STREAM, MetaTxn
from sbpstream.pm.staging import Layer, StagedTxn
from sbpstream.protocol.errors import (
    FencedLeaderError,
    LimitExceededError,
    MetadataError,
    PmNotLeaderError,
    SbpError,
)
from sbpstream.quota.model import QuotaSpec

log = logging.getLogger("sbpstream.pm.etcd")

T = TypeVar("T")
ItemT = TypeVar("ItemT")

SCHEMA_VERSION: Final = 1
"""Layout version kept at ``P/meta/schema_version``; a PM refuses a newer one."""

APPLY_WAIT_TIMEOUT_S: Final = 10.0
"""How long a write waits for the watch to apply its revision before the call fails. The watch
normally delivers within a millisecond; this only bounds a broken or restarting watch."""

SYNC_PROGRESS_RETRY_S: Final = 0.5
"""Interval between watch progress requests while catching the cache up (etcd answers one only
when the watcher is synced, so a request can go unanswered)."""

LOAD_PAGE_KEYS: Final = 2000
"""Keys per range read while loading the cache (about 0.5 MiB a page): bounded messages at any
metadata size, all pages pinned to one revision."""

WATCH_RETRY_S: Final = 0.2
"""First pause before re-establishing a broken watch (and rotating endpoints); it doubles per
consecutive failure up to WATCH_RETRY_MAX_S, so an etcd outage does not flood the log."""

WATCH_RETRY_MAX_S: Final = 3.0

CONFLICT_RETRIES: Final = 3
"""Times a chunk is re-planned after a mod_revision compare failed (stale cache) before the
call reports MetadataError. Only a writer outside sbpstream or a lost RPC outcome causes it."""

CREATE_PIPELINE_DEPTH: Final = 8
"""Transactions of one CREATE_STREAMS call in flight at once. Their items are independent (ids
come from one block reserved first), and etcd commits concurrent proposals together (one raft
entry batch, one fsync), so a few in flight multiply throughput; more only queue in etcd."""


class EtcdMetadataStore:
    """:class:`~sbpstream.pm.metadata.MetadataStore` on etcd v3.

    Writes need leadership: :mod:`sbpstream.pm.leader` calls :meth:`assume_leadership` with the
    fencing token when this PM wins and :meth:`drop_leadership` when it loses. Without a token,
    writes raise PmNotLeaderError carrying the leader's address."""

    def __init__(self, settings: EtcdSettings | str) -> None:
        self.settings = parse_etcd_url(settings) if isinstance(settings, str) else settings
        self.keys = Keys(self.settings.prefix)
        self.client = EtcdClient(self.settings)
        self._cache = Cache(self.keys)
        self._token: int | None = None
        self._write_lock = asyncio.Lock()
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_requests: asyncio.Queue[Any] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._own_writes: dict[bytes, tuple[bytes, object]] = {}
        """key -> (value, decoded) of puts in flight from this PM, so the watch need not
        decode its own writes again."""
        self._open = False
        self._needs_sync = False
        self.leader_changed = asyncio.Event()
        """Set whenever the leader key changes (the election clears it before waiting)."""
        self._soft = rules.SoftState()
        self.txns = 0
        """Committed write transactions (for benchmarks and tests)."""

    @property
    def url(self) -> str:
        return f"etcd://{','.join(self.settings.endpoint_list)}{self.settings.prefix}"

    # ------------------------------------------------------------------ leadership
    @property
    def is_leader(self) -> bool:
        return self._token is not None

    @property
    def leader_token(self) -> int | None:
        return self._token

    def leader_address(self) -> str:
        """The current leader's address as this PM's cache knows it ('' when none)."""
        return self._cache.leader[0] if self._cache.leader else ""

    def leader_revision(self) -> int:
        """create_revision of the leader key in the cache (0 when there is none)."""
        return self._cache.leader[1] if self._cache.leader else 0

    async def assume_leadership(self, token: int) -> None:
        """This PM won at revision ``token``: once the cache holds everything committed up to
        it (every write of any earlier leader), writes are fenced with it."""
        await self.wait_applied(token)
        self._token = token
        self._needs_sync = False
        log.info("event=etcd_leadership_assumed token=%d", token)

    def drop_leadership(self) -> None:
        if self._token is not None:
            log.info("event=etcd_leadership_dropped token=%d", self._token)
        self._token = None

    def _not_leader(self) -> SbpError:
        addr = self.leader_address()
        return PmNotLeaderError(
            f"this PM is not the leader (leader: {addr or 'unknown'})", addr.encode())

    def _fenced(self, leader: str) -> SbpError:
        return FencedLeaderError(
            f"this PM was deposed while writing (leader: {leader or 'unknown'})", leader.encode())

    # ------------------------------------------------------------------ open / close
    async def open(self) -> None:
        if self._open:
            return
        await self.client.connect()
        try:
            await self._init_schema()
            await self._load()
        except BaseException:
            await self.client.close()
            raise
        self._open = True
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_loop())
        log.info("event=etcd_metadata_opened endpoints=%s prefix=%s revision=%d streams=%d "
                 "nodes=%d", ",".join(self.settings.endpoint_list), self.settings.prefix,
                 self._cache.applied, len(self._cache.streams), len(self._cache.nodes))

    async def _init_schema(self) -> None:
        """Create schema version and counters if absent (idempotent: any PM may do it, unfenced,
        because it only ever creates keys that do not exist)."""
        k = self.keys
        puts = [(k.schema, str(SCHEMA_VERSION).encode())] + [
            (k.counter(name), str(first).encode()) for name, first in COUNTER_FIRST.items()]
        req = rpc.TxnRequest(
            compare=[cmp_create(k.schema, 0)],
            success=[put_op(key, v) for key, v in puts],
            failure=[get_op(k.schema)],
        )
        resp = await self.client.txn(req)
        if resp.succeeded:
            log.info("event=etcd_metadata_created prefix=%s schema_version=%d",
                     self.settings.prefix, SCHEMA_VERSION)
            return
        kvs = resp.responses[0].response_range.kvs
        version = int(kvs[0].value) if kvs else 0
        if version > SCHEMA_VERSION:
            raise MetadataError(
                f"etcd prefix {self.settings.prefix} has schema version {version}, newer than "
                f"this sbpstream ({SCHEMA_VERSION}); upgrade sbpstream")

    async def _load(self) -> None:
        """Read the whole prefix at one revision, page by page, into a fresh cache."""
        cache = Cache(self.keys)
        k = self.keys
        start, revision = k.root, 0
        while True:
            resp = await self.client.range(start, k.root_end, limit=LOAD_PAGE_KEYS,
                                           revision=revision)
            if revision == 0:
                revision = int(resp.header.revision)
            for kv in resp.kvs:
                cache.put(kv.key, kv.value, kv.mod_revision, kv.create_revision)
            if not resp.more or not resp.kvs:
                break
            start = resp.kvs[-1].key + b"\0"
        cache.applied = revision
        self._cache = cache
        self.leader_changed.set()
        self._wake_waiters()

    async def close(self) -> None:
        if not self._open:
            return
        with contextlib.suppress(SbpError):
            if self._token is not None:
                await self.flush_soft_state()
        self._open = False
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(MetadataError("metadata store closed"))
        self._waiters.clear()
        await self.client.close()

    # ------------------------------------------------------------------ watch
    async def _watch_loop(self) -> None:
        pause = WATCH_RETRY_S
        while self._open:
            applied = self._cache.applied
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except SbpError as e:
                log.warning("event=etcd_watch_broken error=%r retry_s=%.1f", str(e), pause)
            except Exception as e:
                log.warning("event=etcd_watch_broken error=%r retry_s=%.1f", repr(e), pause)
                if isinstance(e, rpc.AioRpcError) and len(self.settings.endpoints) > 1:
                    with contextlib.suppress(Exception):
                        await self.client.rotate()
            if self._cache.applied > applied:
                pause = WATCH_RETRY_S  # it made progress before breaking: not an outage
            await asyncio.sleep(pause)
            pause = min(pause * 2, WATCH_RETRY_MAX_S)

    async def _watch_once(self) -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        k = self.keys
        await queue.put(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=k.root, range_end=k.root_end, start_revision=self._cache.applied + 1)))

        async def requests() -> AsyncIterator[Any]:
            while True:
                yield await queue.get()

        call = self.client.watch(requests())
        self._watch_requests = queue
        try:
            async for resp in call:
                if resp.compact_revision:
                    log.warning("event=etcd_watch_compacted revision=%d: reloading",
                                resp.compact_revision)
                    await self._load()
                    return
                if resp.canceled:
                    raise MetadataError(f"etcd watch cancelled: {resp.cancel_reason}")
                self._apply(resp)
        finally:
            self._watch_requests = None
            call.cancel()

    def _apply(self, resp: Any) -> None:
        c = self._cache
        top = c.applied
        leader_touched = False
        for ev in resp.events:
            kv = ev.kv
            if kv.key == self.keys.leader:
                leader_touched = True
            if ev.type == rpc.Event.DELETE:
                c.delete(kv.key)
            else:
                own = self._own_writes.get(kv.key)
                known = own[1] if own is not None and own[0] == kv.value else None
                c.put(kv.key, kv.value, kv.mod_revision, kv.create_revision, known)
            top = max(top, int(kv.mod_revision))
        if not resp.events and not resp.created:
            top = max(top, int(resp.header.revision))  # a progress notification
        c.applied = top
        if leader_touched:
            self.leader_changed.set()
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        applied = self._cache.applied
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for rev, fut in self._waiters:
            if rev <= applied:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((rev, fut))
        self._waiters = keep

    async def wait_applied(self, revision: int) -> None:
        """Return once the cache has applied every change up to ``revision``."""
        if self._cache.applied >= revision:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, fut))
        try:
            await asyncio.wait_for(fut, APPLY_WAIT_TIMEOUT_S)
        except TimeoutError as e:
            raise MetadataError(
                f"etcd watch did not reach revision {revision} within {APPLY_WAIT_TIMEOUT_S}s "
                f"(at {self._cache.applied})") from e

    async def sync(self) -> None:
        """Catch the cache up with etcd as of now (a linearizable read, then a watch progress
        notification carrying at least that revision)."""
        resp = await self.client.range(self.keys.leader)
        rev = int(resp.header.revision)
        if self._cache.applied >= rev:
            return
        # A progress notification is only sent by a synced watcher, so ask again until one
        # arrives or the bound passes.
        deadline = time.monotonic() + APPLY_WAIT_TIMEOUT_S
        while self._cache.applied < rev:
            queue = self._watch_requests
            if queue is not None:
                await queue.put(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((rev, fut))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, SYNC_PROGRESS_RETRY_S)
            if time.monotonic() > deadline:
                raise MetadataError(f"etcd watch did not reach revision {rev} within "
                                    f"{APPLY_WAIT_TIMEOUT_S}s (at {self._cache.applied})")

    @property
    def applied_revision(self) -> int:
        return self._cache.applied

    # ------------------------------------------------------------------ write machinery
    def _require_leader(self) -> int:
        if not self._open:
            raise MetadataError("metadata store is not open")
        if self._token is None:
            raise self._not_leader()
        return self._token

    async def _synced(self) -> None:
        if self._needs_sync:
            await self.sync()
            self._needs_sync = False

    def _plan(self, chunk: Layer, plan: Callable[[MetaTxn, ItemT], T],
              item: ItemT) -> tuple[T, Layer, TxnOps]:
        """One item's rule over the cache and ``chunk``; SbpError when the rule refuses."""
        top = Layer()
        res = plan(StagedTxn(CacheReader(self._cache, self._soft), chunk, top), item)
        return res, top, TxnOps.of(top, self._cache)

    def _too_big(self, i: int, ops: TxnOps) -> SbpError | None:
        if TxnOps().fits_with(ops, self.settings.max_txn_ops):
            return None
        return LimitExceededError(
            f"item {i} needs {ops.ops} etcd operations / {ops.nbytes} bytes; "
            f"a transaction allows {self.settings.max_txn_ops} / {MAX_TXN_BYTES}")

    async def _write(
        self, items: Sequence[ItemT], plan: Callable[[MetaTxn, ItemT], T]
    ) -> list[T | SbpError]:
        """Plan each item against the cache plus earlier items' staged writes, pack items into
        fenced transactions, commit them in order. One outcome per item."""
        self._require_leader()
        async with self._write_lock:
            await self._synced()
            out: list[T | SbpError | None] = [None] * len(items)
            committed_any = False
            i = 0
            retries = 0
            while i < len(items):
                chunk, ops, pending, start = Layer(), TxnOps(), [], i
                while i < len(items):
                    try:
                        res, top, item_ops = self._plan(chunk, plan, items[i])
                    except SbpError as e:
                        out[i] = e
                        i += 1
                        continue
                    if not item_ops.empty and not ops.empty and (
                        item_ops.conflicts(ops)
                        or not ops.fits_with(item_ops, self.settings.max_txn_ops)
                    ):
                        break  # commit what we have; re-plan this item on the fresh cache
                    too_big = self._too_big(i, item_ops)
                    if too_big is not None:
                        out[i] = too_big
                        i += 1
                        continue
                    chunk.merge(top)
                    ops.merge(item_ops)
                    pending.append((i, res))
                    i += 1
                if ops.empty:
                    for j, res in pending:
                        out[j] = res
                    continue
                try:
                    await self._commit(ops)
                except _Conflict:
                    retries += 1
                    if retries > CONFLICT_RETRIES:
                        err = MetadataError("etcd metadata changed concurrently; retry")
                        return self._fail_rest(out, start, err, committed_any)
                    await self.sync()
                    i = start
                    continue
                except SbpError as e:
                    return self._fail_rest(out, start, e, committed_any)
                committed_any = True
                for j, res in pending:
                    out[j] = res
            return [o for o in out if o is not None]

    @staticmethod
    def _fail_rest(
        out: list[T | SbpError | None], start: int, err: SbpError, committed_any: bool
    ) -> list[T | SbpError]:
        """Items from ``start`` on fail with ``err``. When nothing of the call committed, the
        whole call raises instead (a fenced leader's request is then redirected as a whole)."""
        if not committed_any:
            raise err
        for j in range(start, len(out)):
            out[j] = err
        return [o for o in out if o is not None]

    async def _commit(self, ops: TxnOps) -> None:
        token = self._token
        if token is None:
            raise self._not_leader()
        k, c = self.keys, self._cache
        compare = [cmp_create(k.leader, token)]
        success: list[Any] = []
        for name, value in ops.counters.items():
            compare.append(cmp_mod(k.counter(name), c.counter_rev(name)))
            success.append(put_op(k.counter(name), str(value).encode()))
        for key, rev in ops.compares.items():
            compare.append(cmp_mod(key, rev))
        for start, end in ops.spans:
            success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                key=start, range_end=end)))
        success.extend(put_op(key, v) for key, v in ops.puts.items())
        req = rpc.TxnRequest(compare=compare, success=success, failure=[get_op(k.leader)])
        own = self._own_writes
        for key, put_value in ops.puts.items():
            own[key] = (put_value, ops.decoded[key])
        try:
            resp = await self.client.txn(req)
            if resp.succeeded:
                # the fence's audit trail: sorted by revision, the tokens of committed writes
                # never go down (the network test bed checks it across every PM's log)
                log.debug("event=etcd_txn_committed token=%d revision=%d", token,
                          int(resp.header.revision))
                await self.wait_applied(int(resp.header.revision))
        except SbpError:
            self._needs_sync = True  # the outcome is unknown: re-read before the next write
            raise
        finally:
            for key in ops.puts:
                own.pop(key, None)
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if not kvs or int(kvs[0].create_revision) != token:
                leader = decode_leader(kvs[0].value) if kvs else ""
                self.drop_leadership()
                log.warning("event=etcd_write_fenced token=%d leader=%s", token, leader)
                raise self._fenced(leader)
            log.warning("event=etcd_write_conflict keys=%d", len(ops.compares))
            raise _Conflict()
        self.txns += 1

    async def _write_one(self, plan: Callable[[MetaTxn, None], T]) -> T:
        (out,) = await self._write([None], plan)
        if isinstance(out, SbpError):
            raise out
        return out

    # ------------------------------------------------------------------ soft state
    async def record_heartbeat(self, node_id: int, now_ms: int) -> None:
        self._soft.heartbeat(node_id, now_ms)
        if self._soft.due():
            await self._flush_quietly()

    async def record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        self._soft.report(node_id, metrics, now_ms)
        if self._soft.due():
            await self._flush_quietly()

    async def _flush_quietly(self) -> None:
        try:
            await self.flush_soft_state()
        except SbpError as e:
            log.warning("event=soft_state_flush_failed error=%r", str(e))

    async def flush_soft_state(self) -> None:
        """Write pending heartbeat times and metrics (leader only; a follower drops them)."""
        self._soft.last_flush = time.monotonic()
        ids = self._soft.pending()
        if not ids:
            return
        if self._token is not None:
            await self._write(ids, rules.flush_soft_state)
        self._soft.forget(ids)

    # ------------------------------------------------------------------ data nodes
    async def allocate_node_id(self, host: str, now_ms: int) -> int:
        return await self._write_one(lambda tx, _: rules.allocate_node_id(tx, host, now_ms))

    async def get_node(self, node_id: int) -> NodeMeta | None:
        return CacheReader(self._cache, self._soft).node(node_id)

    async def list_nodes(self) -> list[NodeMeta]:
        return [self._soft.applied(n) for _, (n, _) in sorted(self._cache.nodes.items())]

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        n = await self._write_one(
            lambda tx, _: rules.update_node_address(tx, node_id, advertise_addr))
        self._soft.forget([node_id])
        return n

    async def remove_node(self, node_id: int) -> bool:
        resp = await self._auth_txn(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
            key=self.keys.node(node_id))))  # fenced like every write; the watch updates the cache
        self._soft.forget([node_id])
        return int(resp.responses[0].response_delete_range.deleted) > 0

    async def set_node_draining(self, node_id: int, draining: bool) -> NodeMeta:
        n = await self._write_one(lambda tx, _: rules.set_node_draining(tx, node_id, draining))
        self._soft.forget([node_id])
        return n

    # ------------------------------------------------------------------ quotas (issue 22)
    async def set_quotas(self, items: Sequence[QuotaSpec]) -> list[QuotaSpec | SbpError]:
        return await self._write(items, rules.set_quota)

    async def delete_quotas(
        self, items: Sequence[tuple[int, str, str]]
    ) -> list[QuotaSpec | SbpError]:
        return await self._write(items, lambda tx, it: rules.delete_quota(tx, *it))

    async def list_quotas(self) -> list[QuotaSpec]:
        return [q for _, (q, _) in sorted(self._cache.quotas.items())]

    # ------------------------------------------------------------------ streams
    async def create_streams(
        self, items: Sequence[NewStream], now_ms: int
    ) -> list[CreatedStream | SbpError]:
        """Reserve a block of ids (one CAS transaction on the counter), then write the items in
        transactions of whole items, up to CREATE_PIPELINE_DEPTH in flight. An item whose
        transaction fails burns its id (ids are never reused)."""
        if not items:
            return []
        self._require_leader()
        async with self._write_lock:
            await self._synced()
            first = await self._reserve_ids(len(items))
            out: list[CreatedStream | SbpError | None] = [None] * len(items)
            chunks: list[tuple[TxnOps, list[tuple[int, CreatedStream]]]] = []
            chunk, ops, pending = Layer(), TxnOps(), list[tuple[int, CreatedStream]]()
            for i, item in enumerate(items):
                try:
                    res, top, item_ops = self._plan(
                        chunk, lambda tx, it: rules.create_stream(tx, it[0], it[1], now_ms),
                        (first + i, item))
                except SbpError as e:
                    out[i] = e
                    continue
                if not ops.fits_with(item_ops, self.settings.max_txn_ops):
                    # ``chunk`` stays: later items must see the names taken by earlier ones
                    chunks.append((ops, pending))
                    ops, pending = TxnOps(), list[tuple[int, CreatedStream]]()
                chunk.merge(top)
                ops.merge(item_ops)
                pending.append((i, res))
            if pending:
                chunks.append((ops, pending))
            errors = await self._commit_all([c for c, _ in chunks])
            for (_, pend), err in zip(chunks, errors, strict=True):
                for i, res in pend:
                    out[i] = res if err is None else err
            if errors and all(e is not None for e in errors):
                raise next(e for e in errors if e is not None)  # nothing committed
            return [o for o in out if o is not None]

    async def _reserve_ids(self, n: int) -> int:
        """Advance the stream id counter by ``n`` with compare-and-swap; the block's first id."""
        for _ in range(CONFLICT_RETRIES + 1):
            block = Layer()
            first = rules.reserve_stream_ids(
                StagedTxn(CacheReader(self._cache, self._soft), Layer(), block), n)
            try:
                await self._commit(TxnOps.of(block, self._cache))
                return first
            except _Conflict:
                await self.sync()
        raise MetadataError(f"etcd counter {COUNTER_STREAM} changed concurrently; retry")

    async def _commit_all(self, chunks: Sequence[TxnOps]) -> list[SbpError | None]:
        """Commit independent chunks, CREATE_PIPELINE_DEPTH at a time; per chunk its error."""
        sem = asyncio.Semaphore(CREATE_PIPELINE_DEPTH)

        async def one(ops: TxnOps) -> SbpError | None:
            async with sem:
                try:
                    await self._commit(ops)
                except _Conflict:
                    return MetadataError("could not create stream: its key appeared in etcd")
                except SbpError as e:
                    return e
            return None

        return list(await asyncio.gather(*(one(c) for c in chunks)))

    async def get_streams(self, stream_ids: Sequence[int]) -> list[StreamMeta | None]:
        streams = self._cache.streams
        out: list[StreamMeta | None] = []
        for sid in stream_ids:
            got = streams.get(sid)
            out.append(None if got is None else got[0])
        return out

    async def list_streams(self, after_stream_id: int, limit: int) -> list[StreamMeta]:
        live = self._cache.live_sorted()
        i = bisect.bisect_right(live, after_stream_id)
        return [self._cache.streams[sid][0] for sid in live[i : i + max(0, limit)]]

    async def get_stream_by_name(self, name: str) -> StreamMeta | None:
        got = self._cache.names.get(name)
        if got is None:
            return None
        s = self._cache.streams.get(got[0])
        return None if s is None or s[0].deleted else s[0]

    async def list_streams_by_prefix(
        self, prefix: str, after_stream_id: int, limit: int
    ) -> list[StreamMeta]:
        c = self._cache
        ids = sorted(sid for name, (sid, _) in c.names.items()
                     if sid > after_stream_id and name.startswith(prefix))
        out: list[StreamMeta] = []
        for sid in ids:
            got = c.streams.get(sid)
            if got is not None and not got[0].deleted:
                out.append(got[0])
                if len(out) >= limit:
                    break
        return out

    async def update_streams(
        self, items: Sequence[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        if not items:
            return []
        return await self._write(list(items), lambda tx, u: rules.update_stream(tx, u, now_ms))

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        if not items:
            return []
        return await self._write(
            list(items), lambda tx, it: rules.trim_stream(tx, it[0], it[1], now_ms))

    async def delete_streams(
        self, stream_ids: Sequence[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        if not stream_ids:
            return []
        return await self._write(
            list(stream_ids), lambda tx, sid: rules.delete_stream(tx, sid, now_ms))

    # ------------------------------------------------------------------ ranges
    async def list_ranges(self, stream_ids: Sequence[int]) -> list[list[RangeMeta]]:
        reader = CacheReader(self._cache, self._soft)
        return [reader.ranges(sid) for sid in stream_ids]

    async def list_node_ranges(
        self, node_id: int, writable_only: bool = False
    ) -> list[RangeMeta]:
        c = self._cache
        out: list[RangeMeta] = []
        for sid, idx in sorted(c.by_node.get(node_id, ())):
            r = c.ranges[sid][idx][0]
            if not writable_only or r.writable:
                out.append(r)
        return out

    async def get_range(self, stream_id: int, range_index: int) -> RangeMeta | None:
        return CacheReader(self._cache, self._soft).range(stream_id, range_index)

    async def writable_range_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for per in self._cache.ranges.values():
            for r, _ in per.values():
                if r.writable:
                    for nid in r.node_ids:
                        counts[nid] = counts.get(nid, 0) + 1
        return counts

    async def record_next_offsets(self, updates: Sequence[tuple[int, int, int]]) -> None:
        # Most reports change nothing: filter on the cache before taking the write lock.
        reader = CacheReader(self._cache, self._soft)
        todo = [u for u in updates
                if (r := reader.range(u[0], u[1])) is not None and r.writable
                and u[2] > r.next_offset]
        if todo:
            await self._write(todo, lambda tx, u: rules.record_next_offset(tx, u[0], u[1], u[2]))

    async def seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: Sequence[ProducerStateMeta],
    ) -> SealOutcome:
        return await self._write_one(lambda tx, _: rules.seal_and_new(
            tx, stream_id, range_index, end_offset, new_replicas, producers))

    async def get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        return CacheReader(self._cache, self._soft).producers(stream_id, range_index)

    # ------------------------------------------------------------------ committed offsets
    async def commit_offsets(
        self, items: Sequence[OffsetMeta], now_ms: int
    ) -> list[OffsetMeta | SbpError]:
        if not items:
            return []
        return await self._write(list(items), lambda tx, o: rules.commit_offset(tx, o, now_ms))

    async def fetch_offsets(self, group: str, stream_ids: Sequence[int]) -> list[OffsetMeta]:
        per = self._cache.offsets.get(group, {})
        ids = sorted(per) if not stream_ids else sorted(set(stream_ids) & per.keys())
        return [per[sid][0] for sid in ids]

    async def offset_groups(self) -> dict[str, int]:
        return {g: len(per) for g, per in sorted(self._cache.offsets.items())}

    async def delete_offsets(self, group: str) -> int:
        items = [OffsetMeta(group, sid, -1) for sid in sorted(self._cache.offsets.get(group, {}))]
        outs = await self.commit_offsets(items, 0)
        failed = next((o for o in outs if isinstance(o, SbpError)), None)
        if failed is not None:
            raise failed
        return len(items)

    async def replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        return await self._write_one(lambda tx, _: rules.replace_replica(
            tx, stream_id, range_index, old_node_id, new_node_id))

    # ------------------------------------------------------------------ auth records
    # Read straight from etcd (linearizable; logins and admin calls are rare), written by the
    # leader only, fenced like every other write. The cache ignores these keys.
    def _auth_key(self, kind: str, key: str) -> bytes:
        return self.keys.root + b"auth/" + kind.encode() + b"/" + key.encode()

    async def auth_get(self, kind: str, key: str) -> str | None:
        resp = await self.client.range(self._auth_key(kind, key))
        return resp.kvs[0].value.decode() if resp.kvs else None

    async def _auth_txn(self, op: Any) -> Any:
        token = self._require_leader()
        req = rpc.TxnRequest(compare=[cmp_create(self.keys.leader, token)], success=[op],
                             failure=[get_op(self.keys.leader)])
        resp = await self.client.txn(req)
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            leader = decode_leader(kvs[0].value) if kvs else ""
            self.drop_leadership()
            raise self._fenced(leader)
        log.debug("event=etcd_txn_committed token=%d revision=%d", token,
                  int(resp.header.revision))
        return resp

    async def auth_put(self, kind: str, key: str, value: str) -> None:
        await self._auth_txn(put_op(self._auth_key(kind, key), value.encode()))

    async def auth_delete(self, kind: str, key: str) -> bool:
        resp = await self._auth_txn(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
            key=self._auth_key(kind, key))))
        return int(resp.responses[0].response_delete_range.deleted) > 0

    async def auth_list(self, kind: str) -> list[tuple[str, str]]:
        start = self.keys.root + b"auth/" + kind.encode() + b"/"
        resp = await self.client.range(start, prefix_end(start))
        return sorted((kv.key[len(start):].decode(), kv.value.decode()) for kv in resp.kvs)


class _Conflict(Exception):
    """A mod_revision compare failed while this PM still leads: the cache was stale."""
