"""Spark's auto-registration hook for the ``sbpstream`` data source.

PySpark registers the ``DefaultSource`` of every importable top-level module named
``pyspark_*``, so once sbpstream is installed ``spark.read.format("sbpstream")`` works without
``spark.dataSource.register(...)``.
"""

from sbpstream.spark.source import SbpstreamDataSource as DefaultSource

__all__ = ["DefaultSource"]
