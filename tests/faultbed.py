"""Fault scenarios against a real cluster in the network test bed (issue 33), for the adversity
tier (a few cycles each: ``tests/test_fault_scenarios.py``) and the soaks (20 cycles each:
``bench/bench_faults.py``).

A cluster here is: one PM on SQLite, or three PMs on a three-member etcd whose members have
hosts of their own; four data nodes; a client host running the workload of
``tests/workload.py`` as separate processes: one producer writing to two streams of
replication factor 2 and two of factor 3 with acknowledgement accounting, and one consumer
reading all four. Every server and client has its own address (:mod:`netbed`).

A scenario is a fault (one or several nemesis actions) applied for :data:`FAULT_S`, healed,
then :data:`RECOVER_S` of calm, for N cycles. Afterwards the producer stops, the consumer
catches up, and :func:`run_scenario` collects:

* the workload checker's result (every acknowledged record readable exactly once at its offset,
  nothing corrupt, no send failed with deadline left after the heal, no call past its deadline,
  the consumer's order and gaps, availability per fault window);
* ``sbpstream check`` clean once the cluster converged (bounded wait);
* with etcd: the fence's audit trail (every PM's ``etcd_txn_committed`` lines, sorted by etcd
  revision, have non-decreasing leader tokens: a deposed leader never wrote after its successor).

Timings are named constants, chosen so each fault outlasts the node timeout and the leader lease
(the fault must cause a failover to test one), and the calm lets the cluster converge.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from netbed import BedProcess, EtcdCluster, NetBed

from sbpstream.auth.bootstrap import bootstrap_admin, bootstrap_token
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.client import Credentials
from sbpstream.auth.config import CA_FILE, SECRET_FILE, read_secret
from sbpstream.client import AsyncClient
from sbpstream.cluster import secure_args
from sbpstream.net.client import Connection
from sbpstream.net.tls import TlsConfig, client_context
from sbpstream.protocol.messages import DescribeStreamsRequest, DescribeStreamsResponse
from sbpstream.protocol.opcodes import Opcode

REPO: Final = Path(__file__).resolve().parents[1]
WORKLOAD: Final = REPO / "tests" / "workload.py"

PM_PORT: Final = 12378
DN_PORT: Final = 10911
"""Every host has its own address, so every server uses its standard port."""

HEARTBEAT_MS: Final = 200
NODE_TIMEOUT_MS: Final = 1_500
"""Short liveness settings so a fault of a few seconds causes a failover (production defaults
are 1 s and 6 s: the same mechanisms, slower)."""

LEASE_TTL_S: Final = 2
"""The PM leader's etcd lease: etcd's floor with default raft timing."""

FAULT_S: Final = 3.0
"""How long each fault lasts: past the node timeout and the lease, so it deposes and seals."""

RECOVER_S: Final = 3.0
"""Calm after each heal: nodes rejoin, re-replication and convergence run."""

PAUSE_S: Final = 3.5
"""A SIGSTOP outlasting both the node timeout and the lease (the scenarios' point)."""

RATE: Final = 150
"""Records per second the producer offers (over all four streams): enough to keep every
range busy, little enough that eleven namespaces of servers share two cores."""

DEADLINE_MS: Final = 15_000
"""The producer's and consumer's SDK deadline: longer than a fault plus a failover, so a send
with deadline left at the heal must succeed."""

REQUEST_TIMEOUT_MS: Final = 3_000
"""One SDK request's timeout (a silent peer is given up on after this, then retried)."""

STREAMS: Final = (("r2-a", 2), ("r2-b", 2), ("r3-a", 3), ("r3-b", 3))
"""The workload's streams and their replication factors."""

SETTLE_TIMEOUT_S: Final = 120.0
"""Bound on the consumer catching up and ``sbpstream check`` turning clean after the last heal
(a loaded 2-core box re-replicating several ranges)."""

START_TIMEOUT_S: Final = 90.0
"""Bound on the cluster starting: etcd members, PMs electing, four data nodes registering."""

LEADER_TIMEOUT_S: Final = 30.0
"""Bound on finding the leading PM (an election takes about a lease TTL)."""

ADMIN: Final = ("admin", "admin-pw")
"""The administrator a secure cluster bootstraps (user, password)."""

DATANODES: Final = ("dn1", "dn2", "dn3", "dn4")
CLIENT: Final = "cl"
ETCD_HOSTS: Final = ("e1", "e2", "e3")


@dataclass
class Window:
    """One cycle's fault, on the monotonic clock (the workload checker's ``--events``)."""

    what: str
    start: float
    heal: float | None = None


@dataclass
class ScenarioResult:
    scenario: str
    metadata: str
    cycles: int
    check: dict[str, Any]
    problems: list[str]
    sbp_check_clean: bool
    sbp_check_output: str
    fence_violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.sbp_check_clean and not self.fence_violations

    def failures(self) -> list[str]:
        out = list(self.problems)
        if not self.sbp_check_clean:
            out.append(f"sbpstream check not clean: {self.sbp_check_output[-2000:]}")
        out += [f"fence: {v}" for v in self.fence_violations]
        return out


def _python_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), path) if p)}


