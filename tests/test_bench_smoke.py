"""Smoke test of the benchmark suite: ``python -m bench.run_all --quick`` end to end.

Starts the real systems (sbpstream cluster, redis-server, nats-server), runs every workload once
at tiny sizes and checks that the JSON, Markdown and plots come out with a figure for every
available system, so the suite cannot rot. Skipped when a peer server is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE_BUDGET_S = 60  # the brief: a tiny run; the subprocess timeout leaves room on a loaded box

pytestmark = pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("nats-server")),
    reason="redis-server and nats-server are needed for the benchmark smoke test",
)


@pytest.mark.timeout(SMOKE_BUDGET_S * 3)
def test_quick_suite_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_BUDGET_S * 2.5,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (doc_path,) = out.glob("*.json")
    doc = json.loads(doc_path.read_text())
    date = doc["date"]
    for suffix in (".md", "-append.png", "-catch_up.png", "-latency.png"):
        assert (out / f"{date}{suffix}").stat().st_size > 0, suffix
    assert doc["quick"] and doc["runs"] == 1
    assert {"Redis Streams", "NATS JetStream", "sbpstream r1", "sbpstream r3"} <= set(
        doc["systems"]
    )
    available = [n for n, m in doc["systems"].items() if m["available"]]
    assert "sbpstream r1" in available
    kinds = {(w["kind"], w["label"]) for w in doc["workloads"]}
    assert len([k for k in kinds if k[0] == "append"]) == 4
    assert len([k for k in kinds if k[0] == "catch_up"]) == 4
    assert len([k for k in kinds if k[0] == "latency"]) == 1
    for w in doc["workloads"]:
        for name in available:
            entry = w["results"][name]
            assert not entry["errors"], (w["kind"], w["label"], name, entry["errors"])
            if w["kind"] == "latency":
                assert entry["p50_ms"]["median"] >= 0
            else:
                assert entry["records_s"]["median"] > 0
                ok = entry["runs"][0]
                assert ok["records"] > 0 and not ok["capped"], (w["label"], name, ok)
    assert doc["physical"] and all(p["mb_s"]["median"] > 0 for p in doc["physical"].values())
    assert any(r["base"] == "Redis Streams" for r in doc["ratios"])
    md = (out / f"{date}.md").read_text()
    assert "| workload |" in md and f"{date}-append.png" in md
    # every server the run started is gone: nothing listens in its work dir any more
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True)
    assert leftovers.returncode == 1, leftovers.stdout
    print(f"quick suite: {elapsed:.1f} s")
