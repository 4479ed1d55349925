"""Prometheus /metrics over HTTP on a real PM and data node."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from waiting import eventually_async

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port

SCRAPE_TIMEOUT_S = 20.0  # the exporter refreshes every second; generous for a loaded machine


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body: bytes = r.read()
        return body.decode()


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise KeyError(series)


async def test_pm_and_datanode_export_metrics(tmp_path: Path) -> None:
    pm_port, dn_port = free_port(), free_port()
    cluster = LocalCluster(tmp_path, datanodes=1,
                           extra_pm_args=["--metrics-port", str(pm_port)],
                           extra_dn_args=["--metrics-port", str(dn_port)])
    with cluster:
        async with AsyncClient(cluster.pm_address) as c:
            sid = await c.create_stream()
            async with c.producer(linger_ms=0) as p:
                futs = [await p.send(sid, b"x" * 100) for _ in range(50)]
                await p.flush()
                assert [await f for f in futs] == list(range(50))
        async def appends_counted() -> str | None:
            dn = await asyncio.to_thread(scrape, dn_port)
            appended = value(dn, 'sbpstream_datanode_requests_total{opcode="APPEND"}')
            written = value(dn, "sbpstream_datanode_store_bytes_written_total")
            return dn if appended >= 1 and written else None

        dn = await eventually_async(appends_counted, timeout=SCRAPE_TIMEOUT_S, interval=0.3,
                                    retry_on=(KeyError,), what="APPEND figures scraped")
        assert value(dn, "sbpstream_datanode_streams") == 1
        assert value(dn, "sbpstream_datanode_store_fsyncs_total") >= 1
        assert "# TYPE sbpstream_datanode_connections_open gauge" in dn
        pm = await asyncio.to_thread(scrape, pm_port)
        assert value(pm, 'sbpstream_pm_data_nodes{state="live"}') == 1
        assert value(pm, "sbpstream_pm_leader") == 1
        assert value(pm, 'sbpstream_pm_requests_total{opcode="CREATE_STREAMS"}') >= 1
