"""Record batch throughput: build and decode, 100 B and 1 KiB records, with and without codecs.

Run: ``.venv/bin/python -m bench.bench_records [--quick]``. Each figure is the median of 5 runs;
MB/s counts key + value bytes (1 MB = 10**6 B). Values are log-like text (words from a fixed
vocabulary), so the codecs have something to do without the data being trivially compressible.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from sbpstream.records import (
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_ZSTD,
    BatchBuilder,
    Record,
    decode_columns,
    iter_batches,
    iter_records,
)

RUNS = 5
BATCH_BYTES_MAX = 1024 * 1024
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_LZ4: "lz4"}
ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,"


def make_records(count: int, value_bytes: int, seed: int = 1) -> list[Record]:
    """Log-like values: words from a 2000-word vocabulary, so codecs find some redundancy."""
    rng = random.Random(seed)
    words = [
        bytes(rng.choice(ALPHABET[:62]) for _ in range(rng.randint(2, 10))) for _ in range(2000)
    ]
    out = []
    for i in range(count):
        value = b" ".join(rng.choices(words, k=value_bytes // 4 + 1))[:value_bytes]
        out.append(
            Record(
                value=value,
                key=b"key-%08d" % (i % 1000),
                timestamp_ms=1_700_000_000_000 + i // 10,
            )
        )
    return out


def build_all(records: list[Record], codec: int) -> list[bytes]:
    batches = []
    b = BatchBuilder(codec=codec, batch_bytes_max=BATCH_BYTES_MAX)
    for r in records:
        if not b.append(r):
            batches.append(b.build())
            b = BatchBuilder(codec=codec, batch_bytes_max=BATCH_BYTES_MAX)
            b.append(r)
    batches.append(b.build())
    return batches


def decode_all(buf: bytes) -> int:
    n = 0
    for batch in iter_batches(buf):
        for _ in iter_records(batch):
            n += 1
    return n


def median_seconds(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tenth of the records")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    print(f"median of {RUNS}; batches bounded at {BATCH_BYTES_MAX} B; MB/s of key+value bytes")
    head = f"{'record':>7} {'codec':>5} {'ratio':>6} | {'build rec/s':>12} {'MB/s':>7} |"
    head += f" {'decode rec/s':>12} {'MB/s':>7} | {'columns rec/s':>13} {'MB/s':>7}"
    print(head)
    print("-" * len(head))
    for value_bytes, count in ((100, 200_000 // scale), (1024, 50_000 // scale)):
        records = make_records(count, value_bytes)
        payload_mb = sum(len(r.value or b"") + len(r.key or b"") for r in records) / 1e6
        for codec in (CODEC_NONE, CODEC_ZSTD, CODEC_LZ4):
            buf = b"".join(build_all(records, codec))
            assert decode_all(buf) == count
            t_build = median_seconds(lambda: build_all(records, codec))  # noqa: B023
            t_decode = median_seconds(lambda: decode_all(buf))  # noqa: B023
            t_cols = median_seconds(lambda: decode_columns(buf))  # noqa: B023
            ratio = payload_mb * 1e6 / len(buf)
            print(
                f"{value_bytes:>5} B {CODEC_NAMES[codec]:>5} {ratio:>6.2f} |"
                f" {count / t_build:>12,.0f} {payload_mb / t_build:>7.1f} |"
                f" {count / t_decode:>12,.0f} {payload_mb / t_decode:>7.1f} |"
                f" {count / t_cols:>13,.0f} {payload_mb / t_cols:>7.1f}"
            )


if __name__ == "__main__":
    main()
