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
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROFILE_ENV = "SBPSTREAM_SPARK_PROFILE"
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
