"""kill -9 at random moments: every batch acknowledged after sync() (fsync policy ALWAYS) reads
back byte-identical after reopening, and check() is clean. 30 short cycles on one directory."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import crc32c
from store_crash_child import CHILD_SEGMENT_BYTES, CHILD_STREAMS

from sbpstream.store import FsyncPolicy, Store, StoreConfig

CYCLES = 30
CHILD = Path(__file__).with_name("store_crash_child.py")


def _run_child(directory: Path, seed: int, run_s: float) -> list[tuple[int, int, int]]:
    path = os.pathsep.join([str(CHILD.parent.parent), str(CHILD.parent)])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), str(seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line == b"ready\n", (line, proc.stderr.read() if proc.stderr else b"")
        time.sleep(run_s)  # the child appends under load for run_s, then it is killed
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
    acked = []
    for raw in out.split(b"\n")[:-1]:  # the last piece may be a line cut by the kill
        sid, offset, crc = raw.split()
        acked.append((int(sid), int(offset), int(crc)))
    return acked


def test_kill9_loses_no_acknowledged_batch(tmp_path: Path) -> None:
    rng = random.Random(1234)
    acked: list[tuple[int, int, int]] = []
    config = StoreConfig(fsync_policy=FsyncPolicy.NONE, segment_bytes_max=CHILD_SEGMENT_BYTES)
    for cycle in range(CYCLES):
        acked += _run_child(tmp_path, cycle, rng.uniform(0.1, 0.3))
        store = Store.open(tmp_path, config)
        try:
            for sid, offset, crc in acked:
                res = store.read(sid, offset, 1)
                batch = res.batches[0]
                assert int.from_bytes(batch[:8], "big", signed=True) == offset
                assert crc32c.crc32c(batch[8:]) == crc, (cycle, sid, offset)
                batch.release()
            assert store.check() == []
            for f in store.recovery_findings:  # a torn tail may be cut aside, never dropped
                assert "cut" in f, f
        finally:
            store.close()
    assert len(acked) > CYCLES
    assert {sid for sid, _, _ in acked} == set(range(1, CHILD_STREAMS + 1))
