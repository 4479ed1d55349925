"""Storage engine benchmark: ``.venv/bin/python -m bench.bench_store [--quick] [--size MB]``.

- append MB/s with 1 KiB-record batches of 64 KiB and 1 MiB under each fsync policy, beside the
  disk's own sequential write rate with the same fsync pattern (ratio printed);
- read MB/s (views over mmaps, CRC-32C over every byte so the pages are really touched);
- reopen time after a crash (no clean close) for a log of --size MB (default 1024; --big = 5 GB),
  and the full rebuild time without a checkpoint;
- memory and open time with --streams streams (default 1,000,000), one small batch each.
Throughput figures are medians of --repeat runs (default 3).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import crc32c

from sbpstream.records.header import CRC_START, HEADER_SIZE, HEADER_STRUCT
from sbpstream.store import FsyncPolicy, Store, StoreConfig

MiB = 1024 * 1024
RECORD_BYTES = 1024
WRITERS = 8  # concurrent appenders under ALWAYS (what group commit is for)


def make_batch(total_bytes: int) -> bytes:
    count = max(1, total_bytes // RECORD_BYTES)
    body = os.urandom(total_bytes - HEADER_SIZE)
    fields = [-1, total_bytes - 12, 2, 0, 0, count, 1, 1, -1, 0, -1]
    buf = bytearray(HEADER_STRUCT.pack(*fields) + body)
    fields[3] = crc32c.crc32c(memoryview(buf)[CRC_START:])
    HEADER_STRUCT.pack_into(buf, 0, *fields)
    return bytes(buf)


def median_of(repeat: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeat))


def fresh_dir(root: Path, name: str) -> Path:
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    return d


# ---------------------------------------------------------------- append vs raw disk


def store_append_mbps(root: Path, policy: FsyncPolicy, batch: bytes, total: int) -> float:
    d = fresh_dir(root, "append")
    store = Store.open(d, StoreConfig(fsync_policy=policy))
    for w in range(WRITERS):
        store.create_range(w, 0, 0)
    n = total // len(batch)

    async def writer(w: int, count: int) -> None:
        for _ in range(count):
            out = store.append(w, 0, batch)
            await store.sync(out.log_position)

    async def run() -> None:
        await asyncio.gather(*(writer(w, n // WRITERS) for w in range(WRITERS)))

    t = time.perf_counter()
    asyncio.run(run())
    if policy is not FsyncPolicy.NONE:
        store.sync_now()
    elapsed = time.perf_counter() - t
    written = (n // WRITERS) * WRITERS * len(batch)
    store.close()
    shutil.rmtree(d)
    return written / elapsed / MiB


def raw_disk_mbps(
    root: Path, policy: FsyncPolicy, chunk: bytes, total: int, interval_ms: int
) -> float:
    """os.write of the same chunks to one file; fdatasync per group of WRITERS chunks (ALWAYS:
    what group commit achieves at best), every interval (INTERVAL), or never (NONE)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "raw.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    n = total // len(chunk)
    last_sync = time.monotonic()
    t = time.perf_counter()
    for i in range(n):
        os.write(fd, chunk)
        if policy is FsyncPolicy.ALWAYS and (i + 1) % WRITERS == 0:
            os.fdatasync(fd)
        elif policy is FsyncPolicy.INTERVAL and time.monotonic() - last_sync >= interval_ms / 1000:
            os.fdatasync(fd)
            last_sync = time.monotonic()
    if policy is not FsyncPolicy.NONE:
        os.fdatasync(fd)
    elapsed = time.perf_counter() - t
    os.close(fd)
    path.unlink()
    return n * len(chunk) / elapsed / MiB


# ---------------------------------------------------------------- read


