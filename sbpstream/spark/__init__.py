"""The PySpark data source and sink for sbpstream streams (docs/spark.md).

``format("sbpstream")`` works without registration once the package is installed (the
top-level module ``pyspark_sbpstream`` exposes ``DefaultSource``); :func:`register` does it
explicitly. :func:`prepare_environment` sets what PySpark's Python workers need.

An editable install (``pip install -e``, what ``make install`` does) hides ``pyspark_sbpstream``
from the module scan PySpark's workers use to find data sources (setuptools serves it through an
import hook, not a path entry). :func:`install_plugin_path` fixes that for one virtualenv: it
writes a ``.pth`` file that puts a directory holding only ``pyspark_sbpstream.py`` on the path
and points ``PYSPARK_PYTHON`` at the venv's interpreter; ``make install`` runs it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

FORMAT = "sbpstream"
PLUGIN_PTH = "sbpstream_spark_plugin.pth"
PLUGIN_DIR = "sbpstream-spark-plugin"  # under sys.prefix (the venv): holds pyspark_sbpstream.py

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


def install_plugin_path(prefix: Path | None = None, site_dir: Path | None = None) -> Path:
    """Make ``format("sbpstream")`` work in every SparkSession of this (editable) install.

    Links ``pyspark_sbpstream.py`` into ``PREFIX/sbpstream-spark-plugin/`` and writes
    ``SITE/sbpstream_spark_plugin.pth``: a path line for that directory (so PySpark's
    ``pkgutil.iter_modules()`` scan sees the module) and one line that defaults
    ``PYSPARK_PYTHON`` to the running interpreter (workers otherwise start ``python3`` from PATH).
    Idempotent; returns the ``.pth`` path. ``prefix`` defaults to ``sys.prefix`` and ``site_dir``
    to the interpreter's purelib directory.
    """
    import pyspark_sbpstream

    module = Path(pyspark_sbpstream.__file__).resolve()
    plugin_dir = Path(prefix or sys.prefix).resolve() / PLUGIN_DIR
    plugin_dir.mkdir(parents=True, exist_ok=True)
    link = plugin_dir / module.name
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(module)
    site = Path(site_dir or sysconfig.get_paths()["purelib"])
    pth = site / PLUGIN_PTH
    pth.write_text(
        f"{plugin_dir}\n"
        "import os, sys; os.environ.setdefault('PYSPARK_PYTHON', sys.executable)\n"
    )
    return pth


def register(spark: Any) -> None:
    """``spark.dataSource.register`` the sbpstream source (only needed when not installed)."""
    from sbpstream.spark.source import SbpstreamDataSource

    spark.dataSource.register(SbpstreamDataSource)


__all__ = ["FORMAT", "install_plugin_path", "prepare_environment", "register"]
