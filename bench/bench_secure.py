"""What TLS and authentication cost: 1 KiB appends and catch-up reads, secure against plain.

Two LocalClusters in the same run, identical but for security: ``plain`` (TCP, auth off) and
``secure`` (TLS on every connection, client and between nodes, SCRAM login, tokens checked on
every request, ACLs per item; the user holds ``append,fetch,describe`` on ``*`` plus ``create``).
For each, ``--runs`` alternating runs of: produce ``--records`` 1 KiB records (the batching
producer) and read them all back (the consumer's columns path). Reported per phase: the median
records/s and the cost ``1 - secure / plain`` (target: at most 25%), and the CPU time (client
plus every server process, user + system) per record with its cost ``secure / plain - 1``: on a
shared, loaded machine wall-clock rates swing by tens of percent between identical runs, CPU
time per record much less.

    .venv/bin/python -m bench.bench_secure [--records 100000] [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run
from sbpstream.tools.loadgen import consume_load, produce_load

SIZE = 1024
TARGET_COST = 0.25
USER = ("bench", "bench-password")


def _cpu_s(cluster: LocalCluster) -> float:
    """User + system CPU seconds of this process and of the cluster's processes so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for node in cluster.nodes:
        if node.proc is not None:
            fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


async def _one(cluster: LocalCluster, records: int, creds: dict[str, str]
               ) -> tuple[float, float, float, float]:
    """(append rec/s, catch-up rec/s, append CPU us/record, catch-up CPU us/record)."""
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=60_000,
                           user=creds.get("user", ""), password=creds.get("password", ""),
                           tls_ca=creds.get("tls_ca", "")) as c:
        sids = await c.create_streams(4, replica_nums=1)
        cpu0 = _cpu_s(cluster)
        prod = await produce_load(c, sids, records, SIZE)
        cpu1 = _cpu_s(cluster)
        cons = await consume_load(c, sids)
        cpu2 = _cpu_s(cluster)
    return (prod.records / prod.seconds, cons.records / cons.seconds,
            (cpu1 - cpu0) / prod.records * 1e6, (cpu2 - cpu1) / cons.records * 1e6)


async def _grant(pm: str, certs: Path) -> None:
    await bootstrap_admin(pm, certs, "admin", "admin-pw")
    async with AsyncClient(pm, user="admin", password="admin-pw",
                           tls_ca=str(certs / CA_FILE)) as admin:
        await admin.add_user(*USER)
        await admin.add_acl(USER[0], "append,fetch,describe", "*")
        await admin.add_acl(USER[0], "create", "*")


def measure(records: int, runs: int, fsync: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-secure-") as tmp:
        root = Path(tmp)
        certs = root / "certs"
        init_dev_certs(certs)
        plain = LocalCluster(root / "plain", datanodes=1, fsync=fsync)
        secure = LocalCluster(root / "secure", datanodes=1, fsync=fsync, secure=certs)
        out: dict[str, dict[str, list[float]]] = {
            name: {"append": [], "catch_up": [], "append_cpu": [], "catch_up_cpu": []}
            for name in ("plain", "secure")}
        try:
            plain.start()
            secure.start()
            run(_grant(secure.pm_address, certs))
            creds = {"user": USER[0], "password": USER[1], "tls_ca": str(certs / CA_FILE)}
            for i in range(runs):
                order: list[tuple[str, LocalCluster, dict[str, str]]] = [
                    ("plain", plain, {}), ("secure", secure, creds)]
                for name, cl, cr in order if i % 2 == 0 else order[::-1]:
                    a, c, a_cpu, c_cpu = run(_one(cl, records, cr))
                    for key, v in (("append", a), ("catch_up", c), ("append_cpu", a_cpu),
                                   ("catch_up_cpu", c_cpu)):
                        out[name][key].append(v)
                    print(f"run {i + 1} {name:6}: append {a:8.0f} rec/s {a_cpu:6.1f} us CPU/rec"
                          f"  catch-up {c:8.0f} rec/s {c_cpu:6.1f} us CPU/rec", file=sys.stderr)
        finally:
            plain.stop()
            secure.stop()
    result: dict[str, Any] = {"records": records, "size": SIZE, "runs": runs, "fsync": fsync}
    for phase in ("append", "catch_up"):
        p = statistics.median(out["plain"][phase])
        s = statistics.median(out["secure"][phase])
        pc = statistics.median(out["plain"][phase + "_cpu"])
        sc = statistics.median(out["secure"][phase + "_cpu"])
        result[phase] = {"plain_rps": round(p), "secure_rps": round(s),
                         "cost": round(1 - s / p, 3), "within_target": 1 - s / p <= TARGET_COST,
                         "plain_cpu_us": round(pc, 2), "secure_cpu_us": round(sc, 2),
                         "cpu_cost": round(sc / pc - 1, 3),
                         "plain_runs": [round(x) for x in out["plain"][phase]],
                         "secure_runs": [round(x) for x in out["secure"][phase]]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fsync", default="interval", choices=["always", "interval", "none"])
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args()
    res = measure(a.records, a.runs, a.fsync)
    for phase in ("append", "catch_up"):
        r = res[phase]
        print(f"{phase:9} plain {r['plain_rps']:>9} rec/s  secure {r['secure_rps']:>9} rec/s  "
              f"cost {r['cost'] * 100:5.1f}%  (target <= {TARGET_COST * 100:.0f}%: "
              f"{'met' if r['within_target'] else 'NOT met'});  CPU/record plain "
              f"{r['plain_cpu_us']} us, secure {r['secure_cpu_us']} us: "
              f"+{r['cpu_cost'] * 100:.1f}%")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
