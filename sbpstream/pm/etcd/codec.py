"""JSON values of the etcd keys (docs/etcd.md). Compact separators; a range's replicas are
stored in the order the writer gave and read back in the one order every read returns."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from sbpstream.pm.metadata import (
    NodeMeta,
    NodeMetrics,
    OffsetMeta,
    ProducerStateMeta,
    RangeMeta,
    ReplicaMeta,
    StreamMeta,
)
from sbpstream.pm.rules import sorted_replicas
from sbpstream.quota.model import QuotaKind, QuotaSpec


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_stream(s: StreamMeta) -> bytes:
    d: dict[str, object] = {
        "replica_nums": s.replica_nums, "retention_period_ms": s.retention_period_ms,
        "start_offset": s.start_offset, "deleted": s.deleted, "created_ms": s.created_ms,
        "updated_ms": s.updated_ms}
    if s.name:
        d["name"] = s.name  # only when named: unnamed streams keep their old bytes
    return _dumps(d)


def decode_stream(sid: int, v: bytes) -> StreamMeta:
    d = json.loads(v)
    return StreamMeta(sid, int(d["replica_nums"]), int(d["retention_period_ms"]),
                      int(d["start_offset"]), bool(d["deleted"]), int(d["created_ms"]),
                      int(d["updated_ms"]), str(d.get("name", "")))


def encode_range(r: RangeMeta) -> bytes:
    return _dumps({"start_offset": r.start_offset, "end_offset": r.end_offset,
                   "next_offset": r.next_offset,
                   "replicas": [[x.node_id, int(x.is_primary)] for x in r.replicas]})


def decode_range(sid: int, idx: int, v: bytes) -> RangeMeta:
    d = json.loads(v)
    reps = sorted_replicas(ReplicaMeta(int(n), bool(p)) for n, p in d["replicas"])
    return RangeMeta(sid, idx, int(d["start_offset"]), int(d["end_offset"]),
                     int(d["next_offset"]), reps)


def encode_producers(ps: Sequence[ProducerStateMeta]) -> bytes:
    return _dumps([[p.producer_id, p.producer_epoch, p.last_sequence, p.last_base_offset]
                   for p in ps])


def decode_producers(v: bytes) -> tuple[ProducerStateMeta, ...]:
    return tuple(ProducerStateMeta(int(a), int(b), int(c), int(d)) for a, b, c, d in json.loads(v))


def encode_node(n: NodeMeta) -> bytes:
    d: dict[str, object] = {
        "host": n.host, "advertise_addr": n.advertise_addr, "registered_ms": n.registered_ms,
        "last_heartbeat_ms": n.last_heartbeat_ms,
        "metrics": None if n.metrics is None else n.metrics.to_dict(), "metrics_ms": n.metrics_ms}
    if n.draining:  # only then: a node that is not draining keeps the earlier bytes
        d["draining"] = True
    return _dumps(d)


def decode_node(nid: int, v: bytes) -> NodeMeta:
    d = json.loads(v)
    m = d.get("metrics")
    return NodeMeta(nid, str(d["host"]), str(d["advertise_addr"]), int(d["registered_ms"]),
                    int(d.get("last_heartbeat_ms", 0)),
                    NodeMetrics.from_dict(m) if isinstance(m, dict) else None,
                    int(d.get("metrics_ms", 0)), bool(d.get("draining", False)))


def encode_quota(q: QuotaSpec) -> bytes:
    d: dict[str, object] = {"kind": int(q.kind), "name": q.name,
                            "produce_bytes_per_s": q.produce_bytes_per_s,
                            "fetch_bytes_per_s": q.fetch_bytes_per_s,
                            "requests_per_s": q.requests_per_s}
    if q.user:  # user and user+client-id quotas; records from before them have no "user"
        d["user"] = q.user
    return _dumps(d)


def decode_quota(v: bytes) -> QuotaSpec:
    d = json.loads(v)
    return QuotaSpec(QuotaKind(int(d["kind"])), str(d["name"]), int(d["produce_bytes_per_s"]),
                     int(d["fetch_bytes_per_s"]), int(d["requests_per_s"]),
                     str(d.get("user", "")))


def encode_offset(o: OffsetMeta) -> bytes:
    return _dumps([o.offset, o.commit_ms, o.metadata] if o.metadata else [o.offset, o.commit_ms])


def decode_offset(group: str, sid: int, v: bytes) -> OffsetMeta:
    d = json.loads(v)
    return OffsetMeta(group, sid, int(d[0]), str(d[2]) if len(d) > 2 else "", int(d[1]))


def encode_leader(address: str) -> bytes:
    return _dumps({"address": address, "since_ms": int(time.time() * 1000)})


def decode_leader(v: bytes) -> str:
    try:
        return str(json.loads(v).get("address", ""))
    except (ValueError, AttributeError):
        return ""
