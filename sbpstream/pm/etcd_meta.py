"""etcd v3 backend of :class:`~sbpstream.pm.metadata.MetadataStore`: several PMs, one leader.

Every PM keeps the whole metadata prefix in memory (:class:`_Cache`), loaded once at a pinned
revision and then kept current by one watch on the prefix. Reads are served from that cache;
followers keep it warm, so a newly elected leader serves at once.

Writes come only from the leader and are **fenced**: every write transaction compares the leader
key's ``create_revision`` with the token this PM got when it won the election
(:mod:`sbpstream.pm.leader`). A deposed leader's write fails as a whole, with
:class:`~sbpstream.protocol.errors.FencedLeaderError`. Besides the fence, each transaction
compares the ``mod_revision`` of every key it overwrites with the revision the cache holds
(optimistic concurrency), so a stale cache can never silently overwrite newer data.

A write is acknowledged only after its transaction succeeded (etcd has made it durable on a
quorum) *and* the watch has applied it to the cache, so the leader reads its own writes.

Batched calls keep the interface's contract with etcd's limits: items are packed into
transactions of at most ``max_txn_ops`` operations and :data:`MAX_TXN_BYTES` bytes; an item is
never split across transactions, so each item stays all-or-nothing. Items of one call see the
effects of earlier items (as in SQLite); an item that touches a key an earlier item of the same
transaction touched starts a new transaction, because etcd refuses a key twice in one txn.

Key layout (``P`` is the prefix, ``/sbpstream`` by default; numbers zero-padded so keys sort
numerically): see :class:`Keys` and docs/etcd.md.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

from aetcd import rpc

from sbpstream.pm.metadata import (
    FIRST_NODE_ID,
    FIRST_STREAM_ID,
    MAX_NODE_ID,
    MAX_STREAM_ID,
    WRITABLE_END_OFFSET,
    CreatedStream,
    DeleteOutcome,
    NewStream,
    NodeMeta,
    NodeMetrics,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    SealOutcome,
    StreamMeta,
    StreamUpdate,
    TrimOutcome,
    replace_in,
)
from sbpstream.protocol.errors import (
    DataNodeNotFoundError,
    FencedLeaderError,
    InvalidRequestError,
    LimitExceededError,
    MetadataError,
    PmNotLeaderError,
    RangeNotFoundError,
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)

log = logging.getLogger("sbpstream.pm.etcd")

T = TypeVar("T")
ItemT = TypeVar("ItemT")

SCHEMA_VERSION: Final = 1
"""Layout version kept at ``P/meta/schema_version``; a PM refuses a newer one."""

DEFAULT_PREFIX: Final = "/sbpstream"
DEFAULT_ETCD_PORT: Final = 2379

DEFAULT_LEASE_TTL_S: Final = 3
"""Leader lease. A killed leader is replaced within about this long; shorter makes a GC pause or
a slow disk depose a healthy leader. etcd rounds a TTL below its minimum (about 2 s with default
raft timing) up to that minimum."""

MIN_LEASE_TTL_S: Final = 2
"""etcd's own floor with default raft timing (1.5 x election timeout, rounded up)."""

DEFAULT_MAX_TXN_OPS: Final = 128
"""etcd's default ``--max-txn-ops``: operations per transaction, per list (compare, success,
failure). A cluster started with a larger limit may be told with ``?max_txn_ops=N``."""

MAX_TXN_BYTES: Final = 1024 * 1024
"""Bytes of keys and values per transaction: under etcd's default ``--max-request-bytes`` of
1.5 MiB with room for the protobuf framing and compares."""

OP_OVERHEAD_BYTES: Final = 32
"""Per-operation protobuf overhead counted against MAX_TXN_BYTES (tags, lengths, lease)."""

DEFAULT_REQUEST_TIMEOUT_S: Final = 5.0
"""One etcd RPC. A quorum write takes milliseconds; five seconds covers an etcd leader election
(about one election timeout, 1 s by default) with a wide margin."""

APPLY_WAIT_TIMEOUT_S: Final = 10.0
"""How long a write waits for the watch to apply its revision before the call fails. The watch
normally delivers within a millisecond; this only bounds a broken or restarting watch."""

SYNC_PROGRESS_RETRY_S: Final = 0.5
"""Interval between watch progress requests while catching the cache up (etcd answers one only
when the watcher is synced, so a request can go unanswered)."""

LOAD_PAGE_KEYS: Final = 2000
"""Keys per range read while loading the cache (about 0.5 MiB a page): bounded messages at any
metadata size, all pages pinned to one revision."""

GRPC_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""gRPC receive limit. A watch response carries whole transactions (up to etcd's 1.5 MiB request
limit each) and may batch several when catching up; gRPC's 4 MiB default is too tight."""

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

SOFT_STATE_FLUSH_INTERVAL_S: Final = 5.0
"""Heartbeat times and metrics reach etcd at most this late (the interface allows soft state to
be persisted lazily; see metadata.py)."""

_ALL: Final = 1 << 62
"""A range-index bound above every real index: "drop every range of the stream"."""


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True, slots=True)
class EtcdSettings:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    @property
    def endpoint_list(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.endpoints]


def is_etcd_url(url: str) -> bool:
    return url.startswith("etcd://")


