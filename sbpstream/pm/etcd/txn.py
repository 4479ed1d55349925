"""A staged layer as one etcd transaction's operations, within etcd's limits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

from sbpstream.pm.etcd.cache import Cache
from sbpstream.pm.etcd.codec import (
    encode_node,
    encode_offset,
    encode_producers,
    encode_quota,
    encode_range,
    encode_stream,
)
from sbpstream.pm.rules import sorted_replicas
from sbpstream.pm.staging import NAME_DROPPED, Layer

MAX_TXN_BYTES: Final = 1024 * 1024
"""Bytes of keys and values per transaction: under etcd's default ``--max-request-bytes`` of
1.5 MiB with room for the protobuf framing and compares."""

OP_OVERHEAD_BYTES: Final = 32
"""Per-operation protobuf overhead counted against MAX_TXN_BYTES (tags, lengths, lease)."""


@dataclass(slots=True)
class TxnOps:
    """Puts, range deletes and counter updates of one or more items, with the compares that
    guard them (each overwritten key must still have the mod_revision the cache holds)."""

    puts: dict[bytes, bytes] = field(default_factory=dict)
    spans: list[tuple[bytes, bytes]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    compares: dict[bytes, int] = field(default_factory=dict)
    """key -> the mod_revision it must still have (0: must not exist)."""
    decoded: dict[bytes, object] = field(default_factory=dict)
    """key -> the object its put value encodes, as the cache would decode it."""
    nbytes: int = 0

    @classmethod
    def of(cls, layer: Layer, cache: Cache) -> TxnOps:
        """The operations writing ``layer`` (planned against ``cache``)."""
        ops = cls(counters=dict(layer.counters))
        k = cache.keys
        for sid, bound in layer.dropped.items():
            for span in (k.ranges_below(sid, bound), k.producers_below(sid, bound)):
                ops.spans.append(span)
                ops.nbytes += len(span[0]) + len(span[1]) + OP_OVERHEAD_BYTES
        for s in layer.streams.values():
            ops._put(k.stream(s.stream_id), encode_stream(s), cache.stream_rev(s.stream_id), s)
        for r in layer.all_ranges():
            ops._put(k.range(r.stream_id, r.range_index), encode_range(r),
                     cache.range_rev(r.stream_id, r.range_index),
                     replace(r, replicas=sorted_replicas(r.replicas)))
        for sid, per in layer.producers.items():
            for idx, ps in per.items():
                ops._put(k.producers(sid, idx), encode_producers(ps),
                         cache.producers_rev(sid, idx), ps)
        for n in layer.nodes.values():
            ops._put(k.node(n.node_id), encode_node(n), cache.node_rev(n.node_id), n)
        for name, sid in layer.names.items():
            # Compared like every key: a new name must still be absent (mod_revision 0), so two
            # PMs (or a deposed and a new leader) can never both take it.
            key = k.name(name)
            if sid == NAME_DROPPED:
                ops.spans.append((key, key + b"\0"))  # exactly this key
                ops.compares.setdefault(key, cache.name_rev(name))
                ops.nbytes += 2 * len(key) + OP_OVERHEAD_BYTES
            else:
                ops._put(key, str(sid).encode(), cache.name_rev(name), sid)
        for qkey, q in layer.quotas.items():
            if q is not None:
                ops._put(k.quota(qkey), encode_quota(q), cache.quota_rev(qkey), q)
            else:  # a delete: the one key, as a span [key, key + b"\0")
                span = (k.quota(qkey), k.quota(qkey) + b"\0")
                ops.spans.append(span)
                ops.nbytes += 2 * len(span[0]) + 1 + OP_OVERHEAD_BYTES
        for (group, sid), o in layer.offsets.items():
            key = k.offset(group, sid)
            if o is None:
                ops.spans.append((key, key + b"\0"))
                ops.compares.setdefault(key, cache.offset_rev(group, sid))
                ops.nbytes += 2 * len(key) + OP_OVERHEAD_BYTES
            else:
                ops._put(key, encode_offset(o), cache.offset_rev(group, sid), o)
        return ops

    def _put(self, key: bytes, value: bytes, cached_rev: int, decoded: object) -> None:
        self.puts[key] = value
        self.decoded[key] = decoded
        self.compares.setdefault(key, cached_rev)
        self.nbytes += len(key) + len(value) + OP_OVERHEAD_BYTES

    @property
    def ops(self) -> int:
        return len(self.puts) + len(self.spans) + len(self.counters)

    @property
    def empty(self) -> bool:
        return not (self.puts or self.spans or self.counters)

    def conflicts(self, other: TxnOps) -> bool:
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

    def fits_with(self, item: TxnOps, max_txn_ops: int) -> bool:
        """Whether ``item`` may join these operations in one transaction."""
        counters = len(self.counters.keys() | item.counters.keys())
        ops = len(self.puts) + len(self.spans) + len(item.puts) + len(item.spans) + counters
        compares = 1 + counters + len(self.compares) + len(item.compares)
        return max(ops, compares) <= max_txn_ops and self.nbytes + item.nbytes <= MAX_TXN_BYTES

    def merge(self, item: TxnOps) -> None:
        self.puts.update(item.puts)
        self.spans.extend(item.spans)
        self.counters.update(item.counters)
        self.compares.update(item.compares)
        self.decoded.update(item.decoded)
        self.nbytes += item.nbytes
