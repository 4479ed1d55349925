"""Client-side profile and rate of the append path: async SDK against the sync SDK, same run.

Starts a LocalCluster (1 PM + 1 data node, ``--fsync always``), then for each record size and
stream count appends ``--records`` records round-robin over fresh streams through:

- ``async``: ``AsyncProducer.send`` per record, awaiting every future at the end (what
  bench/sbp_workloads.py's append does);
- ``sync-batch``: the sync ``Producer.send_batch`` per chunk of ``--chunk`` records of one stream
  (one cross-thread future per chunk; offsets derived per record);
- ``sync-send``: the sync ``Producer.send`` per record (one call into the loop thread each).

The client's CPU time per record (both threads of a sync run; time.process_time) is printed
under each line. Every mode's timing includes reading each record's offset from its future
after the flush.
Rates are medians of ``--runs`` runs with their spread, the sync/async ratio computed per run.
With ``--profile`` the first run of each mode is profiled with cProfile (client process only:
the servers are other processes) and the top functions by own time are printed; a sync mode is
profiled on both of its threads, the caller's and the client's loop thread, printed apart.

    .venv/bin/python -m bench.profile_append [--records 100000] [--profile] [--modes async,...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sbpstream.client import AsyncClient, Client
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run

MODES = ("async", "sync-batch", "sync-send")
LINGER_MS = [5.0]  # the producers' linger_ms (--linger-ms; 5 is the SDK's default)
# client CPU (all of its threads) per record of the last run, microseconds: less sensitive than
# the rate to the other work on a shared machine
_cpu_us = [0.0]


async def _async_append(pm: str, records: int, size: int, streams: int) -> float:
    value = os.urandom(size)
    async with AsyncClient(pm) as c:
        ids = await c.create_streams(streams)
        t0, c0 = time.perf_counter(), time.process_time()
        async with c.producer(linger_ms=LINGER_MS[0]) as p:
            futs = [await p.send(ids[i % streams], value) for i in range(records)]
            await p.flush()
        for f in futs:  # read every offset inside the timing, as the sync modes do
            f.result()
        seconds = time.perf_counter() - t0
        _cpu_us[0] = (time.process_time() - c0) / records * 1e6
    return records / seconds


def _sync_append(pm: str, records: int, size: int, streams: int, mode: str, chunk: int,
                 loop_prof: cProfile.Profile | None = None) -> float:
    value = os.urandom(size)
    with Client(pm) as c:
        ids = c.create_streams(streams)
        if loop_prof is not None:  # cProfile follows one thread: enable it on the loop's too
            c._runner.call(loop_prof.enable)
        t0, c0 = time.perf_counter(), time.process_time()
        p = c.producer(linger_ms=LINGER_MS[0])
        if mode == "sync-send":
            futs = [p.send(ids[i % streams], value) for i in range(records)]
            p.close()
            for f in futs:
                f.result()
        else:
            # chunk records of one stream per call, streams in turn (round-robin by chunk)
            per = max(1, min(chunk, records // streams))
            batches = []
            done = 0
            i = 0
            while done < records:
                n = min(per, records - done)
                batches.append(p.send_batch(ids[i % streams], [value] * n))
                done += n
                i += 1
            p.close()
            for b in batches:
                got = b.result()
                if got.error is not None:
                    raise got.error
        seconds = time.perf_counter() - t0
        _cpu_us[0] = (time.process_time() - c0) / records * 1e6
        if loop_prof is not None:
            c._runner.call(loop_prof.disable)
    return records / seconds


def _stats(prof: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _profiled(fn: Callable[[], float], top: int) -> tuple[float, str]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        rate = fn()
    finally:
        prof.disable()
    return rate, _stats(prof, top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="profile_append", description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--sizes", default="1024,100")
    ap.add_argument("--streams", default="1,1000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1000, help="records per sync send_batch call")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--linger-ms", type=float, default=5.0, help="the producers' linger_ms")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the first run of each mode (sync: both threads)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    LINGER_MS[0] = args.linger_ms
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m}")
    with tempfile.TemporaryDirectory(prefix="profile-append-") as tmp:
        cluster = LocalCluster(Path(tmp), datanodes=1, fsync="always")
        cluster.start()
        try:
            pm = str(cluster.pm_address)
            for size in (int(s) for s in args.sizes.split(",")):
                for streams in (int(s) for s in args.streams.split(",")):
                    rates: dict[str, list[float]] = {m: [] for m in modes}
                    cpu: dict[str, list[float]] = {m: [] for m in modes}
                    for r in range(args.runs):
                        for m in modes:
                            profile = args.profile and r == 0
                            loop_prof = cProfile.Profile() if profile and m != "async" else None
                            if m == "async":
                                def fn(size: int = size, streams: int = streams) -> float:
                                    return run(_async_append(pm, args.records, size, streams))
                            else:
                                def fn(size: int = size, streams: int = streams,
                                       m: str = m, lp: cProfile.Profile | None = loop_prof
                                       ) -> float:
                                    return _sync_append(pm, args.records, size, streams, m,
                                                        args.chunk, lp)
                            if profile:
                                rate, text = _profiled(fn, args.top)
                                thread = "" if loop_prof is None else ", caller thread"
                                print(f"--- cProfile, {m}{thread}, {size} B x {streams} streams")
                                print(text)
                                if loop_prof is not None:
                                    print(f"--- cProfile, {m}, loop thread, {size} B x "
                                          f"{streams} streams")
                                    print(_stats(loop_prof, args.top))
                            else:
                                rate = fn()
                            rates[m].append(rate)
                            cpu[m].append(_cpu_us[0])
                    line = [f"{size:>5} B x {streams:>4} streams:"]
                    for m in modes:
                        v = rates[m]
                        line.append(f"{m} {statistics.median(v):>9,.0f} rec/s "
                                    f"[{min(v):,.0f}..{max(v):,.0f}]")
                    if "async" in modes:
                        for m in modes:
                            if m != "async":
                                ratios = [s / a for s, a in zip(rates[m], rates["async"],
                                                                strict=True)]
                                line.append(f"{m}/async x{statistics.median(ratios):.2f} "
                                            f"[{min(ratios):.2f}..{max(ratios):.2f}]")
                    print("  ".join(line), flush=True)
                    print(" " * 24 + "client CPU us/record: " + "  ".join(
                        f"{m} {statistics.median(cpu[m]):.2f} [{min(cpu[m]):.2f}.."
                        f"{max(cpu[m]):.2f}]" for m in modes), flush=True)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