def parse_etcd_url(url: str) -> EtcdSettings:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX][?lease_ttl_s=3&max_txn_ops=128&timeout_s=5]``.

    Raises ValueError with a message an operator can act on.
    """
    if not is_etcd_url(url):
        raise ValueError(f"--metadata {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    rest = url[len("etcd://"):]
    rest, _, query = rest.partition("?")
    hosts, slash, path = rest.partition("/")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            continue
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, str(DEFAULT_ETCD_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--metadata {url!r}: bad etcd endpoint {part!r} (HOST:PORT)")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError(f"--metadata {url!r}: no etcd endpoint given")
    prefix = "/" + path.strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    opts = dict(urllib.parse.parse_qsl(query, strict_parsing=False))
    known = {"lease_ttl_s", "max_txn_ops", "timeout_s"}
    unknown = set(opts) - known
    if unknown:
        raise ValueError(f"--metadata {url!r}: unknown option(s) {sorted(unknown)}; "
                         f"known: {sorted(known)}")
    try:
        ttl = int(opts.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))
        ops = int(opts.get("max_txn_ops", DEFAULT_MAX_TXN_OPS))
        timeout = float(opts.get("timeout_s", DEFAULT_REQUEST_TIMEOUT_S))
    except ValueError as e:
        raise ValueError(f"--metadata {url!r}: {e}") from e
    if ttl < MIN_LEASE_TTL_S:
        raise ValueError(f"--metadata {url!r}: lease_ttl_s must be >= {MIN_LEASE_TTL_S}")
    if ops < 8:
        raise ValueError(f"--metadata {url!r}: max_txn_ops must be >= 8 (one item needs up to 6)")
    if timeout <= 0:
        raise ValueError(f"--metadata {url!r}: timeout_s must be > 0")
    return EtcdSettings(tuple(endpoints), prefix, ttl, ops, timeout)


# ---------------------------------------------------------------------------- keys
_SID_W: Final = 20  # digits of an int64
_IDX_W: Final = 10  # digits of an int32 range index / node id


class Keys:
    """The key layout under one prefix (docs/etcd.md)."""

    def __init__(self, prefix: str) -> None:
        p = prefix.rstrip("/").encode()
        self.root = p + b"/"
        self.root_end = _prefix_end(self.root)
        self.leader = p + b"/leader"
        self.schema = p + b"/meta/schema_version"
        self._counter = p + b"/meta/"
        self._stream = p + b"/streams/"
        self._range = p + b"/ranges/"
        self._producers = p + b"/seal_producers/"
        self._node = p + b"/nodes/"

    def counter(self, name: str) -> bytes:
        return self._counter + name.encode()

    def stream(self, sid: int) -> bytes:
        return self._stream + b"%020d" % sid

    def range(self, sid: int, idx: int) -> bytes:
        return self._range + b"%020d/%010d" % (sid, idx)

    def ranges_below(self, sid: int, bound: int) -> tuple[bytes, bytes]:
        """[start, end) of the range keys of ``sid`` with index < bound (_ALL: every one)."""
        start = self._range + b"%020d/" % sid
        end = _prefix_end(start) if bound >= _ALL else self.range(sid, bound)
        return start, end

    def producers(self, sid: int, idx: int) -> bytes:
        return self._producers + b"%020d/%010d" % (sid, idx)

    def producers_below(self, sid: int, bound: int) -> tuple[bytes, bytes]:
        start = self._producers + b"%020d/" % sid
        end = _prefix_end(start) if bound >= _ALL else self.producers(sid, bound)
        return start, end

    def node(self, nid: int) -> bytes:
        return self._node + b"%010d" % nid

    def parse(self, key: bytes) -> tuple[str, tuple[int, ...]] | None:
        """(kind, ids) for a key under the root; None for anything else."""
        for kind, head in (("stream", self._stream), ("range", self._range),
                           ("node", self._node), ("producers", self._producers)):
            if key.startswith(head):
                try:
                    return kind, tuple(int(x) for x in key[len(head):].split(b"/"))
                except ValueError:
                    return None
        if key == self.leader:
            return "leader", ()
        if key == self.schema:
            return "schema", ()
        if key.startswith(self._counter):
            return "counter:" + key[len(self._counter):].decode(errors="replace"), ()
        return None


COUNTER_STREAM: Final = "next_stream_id"
COUNTER_NODE: Final = "next_node_id"
_COUNTER_FIRST: Final = {COUNTER_STREAM: FIRST_STREAM_ID, COUNTER_NODE: FIRST_NODE_ID}


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


# ---------------------------------------------------------------------------- codec
def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_stream(s: StreamMeta) -> bytes:
    return _dumps({"replica_nums": s.replica_nums, "retention_period_ms": s.retention_period_ms,
                   "start_offset": s.start_offset, "deleted": s.deleted,
                   "created_ms": s.created_ms, "updated_ms": s.updated_ms})


def decode_stream(sid: int, v: bytes) -> StreamMeta:
    d = json.loads(v)
    return StreamMeta(sid, int(d["replica_nums"]), int(d["retention_period_ms"]),
                      int(d["start_offset"]), bool(d["deleted"]), int(d["created_ms"]),
                      int(d["updated_ms"]))


def _sorted_replicas(reps: Iterable[ReplicaMeta]) -> tuple[ReplicaMeta, ...]:
    # Primary first, then by node id: the order the SQLite backend reads back.
    return tuple(sorted(reps, key=lambda r: (not r.is_primary, r.node_id)))


def encode_range(r: RangeMeta) -> bytes:
    return _dumps({"start_offset": r.start_offset, "end_offset": r.end_offset,
                   "next_offset": r.next_offset,
                   "replicas": [[x.node_id, int(x.is_primary)] for x in r.replicas]})


def decode_range(sid: int, idx: int, v: bytes) -> RangeMeta:
    d = json.loads(v)
    reps = _sorted_replicas(ReplicaMeta(int(n), bool(p)) for n, p in d["replicas"])
    return RangeMeta(sid, idx, int(d["start_offset"]), int(d["end_offset"]),
                     int(d["next_offset"]), reps)


def encode_producers(ps: Sequence[ProducerStateMeta]) -> bytes:
    return _dumps([[p.producer_id, p.producer_epoch, p.last_sequence, p.last_base_offset]
                   for p in ps])


def decode_producers(v: bytes) -> tuple[ProducerStateMeta, ...]:
    return tuple(ProducerStateMeta(int(a), int(b), int(c), int(d)) for a, b, c, d in json.loads(v))


def encode_node(n: NodeMeta) -> bytes:
    return _dumps({"host": n.host, "advertise_addr": n.advertise_addr,
                   "registered_ms": n.registered_ms, "last_heartbeat_ms": n.last_heartbeat_ms,
                   "metrics": None if n.metrics is None else n.metrics.to_dict(),
                   "metrics_ms": n.metrics_ms})


def decode_node(nid: int, v: bytes) -> NodeMeta:
    d = json.loads(v)
    m = d.get("metrics")
    return NodeMeta(nid, str(d["host"]), str(d["advertise_addr"]), int(d["registered_ms"]),
                    int(d.get("last_heartbeat_ms", 0)),
                    NodeMetrics.from_dict(m) if isinstance(m, dict) else None,
                    int(d.get("metrics_ms", 0)))


def encode_leader(address: str) -> bytes:
    return _dumps({"address": address, "since_ms": int(time.time() * 1000)})


def decode_leader(v: bytes) -> str:
    try:
        return str(json.loads(v).get("address", ""))
    except (ValueError, AttributeError):
        return ""


# ---------------------------------------------------------------------------- client
def _rpc_error(e: Exception, what: str) -> SbpError:
    code = e.code() if isinstance(e, rpc.AioRpcError) else None
    details = e.details() if isinstance(e, rpc.AioRpcError) else str(e)
    return MetadataError(f"etcd {what} failed: {getattr(code, 'name', code)}: {details}")


class EtcdClient:
    """The few etcd v3 calls sbpstream needs, over aetcd's generated gRPC bindings (grpc.aio).

    With several endpoints, a call that finds its endpoint unavailable moves the client to the
    next one (the failed call still reports MetadataError: a write's outcome is unknown)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._index = 0
        self._channel: Any = None
        self.kv: Any = None
        self.lease: Any = None
        self.watch_stub: Any = None

    @property
    def endpoint(self) -> str:
        h, p = self.settings.endpoints[self._index % len(self.settings.endpoints)]
        return f"{h}:{p}"

    def _open(self) -> None:
        opts = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES)]
        self._channel = rpc.insecure_channel(self.endpoint, options=opts)
        self.kv = rpc.KVStub(self._channel)
        self.lease = rpc.LeaseStub(self._channel)
        self.watch_stub = rpc.WatchStub(self._channel)

    async def connect(self) -> None:
        """Open a channel to the first endpoint that answers."""
        errors: list[str] = []
        for _ in self.settings.endpoints:
            if self._channel is None:
                self._open()
            try:
                await self.kv.Range(rpc.RangeRequest(key=b"\0", count_only=True),
                                    timeout=self.settings.request_timeout_s)
                return
            except rpc.AioRpcError as e:
                errors.append(f"{self.endpoint}: {e.code().name}")
                await self.rotate()
        raise MetadataError(f"no etcd endpoint answered ({'; '.join(errors)})")

    async def rotate(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            await ch.close()
        self._index += 1
        self._open()

    async def close(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            await ch.close()

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._channel is None:
            raise MetadataError("etcd client is closed")
        try:
            return await fn()
        except rpc.AioRpcError as e:
            if e.code() == rpc.StatusCode.UNAVAILABLE and len(self.settings.endpoints) > 1:
                await self.rotate()
            raise _rpc_error(e, what) from e

    async def txn(self, req: Any) -> Any:
        t = self.settings.request_timeout_s
        return await self._call("txn", lambda: self.kv.Txn(req, timeout=t))

    async def range(self, key: bytes, range_end: bytes = b"", *, limit: int = 0,
                    revision: int = 0) -> Any:
        req = rpc.RangeRequest(key=key, range_end=range_end, limit=limit, revision=revision)
        t = self.settings.request_timeout_s
        return await self._call("range", lambda: self.kv.Range(req, timeout=t))

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        t = self.settings.request_timeout_s
        r = await self._call(
            "lease grant", lambda: self.lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s),
                                                          timeout=t))
        if r.error:
            raise MetadataError(f"etcd lease grant failed: {r.error}")
        return int(r.ID), int(r.TTL)

    async def revoke(self, lease_id: int) -> None:
        t = self.settings.request_timeout_s
        await self._call("lease revoke", lambda: self.lease.LeaseRevoke(
            rpc.LeaseRevokeRequest(ID=lease_id), timeout=t))

    async def keepalive(self, lease_id: int, timeout_s: float) -> int:
        """One keepalive round trip: the lease's new TTL in seconds (<= 0: the lease is gone)."""

        async def one() -> int:
            call = self.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                             timeout=timeout_s)
            try:
                async for reply in call:
                    return int(reply.TTL)
            finally:
                call.cancel()
            return 0

        result: int = await self._call("lease keepalive", one)
        return result

    def watch(self, requests: AsyncIterator[Any]) -> Any:
        if self._channel is None:
            raise MetadataError("etcd client is closed")
        return self.watch_stub.Watch(requests)


