"""Frame codec and connection-layer benchmark (issue: foundation).

Codec: frames/s and MB/s to encode and decode 1 KiB and 1 MiB payloads. Connection layer: PING
round trips/s and p50/p99 over one loopback connection with 1 and 64 requests in flight, beside a
bare asyncio echo server/client of the same bytes in the same run; the ratio is the figure.

    python -m bench.bench_frame [--runs 5] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import median_spread, percentile
from sbpstream.net.client import Connection
from sbpstream.net.loop import new_event_loop
from sbpstream.net.server import Server
from sbpstream.protocol.frame import FrameDecoder, encode_frame, encode_frame_parts
from sbpstream.protocol.opcodes import Opcode


def codec(payload_size: int, seconds: float) -> tuple[float, float]:
    payload = b"x" * payload_size
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            encode_frame_parts(Opcode.APPEND, 1, 0, b"h" * 64, payload)
        n += 100
    enc = n / (time.perf_counter() - t0)
    frame = encode_frame(Opcode.APPEND, 1, 0, b"h" * 64, payload)
    blob = frame * max(1, min(100, (8 << 20) // len(frame)))
    per = len(blob) // len(frame)
    d = FrameDecoder()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        d.feed(blob)
        n += len(d.events())
    dec = n / (time.perf_counter() - t0)
    assert n % per == 0
    return enc, dec


async def sbp_pings(addr: str, in_flight: int, seconds: float) -> tuple[float, list[float]]:
    c = await Connection.open(addr)
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await c.ping(b"p" * 32)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    el = time.perf_counter() - t0
    await c.aclose()
    return len(lat) / el, sorted(lat)


async def bare_echo_pings(in_flight: int, seconds: float) -> tuple[float, list[float]]:
    """The same 52-byte frames echoed by a bare asyncio server; responses matched by order."""
    frame = encode_frame(Opcode.PING, 1, 0, b"", b"p" * 32)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await r.readexactly(len(frame))
                w.write(data)
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    waiters: asyncio.Queue[asyncio.Future[float]] = asyncio.Queue()
    lock = asyncio.Lock()

    async def read_loop() -> None:
        while True:
            await reader.readexactly(len(frame))
            fut = await waiters.get()
            fut.set_result(time.perf_counter())

    rl = asyncio.ensure_future(read_loop())

    async def worker() -> None:
        loop = asyncio.get_running_loop()
        while time.perf_counter() < stop:
            fut: asyncio.Future[float] = loop.create_future()
            t = time.perf_counter()
            async with lock:
                waiters.put_nowait(fut)
                writer.write(frame)
            await fut
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    el = time.perf_counter() - t0
    rl.cancel()
    writer.close()
    srv.close()
    return len(lat) / el, sorted(lat)


async def net_bench(runs: int, seconds: float) -> None:
    srv = Server({}, name="bench")
    await srv.start("127.0.0.1", 0)
    print("\nPING over one loopback connection (uvloop); medians of", runs, "runs [min..max]")
    print(
        f"{'in flight':>9} {'sbp rt/s':>22} {'bare echo rt/s':>22} {'ratio':>6} "
        f"{'sbp p50 us':>10} {'sbp p99 us':>10}"
    )
    for inflight in (1, 64):
        sbp, bare, p50, p99 = [], [], [], []
        for _ in range(runs):
            r, lat = await sbp_pings(srv.address, inflight, seconds)
            sbp.append(r)
            p50.append(percentile(lat, 50) * 1e6)
            p99.append(percentile(lat, 99) * 1e6)
            b, _ = await bare_echo_pings(inflight, seconds)
            bare.append(b)
        ms, slo, shi = median_spread(sbp)
        mb, blo, bhi = median_spread(bare)
        print(
            f"{inflight:>9} {ms:>10.0f} [{slo:.0f}..{shi:.0f}] {mb:>10.0f} [{blo:.0f}..{bhi:.0f}]"
            f" {ms / mb:>6.2f} {median_spread(p50)[0]:>10.0f} {median_spread(p99)[0]:>10.0f}"
        )
    await srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    a = ap.parse_args()
    print(f"frame codec; medians of {a.runs} runs [min..max]")
    print(
        f"{'payload':>8} {'encode frames/s':>26} {'encode MB/s':>12} {'decode frames/s':>26} "
        f"{'decode MB/s':>12}"
    )
    for size in (1024, 1024 * 1024):
        encs, decs = [], []
        for _ in range(a.runs):
            e, d = codec(size, a.seconds / 2)
            encs.append(e)
            decs.append(d)
        me, elo, ehi = median_spread(encs)
        md, dlo, dhi = median_spread(decs)
        print(
            f"{size:>8} {me:>12.0f} [{elo:.0f}..{ehi:.0f}] {me * size / 1e6:>12.1f} "
            f"{md:>12.0f} [{dlo:.0f}..{dhi:.0f}] {md * size / 1e6:>12.1f}"
        )
    loop = new_event_loop()
    try:
        loop.run_until_complete(net_bench(a.runs, a.seconds))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
