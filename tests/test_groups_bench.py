"""bench/bench_groups.py at tiny sizes, so the benchmark cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_bench_groups_runs_at_tiny_sizes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_groups", "--commits", "20", "--batch", "5",
         "--streams", "30", "--members", "3", "--offsets", "300", "--skip-etcd"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "commits (one offset per request)" in out
    assert "rebalance 2->3 members over 30 streams" in out and "10 streams moved" in out
    assert "sqlite: 300 offsets committed" in out