# ---------------------------------------------------------------------------- cache
@dataclass(slots=True)
class _Cache:
    """Everything under the prefix, decoded, with each key's mod_revision."""

    keys: Keys
    streams: dict[int, tuple[StreamMeta, int]] = field(default_factory=dict)
    ranges: dict[int, dict[int, tuple[RangeMeta, int]]] = field(default_factory=dict)
    producers: dict[tuple[int, int], tuple[tuple[ProducerStateMeta, ...], int]] = field(
        default_factory=dict)
    nodes: dict[int, tuple[NodeMeta, int]] = field(default_factory=dict)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)
    by_node: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    schema: int | None = None
    leader: tuple[str, int] | None = None
    """(address, create_revision) of the leader key."""
    applied: int = 0
    _live_sorted: list[int] | None = None

    def put(self, key: bytes, value: bytes, mod_rev: int, create_rev: int,
            known: object = None) -> None:
        """Apply a put. ``known`` is the decoded value when this PM wrote exactly these bytes
        itself (its own writes skip JSON decoding)."""
        parsed = self.keys.parse(key)
        if parsed is None:
            return
        kind, ids = parsed
        try:
            if kind == "stream":
                s = known if isinstance(known, StreamMeta) else decode_stream(ids[0], value)
                self._put_stream(s, mod_rev)
            elif kind == "range":
                self._drop_range(ids[0], ids[1])
                rng = (known if isinstance(known, RangeMeta)
                       else decode_range(ids[0], ids[1], value))
                self.ranges.setdefault(ids[0], {})[ids[1]] = (rng, mod_rev)
                for nid in rng.node_ids:
                    self.by_node.setdefault(nid, set()).add((ids[0], ids[1]))
            elif kind == "producers":
                ps = known if isinstance(known, tuple) else decode_producers(value)
                self.producers[(ids[0], ids[1])] = (ps, mod_rev)
            elif kind == "node":
                n = known if isinstance(known, NodeMeta) else decode_node(ids[0], value)
                self.nodes[ids[0]] = (n, mod_rev)
            elif kind == "leader":
                self.leader = (decode_leader(value), create_rev)
            elif kind == "schema":
                self.schema = int(value)
            elif kind.startswith("counter:"):
                self.counters[kind[len("counter:"):]] = (int(value), mod_rev)
        except (ValueError, KeyError, TypeError) as e:
            log.error("event=etcd_bad_value key=%r error=%r", key, e)

    def delete(self, key: bytes) -> None:
        parsed = self.keys.parse(key)
        if parsed is None:
            return
        kind, ids = parsed
        if kind == "stream":
            if self.streams.pop(ids[0], None) is not None:
                self._live_sorted = None
        elif kind == "range":
            self._drop_range(ids[0], ids[1])
        elif kind == "producers":
            self.producers.pop((ids[0], ids[1]), None)
        elif kind == "node":
            self.nodes.pop(ids[0], None)
        elif kind == "leader":
            self.leader = None
        elif kind == "schema":
            self.schema = None
        elif kind.startswith("counter:"):
            self.counters.pop(kind[len("counter:"):], None)

    def _put_stream(self, s: StreamMeta, mod_rev: int) -> None:
        old = self.streams.get(s.stream_id)
        self.streams[s.stream_id] = (s, mod_rev)
        live = self._live_sorted
        if live is None:
            return
        was_live = old is not None and not old[0].deleted
        if was_live == (not s.deleted):
            return
        if not s.deleted and (not live or live[-1] < s.stream_id):
            live.append(s.stream_id)  # the common case: ids only grow
        else:
            self._live_sorted = None

    def _drop_range(self, sid: int, idx: int) -> None:
        per = self.ranges.get(sid)
        if per is None:
            return
        old = per.pop(idx, None)
        if old is not None:
            for nid in old[0].node_ids:
                s = self.by_node.get(nid)
                if s is not None:
                    s.discard((sid, idx))
        if not per:
            del self.ranges[sid]

    def live_sorted(self) -> list[int]:
        if self._live_sorted is None:
            self._live_sorted = sorted(sid for sid, (s, _) in self.streams.items()
                                       if not s.deleted)
        return self._live_sorted

    def stream_rev(self, sid: int) -> int:
        got = self.streams.get(sid)
        return 0 if got is None else got[1]

    def range_rev(self, sid: int, idx: int) -> int:
        got = self.ranges.get(sid, {}).get(idx)
        return 0 if got is None else got[1]


