"""The data node's hop trace (sbpstream/datanode/hoptrace.py): off by default; with
SBPSTREAM_HOP_TRACE set, one row per acknowledged item, written at shutdown, whose times run in
hop order."""

from __future__ import annotations

import json
from pathlib import Path

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.datanode.hoptrace import HOP_TRACE_ENV
from sbpstream.net.loop import run as run_on_uvloop

RECORDS = 20


async def _produce(pm: str) -> tuple[int, list[int]]:
    async with AsyncClient(pm) as c:
        sid = await c.create_stream()
        async with c.producer(linger_ms=0) as p:
            offsets = [await (await p.send(sid, b"r%d" % i)) for i in range(RECORDS)]
    return sid, offsets


def test_hop_trace_rows_cover_every_acknowledged_record(tmp_path: Path) -> None:
    trace = tmp_path / "hops.jsonl"
    with LocalCluster(tmp_path / "c", datanodes=1, fsync="always",
                      env={HOP_TRACE_ENV: str(trace)}) as cl:
        sid, offsets = run_on_uvloop(_produce(cl.pm_address))
        assert not trace.exists()  # written at shutdown
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[-1] == {"dropped": 0}
    rows = [r for r in lines[:-1] if r[0] == sid]
    covered = sorted(off for _, base, nxt, *_ in rows for off in range(base, nxt))
    assert covered == sorted(offsets) == list(range(RECORDS))
    for _, _, _, read, start, durable, acked in rows:
        assert 0 < read <= start <= durable <= acked


def test_no_hop_trace_by_default(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", datanodes=1, fsync="always") as cl:
        run_on_uvloop(_produce(cl.pm_address))
    assert not list(tmp_path.rglob("*.jsonl"))
