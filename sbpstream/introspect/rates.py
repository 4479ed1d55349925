"""Per-minute figures of monotonic counters, from snapshots taken every few seconds. No I/O.

The hot paths only add to integer totals; a background tick (every :data:`SAMPLE_EVERY_S`)
copies the totals into a short history here. "Per minute" is what was counted during the last
minute: the current totals minus the newest snapshot at least :data:`WINDOW_S` old, so it is
exact to within one tick. While the process is younger than a minute, it is the count since start
(the history begins with an all-zero snapshot at start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from typing import Final, Generic, TypeVar

SAMPLE_EVERY_S: Final = 5.0
"""Tick of the snapshots: the resolution of every per-minute figure."""

WINDOW_S: Final = 60.0
"""Per minute."""

K = TypeVar("K", bound=Hashable)
Totals = tuple[int, ...]


class RateWindow(Generic[K]):
    """Snapshots of ``{key: totals}`` over the last minute; ``per_minute`` subtracts the base."""

    def __init__(self, start: float, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._snaps: deque[tuple[float, Mapping[K, Totals]]] = deque([(start, {})])

    def take(self, now: float, totals: Mapping[K, Totals]) -> None:
        """Record a snapshot (``totals`` must not be mutated afterwards)."""
        self._snaps.append((now, totals))
        # keep exactly one snapshot at least window_s old: the base of per_minute
        while len(self._snaps) >= 2 and now - self._snaps[1][0] >= self.window_s:
            self._snaps.popleft()

    def base(self, now: float) -> Mapping[K, Totals]:
        """The newest snapshot at least ``window_s`` old, else the oldest one (the start)."""
        best = self._snaps[0][1]
        for t, snap in self._snaps:
            if now - t >= self.window_s:
                best = snap
            else:
                break
        return best

    def per_minute(self, now: float, key: K, current: Totals) -> Totals:
        old = self.base(now).get(key)
        if old is None:
            return current
        return tuple(max(0, c - o) for c, o in zip(current, old, strict=True))