# ---------------------------------------------------------------------------- staging
@dataclass(slots=True)
class _Layer:
    """Writes staged over the cache: one item's, or one transaction's (items merged)."""

    streams: dict[int, StreamMeta] = field(default_factory=dict)
    ranges: dict[tuple[int, int], RangeMeta] = field(default_factory=dict)
    dropped: dict[int, int] = field(default_factory=dict)
    """stream id -> ranges (and their producer states) with index < bound are deleted."""
    producers: dict[tuple[int, int], tuple[ProducerStateMeta, ...]] = field(default_factory=dict)
    nodes: dict[int, NodeMeta] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    puts: dict[bytes, bytes] = field(default_factory=dict)
    spans: list[tuple[bytes, bytes]] = field(default_factory=list)
    compares: dict[bytes, int] = field(default_factory=dict)
    """key -> the mod_revision it must still have (0: must not exist)."""
    decoded: dict[bytes, object] = field(default_factory=dict)
    """key -> the object its put value encodes, as the cache would decode it."""
    nbytes: int = 0

    @property
    def ops(self) -> int:
        return len(self.puts) + len(self.spans) + len(self.counters)

    @property
    def empty(self) -> bool:
        return not (self.puts or self.spans or self.counters)

    def conflicts(self, other: _Layer) -> bool:
        """True when the two touch a common key (etcd refuses that within one txn)."""
        if self.puts.keys() & other.puts.keys():
            return True
        for a, b in (self, other), (other, self):
            for start, end in a.spans:
                if any(start <= k < end for k in b.puts):
                    return True
                if any(s < end and start < e for s, e in b.spans):
                    return True
        return False

    def merge(self, item: _Layer) -> None:
        self.streams.update(item.streams)
        self.ranges.update(item.ranges)
        self.dropped.update(item.dropped)
        self.producers.update(item.producers)
        self.nodes.update(item.nodes)
        self.counters.update(item.counters)
        self.puts.update(item.puts)
        self.spans.extend(item.spans)
        self.compares.update(item.compares)
        self.decoded.update(item.decoded)
        self.nbytes += item.nbytes


