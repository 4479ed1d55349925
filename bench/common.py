"""Shared helpers for benchmarks: medians with spread, timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt_ms(values: Sequence[float]) -> str:
    m, lo, hi = median_spread(values)
    return f"{m:.3f} [{lo:.3f}..{hi:.3f}]"


def repeat(fn: Callable[[], float], runs: int) -> list[float]:
    return [fn() for _ in range(runs)]


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
