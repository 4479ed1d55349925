"""Where new ranges go: data node liveness and load-based replica choice. No I/O.

Liveness uses a monotonic clock: a node is *live* while its last heartbeat is at most
``node_timeout_ms`` old. A node the PM has not heard from since it started (a PM restart) is not
live for placement, but is not declared *dead* before ``node_timeout_ms`` after the PM started
either: the grace period lets every node heartbeat once before its ranges are moved.

Placement picks ``count`` distinct live nodes by a load score (lower is better)::

    score = W_RANGES * writable_ranges / max(writable_ranges of candidates)
          + W_APPEND * append_rate     / max(append_rate of candidates)
          + W_DISK   * (1 - free_disk  / max(free_disk of candidates))

``writable_ranges`` is the PM's own count of writable ranges on the node, bumped as soon as it
places one (so one batch of 1,000 creates spreads instead of piling on the node that was least
loaded when the batch began); ``append_rate`` and ``free_disk`` come from the last
REPORT_METRICS. Ties go to the lower node id, so the choice is deterministic. The best node is the
primary. Nodes that reported less than ``DISK_FREE_MIN_BYTES`` free are never chosen, nor are
nodes being drained (:mod:`sbpstream.pm.drain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from sbpstream.pm.metadata import NodeMeta, NodeMetrics, ReplicaMeta
from sbpstream.protocol.errors import NotEnoughDataNodesError, SbpError

W_RANGES: Final = 1.0
"""Writable ranges dominate: they are what the PM controls and what drives future appends."""

W_APPEND: Final = 0.5
"""Reported append traffic (requests/s plus disk bytes-in share) separates equally filled nodes."""

W_DISK: Final = 0.5
"""Emptier disks are preferred, so a nearly full node stops taking ranges before it is full."""

DISK_FREE_MIN_BYTES: Final = 64 * 1024 * 1024
"""A node reporting less free disk than this would reject appends with STORAGE_FULL soon after a
range lands there; placing ranges on it only moves the failure to the writer."""


@dataclass(slots=True)
class NodeState:
    """What the PM knows of one data node at run time."""

    node_id: int
    host: str
    advertise_addr: str
    last_seen: float | None = None
    """Monotonic seconds of the last heartbeat since this PM started; None = not heard yet."""
    metrics: NodeMetrics | None = None


class NodeRegistry:
    """Data nodes and their liveness (in memory; identity is persisted by the metadata store)."""

    def __init__(self, node_timeout_ms: int, started_at: float) -> None:
        self.node_timeout_s = node_timeout_ms / 1000
        self.started_at = started_at
        self._nodes: dict[int, NodeState] = {}

    def load(self, nodes: Iterable[NodeMeta]) -> None:
        for n in nodes:
            self._nodes[n.node_id] = NodeState(n.node_id, n.host, n.advertise_addr, None,
                                               n.metrics)

    def add(self, node_id: int, host: str, advertise_addr: str = "") -> NodeState:
        st = self._nodes.get(node_id)
        if st is None:
            st = NodeState(node_id, host, advertise_addr)
            self._nodes[node_id] = st
        return st

    def get(self, node_id: int) -> NodeState | None:
        return self._nodes.get(node_id)

    def remove(self, node_id: int) -> None:
        """The node was removed from the metadata (pm/drain.py)."""
        self._nodes.pop(node_id, None)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._nodes

    def all(self) -> list[NodeState]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    def heartbeat(self, node_id: int, advertise_addr: str, now: float) -> bool:
        """Record a heartbeat; True if the advertise address changed (persist it)."""
        st = self._nodes[node_id]
        st.last_seen = now
        if advertise_addr and advertise_addr != st.advertise_addr:
            st.advertise_addr = advertise_addr
            return True
        return False

    def excuse_stall(self, stalled_s: float, now: float) -> None:
        """This PM did not run for ``stalled_s`` (a pause: SIGSTOP, a VM stall, swap): that
        time does not count as the nodes' silence. Every node's last heartbeat (and the grace
        period's start) moves forward by it, never past ``now``, so a node silent before the
        stall stays exactly as late as it was, and none is declared dead because this PM could
        not read the heartbeats queued in its sockets (docs/pm.md, "Clocks, pauses and stale
        authority")."""
        self.started_at = min(self.started_at + stalled_s, now)
        for st in self._nodes.values():
            if st.last_seen is not None:
                st.last_seen = min(st.last_seen + stalled_s, now)

    def set_metrics(self, node_id: int, metrics: NodeMetrics) -> None:
        self._nodes[node_id].metrics = metrics

    def is_live(self, node_id: int, now: float) -> bool:
        st = self._nodes.get(node_id)
        return (
            st is not None
            and st.last_seen is not None
            and bool(st.advertise_addr)
            and now - st.last_seen <= self.node_timeout_s
        )

    def is_dead(self, node_id: int, now: float) -> bool:
        """Past the timeout: heard from too long ago, or never heard since the grace period."""
        st = self._nodes.get(node_id)
        if st is None:
            return True
        seen = st.last_seen if st.last_seen is not None else self.started_at
        return now - seen > self.node_timeout_s

    def live_nodes(self, now: float) -> list[NodeState]:
        return [st for st in self.all() if self.is_live(st.node_id, now)]


@dataclass(frozen=True, slots=True)
class NodeLoad:
    node_id: int
    writable_ranges: int
    append_rate: int
    disk_free_space: int | None
    """None when the node has not reported metrics yet."""


class _Ranking:
    """The score terms of a set of candidates, computed once; the ranges term is kept current
    as ranges are placed, so a whole batch is placed without recomputing the rest."""

    def __init__(self, candidates: Sequence[NodeLoad]) -> None:
        usable: dict[int, NodeLoad] = {}
        for c in candidates:
            if c.disk_free_space is None or c.disk_free_space >= DISK_FREE_MIN_BYTES:
                usable.setdefault(c.node_id, c)
        self.ids = sorted(usable)
        self.ranges = {n: usable[n].writable_ranges for n in self.ids}
        max_rate = max((c.append_rate for c in usable.values()), default=0)
        max_free = max((c.disk_free_space or 0 for c in usable.values()), default=0)
        self.static: dict[int, float] = {}
        for n, c in usable.items():
            s = W_APPEND * c.append_rate / max(1, max_rate)
            if c.disk_free_space is None:
                s += W_DISK * 0.5  # unknown: neither preferred nor avoided
            else:
                s += W_DISK * (1 - c.disk_free_space / max(1, max_free))
            self.static[n] = s

    def choose(self, count: int) -> list[int]:
        if count < 1:
            raise ValueError("count must be >= 1")
        if len(self.ids) < count:
            raise NotEnoughDataNodesError(
                f"need {count} live data node(s) with free disk, have {len(self.ids)}"
            )
        max_ranges = max(1, max(self.ranges.values()))
        ranges, static = self.ranges, self.static
        ranked = sorted(
            self.ids, key=lambda n: (W_RANGES * ranges[n] / max_ranges + static[n], n)
        )
        return ranked[:count]

    def take(self, node_ids: Iterable[int]) -> None:
        for n in node_ids:
            self.ranges[n] += 1


def choose_nodes(candidates: Sequence[NodeLoad], count: int) -> list[int]:
    """``count`` distinct node ids, best first. NotEnoughDataNodesError if too few qualify."""
    return _Ranking(candidates).choose(count)


class Placer:
    """Places ranges on live nodes, keeping its own count of writable ranges per node."""

    def __init__(
        self, registry: NodeRegistry, suspect: Callable[[int], bool] | None = None,
        draining: set[int] | None = None,
    ) -> None:
        self.registry = registry
        # nodes that are live by heartbeat but just failed a call: skipped for new ranges
        self.suspect = suspect
        self.draining: set[int] = set() if draining is None else draining
        """Nodes being drained (pm/drain.py): never chosen, for new ranges or copies."""
        self._writable: dict[int, int] = {}

    def reset_counts(self, counts: dict[int, int]) -> None:
        self._writable = dict(counts)

    def writable_count(self, node_id: int) -> int:
        return self._writable.get(node_id, 0)

    def loads(self, now: float) -> list[NodeLoad]:
        out: list[NodeLoad] = []
        for st in self.registry.live_nodes(now):
            if self.suspect is not None and self.suspect(st.node_id):
                continue
            if st.node_id in self.draining:
                continue
            m = st.metrics
            rate = 0 if m is None else max(0, m.network_append_rate) + max(0, m.disk_in_rate) // (
                1024 * 1024
            )
            free = None if m is None else m.disk_free_space
            out.append(NodeLoad(st.node_id, self.writable_count(st.node_id), rate, free))
        return out

    def place(self, count: int, now: float) -> tuple[ReplicaMeta, ...]:
        """Choose replicas for one new writable range and count it against them."""
        out = self.place_many([count], now)[0]
        if isinstance(out, SbpError):
            raise out
        return out

    def place_many(
        self, counts: Sequence[int], now: float
    ) -> list[tuple[ReplicaMeta, ...] | SbpError]:
        """Replicas for one new range per entry of ``counts`` (a CREATE_STREAMS batch), each
        placement counted before the next is chosen. Per entry: replicas, or the error."""
        ranking = _Ranking(self.loads(now))
        out: list[tuple[ReplicaMeta, ...] | SbpError] = []
        for count in counts:
            try:
                chosen = ranking.choose(count)
            except SbpError as e:  # NotEnoughDataNodesError
                out.append(e)
                continue
            ranking.take(chosen)
            self.opened(chosen)
            out.append(tuple(ReplicaMeta(nid, i == 0) for i, nid in enumerate(chosen)))
        return out

    def opened(self, node_ids: Iterable[int]) -> None:
        for nid in node_ids:
            self._writable[nid] = self._writable.get(nid, 0) + 1

    def closed(self, node_ids: Iterable[int]) -> None:
        """A writable range on these nodes was sealed, deleted or never created."""
        for nid in node_ids:
            left = self._writable.get(nid, 0) - 1
            if left > 0:
                self._writable[nid] = left
            else:
                self._writable.pop(nid, None)