class _View:
    """Reads through staged layers (top first) to the cache; writes go to the top layer."""

    def __init__(self, cache: _Cache, below: _Layer, top: _Layer) -> None:
        self.c = cache
        self.below = below
        self.top = top
        self.k = cache.keys

    # --- reads
    def stream(self, sid: int) -> StreamMeta | None:
        for layer in (self.top, self.below):
            if sid in layer.streams:
                return layer.streams[sid]
        got = self.c.streams.get(sid)
        return None if got is None else got[0]

    def live_stream(self, sid: int) -> StreamMeta:
        s = self.stream(sid)
        if s is None:
            raise StreamNotFoundError(f"stream {sid} does not exist")
        if s.deleted:
            raise StreamDeletedError(f"stream {sid} was deleted")
        return s

    def ranges(self, sid: int) -> list[RangeMeta]:
        cur = {i: r for i, (r, _) in self.c.ranges.get(sid, {}).items()}
        for layer in (self.below, self.top):
            bound = layer.dropped.get(sid)
            if bound is not None:
                cur = {i: r for i, r in cur.items() if i >= bound}
            for (s, i), r in layer.ranges.items():
                if s == sid:
                    cur[i] = r
        return [cur[i] for i in sorted(cur)]

    def range(self, sid: int, idx: int) -> RangeMeta | None:
        for layer in (self.top, self.below):
            if (sid, idx) in layer.ranges:
                return layer.ranges[(sid, idx)]
            if idx < layer.dropped.get(sid, -1):
                return None
        got = self.c.ranges.get(sid, {}).get(idx)
        return None if got is None else got[0]

    def producers(self, sid: int, idx: int) -> tuple[ProducerStateMeta, ...]:
        for layer in (self.top, self.below):
            if (sid, idx) in layer.producers:
                return layer.producers[(sid, idx)]
            if idx < layer.dropped.get(sid, -1):
                return ()
        got = self.c.producers.get((sid, idx))
        return () if got is None else got[0]

    def node(self, nid: int) -> NodeMeta | None:
        for layer in (self.top, self.below):
            if nid in layer.nodes:
                return layer.nodes[nid]
        got = self.c.nodes.get(nid)
        return None if got is None else got[0]

    def counter(self, name: str) -> int:
        for layer in (self.top, self.below):
            if name in layer.counters:
                return layer.counters[name]
        got = self.c.counters.get(name)
        if got is None:
            raise MetadataError(f"metadata counter {name!r} missing in etcd")
        return got[0]

    # --- writes
    def _put(self, key: bytes, value: bytes, cached_rev: int, decoded: object) -> None:
        top = self.top
        top.puts[key] = value
        top.decoded[key] = decoded
        top.compares.setdefault(key, cached_rev)
        top.nbytes += len(key) + len(value) + OP_OVERHEAD_BYTES

    def put_stream(self, s: StreamMeta) -> None:
        self.top.streams[s.stream_id] = s
        self._put(self.k.stream(s.stream_id), encode_stream(s), self.c.stream_rev(s.stream_id),
                  s)

    def put_range(self, r: RangeMeta) -> None:
        if len(set(r.node_ids)) != len(r.node_ids):
            raise MetadataError(
                f"range {r.range_index} of stream {r.stream_id} lists a node twice")
        self.top.ranges[(r.stream_id, r.range_index)] = r
        self._put(self.k.range(r.stream_id, r.range_index), encode_range(r),
                  self.c.range_rev(r.stream_id, r.range_index),
                  replace(r, replicas=_sorted_replicas(r.replicas)))

    def put_producers(self, sid: int, idx: int, ps: tuple[ProducerStateMeta, ...]) -> None:
        self.top.producers[(sid, idx)] = ps
        got = self.c.producers.get((sid, idx))
        self._put(self.k.producers(sid, idx), encode_producers(ps),
                  0 if got is None else got[1], ps)

    def put_node(self, n: NodeMeta) -> None:
        self.top.nodes[n.node_id] = n
        got = self.c.nodes.get(n.node_id)
        self._put(self.k.node(n.node_id), encode_node(n), 0 if got is None else got[1], n)

    def drop_ranges_below(self, sid: int, bound: int) -> None:
        """Delete ranges (and their producer states) of ``sid`` with index < bound."""
        self.top.dropped[sid] = max(bound, self.top.dropped.get(sid, 0))
        for span in (self.k.ranges_below(sid, bound), self.k.producers_below(sid, bound)):
            self.top.spans.append(span)
            self.top.nbytes += len(span[0]) + len(span[1]) + OP_OVERHEAD_BYTES

    def next_id(self, name: str) -> int:
        v = self.counter(name)
        self.top.counters[name] = v + 1
        return v


