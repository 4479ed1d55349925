"""Fault soak in the network test bed: every scenario of issue 33 for N cycles (20 by default),
on a PM with SQLite metadata and on three PMs over a three-member etcd, streams of replication
factor 2 and 3 on four data nodes, a producer and a consumer in their own host.

The scenarios, the cluster and the checks are those of ``tests/faultbed.py`` (the suite runs
each for two cycles: ``tests/test_fault_scenarios.py``). For each run this prints one line and
writes a JSON document with: records acknowledged, lost, duplicated (acknowledged and not),
failed sends, failed sends with deadline left at the heal, calls past their deadline, the
longest write and read unavailability (overall and the worst fault window), ``sbpstream check``
clean or not, and fence violations (etcd).

Needs root (network namespaces). Run::

    python -m bench.bench_faults                       # all scenarios, both stores, 20 cycles
    python -m bench.bench_faults --cycles 5 --scenario halves --metadata etcd
    python -m bench.bench_faults --out bench/results/2026-11-28-faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from faultbed import SCENARIOS, run_drain, run_rolling_restart, run_scenario  # noqa: E402

METADATA = ("sqlite", "etcd")


def _summary(r: Any, seconds: float) -> dict[str, Any]:
    c = r.check
    faults = c.get("faults", [])
    return {
        "scenario": r.scenario, "metadata": r.metadata, "cycles": r.cycles,
        "seconds": round(seconds, 1),
        "acked": c.get("acked"), "sent": c.get("sent"), "failed": c.get("failed"),
        "lost": _n(c.get("lost")), "misplaced": _n(c.get("misplaced")),
        "corrupt": _n(c.get("corrupt")),
        "duplicated": _n(c.get("duplicated")), "unacked_duplicated": _n(
            c.get("unacked_duplicated")),
        "failed_after_heal": _n(c.get("failed_after_heal")),
        "waited_past_deadline": _n(c.get("waited_past_deadline")),
        "max_call_s": c.get("max_call_s"),
        "write_gap_s": c.get("write_gap_s"), "read_gap_s": c.get("read_gap_s"),
        "worst_window_write_gap_s": max((f.get("write_gap_s") or 0 for f in faults), default=0),
        "worst_window_read_gap_s": max((f.get("read_gap_s") or 0 for f in faults), default=0),
        "sbp_check_clean": r.sbp_check_clean,
        "fence_violations": len(r.fence_violations),
        "problems": r.failures(),
    }


def _n(v: Any) -> Any:
    return len(v) if isinstance(v, list | dict) else v


def _keep_if_failed(d: Path, s: dict[str, Any]) -> None:
    """A run with problems keeps its directory (logs of every server, the workload's logs, the
    fault windows) for reading, named in the result; a clean run's is removed."""
    if s["problems"]:
        s["kept"] = str(d)
    else:
        shutil.rmtree(d, ignore_errors=True)


def _print(meta: str, name: str, s: dict[str, Any]) -> None:
    print(f"{meta:6} {name:22} acked={s.get('acked')} lost={s.get('lost')} "
          f"dup={s.get('duplicated')} failed={s.get('failed')} "
          f"failed_after_heal={s.get('failed_after_heal')} "
          f"past_deadline={s.get('waited_past_deadline')} "
          f"write_gap={s.get('worst_window_write_gap_s')}s "
          f"read_gap={s.get('worst_window_read_gap_s')}s "
          f"check_clean={s.get('sbp_check_clean')} problems={len(s['problems'])}", flush=True)


def markdown_table(doc: dict[str, Any]) -> str:
    """One row per run: the accounting and the availability figures (docs/operations.md)."""
    rows = ["| store | scenario | cycles | acknowledged | lost | duplicated | failed sends "
            "| failed with deadline left | past deadline | longest write gap in a fault (s) "
            "| longest read gap in a fault (s) | check clean |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["results"]:
        if s.get("acked") is None:
            why = " ".join("; ".join(s["problems"]).split())[:120].replace("|", "/")
            rows.append(f"| {s['metadata']} | {s['scenario']} | {s['cycles']} | run failed: "
                        f"{why} |||||||||")
            continue
        rows.append(
            f"| {s['metadata']} | {s['scenario']} | {s['cycles']} | {s['acked']:,} | {s['lost']} "
            f"| {s['duplicated']} | {s['failed']} | {s['failed_after_heal']} "
            f"| {s['waited_past_deadline']} | {s['worst_window_write_gap_s']:.2f} "
            f"| {s['worst_window_read_gap_s']:.2f} | {'yes' if s['sbp_check_clean'] else 'no'} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="repeatable; default: every scenario")
    ap.add_argument("--metadata", action="append", choices=METADATA,
                    help="repeatable; default: both")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--secure", action="store_true",
                    help="TLS and authentication on every connection")
    ap.add_argument("--operations", action="store_true",
                    help="also a rolling restart of every server and a drain, per store")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    ap.add_argument("--table", type=Path, metavar="RESULTS",
                    help="print a results file (--out) as a Markdown table and exit")
    args = ap.parse_args()
    if args.table is not None:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    if os.geteuid() != 0:
        print("bench_faults: needs root (network namespaces)", file=sys.stderr)
        return 2
    results = []
    for meta in args.metadata or METADATA:
        for name in args.scenario or sorted(SCENARIOS):
            if SCENARIOS[name].etcd_only and meta != "etcd":
                continue
            d = Path(tempfile.mkdtemp(prefix=f"sbp-faults-{meta}-{name}-"))
            t0 = time.monotonic()
            try:
                r = run_scenario(d, name, metadata=meta, cycles=args.cycles, seed=args.seed,
                                 secure=args.secure)
                s = _summary(r, time.monotonic() - t0)
            except Exception as exc:  # a run that could not complete is a result too
                s = {"scenario": name, "metadata": meta, "cycles": args.cycles,
                     "problems": [f"run failed: {type(exc).__name__}: {exc}"]}
            _keep_if_failed(d, s)
            results.append(s)
            _print(meta, name, s)
    if args.operations:
        for meta in args.metadata or METADATA:
            for name, fn in (("rolling-restart", run_rolling_restart), ("drain", run_drain)):
                d = Path(tempfile.mkdtemp(prefix=f"sbp-ops-{meta}-{name}-"))
                t0 = time.monotonic()
                try:
                    s = _summary(fn(d, metadata=meta), time.monotonic() - t0)
                except Exception as exc:
                    s = {"scenario": name, "metadata": meta, "cycles": 1,
                         "problems": [f"run failed: {type(exc).__name__}: {exc}"]}
                _keep_if_failed(d, s)
                results.append(s)
                _print(meta, name, s)
    doc = {"cycles": args.cycles, "seed": args.seed, "secure": args.secure,
           "results": results}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(not s["problems"] for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
