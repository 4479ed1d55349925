"""Client CPU per record of the sync ``Producer.send`` against ``AsyncProducer.send``, no I/O.

What a real append run costs the client process minus the network: send ``--records`` records
round-robin over ``--streams`` streams, settle every batch as if its APPEND were acknowledged
(``_close_builder`` / ``_acked``, the producer's own code; nothing is sent: the sender task is
never started), and read every record's offset. The sync run uses the client's real loop thread
and feeder; its caller hands the queue over every ``--handover`` records, as the loop thread
takes it when it gets the GIL (about one switch interval, 5 ms, of caller work). CPU is
``time.process_time`` of the process (both threads); min [median] of ``--runs``.

    .venv/bin/python -m bench.bench_sync_overhead [--records 100000] [--handover 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from typing import Any

from sbpstream.client import _sync_support
from sbpstream.client.options import ProducerOptions
from sbpstream.client.producer import AsyncProducer
from sbpstream.client.sync import Producer


class _NoClient:
    """What AsyncProducer reads off its client before sending anything."""

    class routing:  # the attribute AsyncProducer reads
        throttle = None


def _new_producer() -> AsyncProducer:
    """A producer on the running loop whose sender never starts (nothing is sent)."""
    p = AsyncProducer(_NoClient(), ProducerOptions(buffer_max_bytes=1 << 40))  # type: ignore[arg-type]
    p._loop = asyncio.get_running_loop()
    return p


def _ack_all(p: AsyncProducer) -> None:
    """Close every open batch and acknowledge each batch at consecutive offsets."""
    for st in list(p._streams.values()):
        if st.builder is not None:
            p._close_builder(st)
        offset = 0
        while st.ready:
            batch = st.ready.popleft()
            p._acked(st, batch, offset)
            offset += batch.record_count


def run_async(records: int, size: int, streams: int) -> float:
    value = os.urandom(size)
    ids = list(range(1, streams + 1))

    async def go() -> None:
        p = _new_producer()
        send = p.send
        futs = [await send(ids[i % streams], value) for i in range(records)]
        _ack_all(p)
        for f in futs:
            f.result()

    loop = asyncio.new_event_loop()
    try:
        gc.collect()
        c0 = time.process_time()
        loop.run_until_complete(go())
        return (time.process_time() - c0) / records * 1e6
    finally:
        loop.close()


def run_sync(records: int, size: int, streams: int, handover: int) -> float:
    value = os.urandom(size)
    ids = list(range(1, streams + 1))
    runner = _sync_support.LoopThread()
    saved = _sync_support.SYNC_QUEUE_MAX_BYTES
    _sync_support.SYNC_QUEUE_MAX_BYTES = 1 << 40  # the hand-over is driven below
    try:

        async def make() -> AsyncProducer:
            return _new_producer()

        ap = runner.run(make())
        p = Producer._wrap(runner, ap)
        send = p.send
        futs: list[Any] = []
        gc.collect()
        c0 = time.process_time()
        for start in range(0, records, handover):
            futs += [send(ids[i % streams], value)
                     for i in range(start, min(records, start + handover))]
            p._before_call()  # the feeder takes everything queued
        runner.call(_ack_all, ap)
        for f in futs:
            f.result()
        return (time.process_time() - c0) / records * 1e6
    finally:
        _sync_support.SYNC_QUEUE_MAX_BYTES = saved
        runner.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_sync_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--sizes", default="1024,100")
    ap.add_argument("--streams", default="1,1000")
    ap.add_argument("--handover", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    for size in (int(s) for s in args.sizes.split(",")):
        for streams in (int(s) for s in args.streams.split(",")):
            a = [run_async(args.records, size, streams) for _ in range(args.runs)]
            s = [run_sync(args.records, size, streams, args.handover) for _ in range(args.runs)]
            print(f"{size:>5} B x {streams:>4} streams: client CPU us/record, min [median]: "
                  f"async {min(a):.2f} [{statistics.median(a):.2f}]  "
                  f"sync send {min(s):.2f} [{statistics.median(s):.2f}]  "
                  f"async/sync {min(a) / min(s):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
