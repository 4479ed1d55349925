"""Stateful property test: the store agrees with an in-memory model through appends (with
idempotent duplicates), seals (with and without truncation), trims, deletes, compactions, reads
and close/reopen; check() is clean after every step."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from store_crash_child import make_batch

from sbpstream.protocol.errors import RangeSealedError, StreamDeletedError
from sbpstream.records.header import patch_base_offset
from sbpstream.store import FsyncPolicy, Store, StoreConfig
from sbpstream.store import types as types_mod

STREAMS = (1, 2, 3)
SEGMENT_BYTES = 24 * 1024  # tiny segments, so compaction has sealed segments to work on


@dataclass
class MRange:
    index: int
    start: int
    batches: list[tuple[int, int, bytes]] = field(default_factory=list)  # base, count, bytes
    sealed: bool = False
    recent: list[tuple[bytes, int]] = field(default_factory=list)  # producer batch, base

    @property
    def next(self) -> int:
        return self.batches[-1][0] + self.batches[-1][1] if self.batches else self.start


@dataclass
class MStream:
    ranges: list[MRange]
    deleted: bool = False
    trim: int = 0
    seq: int = 0

    def visible(self) -> list[tuple[int, int, bytes]]:
        return [b for r in self.ranges for b in r.batches if b[0] + b[1] > self.trim]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.config = StoreConfig(
            fsync_policy=FsyncPolicy.NONE, segment_bytes_max=SEGMENT_BYTES,
            index_checkpoint_interval_bytes=100_000, compaction_live_ratio=0.9,
        )
        self.store = Store.open(self.dir, self.config)
        self.model: dict[int, MStream] = {}
        self.next_sid = 1
        self.appends = 0
        for _ in STREAMS:
            self._new_stream()

    def _new_stream(self) -> None:
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        self.store.create_range(sid, 0, 0)
        self.model[sid] = MStream([MRange(0, 0)])

    def _pick(self, k: int) -> int:
        live = sorted(s for s, m in self.model.items() if not m.deleted)
        return live[k % len(live)]

    def teardown(self) -> None:
        try:
            assert self.store.check() == []
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(k=st.integers(0, 99), count=st.integers(1, 4), size=st.integers(1, 6000),
          idem=st.booleans(), fill=st.integers(0, 250), repeat=st.integers(1, 8))
    def append(self, k: int, count: int, size: int, idem: bool, fill: int, repeat: int) -> None:
        sid = self._pick(k)
        for i in range(repeat):
            self._append(sid, count, size, idem, fill + i)

    @rule(k=st.integers(0, 99))
    def append_to_deleted(self, k: int) -> None:
        dead = sorted(s for s, m in self.model.items() if m.deleted)
        if dead:
            with pytest.raises(StreamDeletedError):
                self.store.append(dead[k % len(dead)], 0, make_batch(1))

    def _append(self, sid: int, count: int, size: int, idem: bool, fill: int) -> None:
        self.appends += 1
        m = self.model[sid]
        kw = {"producer_id": sid, "epoch": 0, "base_sequence": m.seq} if idem else {}
        batch = make_batch(count, size, fill=fill, **kw)  # type: ignore[arg-type]
        r = m.ranges[-1]
        if m.deleted:
            with pytest.raises(StreamDeletedError):
                self.store.append(sid, r.index, batch)
            return
        if r.sealed:
            with pytest.raises(RangeSealedError):
                self.store.append(sid, r.index, batch)
            return
        out = self.store.append(sid, r.index, batch)
        assert not out.duplicate and out.base_offset == r.next
        stored = bytearray(batch)
        patch_base_offset(stored, out.base_offset)
        r.batches.append((out.base_offset, count, bytes(stored)))
        if idem:
            m.seq += count
            r.recent = [*r.recent, (batch, out.base_offset)][-5:]

    @rule(k=st.integers(0, 99), pick=st.integers(0, 4))
    def duplicate(self, k: int, pick: int) -> None:
        sid = self._pick(k)
        m = self.model[sid]
        r = m.ranges[-1]
        if m.deleted or r.sealed or not r.recent:
            return
        batch, base = r.recent[pick % len(r.recent)]
        out = self.store.append(sid, r.index, batch)
        assert out.duplicate and out.base_offset == base

    @rule(k=st.integers(0, 99), cut=st.integers(0, 3), fence_first=st.booleans())
    def seal_and_next(self, k: int, cut: int, fence_first: bool) -> None:
        sid = self._pick(k)
        m = self.model[sid]
        if m.deleted:
            return
        r = m.ranges[-1]
        if fence_first:
            assert self.store.seal_range(sid, r.index, None) == r.next
        # the final end: the local end, or a batch boundary a few batches back (truncation)
        keep = max(0, len(r.batches) - cut)
        while keep < len(r.batches) and r.batches[keep][0] < m.trim:
            keep += 1
        end = r.batches[keep][0] if keep < len(r.batches) else r.next
        assert self.store.seal_range(sid, r.index, end) == end
        del r.batches[keep:]
        r.sealed = True
        self.store.create_range(sid, r.index + 1, end)
        m.ranges.append(MRange(r.index + 1, end))

    @rule(k=st.integers(0, 99), frac=st.floats(0, 1))
    def trim(self, k: int, frac: float) -> None:
        sid = self._pick(k)
        m = self.model[sid]
        if m.deleted:
            return
        end = m.ranges[-1].next
        offset = int(m.trim + (end - m.trim) * frac)
        self.store.trim(sid, offset)
        m.trim = max(m.trim, offset)

    @precondition(lambda self: self.appends >= 8)
    @rule(k=st.integers(0, 99))
    def delete(self, k: int) -> None:
        sid = self._pick(k)
        self.store.delete_stream(sid)
        self.model[sid].deleted = True
        self.appends = 0
        self._new_stream()

    @rule()
    def compact(self) -> None:
        self.store.compact()

    @rule()
    def reopen(self) -> None:
        assert self.store.check() == []
        self.store.close()
        self.store = Store.open(self.dir, self.config)
        assert self.store.recovery_findings == []

    @precondition(lambda self: any(not m.deleted and m.visible() for m in self.model.values()))
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from([s for s, m in self.model.items()
                                         if not m.deleted and m.visible()]))
        m = self.model[sid]
        vis = m.visible()
        i = data.draw(st.integers(0, len(vis) - 1))
        base, count, _ = vis[i]
        offset = max(m.trim, data.draw(st.integers(base, base + count - 1)))
        res = self.store.read(sid, offset, 1 << 30)
        got = [bytes(b) for b in res.batches]
        assert got == [b for _, _, b in vis[i:]]
        assert res.next_offset == m.ranges[-1].next
        one = self.store.read(sid, offset, 1)
        assert [bytes(b) for b in one.batches] == [vis[i][2]]

    @invariant()
    def consistent(self) -> None:
        assert self.store.check() == []
        for sid, m in self.model.items():
            if m.deleted:
                continue
            r = m.ranges[-1]
            st_ = self.store.describe_range(sid, r.index)
            assert (st_.start_offset, st_.next_offset, st_.sealed) == (r.start, r.next, r.sealed)


StoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(autouse=True)
def _tiny_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(types_mod, "MIN_SEGMENT_BYTES", 16 * 1024)


TestStoreMachine = StoreMachine.TestCase