class FaultCluster:
    """PM(s), data nodes and the client host in a :class:`NetBed`; stopped on exit."""

    def __init__(self, workdir: Path, *, metadata: str, secure: bool = False) -> None:
        if metadata not in ("sqlite", "etcd"):
            raise ValueError(f"metadata {metadata!r}: sqlite or etcd")
        self.metadata = metadata
        self.secure = secure
        self.certs = workdir / "certs"
        self.workdir = workdir
        self.pm_hosts = ["pm1"] if metadata == "sqlite" else ["pm1", "pm2", "pm3"]
        hosts = [*self.pm_hosts, *DATANODES, CLIENT]
        if metadata == "etcd":
            hosts += ETCD_HOSTS
        self.bed = NetBed(hosts)
        self.etcd: EtcdCluster | None = None
        self.pms: dict[str, BedProcess] = {}
        self.dns: dict[str, BedProcess] = {}
        self.env = _python_env()
        if secure:  # the CLI in the client host logs in as the administrator over TLS
            self.env.update(SBPSTREAM_USER=ADMIN[0], SBPSTREAM_PASSWORD=ADMIN[1],
                            SBPSTREAM_TLS_CA=str(self.certs / CA_FILE))

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> FaultCluster:
        self.bed.start()
        try:
            self._start()
        except BaseException:
            self.bed.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.bed.close()

    def _server_args(self) -> list[str]:
        """TLS and authentication (certificates valid for every host's address), or
        plaintext open to the bed's addresses."""
        if self.secure:
            return secure_args(self.certs)
        return ["--allow-remote-unauthenticated"]

    def client_kwargs(self) -> dict[str, Any]:
        """What an SDK client of the test process needs to log in (secure) or nothing."""
        if not self.secure:
            return {}
        return {"user": ADMIN[0], "password": ADMIN[1], "tls_ca": str(self.certs / CA_FILE)}

    def _start(self) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if self.secure:
            init_dev_certs(self.certs, [self.bed.address(h) for h in self.bed.hosts])
        if self.metadata == "etcd":
            self.etcd = self.bed.etcd_cluster(list(ETCD_HOSTS), log_dir=logs)
            meta = self.etcd.url() + f"?lease_ttl_s={LEASE_TTL_S}"
        else:
            meta = f"sqlite:{self.workdir / 'pm1' / 'metadata.sqlite3'}"
        for h in self.pm_hosts:
            addr = self.bed.address(h)
            self.pms[h] = self.bed.spawn(h, [
                sys.executable, "-m", "sbpstream.pm", "--host", addr, "--port", str(PM_PORT),
                "--advertise", f"{addr}:{PM_PORT}", "--metadata", meta,
                "--heartbeat-interval-ms", str(HEARTBEAT_MS),
                "--node-timeout-ms", str(NODE_TIMEOUT_MS), "--log-level", "DEBUG",
                *self._server_args(),
            ], env=self.env, log=logs / f"{h}.log")
        for h in DATANODES:
            addr = self.bed.address(h)
            self.dns[h] = self.bed.spawn(h, [
                sys.executable, "-m", "sbpstream.datanode", "--host", addr,
                "--port", str(DN_PORT), "--advertise", f"{addr}:{DN_PORT}",
                "--dir", str(self.workdir / h), "--pm", self.pm_arg,
                "--heartbeat-interval-ms", str(HEARTBEAT_MS), *self._server_args(),
            ], env=self.env, log=logs / f"{h}.log")
        if self.secure:  # the first administrator, once the PMs listen and one leads
            for h in self.pm_hosts:
                self._wait(functools.partial(self.pm_listening, h), START_TIMEOUT_S,
                           f"{h} listening")
            leader = f"{self.bed.address(self.leader())}:{PM_PORT}"
            asyncio.run(bootstrap_admin(leader, self.certs, *ADMIN))
        self._wait(lambda: self._live_nodes() == len(DATANODES), START_TIMEOUT_S,
                   "every data node registered and live")

    # ------------------------------------------------------------------ addresses
    @property
    def pm_arg(self) -> str:
        return ",".join(f"{self.bed.address(h)}:{PM_PORT}" for h in self.pm_hosts)

    def dn_host(self, address: str) -> str:
        ip = address.rsplit(":", 1)[0]
        return next(h for h in DATANODES if self.bed.address(h) == ip)

    # ------------------------------------------------------------------ commands
    def cli(self, *args: str, timeout: float = 60.0) -> tuple[int, str]:
        """``sbpstream ARGS --pm ...`` run in the client host: (exit code, stdout + stderr)."""
        done = self.bed.run(CLIENT, [*self._env_argv(), sys.executable, "-m", "sbpstream.cli",
                                     *args, "--pm", self.pm_arg], timeout=timeout)
        return done.returncode, done.stdout + done.stderr

    def pm_listening(self, host: str) -> bool:
        """The PM of ``host`` accepts connections (from the test process)."""
        return self.bed.tcp_probe(None, self.bed.address(host), PM_PORT, 2.0) == "connected"

    def _env_argv(self) -> list[str]:
        """``env K=V ...``: what :meth:`NetBed.run` needs to find this tree's packages."""
        return ["env", *(f"{k}={v}" for k, v in self.env.items())]

    def _live_nodes(self) -> int:
        rc, out = self.cli("nodes", "--json", timeout=30)
        if rc != 0:
            return -1
        try:
            nodes = json.loads(out[out.index("{"):])["nodes"]
        except (ValueError, KeyError):
            return -1
        return sum(1 for n in nodes if n.get("live"))

    @staticmethod
    def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.3)
        raise TimeoutError(f"not within {timeout:.0f} s: {what}")

    def leader(self) -> str:
        """The PM host that leads now (the one answering a leader-only request)."""
        if len(self.pm_hosts) == 1:
            return self.pm_hosts[0]

        async def leads(host: str) -> bool:
            addr = f"{self.bed.address(host)}:{PM_PORT}"
            ssl_context, creds = None, None
            if self.secure:  # the cluster secret's bootstrap token: no user needed yet
                tls = TlsConfig(ca=str(self.certs / CA_FILE))
                ssl_context = client_context(tls)
                creds = Credentials(token=bootstrap_token(read_secret(
                    str(self.certs / SECRET_FILE))), pm=(addr,), tls=tls)
            try:
                conn = await asyncio.wait_for(
                    Connection.open(addr, ssl_context=ssl_context, authenticator=creds), 5.0)
            except (OSError, TimeoutError, Exception):
                return False
            try:
                f = await conn.request_one(
                    Opcode.DESCRIBE_STREAMS,
                    DescribeStreamsRequest(timeout_ms=2000, stream_ids=()).encode(), timeout_s=3.0)
                return DescribeStreamsResponse.decode(f.header).status.ok
            except Exception:
                return False
            finally:
                await conn.aclose()

        async def find() -> str | None:
            for h in self.pm_hosts:
                if await leads(h):
                    return h
            return None

        deadline = time.monotonic() + LEADER_TIMEOUT_S
        while time.monotonic() < deadline:
            host = asyncio.run(find())
            if host is not None:
                return host
            time.sleep(0.3)
        raise TimeoutError(f"no PM leads after {LEADER_TIMEOUT_S:.0f} s")

    def primary_host(self, stream: str) -> str:
        """The data node host holding the primary of ``stream``'s last (writable) range, as the
        PM says (asked from the test process, over the bridge)."""

        async def ask() -> str:
            async with AsyncClient(self.pm_arg, retry_deadline_ms=DEADLINE_MS,
                                   **self.client_kwargs()) as client:
                ranges = await client.list_ranges(stream)
            last = ranges[-1]
            return next(rn.data_node.advertise_addr for rn in last.replica_nodes
                        if rn.is_primary)

        return self.dn_host(asyncio.run(ask()))

    def workload(self, role: str, log: Path, *extra: str) -> BedProcess:
        return self.bed.spawn(CLIENT, [
            sys.executable, str(WORKLOAD), role, "--pm", self.pm_arg,
            "--stream-names", ",".join(n for n, _ in STREAMS), "--log", str(log),
            "--deadline-ms", str(DEADLINE_MS), "--request-timeout-ms", str(REQUEST_TIMEOUT_MS),
            *self._workload_login(), *extra], env=self.env, log=log.with_suffix(".out"))

    def _workload_login(self) -> list[str]:
        if not self.secure:
            return []
        return ["--user", ADMIN[0], "--password", ADMIN[1], "--tls-ca",
                str(self.certs / CA_FILE)]

    def fence_violations(self) -> list[str]:
        """Committed etcd writes whose leader token goes down as the revision goes up."""
        pat = re.compile(r"event=etcd_txn_committed token=(\d+) revision=(\d+)")
        writes: list[tuple[int, int, str]] = []
        for h, p in self.pms.items():
            for m in pat.finditer(p.log_text()):
                writes.append((int(m.group(2)), int(m.group(1)), h))
        writes.sort()
        out = []
        top = (0, 0, "")
        for rev, token, host in writes:
            if token < top[1]:
                out.append(f"{host} wrote revision {rev} with token {token} after {top[2]} "
                           f"wrote revision {top[0]} with token {top[1]}")
            if token >= top[1]:
                top = (rev, token, host)
        return out


