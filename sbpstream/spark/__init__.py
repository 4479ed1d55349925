"""The PySpark data source and sink for sbpstream streams (docs/spark.md).

``format("sbpstream")`` works without registration once the package is installed (the
top-level module ``pyspark_sbpstream`` exposes ``DefaultSource``); :func:`register` does it
explicitly. :func:`prepare_environment` sets what PySpark's Python workers need.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

FORMAT = "sbpstream"

# PySpark's workers otherwise start `python3` from PATH, which may lack pyarrow (or sbpstream):
# importing this package on the driver, before the session starts, is enough.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def prepare_environment() -> None:
    """Before a SparkSession starts: workers run this interpreter and can import sbpstream.

    ``PYSPARK_PYTHON`` defaults to ``sys.executable`` (workers otherwise start ``python3`` from
    PATH, which may lack pyarrow). With an editable install the top-level ``pyspark_sbpstream``
    module is invisible to the workers' module scan, so its directory goes on ``PYTHONPATH``.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import pyspark_sbpstream

    root = str(Path(pyspark_sbpstream.__file__).resolve().parent)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts and not root.endswith("site-packages"):
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def register(spark: Any) -> None:
    """``spark.dataSource.register`` the sbpstream source (only needed when not installed)."""
    from sbpstream.spark.source import SbpstreamDataSource

    spark.dataSource.register(SbpstreamDataSource)


__all__ = ["FORMAT", "prepare_environment", "register"]
