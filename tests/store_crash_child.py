"""Batch helper for the store tests, and the child process of the crash test.

As a program: ``python tests/store_crash_child.py DIR [SEED]`` opens a Store in DIR (fsync
policy ALWAYS, small segments), appends batches to a few streams from several concurrent tasks,
and after each ``sync()`` returns prints ``stream offset crc`` of the acknowledged batch on its
own line (flushed), until it is killed.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import crc32c

from sbpstream.records.header import CRC_START, HEADER_SIZE, HEADER_STRUCT

CHILD_STREAMS = 4
CHILD_SEGMENT_BYTES = 17 * 1024 * 1024  # small, so the crash test also crosses segment rolls


def make_batch(
    record_count: int = 1,
    body_size: int = 16,
    *,
    producer_id: int = -1,
    epoch: int = 0,
    base_sequence: int = -1,
    timestamp: int = 1_000,
    fill: int = 0,
    base_offset: int = -1,
) -> bytes:
    """A record batch with a valid header and CRC; its records are opaque filler bytes."""
    body = bytes((fill + i) % 251 for i in range(body_size))
    total = HEADER_SIZE + len(body)
    fields = [
        base_offset, total - 12, 2, 0, 0, record_count, timestamp, timestamp,
        producer_id, epoch, base_sequence,
    ]
    buf = bytearray(HEADER_STRUCT.pack(*fields) + body)
    fields[3] = crc32c.crc32c(memoryview(buf)[CRC_START:])
    HEADER_STRUCT.pack_into(buf, 0, *fields)
    return bytes(buf)


async def _writer(store: object, stream_id: int, rng: random.Random) -> None:
    from sbpstream.store import Store

    assert isinstance(store, Store)
    while True:
        batch = make_batch(rng.randint(1, 5), rng.randint(16, 4096), fill=rng.randint(0, 250))
        out = store.append(stream_id, 0, batch)
        await store.sync(out.log_position)
        crc = crc32c.crc32c(memoryview(batch)[8:])  # everything but the assigned base_offset
        sys.stdout.write(f"{stream_id} {out.base_offset} {crc}\n")
        sys.stdout.flush()
        await asyncio.sleep(0)


async def _main(directory: Path, seed: int) -> None:
    from sbpstream.store import FsyncPolicy, Store, StoreConfig

    config = StoreConfig(
        fsync_policy=FsyncPolicy.ALWAYS, segment_bytes_max=CHILD_SEGMENT_BYTES,
        index_checkpoint_interval_bytes=2 * 1024 * 1024,
    )
    store = Store.open(directory, config)
    for sid in range(1, CHILD_STREAMS + 1):
        st = store.create_range(sid, 0, 0)
        assert st.start_offset == 0
    await store.sync(store.log_position)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    rng = random.Random(seed)
    await asyncio.gather(
        *(_writer(store, sid, random.Random(rng.random())) for sid in range(1, CHILD_STREAMS + 1))
    )


if __name__ == "__main__":
    asyncio.run(_main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
