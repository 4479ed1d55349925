"""Which data nodes are live, as this PM can tell: the one answer the overview (INFO, the admin
port's ``/v1/nodes``, ``sbpstream nodes``) and the cluster's traffic figures use.

Heartbeats go to the leading PM only, so only it knows liveness first hand (its
:class:`~sbpstream.pm.placement.NodeRegistry`, monotonic clock). A follower on etcd reads what
the leader persisted instead: every node's last heartbeat time (wall clock), written as soft
state at most :data:`~sbpstream.pm.rules.SOFT_STATE_FLUSH_INTERVAL_S` late, which the follower's
watched copy of etcd holds. A node is live at a follower while that time is within the node
timeout plus the lag of those writes (:func:`stored_liveness`), so a healthy node is never
reported silent there; it is reported dead only once past that longer bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sbpstream.pm.metadata import NodeMeta, NodeMetrics
from sbpstream.pm.placement import NodeRegistry
from sbpstream.pm.rules import SOFT_STATE_FLUSH_INTERVAL_S


@dataclass(frozen=True, slots=True)
class NodeLiveness:
    """One data node as the overview shows it."""

    node_id: int
    host: str
    advertise_addr: str
    live: bool
    dead: bool
    """Neither live nor dead: silent (not heard yet, within its grace period)."""
    heard_s_ago: float | None
    """Seconds since its last heartbeat; None = not heard from."""
    metrics: NodeMetrics | None


def registry_liveness(registry: NodeRegistry, now: float) -> list[NodeLiveness]:
    """The leader's (or a lone SQLite PM's) first-hand view, by node id."""
    return [NodeLiveness(st.node_id, st.host, st.advertise_addr,
                         registry.is_live(st.node_id, now), registry.is_dead(st.node_id, now),
                         None if st.last_seen is None else now - st.last_seen, st.metrics)
            for st in registry.all()]


def stored_lag_ms(heartbeat_interval_ms: int) -> int:
    """How late a heartbeat's time reaches the store at most: the soft-state flush interval,
    plus one heartbeat interval (a flush runs when a heartbeat arrives past that interval)."""
    return int(SOFT_STATE_FLUSH_INTERVAL_S * 1000) + heartbeat_interval_ms


def stored_liveness(nodes: Sequence[NodeMeta], now_ms: int, node_timeout_ms: int,
                    heartbeat_interval_ms: int) -> list[NodeLiveness]:
    """A follower's view from the leader's persisted heartbeat times (wall clock), by node id:
    live within ``node_timeout_ms`` plus :func:`stored_lag_ms` of its last heartbeat; a node
    never heard from is silent for that long after it registered, then dead."""
    bound = node_timeout_ms + stored_lag_ms(heartbeat_interval_ms)
    out = []
    for n in sorted(nodes, key=lambda n: n.node_id):
        heard = n.last_heartbeat_ms > 0
        age = now_ms - (n.last_heartbeat_ms if heard else n.registered_ms)
        live = heard and bool(n.advertise_addr) and age <= bound
        out.append(NodeLiveness(n.node_id, n.host, n.advertise_addr, live, age > bound,
                                max(age, 0) / 1000 if heard else None, n.metrics))
    return out