def read_mbps(root: Path, batch: bytes, total: int, repeat: int) -> float:
    d = fresh_dir(root, "read")
    store = Store.open(d, StoreConfig(fsync_policy=FsyncPolicy.NONE))
    store.create_range(1, 0, 0)
    for _ in range(total // len(batch)):
        store.append(1, 0, batch)

    def once() -> float:
        offset, got = 0, 0
        t = time.perf_counter()
        while True:
            res = store.read(1, offset, 4 * MiB)
            if not res.batches:
                break
            for b in res.batches:
                crc32c.crc32c(b)
                got += len(b)
                b.release()
            offset = res.next_offset
        return got / (time.perf_counter() - t) / MiB

    result = median_of(repeat, once)
    store.close()
    shutil.rmtree(d)
    return result


# ---------------------------------------------------------------- crash reopen


def reopen_after_crash(root: Path, size_mb: int, repeat: int) -> tuple[float, float]:
    d = fresh_dir(root, "reopen")
    store = Store.open(d, StoreConfig(fsync_policy=FsyncPolicy.NONE))
    batch = make_batch(64 * 1024)
    for s in range(16):
        store.create_range(s, 0, 0)
    for i in range(size_mb * MiB // len(batch)):
        store.append(i % 16, 0, batch)
    store.sync_now()
    store._release_all()  # a crash: no final checkpoint (pages stay in the cache, as on kill -9)

    def timed_open() -> float:
        t = time.perf_counter()
        s = Store.open(d, StoreConfig(fsync_policy=FsyncPolicy.NONE))
        elapsed = time.perf_counter() - t
        s._release_all()
        return elapsed

    with_checkpoint = median_of(repeat, timed_open)
    ckpt = d / "index.ckpt"

    def timed_rebuild() -> float:
        ckpt.unlink(missing_ok=True)
        return timed_open()

    rebuild = median_of(repeat, timed_rebuild)
    shutil.rmtree(d)
    return with_checkpoint, rebuild


# ---------------------------------------------------------------- many streams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def many_streams(root: Path, n: int) -> dict[str, float]:
    d = fresh_dir(root, "streams")
    batch = make_batch(HEADER_SIZE + 64)
    gc.collect()
    base = rss_bytes()
    store = Store.open(d, StoreConfig(fsync_policy=FsyncPolicy.NONE))
    t = time.perf_counter()
    for sid in range(n):
        store.create_range(sid, 0, 0)
        store.append(sid, 0, batch)
    load_s = time.perf_counter() - t
    gc.collect()
    used = rss_bytes() - base
    t = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - t
    del store
    gc.collect()
    t = time.perf_counter()
    store = Store.open(d, StoreConfig(fsync_policy=FsyncPolicy.NONE))
    open_s = time.perf_counter() - t
    ckpt_mb = (d / "index.ckpt").stat().st_size / MiB
    store._release_all()
    shutil.rmtree(d)
    return {
        "streams": n, "rss_bytes_per_stream": used / n, "create_and_append_s": load_s,
        "close_checkpoint_s": close_s, "open_s": open_s, "checkpoint_mb": ckpt_mb,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--append-mb", type=int, default=256, help="bytes appended per run")
    ap.add_argument("--size", type=int, default=1024, help="log size (MB) for the reopen test")
    ap.add_argument("--big", action="store_true", help="reopen test with a 5 GB log")
    ap.add_argument("--streams", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = ap.parse_args()
    if args.big:
        args.size = 5 * 1024
    if args.quick:
        args.append_mb, args.size, args.streams, args.repeat = 32, 64, 50_000, 1
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-store-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        run(root, args)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def run(root: Path, args: argparse.Namespace) -> None:
    total = args.append_mb * MiB
    print(f"# scratch {root}; {args.append_mb} MiB per append run, {WRITERS} writers, "
          f"median of {args.repeat}")
    print(f"{'batch':>8} {'policy':>9} {'store MB/s':>11} {'disk MB/s':>10} {'ratio':>6}")
    for size in (64 * 1024, MiB):
        batch = make_batch(size)
        for policy in FsyncPolicy:
            store = median_of(args.repeat, partial(store_append_mbps, root, policy, batch, total))
            disk = median_of(args.repeat, partial(raw_disk_mbps, root, policy, batch, total, 10))
            print(f"{size // 1024:>6}Ki {policy.value:>9} {store:>11.0f} {disk:>10.0f} "
                  f"{store / disk:>6.2f}")
    for size in (64 * 1024, MiB):
        mbps = read_mbps(root, make_batch(size), total, args.repeat)
        print(f"read {size // 1024} KiB batches: {mbps:.0f} MB/s (mmap views + CRC-32C)")
    ck, rebuild = reopen_after_crash(root, args.size, args.repeat)
    print(f"reopen after crash, {args.size} MB log: {ck:.2f} s with checkpoint "
          f"(replays <= 64 MiB), {rebuild:.2f} s full rebuild without one")
    res = many_streams(root, args.streams)
    print(f"{res['streams']:,} streams: {res['rss_bytes_per_stream']:.0f} B RSS/stream, "
          f"create+append {res['create_and_append_s']:.1f} s, close (checkpoint) "
          f"{res['close_checkpoint_s']:.1f} s, open {res['open_s']:.1f} s, "
          f"checkpoint {res['checkpoint_mb']:.0f} MB")


if __name__ == "__main__":
    main()
