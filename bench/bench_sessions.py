"""Fetch sessions: what one poll of a consumer of ``--streams`` idle streams costs, with and
without a session.

One data node process (R=1) holds ``--streams`` streams with nothing new to read. A consumer on
one connection polls them ``--polls`` times (max_wait_ms 0: every poll answers at once):

- **without sessions**: every poll is a full FETCH naming every stream (``session_epoch -1``);
- **with a session**: the first poll is a full FETCH making the session (``session_epoch 0``),
  every next one an incremental FETCH naming nothing (``session_id``, epoch + 1).

For each: request bytes per poll (extended header + 24 bytes of frame overhead), response
bytes per poll (every frame's header and payload), the data node's CPU per poll (user + system
time of its process from /proc, over the polls) and the client's wall time per poll. The first
(full) poll of the session run is left out of its steady-state figures and reported apart.

    .venv/bin/python -m bench.bench_sessions [--streams 10000] [--polls 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from sbpstream.cluster import LocalCluster
from sbpstream.net.client import Connection
from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.messages import (
    CreateStreamItem,
    CreateStreamsRequest,
    CreateStreamsResponse,
    FetchItem,
    FetchRequest,
    FetchResponse,
)
from sbpstream.protocol.opcodes import Opcode

FRAME_OVERHEAD = 24  # length prefix, fixed header, CRC (net/server.py)
CREATE_BATCH = 2000


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _create(pm: str, n: int) -> list[int]:
    conn = await Connection.open(pm)
    out: list[int] = []
    try:
        while len(out) < n:
            k = min(CREATE_BATCH, n - len(out))
            f = await conn.request_one(Opcode.CREATE_STREAMS, CreateStreamsRequest(
                timeout_ms=30_000, items=(CreateStreamItem(replica_nums=1),) * k).encode(),
                timeout_s=60)
            res = CreateStreamsResponse.decode(f.header).items
            if res[0].status.code == ErrorCode.NOT_ENOUGH_DATA_NODES:
                await asyncio.sleep(0.1)
                continue
            for r in res:
                assert r.status.ok and r.stream is not None, r.status
                out.append(r.stream.stream_id)
    finally:
        await conn.aclose()
    return out


async def _poll(conn: Connection, req: FetchRequest) -> tuple[int, int, int]:
    """(request bytes, response bytes, session id) of one FETCH."""
    header = req.encode()
    frames = await conn.request(req.OPCODE, header, timeout_s=60)
    resp_bytes = 0
    session_id = 0
    for f in frames:
        resp = FetchResponse.decode(f.header)
        resp.status.raise_for_error()
        session_id = resp.session_id
        resp_bytes += FRAME_OVERHEAD + len(f.header) + len(f.payload)
    return FRAME_OVERHEAD + len(header), resp_bytes, session_id


async def _run(pm: str, node_addr: str, pid: int, streams: int, polls: int) -> dict[str, object]:
    ids = await _create(pm, streams)
    items = tuple(FetchItem(stream_id=s, request_index=i, fetch_offset=0,
                            batch_max_bytes=1 << 20) for i, s in enumerate(ids))
    conn = await Connection.open(node_addr)
    out: dict[str, object] = {"streams": streams, "polls": polls}
    try:
        full = FetchRequest(items=items)
        await _poll(conn, full)  # warm up
        req_b = resp_b = 0
        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        for _ in range(polls):
            q, r, _ = await _poll(conn, full)
            req_b, resp_b = req_b + q, resp_b + r
        cpu, wall = _cpu_s(pid) - cpu0, time.perf_counter() - t0
        out["without"] = {"request_bytes": req_b / polls, "response_bytes": resp_b / polls,
                          "node_cpu_ms": cpu * 1000 / polls, "wall_ms": wall * 1000 / polls}
        q, r, sid = await _poll(conn, FetchRequest(items=items, session_epoch=0))
        assert sid > 0, "the node made no session"
        out["session_first_poll"] = {"request_bytes": q, "response_bytes": r}
        epoch, req_b, resp_b = 1, 0, 0
        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        for _ in range(polls):
            q, r, got = await _poll(conn, FetchRequest(session_id=sid, session_epoch=epoch))
            assert got == sid
            epoch += 1
            req_b, resp_b = req_b + q, resp_b + r
        cpu, wall = _cpu_s(pid) - cpu0, time.perf_counter() - t0
        out["with"] = {"request_bytes": req_b / polls, "response_bytes": resp_b / polls,
                       "node_cpu_ms": cpu * 1000 / polls, "wall_ms": wall * 1000 / polls}
        await _poll(conn, FetchRequest(session_id=sid, session_epoch=-1))
    finally:
        await conn.aclose()
    w, s = out["without"], out["with"]
    assert isinstance(w, dict) and isinstance(s, dict)
    out["request_bytes_ratio"] = w["request_bytes"] / s["request_bytes"]
    out["response_bytes_ratio"] = w["response_bytes"] / s["response_bytes"]
    out["node_cpu_ratio"] = w["node_cpu_ms"] / max(s["node_cpu_ms"], 1e-9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--streams", type=int, default=10_000)
    ap.add_argument("--polls", type=int, default=50)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as d, \
            LocalCluster(Path(d), datanodes=1) as cluster:
        dn = cluster.datanodes[0]
        assert dn.proc is not None
        res = asyncio.run(_run(cluster.pm_address, dn.address, dn.proc.pid, args.streams,
                               args.polls))
    if args.json:
        print(json.dumps(res, indent=2))
        return
    w, s, f = res["without"], res["with"], res["session_first_poll"]
    assert isinstance(w, dict) and isinstance(s, dict) and isinstance(f, dict)
    print(f"{args.streams} idle streams, {args.polls} polls each (max_wait_ms 0)")
    for name, r in (("without sessions", w), ("with a session  ", s)):
        print(f"  {name}: request {r['request_bytes']:9.0f} B/poll  response "
              f"{r['response_bytes']:9.0f} B/poll  node CPU {r['node_cpu_ms']:7.2f} ms/poll  "
              f"wall {r['wall_ms']:7.2f} ms/poll")
    print(f"  session's first (full) poll: request {f['request_bytes']} B, response "
          f"{f['response_bytes']} B")
    print(f"  request bytes {res['request_bytes_ratio']:.0f}x fewer, response bytes "
          f"{res['response_bytes_ratio']:.0f}x fewer, node CPU {res['node_cpu_ratio']:.1f}x "
          "less per poll")


if __name__ == "__main__":
    main()
