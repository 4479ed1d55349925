"""The Spark source and sink against a cluster with TLS and auth on (issue 23): options
``user``/``password`` or ``tokenFile``, and ``tlsCa``, reach the driver's and executors' clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from spark_fixtures import spark_session_fixture  # noqa: F401

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.spark]

USER = ("sparky", "sparky-pw")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    d: Path = tmp_path_factory.mktemp("spark-secure")
    certs = d / "certs"
    init_dev_certs(certs)
    with LocalCluster(d / "c", datanodes=2, secure=certs) as c:
        async def grant() -> None:
            await bootstrap_admin(c.pm_address, certs, "admin", "admin-pw")
            async with AsyncClient(c.pm_address, user="admin", password="admin-pw",
                                   tls_ca=str(certs / CA_FILE)) as admin:
                await admin.add_user(*USER)
                await admin.add_acl(USER[0], "create,append,fetch,describe", "*")

        asyncio.run(grant())
        yield c, certs


def test_write_then_read_with_credentials(spark: Any,
                                          secure: tuple[LocalCluster, Path]) -> None:
    cluster, certs = secure

    async def new_stream() -> tuple[int, str]:
        async with AsyncClient(cluster.pm_address, user=USER[0], password=USER[1],
                               tls_ca=str(certs / CA_FILE)) as c:
            (sid,) = await c.create_streams(1)
            assert c.credentials is not None
            return sid, await c.credentials.token()

    sid, token = asyncio.run(new_stream())
    ca = str(certs / CA_FILE)
    rows = [(f"v{i}",) for i in range(200)]
    spark.createDataFrame(rows, "value string").repartition(2).write.format("sbpstream") \
        .option("pm", cluster.pm_address).option("stream", sid).option("user", USER[0]) \
        .option("password", USER[1]).option("tlsCa", ca).mode("append").save()
    token_file = certs.parent / "token"
    token_file.write_text(token)
    got = spark.read.format("sbpstream").option("pm", cluster.pm_address) \
        .option("streams", str(sid)).option("tokenFile", str(token_file)) \
        .option("tlsCa", ca).load().collect()
    assert sorted(r.value.decode() for r in got) == sorted(v for (v,) in rows)
    with pytest.raises(Exception, match=r"AUTHENTICATION_REQUIRED|AUTHENTICATION_FAILED"):
        spark.read.format("sbpstream").option("pm", cluster.pm_address) \
            .option("streams", str(sid)).option("tlsCa", ca).load().collect()
