"""Extended-header benchmark (issue: Messages).

Encodes and decodes per second of the two hot-path headers: an APPEND request with 100 items and
a FETCH response with 100 items (each with an OK status, the common case, and one with errors).
Each figure is the median of ``--runs`` runs of ``--seconds`` each, with the min..max spread.
``--clock cpu`` times with the process's CPU time instead of the wall clock: on a machine shared
with other work it leaves out the time the process waits for a core, so A/B comparisons of the
codec hold still (the figures are then per CPU-second).

    python -m bench.bench_messages [--runs 5] [--seconds 0.5] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from sbpstream.protocol.errors import ErrorCode
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    FetchResponse,
    FetchResult,
    Header,
    Status,
)

ITEMS = 100


def append_request() -> AppendRequest:
    return AppendRequest(
        timeout_ms=5_000,
        items=tuple(AppendItem(1_000 + i, i, 16_384, 3) for i in range(ITEMS)),
    )


def fetch_response(errors: bool) -> FetchResponse:
    bad = Status(int(ErrorCode.OFFSET_OUT_OF_RANGE), "offset 5 is past the end", b"")
    return FetchResponse(
        items=tuple(
            FetchResult(
                stream_id=1_000 + i,
                request_index=i,
                batch_length=16_384,
                status=bad if errors and i % 10 == 0 else Status(),
                start_offset=0,
                high_watermark=1_000_000 + i,
            )
            for i in range(ITEMS)
        )
    )


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def rate(fn: Callable[[], object], seconds: float, clock: Callable[[], float]) -> float:
    """Calls per second of fn over about ``seconds`` of ``clock``."""
    n = 0
    t0 = clock()
    elapsed = 0.0
    while elapsed < seconds:
        for _ in range(20):
            fn()
        n += 20
        elapsed = clock() - t0
    return n / elapsed


def measure(name: str, msg: Header, runs: int, seconds: float, clock: str = "wall") -> None:
    raw = msg.encode()
    assert type(msg).decode(raw) == msg
    for op, fn in (("encode", msg.encode), ("decode", lambda: type(msg).decode(raw))):
        rates = [rate(fn, seconds, CLOCKS[clock]) for _ in range(runs)]
        med = statistics.median(rates)
        print(
            f"{name:<32} {op}  {med:>9,.0f}/s  [{min(rates):,.0f}..{max(rates):,.0f}]"
            f"  {1e6 / med:7.1f} us/header  {1e6 / med / ITEMS:5.2f} us/item  {len(raw):>5} B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    print(f"median of {args.runs} runs of {args.seconds}s ({args.clock} clock); {ITEMS} items")
    cases = [
        ("APPEND request", append_request()),
        ("FETCH response (all OK)", fetch_response(False)),
        ("FETCH response (10% errors)", fetch_response(True)),
    ]
    for name, msg in cases:
        measure(name, msg, args.runs, args.seconds, args.clock)


if __name__ == "__main__":
    main()
