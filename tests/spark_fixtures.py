"""Session fixtures of the Spark tests: one local[2] SparkSession and one LocalCluster.

Imported by the ``tests/test_spark*.py`` modules (tests/conftest.py is not ours to edit); the
functions have other names than their fixtures so importing them shadows nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbpstream.cluster import LocalCluster

TESTS_DIR = Path(__file__).resolve().parent


def _jvm_jars() -> str:
    """The sbpstream-jvm reader's jar for ``spark.jars`` (built when stale), or "" when it
    cannot be built here (no JDK): its tests then skip, the others run as before."""
    from sbpstream.spark.jvm import JvmBuildError, jar_path

    try:
        return str(jar_path())
    except JvmBuildError:
        return ""


def _require_java() -> None:
    if shutil.which("java") is None:
        pytest.skip("java is not on PATH: the Spark tests need a JVM (Java 17)")


@pytest.fixture(scope="session", name="spark")
def spark_session_fixture() -> Iterator[Any]:
    _require_java()
    pytest.importorskip("pyspark")
    from sbpstream.spark import prepare_environment

    prepare_environment()
    os.environ["PYSPARK_PYTHON"] = os.environ.get("PYSPARK_PYTHON") or sys.executable
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(TESTS_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(TESTS_DIR)])
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("sbpstream-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.jars", _jvm_jars())
        .config("spark.driver.host", "127.0.0.1")  # where local executors fetch spark.jars
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session", name="cluster")
def cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    _require_java()
    with LocalCluster(tmp_path_factory.mktemp("spark-cluster"), datanodes=2) as c:
        yield c


def drop_last_commit(ck: Path) -> int:
    """Delete the last commit of a streaming checkpoint (and its .crc), as a crash between a
    batch's write and its commit leaves it; returns that batch id."""
    commits = sorted((ck / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    last = commits[-1]
    last.unlink()
    crc = last.parent / f".{last.name}.crc"
    if crc.exists():
        crc.unlink()
    return int(last.name)
