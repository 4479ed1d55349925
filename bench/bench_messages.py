"""Extended-header benchmark (issue: Messages).

Encodes and decodes per second of the two hot-path headers: an APPEND request with 100 items and
a FETCH response with 100 items (each with an OK status, the common case, and one with errors).
Each figure is the median of ``--runs`` runs of ``--seconds`` each, with the min..max spread.

    python -m bench.bench_messages [--runs 5] [--seconds 0.5]
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


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of fn over about ``seconds``."""
    n = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds:
        for _ in range(20):
            fn()
        n += 20
        elapsed = time.perf_counter() - t0
    return n / elapsed


def measure(name: str, msg: Header, runs: int, seconds: float) -> None:
    raw = msg.encode()
    assert type(msg).decode(raw) == msg
    for op, fn in (("encode", msg.encode), ("decode", lambda: type(msg).decode(raw))):
        rates = [rate(fn, seconds) for _ in range(runs)]
        med = statistics.median(rates)
        print(
            f"{name:<32} {op}  {med:>9,.0f}/s  [{min(rates):,.0f}..{max(rates):,.0f}]"
            f"  {1e6 / med:7.1f} us/header  {1e6 / med / ITEMS:5.2f} us/item  {len(raw):>5} B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    print(f"median of {args.runs} runs of {args.seconds}s; {ITEMS} items per header")
    measure("APPEND request", append_request(), args.runs, args.seconds)
    measure("FETCH response (all OK)", fetch_response(False), args.runs, args.seconds)
    measure("FETCH response (10% errors)", fetch_response(True), args.runs, args.seconds)


if __name__ == "__main__":
    main()
