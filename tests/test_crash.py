"""Crash tests: SIGKILL data nodes and the PM under load at R=2 and R=3, then account for every
record (``bench/bench_soak.py`` with a few cycles, as a subprocess so the figures are the bench's).

0 acknowledged records lost, 0 duplicates, 0 failed sends, and ``sbpstream check`` clean once
the replicas converged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.adversity

ROOT = Path(__file__).resolve().parent.parent
SOAK_TIMEOUT_S = 600  # hang guard for the whole run (a few kill cycles, read-back, check)


@pytest.mark.timeout(SOAK_TIMEOUT_S + 60)
@pytest.mark.parametrize(("replicas", "cycles"), [(2, 4), (3, 3)])
def test_kill_cycles_lose_nothing(tmp_path: Path, replicas: int, cycles: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_soak", "--cycles", str(cycles), "--replicas",
         str(replicas), "--seed", str(replicas), "--converge-s", "120", "--dir",
         str(tmp_path / "soak"), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=SOAK_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["dn_kills"] + res["pm_kills"] == cycles
    assert res["acked"] > 0
    assert (res["lost"], res["duplicates"], res["failed"], res["check_problems"]) == (
        0, 0, 0, 0), res
