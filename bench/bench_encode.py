"""Encoding cost of the hot-path headers (microseconds per ``encode()``, CPU time).

Each figure is the best of ``--repeats`` runs of ``--number`` encodes (scaled down for large
messages), timed with the process's CPU time: on a machine shared with other work the best run
is the one least disturbed. ``--against DIR`` compares with another tree (e.g. a ``git archive``
of the branch point with the same compiled extensions copied in): the two are run alternately,
``--rounds`` times each, in fresh interpreters, and the best of all rounds is kept per message.

    python -m bench.bench_encode [--against DIR] [--rounds 3] [--repeats 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import sbpstream
from sbpstream.protocol.messages import (
    AppendItem,
    AppendRequest,
    AppendResponse,
    AppendResult,
    BufferAckRequest,
    BufferAckResponse,
    CreateStreamItem,
    CreateStreamsRequest,
    FetchItem,
    FetchRequest,
    FetchResponse,
    FetchResult,
    Header,
)

_HERE = Path(__file__).resolve().parent.parent  # this tree


def messages() -> list[tuple[str, Header]]:
    """The measured messages: what a data node and its clients encode per request."""
    out: list[tuple[str, Header]] = []
    for n in (1, 100):
        out += [
            (f"AppendRequest, {n} item(s)", AppendRequest(5_000, tuple(
                AppendItem(1_000 + i, i, 16_384, 3) for i in range(n)))),
            (f"AppendResponse, {n} item(s)", AppendResponse(0, items=tuple(
                AppendResult(1_000 + i, i, 5_000 + i, 1_700_000_000_000, next_offset=6_000 + i)
                for i in range(n)))),
            (f"FetchRequest, {n} item(s)", FetchRequest(500, 1, tuple(
                FetchItem(1_000 + i, i, 5_000 + i, 1 << 20) for i in range(n)), 7, 3)),
            (f"FetchResponse, {n} item(s)", FetchResponse(items=tuple(
                FetchResult(1_000 + i, i, 16_384, start_offset=0, high_watermark=1_000_000 + i)
                for i in range(n)), session_id=7)),
        ]
    out += [
        ("BufferAckRequest", BufferAckRequest(123_456, 7)),
        ("BufferAckResponse", BufferAckResponse()),
        ("CreateStreamsRequest, 1,000 items", CreateStreamsRequest(5_000, tuple(
            CreateStreamItem(3, 86_400_000, f"stream-{i}") for i in range(1_000)))),
    ]
    return out


def measure(repeats: int, number: int) -> dict[str, float]:
    """Microseconds of CPU per encode, best of ``repeats``, per message."""
    out = {}
    for name, msg in messages():
        encode = msg.encode
        raw = encode()
        assert type(msg).decode(raw) == msg
        n = max(1, int(number / (1 + len(raw) / 100)))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(n):
                encode()
            best = min(best, (time.process_time() - t0) / n)
        out[name] = best * 1e6
    return out


def _run(tree: Path, repeats: int, number: int) -> dict[str, float]:
    """This script's figures for the ``sbpstream`` package of ``tree``, in a fresh interpreter."""
    cmd = [sys.executable, __file__, "--json", "--repeats", str(repeats), "--number", str(number)]
    out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(tree)), check=True,
                         capture_output=True, text=True)
    result = json.loads(out.stdout)
    if not Path(result["module"]).is_relative_to(tree):
        raise SystemExit(f"{tree}: measured {result['module']} instead")
    figures: dict[str, float] = result["figures"]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--against", help="another tree (its sbpstream package) to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=2_000)
    ap.add_argument("--json", action="store_true", help="print this tree's figures as JSON")
    args = ap.parse_args()
    if args.json:
        print(json.dumps({"module": sbpstream.__file__,
                          "figures": measure(args.repeats, args.number)}))
        return
    if args.against is None:
        for name, us in measure(args.repeats, args.number).items():
            print(f"{name:<36} {us:10.1f} us")
        return
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    for _ in range(args.rounds):  # alternated, so that both see the same machine
        for best, tree in ((before, Path(args.against).resolve()), (after, _HERE)):
            for name, us in _run(tree, args.repeats, args.number).items():
                best[name] = min(best.get(name, float("inf")), us)
    print(f"{'message':<36} {'before':>10} {'after':>10} {'ratio':>7}")
    for name in after:
        b, a = before[name], after[name]
        print(f"{name:<36} {b:8.1f}us {a:8.1f}us {b / a:6.1f}x")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
