"""``make bench``: sbpstream against Redis Streams and NATS JetStream, in one run, with plots.

    python -m bench.run_all [--quick] [--runs 3] [--out bench/results] [--update-docs]

Starts (on free loopback ports, in a throwaway directory) a local sbpstream cluster with
``--fsync always``, ``redis-server --appendonly yes --appendfsync everysec`` and ``nats-server
-js``; measures the machine's physical limits; runs every workload against every system, runs
times, rotating the order of the systems each run; stops everything it started (also on Ctrl-C,
SIGTERM or an error); writes ``<out>/<date>.json``, ``<out>/<date>.md`` and PNG plots. Figures
are medians of the runs with their min..max; ratios are computed within each run, then their
median taken. A workload that fails records its error; sbpstream with ``replica_nums 3`` is
recorded as "not available: <error>" when the PM rejects it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from bench import peers
from bench.common import median_spread
from bench.peers import (
    AppendSpec,
    LatencySpec,
    NatsSystem,
    RedisSystem,
    System,
    Throughput,
    payload_of,
)
from bench.physical import measure_all
from bench.sbp_workloads import SbpCluster, SbpSystem

DEFAULT_OUT = Path("bench/results")
RECORD_SIZES = (100, 1024)
STREAM_COUNTS = (1, 1000)
LATENCY_RATE_PER_S = 2000
LATENCY_RECORD_BYTES = 100


@dataclass(frozen=True, slots=True)
class Plan:
    """How much each workload does; ``quick`` is the smoke-test size."""

    records_by_size: dict[int, int]
    stream_counts: tuple[int, ...]
    time_cap_s: float
    latency_records: int
    latency_cap_s: float
    runs: int
    quick: bool

    @classmethod
    def make(cls, *, quick: bool, runs: int | None) -> Plan:
        if quick:
            return cls({100: 2000, 1024: 1000}, (1, 100), 10.0, 400, 5.0, runs or 1, True)
        return cls(
            {100: 150_000, 1024: 100_000}, STREAM_COUNTS, 30.0, 20_000, 20.0, runs or 3, False
        )

    def append_specs(self) -> list[AppendSpec]:
        return [
            AppendSpec(size, streams, self.records_by_size[size], self.time_cap_s)
            for size in RECORD_SIZES
            for streams in self.stream_counts
        ]

    def latency_spec(self) -> LatencySpec:
        return LatencySpec(
            LATENCY_RATE_PER_S, self.latency_records, LATENCY_RECORD_BYTES, self.latency_cap_s
        )


# ---------------------------------------------------------------------------------- machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_info(directory: Path) -> dict[str, Any]:
    mem_kib = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
         if line.startswith("MemTotal:")),
        0,
    )
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
         if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    disk: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(
            ["findmnt", "-no", "SOURCE,FSTYPE", "-T", str(directory)],
            capture_output=True, text=True, timeout=5,
        ).stdout.split()
        disk["device"], disk["fstype"] = out[0], out[1]
        name = Path(disk["device"]).name
        rota = _read(f"/sys/block/{name}/queue/rotational").strip()
        disk["rotational"] = rota == "1" if rota else None
    st = os.statvfs(directory)
    disk["size_gib"] = round(st.f_blocks * st.f_frsize / 1024**3, 1)
    disk["free_gib"] = round(st.f_bavail * st.f_frsize / 1024**3, 1)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "memory_gib": round(mem_kib / 1024**2, 1),
        "disk": disk,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": list(os.getloadavg()),
    }


def versions(redis: RedisSystem, nats: NatsSystem) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def pkg(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "redis-server": redis.version,
        "nats-server": nats.version,
        "redis-py": pkg("redis"),
        "hiredis": pkg("hiredis"),
        "redis-py parser": redis.parser,
        "nats-py": pkg("nats-py"),
        "sbpstream": pkg("sbpstream"),
        "uvloop": pkg("uvloop"),
    }


# ---------------------------------------------------------------------------------- running


class Results:
    """Per-run raw figures, keyed by (kind, label, system)."""

    def __init__(self) -> None:
        self.raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self.physical: dict[str, list[dict[str, Any]]] = {}

    def add(self, kind: str, label: str, system: str, run: int, fig: dict[str, Any]) -> None:
        self.raw.setdefault((kind, label, system), []).append({"run": run, **fig})


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}".strip()[:500]}


async def run_append_read(
    system: System, spec: AppendSpec, run: int, res: Results, log: Any
) -> None:
    payload = payload_of(spec.record_bytes)
    try:
        tp, handle = await system.append(spec, payload)
    except Exception as e:  # one system failing a workload must not stop the others
        log(f"  {system.name}: append {spec.label} FAILED: {e}")
        traceback.print_exc()
        res.add("append", spec.label, system.name, run, _error(e))
        res.add("catch_up", spec.label, system.name, run, _error(e))
        return
    res.add("append", spec.label, system.name, run, tp.to_json())
    # What the append left behind (an SDK producer's per-record futures, a client's buffers) is
    # garbage now: collect it before the timed read, for every system alike, or the collector's
    # full passes over it land inside the read (measured: 120-230 ms of a 370-720 ms sbpstream
    # read of 1,000 streams)
    gc.collect()
    try:
        rd: Throughput | dict[str, Any] = await system.catch_up(handle, spec)
    except Exception as e:
        traceback.print_exc()
        rd = _error(e)
    res.add("catch_up", spec.label, system.name, run,
            rd.to_json() if isinstance(rd, Throughput) else rd)
    with contextlib.suppress(Exception):
        await system.drop(handle)
    rd_s = f"{rd.mb_s:7.1f} MB/s" if isinstance(rd, Throughput) else f"FAILED {rd['error']}"
    log(f"  {system.name:16s} {spec.label:20s} append {tp.mb_s:7.1f} MB/s "
        f"{tp.records_s:9.0f} rec/s{' CAPPED' if tp.capped else ''} | catch-up {rd_s}")


async def run_latency(system: System, spec: LatencySpec, run: int, res: Results, log: Any) -> None:
    label = f"{spec.rate_per_s} rec/s x {spec.record_bytes} B"
    try:
        lat = await system.latency(spec)
    except Exception as e:
        traceback.print_exc()
        res.add("latency", label, system.name, run, _error(e))
        log(f"  {system.name}: latency FAILED: {e}")
        return
    fig = lat.to_json()
    res.add("latency", label, system.name, run, fig)
    log(f"  {system.name:16s} latency p50 {fig['p50_ms']:7.2f} p99 {fig['p99_ms']:7.2f} "
        f"p999 {fig['p999_ms']:7.2f} ms ({fig['received']}/{fig['sent']})")


def rotated(items: Sequence[System], run: int) -> list[System]:
    k = run % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


async def run_suite(
    plan: Plan, systems: list[System], workdir: Path, res: Results, log: Any
) -> None:
    for run in range(plan.runs):
        log(f"run {run + 1}/{plan.runs}")
        for p in await asyncio.to_thread(measure_all, workdir / "physical", quick=plan.quick):
            res.physical.setdefault(p.name, []).append({"run": run, **p.to_json()})
            log(f"  physical {p.name:36s} {p.mb_s:8.1f} MB/s {p.ops_s:9.1f} ops/s")
        for spec in plan.append_specs():
            for system in rotated(systems, run):
                await run_append_read(system, spec, run, res, log)
        for system in rotated(systems, run):
            await run_latency(system, plan.latency_spec(), run, res, log)


# ---------------------------------------------------------------------------- aggregation


METRICS = {
    "append": ("mb_s", "records_s"),
    "catch_up": ("mb_s", "records_s"),
    "latency": ("p50_ms", "p99_ms", "p999_ms"),
}
RATIO_BASES = ("Redis Streams", "NATS JetStream")


def _stat(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    m, lo, hi = median_spread(values)
    return {"median": m, "min": lo, "max": hi, "n": len(values)}


def aggregate(res: Results, systems_meta: dict[str, dict[str, Any]]) -> dict[str, Any]:
    workloads: dict[tuple[str, str], dict[str, Any]] = {}
    for (kind, label, system), runs in res.raw.items():
        w = workloads.setdefault((kind, label), {"kind": kind, "label": label, "results": {}})
        ok = [r for r in runs if "error" not in r]
        entry: dict[str, Any] = {"runs": runs}
        for metric in METRICS[kind]:
            entry[metric] = _stat([float(r[metric]) for r in ok])
        entry["capped"] = any(r.get("capped") for r in ok)
        errors = sorted({r["error"] for r in runs if "error" in r})
        entry["errors"] = errors
        w["results"][system] = entry
    ratios: list[dict[str, Any]] = []
    sbp_names = [n for n in systems_meta if n.startswith("sbpstream")]
    for (kind, label), w in workloads.items():
        if kind == "latency":
            continue
        for sbp in sbp_names:
            for base in RATIO_BASES:
                a, b = w["results"].get(sbp), w["results"].get(base)
                if not a or not b:
                    continue
                b_by_run = {r["run"]: r for r in b["runs"] if "error" not in r}
                per_run = [
                    r["mb_s"] / b_by_run[r["run"]]["mb_s"]
                    for r in a["runs"]
                    if "error" not in r and r["run"] in b_by_run and b_by_run[r["run"]]["mb_s"]
                ]
                stat = _stat(per_run)
                if stat:
                    ratios.append({"kind": kind, "label": label, "system": sbp, "base": base,
                                   "per_run": per_run, **stat})
    return {"workloads": list(workloads.values()), "ratios": ratios}


# ---------------------------------------------------------------------------------- main


class Interrupts:
    """SIGINT/SIGTERM handling that never raises inside the event loop.

    While the suite's top-level task runs, a signal sets ``peers.STOP`` (worker threads stop) and
    cancels that task from the loop; ``main`` turns the cancellation into KeyboardInterrupt once
    the loop is closed. Outside the loop (starting or stopping servers) a signal raises
    KeyboardInterrupt at once, and the ExitStack stops whatever was started; later signals are
    ignored so that the cleanup (bounded by the stop timeouts) completes.
    """

    def __init__(self) -> None:
        self.fired = False
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        first = not self.fired
        self.fired = True
        peers.STOP.set()
        if self.loop is not None:
            if self.task is not None and first:
                self.loop.call_soon_threadsafe(self.task.cancel)
            return
        if first:  # a second signal must not break off the (bounded) cleanup under way
            raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    async def run(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as the cancellable top-level task (the loop stays registered until
        ``left_loop``, so a signal during the loop's shutdown does not raise inside it)."""
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.ensure_future(coro)
        if self.fired:
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    def left_loop(self) -> None:
        self.loop = self.task = None
        if self.fired:
            raise KeyboardInterrupt("interrupted")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (smoke test): 1 run")
    p.add_argument("--runs", type=int, default=None, help="runs per figure (default 3; quick 1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the systems keep their data (default: a temp dir, removed after)")
    p.add_argument("--skip", action="append", default=[],
                   choices=["redis", "nats", "sbp1", "sbp3"], help="leave a system out")
    p.add_argument("--update-docs", action="store_true",
                   help="also rewrite the results section of docs/benchmarks.md")
    a = p.parse_args(argv)
    if a.runs is not None and a.runs < 1:
        p.error("--runs must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    from bench import report
    from sbpstream.net.loop import run as run_on_uvloop

    args = parse_args(argv)
    plan = Plan.make(quick=args.quick, runs=args.runs)
    started = dt.datetime.now()
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="sbpbench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    redis, nats = RedisSystem(workdir / "redis"), NatsSystem(workdir / "nats")
    cluster = SbpCluster(workdir / "sbpstream", datanodes=3)
    machine = machine_info(workdir)
    systems_meta: dict[str, dict[str, Any]] = {}
    res = Results()
    interrupts = Interrupts()

    def in_loop(coro: Coroutine[Any, Any, None]) -> None:
        try:
            run_on_uvloop(interrupts.run(coro))
        finally:
            interrupts.left_loop()

    with interrupts.installed(), contextlib.ExitStack() as stack:
        if own_workdir:
            stack.callback(shutil.rmtree, workdir, True)
        systems: list[System] = []
        for key, proc, members in (
            ("redis", redis, [redis]),
            ("nats", nats, [nats]),
            ("sbp", cluster, [SbpSystem(cluster, 1), SbpSystem(cluster, 3)]),
        ):
            wanted = [m for m in members if _key_of(m) not in args.skip]
            if not wanted:
                continue
            log(f"starting {key}")
            stack.callback(proc.stop)
            proc.start()
            for m in wanted:
                meta: dict[str, Any] = {"acks": m.acks, "available": True, "error": None}
                if isinstance(m, SbpSystem):
                    try:
                        in_loop(m.probe())
                    except Exception as e:
                        meta.update(available=False, error=f"not available: {e}")
                        log(f"  {m.name} not available: {e}")
                systems_meta[m.name] = meta
                if meta["available"]:
                    systems.append(m)
        in_loop(run_suite(plan, systems, workdir, res, log))
        machine["loadavg_end"] = list(os.getloadavg())
    doc: dict[str, Any] = {
        "date": started.date().isoformat(),
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t_start, 1),
        "quick": plan.quick,
        "runs": plan.runs,
        "command": " ".join(["python -m bench.run_all", *(argv or sys.argv[1:])]),
        "machine": machine,
        "versions": versions(redis, nats),
        "plan": {
            "append_records": {str(k): v for k, v in plan.records_by_size.items()},
            "stream_counts": list(plan.stream_counts),
            "time_cap_s": plan.time_cap_s,
            "latency": {"rate_per_s": LATENCY_RATE_PER_S, "records": plan.latency_records,
                        "record_bytes": LATENCY_RECORD_BYTES, "time_cap_s": plan.latency_cap_s},
        },
        "systems": systems_meta,
        "physical": {
            name: {"runs": runs, "mb_s": _stat([r["mb_s"] for r in runs]),
                   "ops_s": _stat([r["ops_s"] for r in runs])}
            for name, runs in res.physical.items()
        },
        **aggregate(res, systems_meta),
    }
    paths = report.write_all(doc, args.out)
    for p in paths:
        log(f"wrote {p}")
    if args.update_docs:
        log(f"updated {report.update_docs(doc, args.out, Path('docs/benchmarks.md'))}")
    return 0


def _key_of(system: object) -> str:
    if isinstance(system, RedisSystem):
        return "redis"
    if isinstance(system, NatsSystem):
        return "nats"
    assert isinstance(system, SbpSystem)
    return f"sbp{system.replica_nums}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: every process this run started was stopped", file=sys.stderr)
        sys.exit(130)