# ---------------------------------------------------------------------------- the store
class EtcdMetadataStore:
    """:class:`~sbpstream.pm.metadata.MetadataStore` on etcd v3.

    Writes need leadership: :mod:`sbpstream.pm.leader` calls :meth:`assume_leadership` with the
    fencing token when this PM wins and :meth:`drop_leadership` when it loses. Without a token,
    writes raise PmNotLeaderError carrying the leader's address."""

    def __init__(self, settings: EtcdSettings | str) -> None:
        self.settings = parse_etcd_url(settings) if isinstance(settings, str) else settings
        self.keys = Keys(self.settings.prefix)
        self.client = EtcdClient(self.settings)
        self._cache = _Cache(self.keys)
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
        self._pending_heartbeats: dict[int, int] = {}
        self._pending_metrics: dict[int, tuple[NodeMetrics, int]] = {}
        self._last_flush = time.monotonic()
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
            (k.counter(name), str(first).encode()) for name, first in _COUNTER_FIRST.items()]
        req = rpc.TxnRequest(
            compare=[_cmp_create(k.schema, 0)],
            success=[_put_op(key, v) for key, v in puts],
            failure=[_get_op(k.schema)],
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
        cache = _Cache(self.keys)
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

    async def _write(
        self, items: Sequence[ItemT], plan: Callable[[_View, ItemT], T]
    ) -> list[T | SbpError]:
        """Plan each item against the cache plus earlier items' staged writes, pack items into
        fenced transactions, commit them in order. One outcome per item."""
        self._require_leader()
        async with self._write_lock:
            if self._needs_sync:
                await self.sync()
                self._needs_sync = False
            out: list[T | SbpError | None] = [None] * len(items)
            committed_any = False
            i = 0
            retries = 0
            while i < len(items):
                chunk, pending, start = _Layer(), [], i
                while i < len(items):
                    item = _Layer()
                    try:
                        res = plan(_View(self._cache, chunk, item), items[i])
                    except SbpError as e:
                        out[i] = e
                        i += 1
                        continue
                    if not item.empty and not chunk.empty and (
                        item.conflicts(chunk) or not self._fits(chunk, item)
                    ):
                        break  # commit what we have; re-plan this item on the fresh cache
                    if not self._fits(_Layer(), item):
                        out[i] = LimitExceededError(
                            f"item {i} needs {item.ops} etcd operations / {item.nbytes} bytes; "
                            f"a transaction allows {self.settings.max_txn_ops} / {MAX_TXN_BYTES}")
                        i += 1
                        continue
                    chunk.merge(item)
                    pending.append((i, res))
                    i += 1
                if chunk.empty:
                    for j, res in pending:
                        out[j] = res
                    continue
                try:
                    await self._commit(chunk)
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

    def _fits(self, chunk: _Layer, item: _Layer) -> bool:
        counters = len(chunk.counters.keys() | item.counters.keys())
        ops = len(chunk.puts) + len(chunk.spans) + len(item.puts) + len(item.spans) + counters
        compares = 1 + counters + len(chunk.compares) + len(item.compares)
        return (max(ops, compares) <= self.settings.max_txn_ops
                and chunk.nbytes + item.nbytes <= MAX_TXN_BYTES)

    async def _commit(self, chunk: _Layer) -> None:
        token = self._token
        if token is None:
            raise self._not_leader()
        k, c = self.keys, self._cache
        compare = [_cmp_create(k.leader, token)]
        success: list[Any] = []
        for name, value in chunk.counters.items():
            got = c.counters.get(name)
            compare.append(_cmp_mod(k.counter(name), 0 if got is None else got[1]))
            success.append(_put_op(k.counter(name), str(value).encode()))
        for key, rev in chunk.compares.items():
            compare.append(_cmp_mod(key, rev))
        for start, end in chunk.spans:
            success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                key=start, range_end=end)))
        success.extend(_put_op(key, v) for key, v in chunk.puts.items())
        req = rpc.TxnRequest(compare=compare, success=success, failure=[_get_op(k.leader)])
        own = self._own_writes
        for key, put_value in chunk.puts.items():
            own[key] = (put_value, chunk.decoded[key])
        try:
            resp = await self.client.txn(req)
            if resp.succeeded:
                await self.wait_applied(int(resp.header.revision))
        except SbpError:
            self._needs_sync = True  # the outcome is unknown: re-read before the next write
            raise
        finally:
            for key in chunk.puts:
                own.pop(key, None)
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if not kvs or int(kvs[0].create_revision) != token:
                leader = decode_leader(kvs[0].value) if kvs else ""
                self.drop_leadership()
                log.warning("event=etcd_write_fenced token=%d leader=%s", token, leader)
                raise self._fenced(leader)
            log.warning("event=etcd_write_conflict keys=%d", len(chunk.compares))
            raise _Conflict()
        self.txns += 1

    async def _write_one(self, item: ItemT, plan: Callable[[_View, ItemT], T]) -> T:
        (out,) = await self._write([item], plan)
        if isinstance(out, SbpError):
            raise out
        return out

    # ------------------------------------------------------------------ soft state
    def _soft_due(self) -> bool:
        return time.monotonic() - self._last_flush >= SOFT_STATE_FLUSH_INTERVAL_S

    async def record_heartbeat(self, node_id: int, now_ms: int) -> None:
        self._pending_heartbeats[node_id] = now_ms
        if self._soft_due():
            await self._flush_quietly()

    async def record_metrics(self, node_id: int, metrics: NodeMetrics, now_ms: int) -> None:
        self._pending_metrics[node_id] = (metrics, now_ms)
        if self._soft_due():
            await self._flush_quietly()

    async def _flush_quietly(self) -> None:
        try:
            await self.flush_soft_state()
        except SbpError as e:
            log.warning("event=soft_state_flush_failed error=%r", str(e))

    async def flush_soft_state(self) -> None:
        """Write pending heartbeat times and metrics (leader only; a follower drops them)."""
        self._last_flush = time.monotonic()
        ids = sorted(self._pending_heartbeats.keys() | self._pending_metrics.keys())
        if not ids:
            return
        if self._token is None:
            self._pending_heartbeats.clear()
            self._pending_metrics.clear()
            return

        def plan(v: _View, nid: int) -> None:
            n = v.node(nid)
            if n is not None:
                v.put_node(self._with_soft(n))

        await self._write(ids, plan)
        for nid in ids:
            self._pending_heartbeats.pop(nid, None)
            self._pending_metrics.pop(nid, None)

    def _with_soft(self, n: NodeMeta) -> NodeMeta:
        hb = self._pending_heartbeats.get(n.node_id)
        if hb is not None:
            n = replace(n, last_heartbeat_ms=hb)
        m = self._pending_metrics.get(n.node_id)
        if m is not None:
            n = replace(n, metrics=m[0], metrics_ms=m[1])
        return n

    # ------------------------------------------------------------------ data nodes
    async def allocate_node_id(self, host: str, now_ms: int) -> int:
        def plan(v: _View, host: str) -> int:
            nid = v.counter(COUNTER_NODE)
            if nid > MAX_NODE_ID:
                raise LimitExceededError("node ids exhausted (int32)")
            v.next_id(COUNTER_NODE)
            if v.node(nid) is not None:
                raise MetadataError(f"node id {nid} is already registered")
            v.put_node(NodeMeta(nid, host, "", now_ms))
            return nid

        return await self._write_one(host, plan)

    async def get_node(self, node_id: int) -> NodeMeta | None:
        got = self._cache.nodes.get(node_id)
        return None if got is None else self._with_soft(got[0])

    async def list_nodes(self) -> list[NodeMeta]:
        return [self._with_soft(n) for _, (n, _) in sorted(self._cache.nodes.items())]

    async def update_node_address(self, node_id: int, advertise_addr: str) -> NodeMeta:
        def plan(v: _View, nid: int) -> NodeMeta:
            n = v.node(nid)
            if n is None:
                raise DataNodeNotFoundError(f"data node {nid} was never allocated here")
            n = replace(self._with_soft(n), advertise_addr=advertise_addr)
            v.put_node(n)
            return n

        n = await self._write_one(node_id, plan)
        self._pending_heartbeats.pop(node_id, None)
        self._pending_metrics.pop(node_id, None)
        return n

    # ------------------------------------------------------------------ streams
    async def create_streams(
        self, items: Sequence[NewStream], now_ms: int
    ) -> list[CreatedStream | SbpError]:
        """Reserve a block of ids (one CAS transaction on the counter), then write the items in
        transactions of whole items, up to CREATE_PIPELINE_DEPTH in flight. An item whose
        transaction fails burns its id (as in SQLite, ids are never reused)."""
        if not items:
            return []
        self._require_leader()
        async with self._write_lock:
            if self._needs_sync:
                await self.sync()
                self._needs_sync = False
            first = await self._reserve_ids(COUNTER_STREAM, len(items), MAX_STREAM_ID)
            out: list[CreatedStream | SbpError | None] = [None] * len(items)
            chunks: list[tuple[_Layer, list[tuple[int, CreatedStream]]]] = []
            chunk, pending = _Layer(), list[tuple[int, CreatedStream]]()
            for i, item in enumerate(items):
                layer = _Layer()
                try:
                    res = self._plan_create(_View(self._cache, chunk, layer), first + i, item,
                                            now_ms)
                except SbpError as e:
                    out[i] = e
                    continue
                if not self._fits(chunk, layer):
                    chunks.append((chunk, pending))
                    chunk, pending = _Layer(), list[tuple[int, CreatedStream]]()
                chunk.merge(layer)
                pending.append((i, res))
            if pending:
                chunks.append((chunk, pending))
            errors = await self._commit_all([c for c, _ in chunks])
            for (_, pend), err in zip(chunks, errors, strict=True):
                for i, res in pend:
                    out[i] = res if err is None else err
            if errors and all(e is not None for e in errors):
                raise next(e for e in errors if e is not None)  # nothing committed
            return [o for o in out if o is not None]

    @staticmethod
    def _plan_create(v: _View, sid: int, item: NewStream, now_ms: int) -> CreatedStream:
        stream = StreamMeta(sid, item.replica_nums, item.retention_period_ms, 0, False,
                            now_ms, now_ms)
        rng = RangeMeta(sid, 0, 0, WRITABLE_END_OFFSET, 0, item.replicas)
        if v.stream(sid) is not None or v.range(sid, 0) is not None:
            raise MetadataError(f"could not create stream: id {sid} is already in use")
        v.put_stream(stream)
        v.put_range(rng)
        return CreatedStream(stream, rng)

    async def _reserve_ids(self, name: str, n: int, max_id: int) -> int:
        """Advance counter ``name`` by ``n`` with compare-and-swap; the first id of the block."""
        for _ in range(CONFLICT_RETRIES + 1):
            got = self._cache.counters.get(name)
            if got is None:
                raise MetadataError(f"metadata counter {name!r} missing in etcd")
            first = got[0]
            if first + n - 1 > max_id:
                raise LimitExceededError(f"{name}: ids exhausted (max {max_id})")
            block = _Layer()
            block.counters[name] = first + n
            try:
                await self._commit(block)
                return first
            except _Conflict:
                await self.sync()
        raise MetadataError(f"etcd counter {name} changed concurrently; retry")

    async def _commit_all(self, chunks: Sequence[_Layer]) -> list[SbpError | None]:
        """Commit independent chunks, CREATE_PIPELINE_DEPTH at a time; per chunk its error."""
        sem = asyncio.Semaphore(CREATE_PIPELINE_DEPTH)

        async def one(chunk: _Layer) -> SbpError | None:
            async with sem:
                try:
                    await self._commit(chunk)
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

    async def update_streams(
        self, items: Sequence[StreamUpdate], now_ms: int
    ) -> list[StreamMeta | SbpError]:
        if not items:
            return []

        def plan(v: _View, u: StreamUpdate) -> StreamMeta:
            s = replace(v.live_stream(u.stream_id), replica_nums=u.replica_nums,
                        retention_period_ms=u.retention_period_ms, updated_ms=now_ms)
            v.put_stream(s)
            return s

        return await self._write(list(items), plan)

    async def trim_streams(
        self, items: Sequence[tuple[int, int]], now_ms: int
    ) -> list[TrimOutcome | SbpError]:
        if not items:
            return []

        def plan(v: _View, it: tuple[int, int]) -> TrimOutcome:
            sid, trim_offset = it
            if trim_offset < 0:
                raise InvalidRequestError(f"trim offset {trim_offset} is negative")
            stream = v.live_stream(sid)
            ranges = v.ranges(sid)
            if trim_offset <= stream.start_offset:
                return TrimOutcome(stream, ranges[0] if ranges else None, ())
            dropped = tuple(r for r in ranges if not r.writable and r.end_offset <= trim_offset)
            remaining = ranges[len(dropped):]
            if dropped:
                bound = remaining[0].range_index if remaining else _ALL
                v.drop_ranges_below(sid, bound)
            first: RangeMeta | None = None
            if remaining:
                r0 = remaining[0]
                start = max(r0.start_offset, trim_offset)
                first = replace(r0, start_offset=start, next_offset=max(r0.next_offset, start))
                if first != r0:
                    v.put_range(first)
            s = replace(stream, start_offset=trim_offset, updated_ms=now_ms)
            v.put_stream(s)
            return TrimOutcome(s, first, dropped)

        return await self._write(list(items), plan)

    async def delete_streams(
        self, stream_ids: Sequence[int], now_ms: int
    ) -> list[DeleteOutcome | SbpError]:
        if not stream_ids:
            return []

        def plan(v: _View, sid: int) -> DeleteOutcome:
            stream = v.live_stream(sid)
            ranges = v.ranges(sid)
            v.drop_ranges_below(sid, _ALL)
            s = replace(stream, deleted=True, updated_ms=now_ms)
            v.put_stream(s)
            return DeleteOutcome(s, tuple(ranges))

        return await self._write(list(stream_ids), plan)

    # ------------------------------------------------------------------ ranges
    async def list_ranges(self, stream_ids: Sequence[int]) -> list[list[RangeMeta]]:
        ranges = self._cache.ranges
        out: list[list[RangeMeta]] = []
        for sid in stream_ids:
            per = ranges.get(sid, {})
            out.append([per[i][0] for i in sorted(per)])
        return out

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
        got = self._cache.ranges.get(stream_id, {}).get(range_index)
        return None if got is None else got[0]

    async def writable_range_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for per in self._cache.ranges.values():
            for r, _ in per.values():
                if r.writable:
                    for nid in r.node_ids:
                        counts[nid] = counts.get(nid, 0) + 1
        return counts

    async def record_next_offsets(self, updates: Sequence[tuple[int, int, int]]) -> None:
        todo = []
        for sid, idx, nxt in updates:
            r = await self.get_range(sid, idx)
            if r is not None and r.writable and nxt > r.next_offset:
                todo.append((sid, idx, nxt))
        if not todo:
            return

        def plan(v: _View, it: tuple[int, int, int]) -> None:
            sid, idx, nxt = it
            r = v.range(sid, idx)
            if r is not None and r.writable and nxt > r.next_offset:
                v.put_range(replace(r, next_offset=nxt))

        await self._write(todo, plan)

    async def seal_and_new(
        self,
        stream_id: int,
        range_index: int,
        end_offset: int,
        new_replicas: tuple[ReplicaMeta, ...],
        producers: Sequence[ProducerStateMeta],
    ) -> SealOutcome:
        def plan(v: _View, _: None) -> SealOutcome:
            v.live_stream(stream_id)
            cur = v.range(stream_id, range_index)
            if cur is None:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            end = end_offset
            if not cur.writable:
                nxt = v.range(stream_id, range_index + 1)
                if nxt is not None:  # any sealed range: its pair and its producer states
                    return SealOutcome(cur, nxt, v.producers(stream_id, range_index), False)
                end = cur.end_offset  # a sealed last range: open its successor
            elif end < cur.start_offset:
                raise InvalidRequestError(f"seal end {end} is below range start "
                                          f"{cur.start_offset}")
            if not new_replicas:
                raise InvalidRequestError("a new range needs at least one replica")
            sealed = replace(cur, end_offset=end, next_offset=end)
            new = RangeMeta(stream_id, range_index + 1, end, WRITABLE_END_OFFSET, end,
                            _sorted_replicas(new_replicas))
            v.put_range(sealed)
            v.put_range(new)
            if producers:
                merged = {p.producer_id: p for p in v.producers(stream_id, range_index)}
                merged.update((p.producer_id, p) for p in producers)
                v.put_producers(stream_id, range_index,
                                tuple(merged[k] for k in sorted(merged)))
            return SealOutcome(sealed, new, v.producers(stream_id, range_index), True)

        return await self._write_one(None, plan)

    async def get_seal_producers(
        self, stream_id: int, range_index: int
    ) -> tuple[ProducerStateMeta, ...]:
        got = self._cache.producers.get((stream_id, range_index))
        return () if got is None else got[0]

    async def replace_replica(
        self, stream_id: int, range_index: int, old_node_id: int, new_node_id: int
    ) -> RangeMeta:
        def plan(v: _View, _: None) -> RangeMeta:
            v.live_stream(stream_id)
            cur = v.range(stream_id, range_index)
            new = replace_in(cur, stream_id, range_index, old_node_id, new_node_id)
            if new is None:
                assert cur is not None
                return cur
            new = replace(new, replicas=_sorted_replicas(new.replicas))
            v.put_range(new)
            return new

        return await self._write_one(None, plan)


class _Conflict(Exception):
    """A mod_revision compare failed while this PM still leads: the cache was stale."""


def _cmp_create(key: bytes, create_revision: int) -> Any:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key,
                       create_revision=create_revision)


def _cmp_mod(key: bytes, mod_revision: int) -> Any:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key,
                       mod_revision=mod_revision)


def _put_op(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _get_op(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_TXN_OPS",
    "MAX_TXN_BYTES",
    "EtcdClient",
    "EtcdMetadataStore",
    "EtcdSettings",
    "Keys",
    "is_etcd_url",
    "parse_etcd_url",
]
