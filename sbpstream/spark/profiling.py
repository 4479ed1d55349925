"""Opt-in cProfile of the data source's executor-side work (the Python worker's share).

With ``SBPSTREAM_SPARK_PROFILE=<dir>`` in the Python workers' environment (Spark passes the
driver's environment to local workers; elsewhere set ``spark.executorEnv.*``), every partition
read and every task write is profiled from its first call to its end, and the stats are dumped
to ``<dir>/<kind>-<pid>-<n>.prof`` (read with ``python -m pstats`` or ``bench.bench_spark
--profile``). A read's profile includes PySpark's own work between our yields (it runs while
the profiler is enabled): its Arrow serialization to the JVM shows up there too.
"""

from __future__ import annotations

import cProfile
import itertools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

PROFILE_ENV: Final = "SBPSTREAM_SPARK_PROFILE"
_seq = itertools.count()


@contextmanager
def profiled(kind: str) -> Iterator[None]:
    """Profile the block into ``$SBPSTREAM_SPARK_PROFILE/<kind>-<pid>-<n>.prof`` when set."""
    where = os.environ.get(PROFILE_ENV)
    if not where:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        out = Path(where)
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(out / f"{kind}-{os.getpid()}-{next(_seq)}.prof"))


PHASES_ENV: Final = "SBPSTREAM_SPARK_PHASES"
"""Set to a directory: every partition read and every planning writes where its time went
there, as ``<kind>-<pid>-<n>.json`` (``bench.bench_spark`` sums them). Two clock reads per
FETCH answer, so it can stay on in a benchmark's timed runs; off by default."""


class Phases:
    """Seconds (and counts) per phase of one partition read or one planning: ``fetch`` (waiting
    for FETCH answers), ``decode`` (records into Arrow's buffers), ``arrow`` (the record batch
    built), ``handoff`` (the time Spark held the batch: PySpark's Arrow serialization to the JVM
    and the JVM's work before it asks for the next), ``plan`` and ``pm_lookups``."""

    __slots__ = ("counts", "kind", "seconds")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def dump(self) -> None:
        where = os.environ.get(PHASES_ENV)
        if not where:
            return
        out = Path(where)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.kind}-{os.getpid()}-{next(_seq)}.json").write_text(
            json.dumps({"seconds": self.seconds, "counts": self.counts}))


def phases(kind: str) -> Phases | None:
    """A :class:`Phases` to fill when ``$SBPSTREAM_SPARK_PHASES`` is set, else None."""
    return Phases(kind) if os.environ.get(PHASES_ENV) else None
