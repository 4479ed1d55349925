"""Storage engine: log, index, append/read/sync, recovery, seal, trim, delete, retention,
compaction, corrupt tails, disk full. No network. Every test ends with check() == []."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from store_crash_child import make_batch
from waiting import eventually

from sbpstream.protocol.errors import (
    CorruptBatchError,
    OffsetMismatchError,
    OffsetOutOfRangeError,
    OffsetTrimmedError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    RangeAlreadyExistsError,
    RangeNotFoundError,
    RangeSealedError,
    StorageError,
    StorageFullError,
    StreamDeletedError,
)
from sbpstream.records.header import read_header
from sbpstream.store import FsyncPolicy, Store, StoreConfig
from sbpstream.store import segment as segment_mod
from sbpstream.store.limits import MIN_SEGMENT_BYTES

SMALL = MIN_SEGMENT_BYTES  # the smallest segment: rolls happen after ~16 MiB


def cfg(**kw: object) -> StoreConfig:
    base: dict[str, object] = {"fsync_policy": FsyncPolicy.NONE, "segment_bytes_max": SMALL}
    base.update(kw)
    return StoreConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "s", cfg())
    yield s
    if not s._log.closed:
        assert s.check() == []
        s.close()


def reopen(s: Store, **kw: object) -> Store:
    assert s.check() == []
    s.close()
    s2 = Store.open(s.directory, cfg(**kw))
    assert s2.recovery_findings == []
    assert s2.check() == []
    return s2


def read_all(s: Store, sid: int, offset: int = 0) -> list[bytes]:
    out: list[bytes] = []
    while True:
        res = s.read(sid, offset, 1 << 20)
        if not res.batches:
            return out
        out.extend(bytes(b) for b in res.batches)
        for b in res.batches:
            b.release()
        offset = res.next_offset


def bases(batches: Sequence[bytes]) -> list[int]:
    return [read_header(b).base_offset for b in batches]


def test_append_read_reopen(store: Store) -> None:
    st = store.create_range(7, 0, 100)
    assert (st.start_offset, st.next_offset, st.end_offset, st.sealed) == (100, 100, -1, False)
    assert store.create_range(7, 0, 100) == st  # idempotent
    with pytest.raises(RangeAlreadyExistsError):
        store.create_range(7, 0, 5)
    outs = [store.append(7, 0, make_batch(n, 100, fill=n)) for n in (1, 3, 2)]
    assert [(o.base_offset, o.next_offset) for o in outs] == [(100, 101), (101, 104), (104, 106)]
    assert outs[0].log_position < outs[1].log_position < outs[2].log_position
    res = store.read(7, 102, 1 << 20)  # starts inside the second batch: returns it whole
    assert bases([bytes(b) for b in res.batches]) == [101, 104]
    assert (res.next_offset, res.start_offset, res.end_offset) == (106, 100, 106)
    assert store.read(7, 100, 1).batches.__len__() == 1  # at least one batch past max_bytes
    assert bases([bytes(b) for b in store.read(7, 100, 1 << 20, max_offset=104).batches]) == [
        100, 101,
    ]
    assert store.read(7, 106, 100).batches == []
    with pytest.raises(OffsetOutOfRangeError):
        store.read(7, 107, 100)
    with pytest.raises(OffsetOutOfRangeError):
        store.read(7, 99, 100)
    with pytest.raises(RangeNotFoundError):
        store.read(8, 0, 100)
    before = read_all(store, 7, 100)
    del res
    store2 = reopen(store)
    assert read_all(store2, 7, 100) == before
    assert store2.describe_range(7, 0).next_offset == 106
    assert store2.append(7, 0, make_batch(1)).base_offset == 106
    assert store2.check() == []
    store2.close()


def test_append_rejects_bad_batches(store: Store) -> None:
    store.create_range(1, 0, 0)
    good = bytearray(make_batch(2, 50))
    good[60] ^= 0xFF
    with pytest.raises(CorruptBatchError):
        store.append(1, 0, bytes(good))
    with pytest.raises(CorruptBatchError):
        store.append(1, 0, make_batch(1) + b"x")
    with pytest.raises(RangeNotFoundError):
        store.append(1, 1, make_batch(1))
    assert store.describe_range(1, 0).next_offset == 0


def test_replication_appends_are_dense(store: Store) -> None:
    store.create_range(1, 0, 10)
    b0 = make_batch(3, base_offset=10)
    assert store.append(1, 0, b0, assign_offset=False).next_offset == 13
    with pytest.raises(OffsetMismatchError):
        store.append(1, 0, make_batch(1, base_offset=14), assign_offset=False)
    dup = store.append(1, 0, b0, assign_offset=False)  # a retried replication append
    assert dup.duplicate and dup.base_offset == 10
    with pytest.raises(OffsetMismatchError):  # same offset, different bytes
        store.append(1, 0, make_batch(3, fill=9, base_offset=10), assign_offset=False)
    assert store.append(1, 0, make_batch(1, base_offset=13), assign_offset=False).base_offset == 13


def test_idempotent_producer(store: Store) -> None:
    store.create_range(1, 0, 0)
    b = make_batch(2, producer_id=5, epoch=1, base_sequence=0)
    assert store.append(1, 0, b).base_offset == 0
    store.append(1, 0, make_batch(1))  # a non-idempotent batch in between
    dup = store.append(1, 0, b)
    assert dup.duplicate and (dup.base_offset, dup.next_offset) == (0, 2)
    nxt = make_batch(3, producer_id=5, epoch=1, base_sequence=2)
    assert store.append(1, 0, nxt).base_offset == 3
    with pytest.raises(OutOfOrderSequenceError):
        store.append(1, 0, make_batch(1, producer_id=5, epoch=1, base_sequence=9))
    with pytest.raises(ProducerFencedError):
        store.append(1, 0, make_batch(1, producer_id=5, epoch=0, base_sequence=5))
    assert store.producer_states(1, 0) == [(5, 1, 4, 3)]
    store2 = reopen(store)
    assert store2.producer_states(1, 0) == [(5, 1, 4, 3)]
    assert store2.append(1, 0, b).duplicate
    new_epoch = make_batch(1, producer_id=5, epoch=2, base_sequence=0)
    assert store2.append(1, 0, new_epoch).base_offset == 6
    store2.close()


def test_seal_semantics(store: Store) -> None:
    store.create_range(1, 0, 0)
    for n in (2, 2, 2):
        store.append(1, 0, make_batch(n))
    assert store.seal_range(1, 0, None) == 6
    with pytest.raises(RangeSealedError):
        store.append(1, 0, make_batch(1))
    st = store.describe_range(1, 0)
    assert (st.sealed, st.end_offset) == (True, -1)
    with pytest.raises(OffsetMismatchError):
        store.seal_range(1, 0, 3)  # inside a batch
    assert store.seal_range(1, 0, 4) == 4  # drops the batch at 4
    assert store.seal_range(1, 0, 4) == 4  # idempotent
    with pytest.raises(RangeSealedError):
        store.seal_range(1, 0, 6)
    assert store.describe_range(1, 0).next_offset == 4
    assert bases(read_all(store, 1)) == [0, 2]
    store.create_range(1, 1, 4)
    store.append(1, 1, make_batch(5))
    res = store.read(1, 0, 1 << 20)
    assert bases([bytes(b) for b in res.batches]) == [0, 2, 4]  # reads across ranges
    assert res.next_offset == 9 and not res.range_end
    store2 = reopen(store)
    st = store2.describe_range(1, 0)
    assert (st.sealed, st.end_offset, st.next_offset) == (True, 4, 4)
    assert bases(read_all(store2, 1)) == [0, 2, 4]
    store2.close()


def test_seal_drops_producer_state_past_end(store: Store) -> None:
    store.create_range(1, 0, 0)
    store.append(1, 0, make_batch(1, producer_id=3, epoch=0, base_sequence=0))
    store.append(1, 0, make_batch(1, producer_id=3, epoch=0, base_sequence=1))
    store.seal_range(1, 0, 1)
    assert store.producer_states(1, 0) == [(3, 0, 0, 0)]


def test_sealed_end_beyond_local_accepts_replication_fill(store: Store) -> None:
    store.create_range(1, 0, 0)
    store.append(1, 0, make_batch(2))
    assert store.seal_range(1, 0, 5) == 5
    res = store.read(1, 0, 1 << 20)
    assert res.next_offset == 2 and not res.range_end
    with pytest.raises(RangeSealedError):
        store.append(1, 0, make_batch(3))
    store.append(1, 0, make_batch(3, base_offset=2), assign_offset=False)
    res = store.read(1, 0, 1 << 20)
    assert res.next_offset == 5 and res.range_end
    with pytest.raises(RangeSealedError):
        store.append(1, 0, make_batch(1, base_offset=5), assign_offset=False)


def test_trim_delete_retention(tmp_path: Path) -> None:
    now = [1_000_000]
    s = Store.open(tmp_path, cfg(clock_ms=lambda: now[0]))
    s.create_range(1, 0, 0)
    s.create_range(2, 0, 0)
    for _ in range(10):
        now[0] += 1000
        s.append(1, 0, make_batch(2, 64))
        s.append(2, 0, make_batch(1, 64))
    s.trim(1, 5)  # the batch [4, 6) survives: it holds offset 5
    assert bases(read_all(s, 1, 5)) == [4, 6, 8, 10, 12, 14, 16, 18]
    with pytest.raises(OffsetTrimmedError):
        s.read(1, 3, 100)
    assert s.read(1, 5, 100).start_offset == 5
    s.set_retention(2, 4500)
    assert s.apply_retention(now[0]) == [(2, 5)]
    assert s.apply_retention(now[0]) == []
    assert bases(read_all(s, 2, 5)) == [5, 6, 7, 8, 9]
    s.delete_stream(1)
    with pytest.raises(StreamDeletedError):
        s.read(1, 6, 100)
    with pytest.raises(StreamDeletedError):
        s.append(1, 0, make_batch(1))
    with pytest.raises(StreamDeletedError):
        s.create_range(1, 1, 20)
    s = reopen(s, clock_ms=lambda: now[0])
    with pytest.raises(StreamDeletedError):
        s.read(1, 6, 100)
    assert bases(read_all(s, 2, 5)) == [5, 6, 7, 8, 9]
    with pytest.raises(OffsetTrimmedError):
        s.read(2, 4, 100)
    assert s.check() == []
    s.close()


def test_compaction_reclaims_space(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg(compaction_live_ratio=0.5))
    s.create_range(1, 0, 0)
    s.create_range(2, 0, 0)
    s.create_range(3, 0, 0)
    s.set_retention(3, 10**9)
    batch = make_batch(1, 64 * 1024)
    for _ in range(400):  # ~26 MiB: two segments
        s.append(1, 0, batch)
        s.append(2, 0, batch)
    s.append(3, 0, batch)
    keep2 = read_all(s, 2)
    segments_before = s.stats().segment_count
    assert segments_before >= 2
    s.delete_stream(1)
    s.seal_range(3, 0, None)
    report = s.compact()
    assert report.segments_compacted and report.bytes_reclaimed > 0
    assert s.check() == []
    assert read_all(s, 2) == keep2
    assert s.stats().log_bytes < 300 * 64 * 1024 * 2
    # A rebuild from the log alone (no checkpoint) still knows every stream's metadata.
    s.close()
    (tmp_path / "index.ckpt").unlink()
    s = Store.open(tmp_path, cfg())
    assert s.check() == []
    assert read_all(s, 2) == keep2
    with pytest.raises(StreamDeletedError):
        s.read(1, 0, 10)
    assert s.describe_range(3, 0).sealed
    assert s._state.streams[3].retention_ms == 10**9
    s.close()


def test_compaction_with_live_reader_views(store: Store) -> None:
    store.create_range(1, 0, 0)
    store.create_range(2, 0, 0)
    batch = make_batch(1, 256 * 1024)
    for _ in range(70):
        store.append(1, 0, batch)
        store.append(2, 0, batch)
    res = store.read(1, 0, 1 << 30)  # views into the first segment
    held = bytes(res.batches[0])
    store.delete_stream(1)
    report = store.compact()
    assert report.segments_deleted or report.segments_compacted
    assert bytes(res.batches[0]) == held  # the old map stays valid while viewed
    assert store._log.zombies
    for b in res.batches:
        b.release()
    store.compact()
    assert not store._log.zombies


def test_corrupt_tail_is_cut_aside(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg())
    s.create_range(1, 0, 0)
    for i in range(5):
        s.append(1, 0, make_batch(1, 100, fill=i))
    good = read_all(s, 1)
    seg = s._log.active
    assert seg is not None
    end, path = seg.end, seg.path
    s.sync_now()
    os.close(s._lock_fd)  # simulate a crash: no close(), no checkpoint
    s._log.syncer.close()
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(b"\x53\x42\x53\x31garbage-after-a-torn-write")
    s = Store.open(tmp_path, cfg())
    assert len(s.recovery_findings) == 1 and "cut" in s.recovery_findings[0]
    side = path.with_name(f"{path.name}.corrupt-{end}")
    assert side.read_bytes() == b"\x53\x42\x53\x31garbage-after-a-torn-write"
    assert read_all(s, 1) == good
    assert s.check() == []
    assert s.append(1, 0, make_batch(1)).base_offset == 5
    s.close()


def test_truncated_entry_is_cut_aside(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg())
    s.create_range(1, 0, 0)
    s.checkpoint()
    for i in range(4):
        s.append(1, 0, make_batch(1, 1000, fill=i))
    seg = s._log.active
    assert seg is not None
    last = seg.end - (36 + 53 + 1000)
    path, end = seg.path, seg.end
    s.sync_now()
    os.close(s._lock_fd)
    s._log.syncer.close()
    with open(path, "r+b") as f:  # a torn write: only the first 500 bytes of the last entry
        f.seek(last)
        torn = f.read(500)
        f.seek(last + 500)
        f.write(bytes(end - last - 500))
    s = Store.open(tmp_path, cfg())
    side = path.with_name(f"{path.name}.corrupt-{last}")
    assert side.read_bytes() == torn
    assert s.describe_range(1, 0).next_offset == 3
    assert s.check() == []
    s.close()


def test_corrupt_checkpoint_rebuilds(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg())
    s.create_range(1, 0, 0)
    for i in range(20):
        s.append(1, 0, make_batch(2, 10, producer_id=1, epoch=0, base_sequence=2 * i))
    s.trim(1, 7)
    good = read_all(s, 1, 7)
    s.close()
    ck = tmp_path / "index.ckpt"
    data = bytearray(ck.read_bytes())
    data[-3] ^= 0x55
    ck.write_bytes(bytes(data))
    s = Store.open(tmp_path, cfg())
    assert any("rebuilding" in f for f in s.recovery_findings)
    assert read_all(s, 1, 7) == good
    assert s.producer_states(1, 0) == [(1, 0, 39, 38)]
    assert s.check() == []
    s.close()


def test_check_reports_mid_segment_corruption(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg())
    s.create_range(1, 0, 0)
    for i in range(10):
        s.append(1, 0, make_batch(1, 1000, fill=i))
    s.close()
    s = Store.open(tmp_path, cfg())
    path = next((tmp_path / "log").glob("*.log"))
    with open(path, "r+b") as f:  # flip a byte inside the 3rd entry (covered by the checkpoint)
        f.seek(2 * (36 + 53 + 1000) + 36 + 300)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    findings = s.check()
    assert findings and any("corrupt entry" in f for f in findings)
    s.close()


def test_disk_full_leaves_no_corruption(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.create_range(1, 0, 0)
    store.append(1, 0, make_batch(1, 500))
    real = os.pwritev

    def half_then_enospc(fd: int, bufs: Sequence[bytes | bytearray | memoryview], pos: int) -> int:
        data = b"".join(bytes(b) for b in bufs)
        real(fd, [data[: len(data) // 2]], pos)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_mod, "pwritev", half_then_enospc)
    with pytest.raises(StorageFullError):
        store.append(1, 0, make_batch(1, 500))
    monkeypatch.setattr(segment_mod, "pwritev", real)
    assert store.check() == []
    assert store.append(1, 0, make_batch(1, 500)).base_offset == 1
    store2 = reopen(store)
    assert bases(read_all(store2, 1)) == [0, 1]
    store2.close()


def test_group_commit_shares_fsyncs(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg(fsync_policy=FsyncPolicy.ALWAYS))
    s.create_range(1, 0, 0)

    async def many() -> None:
        async def one(i: int) -> None:
            out = s.append(1, 0, make_batch(1, 100, fill=i))
            await s.sync(out.log_position)
            assert s._log.syncer.durable >= out.log_position

        await asyncio.gather(*(one(i) for i in range(50)))

    before = s.stats().fsyncs
    asyncio.run(many())
    assert 1 <= s.stats().fsyncs - before <= 3
    assert s.check() == []
    s.close()


def test_interval_policy_syncs_in_background(tmp_path: Path) -> None:
    s = Store.open(tmp_path, cfg(fsync_policy=FsyncPolicy.INTERVAL, fsync_interval_ms=5))
    s.create_range(1, 0, 0)
    out = s.append(1, 0, make_batch(1))
    asyncio.run(s.sync(out.log_position))  # returns at once
    eventually(lambda: s._log.syncer.durable >= out.log_position, timeout=5, interval=0.01,
               what="the background fsync")
    s.close()


def test_second_open_is_refused(store: Store) -> None:
    with pytest.raises(StorageError):
        Store.open(store.directory, cfg())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_many_streams_memory_bound(tmp_path: Path) -> None:
    """100k streams with one batch each stay within the documented bound (docs/storage.md:
    <= 1 KiB of resident memory per stream with one range and a few batches)."""
    n = 100_000
    batch = make_batch(1, 8)
    s = Store.open(tmp_path, cfg())
    gc.collect()
    base = _rss_bytes()
    for sid in range(n):
        s.create_range(sid, 0, 0)
        s.append(sid, 0, batch)
    gc.collect()
    used = _rss_bytes() - base
    assert used / n < 1024, f"{used / n:.0f} bytes per stream"
    s.close()
    s = Store.open(tmp_path, cfg())
    assert s.stats().streams == n and s.stats().indexed_batches == n
    assert s.read(n - 1, 0, 100).next_offset == 1
    s.close()