# ---------------------------------------------------------------------- scenarios
Fault = Callable[[FaultCluster, random.Random], Callable[[], None]]
"""Applies a fault and returns its undo (called at the heal)."""


def _dn_isolated(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    h = rnd.choice(DATANODES)
    c.bed.link_down(h)
    return lambda: c.bed.link_up(h)


def _dn_cut_from_pm(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    h = rnd.choice(DATANODES)
    c.bed.split([h], c.pm_hosts)
    return lambda: c.bed.unsplit([h], c.pm_hosts)


def _client_cut_from_dn(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    h = c.primary_host(rnd.choice(STREAMS)[0])
    c.bed.cut(CLIENT, h)
    return lambda: c.bed.uncut(CLIENT, h)


def _pm_cut_from_dns(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    c.bed.split(c.pm_hosts, list(DATANODES))
    return lambda: c.bed.unsplit(c.pm_hosts, list(DATANODES))


def _leader_cut_from_etcd(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    leader = c.leader()
    others = [*ETCD_HOSTS, *(h for h in c.pm_hosts if h != leader)]
    c.bed.split([leader], others)
    return lambda: c.bed.unsplit([leader], others)


def _halves(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    dns = list(DATANODES)
    rnd.shuffle(dns)
    if c.metadata == "etcd":
        # the leader's side is the minority of etcd: it must step down; the majority elects
        leader = c.leader()
        others = [h for h in c.pm_hosts if h != leader]
        a = [leader, ETCD_HOSTS[0], dns[0], dns[1]]
        b = [*others, *ETCD_HOSTS[1:], dns[2], dns[3]]
    else:
        a = [c.pm_hosts[0], dns[0], dns[1]]
        b = [dns[2], dns[3]]
    c.bed.split(a, b)
    return lambda: c.bed.unsplit(a, b)


def _flaky(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    h = c.primary_host(rnd.choice(STREAMS)[0])
    c.bed.flaky(h, loss=0.05, delay_ms=10.0, jitter_ms=5.0)
    return lambda: c.bed.unflaky(h)


def _leader_paused(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    p = c.pms[c.leader()]
    c.bed.pause(p)
    return lambda: c.bed.resume(p)


def _primary_paused(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    p = c.dns[c.primary_host(rnd.choice(STREAMS)[0])]
    c.bed.pause(p)
    return lambda: c.bed.resume(p)


def _etcd_member_isolated(c: FaultCluster, rnd: random.Random) -> Callable[[], None]:
    h = rnd.choice(ETCD_HOSTS)
    c.bed.link_down(h)
    return lambda: c.bed.link_up(h)


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: Fault
    etcd_only: bool = False
    duration_s: float = FAULT_S


SCENARIOS: Final = {s.name: s for s in (
    Scenario("dn-isolated", _dn_isolated),
    Scenario("dn-cut-from-pm", _dn_cut_from_pm),
    Scenario("client-cut-from-dn", _client_cut_from_dn),
    Scenario("pm-cut-from-dns", _pm_cut_from_dns),
    Scenario("leader-cut-from-etcd", _leader_cut_from_etcd, etcd_only=True),
    Scenario("halves", _halves),
    Scenario("flaky-link", _flaky),
    Scenario("pm-leader-paused", _leader_paused, duration_s=PAUSE_S),
    Scenario("primary-paused", _primary_paused, duration_s=PAUSE_S),
    Scenario("etcd-member-isolated", _etcd_member_isolated, etcd_only=True),
)}


@contextmanager
def _running(procs: Sequence[BedProcess]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.alive:
                p.kill()


def run_scenario(workdir: Path, scenario: str, *, metadata: str, cycles: int,
                 seed: int = 0, secure: bool = False) -> ScenarioResult:
    """Run ``cycles`` of ``scenario`` under the workload on a fresh cluster; see the module."""
    return run_scenarios(workdir, [scenario], metadata=metadata, cycles=cycles, seed=seed,
                         secure=secure)


def run_scenarios(workdir: Path, scenarios: Sequence[str], *, metadata: str, cycles: int,
                  seed: int = 0, secure: bool = False) -> ScenarioResult:
    """``cycles`` of each scenario in turn, all on one fresh cluster under one workload (the
    suite's way: one cluster start for many faults, each fault meeting a cluster that went
    through the ones before); see the module."""
    for name in scenarios:
        if SCENARIOS[name].etcd_only and metadata != "etcd":
            raise ValueError(f"{name} needs etcd metadata (it faults the etcd cluster or PMs)")
    rnd = random.Random(seed)

    def cycles_of_faults(c: FaultCluster, windows: list[Window]) -> None:
        for name in scenarios:
            sc = SCENARIOS[name]
            for _ in range(cycles):
                w = Window(sc.name, time.monotonic())
                undo = sc.fault(c, rnd)
                time.sleep(sc.duration_s)  # the fault lasts this long
                c.bed.heal()
                undo()
                w.heal = time.monotonic()
                windows.append(w)
                time.sleep(RECOVER_S)  # calm: the cluster recovers under load

    label = scenarios[0] if len(scenarios) == 1 else "+".join(scenarios)
    return exercise(workdir, label, metadata=metadata, cycles=cycles, body=cycles_of_faults,
                    secure=secure)


def exercise(workdir: Path, name: str, *, metadata: str, cycles: int,
             body: Callable[[FaultCluster, list[Window]], None],
             secure: bool = False) -> ScenarioResult:
    """A fresh cluster, the workload's streams, producer and consumer; ``body`` does its faults
    or operations (recording a :class:`Window` for each); then the checks of the module."""
    with FaultCluster(workdir, metadata=metadata, secure=secure) as c:
        for stream, r in STREAMS:
            rc, out = c.cli("stream", "create", stream, "--replicas", str(r))
            if rc != 0:
                raise RuntimeError(f"stream create {stream}: {out[-500:]}")
        plog, clog = workdir / "producer.jsonl", workdir / "consumer.jsonl"
        producer = c.workload("produce", plog, "--rate", str(RATE),
                              "--duration-s", str(3600))
        consumer = c.workload("consume", clog)
        windows: list[Window] = []
        problems: list[str] = []
        with _running([producer, consumer]):
            _wait_lines(plog, 50, "the producer's first acknowledgements")
            body(c, windows)
            producer.terminate(timeout=DEADLINE_MS / 1000 + 30)
            acked = sum(1 for line in _lines(plog) if "acked_at" in line)
            try:
                c._wait(lambda: _count(clog, "offset") >= acked, SETTLE_TIMEOUT_S,
                        f"the consumer reads all {acked} acknowledged records")
            except TimeoutError as exc:
                problems.append(f"consumer stuck: {exc}; {_lag(plog, clog)}")
            consumer.terminate()
        events = workdir / "faults.json"
        events.write_text(json.dumps([asdict(w) for w in windows]))
        done = c.bed.run(CLIENT, [*c._env_argv(), sys.executable, str(WORKLOAD), "check",
                                  "--pm", c.pm_arg, "--producer-log", str(plog),
                                  "--consumer-log", str(clog), "--events", str(events),
                                  *c._workload_login()],
                         timeout=SETTLE_TIMEOUT_S)
        try:
            check = json.loads(done.stdout)
        except ValueError:
            check = {"error": done.stdout[-2000:] + done.stderr[-2000:]}
        problems += list(check.get("problems", [])) if "error" not in check else [
            f"checker failed: {check['error']}"]
        clean: list[str] = []

        def sbp_check_clean() -> bool:
            rc, out = c.cli("check", timeout=120)
            clean[:] = [out]
            return rc == 0

        try:
            c._wait(sbp_check_clean, SETTLE_TIMEOUT_S, "sbpstream check clean")
            ok = True
        except TimeoutError:
            ok = False
        return ScenarioResult(name, metadata, cycles, check, problems, ok,
                              clean[0] if clean else "", c.fence_violations())


DRAIN_TIMEOUT_S: Final = 180.0
"""Bound on a drain under load: sealing the node's writable ranges and copying its sealed ones
(a few hundred KiB here) on a loaded 2-core box."""


def run_rolling_restart(workdir: Path, *, metadata: str) -> ScenarioResult:
    """Every server restarted in turn (SIGTERM, start again, wait until it is back: a data node
    live at the PM, a PM answering), data nodes first, then PMs, then etcd members, under the
    workload; then the module's checks."""

    def rolling(c: FaultCluster, windows: list[Window]) -> None:
        servers = [*c.dns.items(), *c.pms.items(),
                   *(c.etcd.members.items() if c.etcd is not None else ())]
        for host, proc in servers:
            w = Window(f"restart {host}", time.monotonic())
            proc.terminate()
            proc.restart()
            if host in c.dns:
                c._wait(lambda: c._live_nodes() == len(DATANODES), START_TIMEOUT_S,
                        f"{host} live again")
            elif host in c.pms:
                c._wait(functools.partial(c.pm_listening, host), START_TIMEOUT_S,
                        f"{host} listening again")
                c._wait(lambda: c._live_nodes() == len(DATANODES), START_TIMEOUT_S,
                        "a PM leads and sees every data node")
            else:
                assert c.etcd is not None
                c.etcd.wait_healthy([host], timeout=START_TIMEOUT_S)
            w.heal = time.monotonic()
            windows.append(w)
            time.sleep(RECOVER_S / 2)  # the operator's pause between two servers

    return exercise(workdir, "rolling-restart", metadata=metadata, cycles=1, body=rolling)


def run_drain(workdir: Path, *, metadata: str) -> ScenarioResult:
    """Drain the data node holding the primary of an R=3 stream under the workload, stop it
    and remove it (``sbpstream node drain --wait``, ``node remove``); then the module's
    checks (``sbpstream check`` finds no under-replicated range on the three nodes left)."""

    def drain(c: FaultCluster, windows: list[Window]) -> None:
        host = c.primary_host("r3-a")
        addr = f"{c.bed.address(host)}:{DN_PORT}"
        w = Window(f"drain {host}", time.monotonic())
        rc, out = c.cli("node", "drain", addr, "--wait", timeout=DRAIN_TIMEOUT_S)
        if rc != 0:
            raise RuntimeError(f"node drain {addr}: {out[-1000:]}")
        w.heal = time.monotonic()
        windows.append(w)
        c.dns[host].terminate()
        del c.dns[host]
        c._wait(lambda: c.cli("node", "remove", addr, timeout=30)[0] == 0, START_TIMEOUT_S,
                f"node remove {addr} (once the PM sees it stopped)")
        time.sleep(RECOVER_S)  # the workload goes on with three data nodes

    return exercise(workdir, "drain", metadata=metadata, cycles=1, body=drain)


def _lag(plog: Path, clog: Path) -> str:
    """Per stream: the highest acknowledged offset and the highest the consumer read."""
    acked: dict[str, int] = {}
    read: dict[str, int] = {}
    for line in _lines(plog):
        d = json.loads(line)
        if "acked_at" in d:
            acked[d["stream"]] = max(acked.get(d["stream"], -1), d["offset"])
    for line in _lines(clog):
        d = json.loads(line)
        if "offset" in d:
            read[d["stream"]] = max(read.get(d["stream"], -1), d["offset"])
    return ", ".join(f"{s}: acked to {acked[s]}, read to {read.get(s, -1)}"
                     for s in sorted(acked))


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _count(path: Path, key: str) -> int:
    return sum(1 for line in _lines(path) if f'"{key}"' in line)


def _wait_lines(path: Path, n: int, what: str) -> None:
    FaultCluster._wait(lambda: _count(path, "acked_at") >= n, START_TIMEOUT_S, what)


