"""``sbpstream produce`` against pipelined XADD (redis-py with hiredis), timed as a user runs them.

Both sides read the same file of ``--lines`` lines of ``--line-bytes`` bytes (newline excluded)
from stdin in a fresh process, and the wall time of that process is measured from the parent,
so interpreter start and imports are included:

- sbpstream: ``sbpstream produce --stream S --pm PM < FILE`` against a local cluster started the
  way ``sbpstream up`` does (PM + ``--datanodes`` data nodes, ``--fsync always``: a record is
  acknowledged once fdatasync'd); a fresh stream per run;
- Redis: ``python -c <XADD script> < FILE``: redis-py with the hiredis parser (the script checks
  it), ``XADD key * v <line>`` in pipelines of 1,000 (non-transactional), one fresh key per run,
  against a redis-server with ``--appendonly yes --appendfsync everysec``.

Runs alternate between the systems, each starting after ``sync`` (no writeback of the previous
run's data in flight); every run checks the record count afterwards. Reported: each
side's median time of ``--runs`` runs with its spread, and the ratio (Redis time / sbpstream
time, > 1: sbpstream faster) computed per run, median with spread.

    .venv/bin/python -m bench.bench_cli_produce [--lines 300000] [--line-bytes 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import RedisSystem, redis_parser
from sbpstream.client import Client
from sbpstream.cluster import LocalCluster

# The Redis producer a user would write: redis-py (hiredis parser), pipelined XADD of stdin.
REDIS_PRODUCER = r"""
import sys, redis
from redis.connection import DefaultParser
assert "Hiredis" in DefaultParser.__name__, DefaultParser
port, key = int(sys.argv[1]), sys.argv[2]
r = redis.Redis(host="127.0.0.1", port=port)
pipe = r.pipeline(transaction=False)
n = 0
for line in sys.stdin.buffer:
    pipe.xadd(key, {"v": line[:-1] if line.endswith(b"\n") else line})
    n += 1
    if n % 1000 == 0:
        pipe.execute()
pipe.execute()
print(n, file=sys.stderr)
"""


def make_input(path: Path, lines: int, line_bytes: int) -> None:
    """``lines`` lines of ``line_bytes`` random bytes each (no newline inside a line)."""
    with open(path, "wb") as f:
        block = 1000
        for start in range(0, lines, block):
            n = min(block, lines - start)
            raw = os.urandom(n * line_bytes).replace(b"\n", b"\x00")
            f.write(b"".join(raw[i * line_bytes:(i + 1) * line_bytes] + b"\n" for i in range(n)))


def timed(argv: list[str], stdin_path: Path, env: dict[str, str] | None = None) -> float:
    with open(stdin_path, "rb") as stdin:
        t0 = time.perf_counter()
        proc = subprocess.run(argv, stdin=stdin, capture_output=True, env=env)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_cli_produce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--line-bytes", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--datanodes", type=int, default=3, help="as `sbpstream up` (default 3)")
    args = ap.parse_args(argv)
    exe = shutil.which("sbpstream", path=str(Path(sys.executable).parent)) or "sbpstream"
    print(f"redis-py reply parser: {redis_parser()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-cli-produce-") as tmp:
        work = Path(tmp)
        data = work / "lines.bin"
        make_input(data, args.lines, args.line_bytes)
        cluster = LocalCluster(work / "sbp", datanodes=args.datanodes, fsync="always")
        redis = RedisSystem(work / "redis")
        sbp_s: list[float] = []
        red_s: list[float] = []
        try:
            cluster.start()
            redis.start()
            pm = str(cluster.pm_address)
            env = {**os.environ, "SBPSTREAM_PM": pm}
            import redis as redis_py

            rc = redis_py.Redis(host="127.0.0.1", port=redis.port)
            with Client(pm) as c:
                for run in range(args.runs):
                    sid = c.create_stream()
                    key = f"cli:{run}"
                    order = ["sbp", "redis"] if run % 2 == 0 else ["redis", "sbp"]
                    for side in order:
                        # start each timed run with no dirty pages of the previous one being
                        # written back (300 MB of AOF or segments would slow the next run's I/O)
                        os.sync()
                        if side == "sbp":
                            sbp_s.append(timed([exe, "produce", "--stream", str(sid)], data, env))
                            got = c.end_offset(sid)
                        else:
                            red_s.append(timed([sys.executable, "-c", REDIS_PRODUCER,
                                                str(redis.port), key], data))
                            got = int(rc.xlen(key))
                            rc.delete(key)
                        if got != args.lines:
                            raise AssertionError(f"{side}: {got} records, not {args.lines}")
                    print(f"run {run + 1}: sbpstream produce {sbp_s[-1]:.2f} s, "
                          f"redis-py XADD pipelines {red_s[-1]:.2f} s, "
                          f"ratio x{red_s[-1] / sbp_s[-1]:.2f}", flush=True)
                    c.delete_stream(sid)
            rc.close()
        finally:
            redis.stop()
            cluster.stop()
    ratios = [r / s for r, s in zip(red_s, sbp_s, strict=True)]
    mb = args.lines * args.line_bytes / 1e6
    print(f"{args.lines:,} lines of {args.line_bytes} B ({mb:.0f} MB), median of {args.runs} "
          f"[min..max], process start included:")
    print(f"  sbpstream produce       {statistics.median(sbp_s):6.2f} s "
          f"[{min(sbp_s):.2f}..{max(sbp_s):.2f}]")
    print(f"  redis-py XADD pipelines {statistics.median(red_s):6.2f} s "
          f"[{min(red_s):.2f}..{max(red_s):.2f}]")
    print(f"  ratio redis/sbpstream   x{statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}..{max(ratios):.2f}] (> 1: sbpstream faster; target >= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
