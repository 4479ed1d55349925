"""A multi-host test bed on one Linux machine: hosts are network namespaces on one bridge.

    with NetBed(["n1", "n2", "n3"]) as bed:
        server = bed.spawn("n1", [sys.executable, "-m", "http.server", "8000",
                                  "--bind", bed.address("n1")], log=tmp_path / "n1.log")
        bed.cut("n1", "n2")          # n1 and n2 no longer hear each other, silently
        bed.flaky("n3", loss=0.05)   # n3's link loses and delays frames
        bed.heal()                   # every network fault undone, paused processes resumed

Topology: each host is a namespace ``<prefix><host>`` with ``lo`` up and an ``eth0`` whose peer
(``<prefix>v<i>``) is a port of the bridge ``<prefix>br`` in the root namespace. Host ``i``
(0-based, in the order given) has ``<subnet>.<i+1>``; the bridge itself has ``<subnet>.254``
(:data:`BRIDGE_HOST_OCTET`), so the test process reaches every host directly. The /24 is a free
one of 10.201.0.0/16 .. 10.250.0.0/16, chosen under a lock file so concurrent beds differ.

Names carry a prefix unique to the bed, ``nb<pid base 36>_<counter base 36>_``, so two beds (of
one process or of several) run at once, and :func:`sweep_stale` can tell leftovers of a dead
owner (the pid in the name) from a live bed's.

The nemesis (methods of the bed) drops packets SILENTLY, as a failed cable or switch would: the
far side sees nothing, a connect times out. Each fault is a :class:`FaultEvent` in
:attr:`NetBed.events` with its start (and, once undone, end) time:

* ``link_down(host)``/``link_up(host)``: the bridge-side veth down (the host sees no carrier);
* ``cut(a, b, one_way=False)``/``uncut``: on ``a`` a permanent neighbour entry maps ``b``'s
  address to :data:`BLACKHOLE_MAC`, a MAC nobody owns: the bridge floods those frames and every
  port ignores them. ARP cannot overwrite a permanent entry. Healing deletes it;
* ``split(group1, group2)``: every pair across the halves cut both ways;
* ``flaky(host, loss, delay_ms, jitter_ms)``/``unflaky``: the host's veth leaves the bridge and a
  relay process (``tests/netbed_relay.py``) forwards frames between it and a second veth pair
  that joins the bridge, over AF_PACKET sockets with PACKET_VNET_HDR (so the veths' 64 KiB GSO
  super-frames pass intact), dropping with probability ``loss`` and delaying by delay +- jitter
  (order kept per direction). ``tc netem`` would do this, but the kernel here has no netem;
* ``pause(proc)``/``resume(proc)`` (SIGSTOP/SIGCONT), ``kill(proc)`` then ``proc.restart()``.

This module uses the standard library only, so ``bench/`` can import it too.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final

NAME_ROOT: Final = "nb"
"""Every name a bed makes starts with this (namespaces, links, work directories)."""

STALE_NAME: Final = re.compile(r"^nb([0-9a-z]{1,6})_([0-9a-z]{1,2})_")
"""A bed's name: the owning pid and the bed counter, both base 36."""

MAX_BEDS_PER_PROCESS: Final = 36 * 36
"""The counter has two base-36 digits, to keep interface names within 15 characters."""

MAX_HOSTS: Final = 200
"""Hosts are .1 .. .N of one /24, the bridge .254; 200 is far above any test's need."""

HOST_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")
"""Host names become part of namespace names: lowercase, short, shell-safe."""

BRIDGE_HOST_OCTET: Final = 254
"""The bridge (the test process's side) is <subnet>.254."""

SUBNET_SECOND_OCTETS: Final = range(201, 251)
"""Beds use 10.201.0.0/24 .. 10.250.255.0/24: far from the 10.0.x.x networks tools default to."""

LOCK_FILE: Final = Path(tempfile.gettempdir()) / "sbp-netbed.lock"
"""Serialises subnet choice (and sweeping) between beds of different processes."""

TEST_PROCESS: Final = "@test"
"""Stands for the test process (the root namespace, on the bridge) in :meth:`NetBed.cut`,
:meth:`NetBed.split` and :meth:`NetBed.address`."""

BLACKHOLE_MAC: Final = "02:00:5e:ba:d0:99"
"""A locally administered MAC no interface has: frames sent to it are flooded and ignored."""

IP_TIMEOUT_S: Final = 20.0
"""Bound on one ``ip`` command (they take milliseconds; a loaded 2-core box may stall)."""

STOP_TIMEOUT_S: Final = 10.0
"""Bound on a process's exit after SIGTERM before SIGKILL, and after SIGKILL."""

RELAY_SCRIPT: Final = Path(__file__).resolve().with_name("netbed_relay.py")
"""The relay of :meth:`NetBed.flaky`, run as a process of its own."""

RELAY_READY_TIMEOUT_S: Final = 20.0
"""Bound on the relay process binding its sockets (an interpreter start on a loaded box)."""

ETCD_CLIENT_PORT: Final = 2379
"""Each host has its own address, so every member uses etcd's standard ports."""

ETCD_PEER_PORT: Final = 2380
"""etcd's standard peer port (see :data:`ETCD_CLIENT_PORT`)."""

ETCD_CLUSTER_READY_TIMEOUT_S: Final = 60.0
"""Bound on three members starting and electing a leader on a loaded 2-core box."""

ETCD_REQUEST_TIMEOUT_S: Final = 5.0
"""Bound on one HTTP request to a member (a put through a healthy majority takes milliseconds)."""

PROBE_SCRIPT: Final = """
import errno, socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(); s.settimeout(timeout)
try:
    s.connect((addr, port)); print("connected")
except socket.timeout: print("timeout")
except ConnectionRefusedError: print("refused")
except OSError as e: print("error:" + errno.errorcode.get(e.errno or 0, str(e.errno)))
"""
"""Connects once and prints the outcome (see :meth:`NetBed.tcp_probe`)."""

_counter = 0
_counter_lock = threading.Lock()
_live_beds: set[NetBed] = set()


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(("-n", ns) if ns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def _sysctl(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", *key.split(".")).write_text(value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def require_root() -> None:
    """Skip the calling test, with the reason, unless this process can make namespaces."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("the network test bed needs root (namespaces, veths, a bridge)")
    if shutil.which("ip") is None:
        pytest.skip("the network test bed needs iproute2's `ip` on PATH")
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=IP_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"`ip netns` does not work here: {done.stderr.decode().strip()}")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _kill_namespace_pids(ns: str) -> None:
    for word in _ip("netns", "pids", ns, check=False).split():
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(word), signal.SIGKILL)


def sweep_stale() -> list[str]:
    """Remove namespaces, links and work directories of beds whose owning process is dead.

    Returns what was removed. Every bed calls it when it starts."""
    removed: list[str] = []

    def stale(name: str) -> bool:
        m = STALE_NAME.match(name)
        return m is not None and not _pid_alive(int(m.group(1), 36))

    with _locked():
        for line in _ip("netns", "list", check=False).splitlines():
            ns = line.split(" ", 1)[0]
            if stale(ns):
                _kill_namespace_pids(ns)
                _ip("netns", "delete", ns, check=False)
                removed.append(ns)
        for line in _ip("-o", "link", "show", check=False).splitlines():
            parts = line.split(":", 2)
            if len(parts) < 3:
                continue
            name = parts[1].strip().split("@", 1)[0]
            if stale(name):
                _ip("link", "delete", name, check=False)
                removed.append(name)
        for path in Path(tempfile.gettempdir()).glob(f"{NAME_ROOT}*"):
            if path.is_dir() and stale(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    return removed


@dataclass
class FaultEvent:
    """One fault the nemesis injected: what, on whom, when it started and (once undone) ended.

    ``started``/``ended`` are ``time.monotonic()``; ``started_wall`` is ``time.time()``."""

    kind: str
    subject: str
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    ended: float | None = None

    @property
    def active(self) -> bool:
        return self.ended is None


class BedProcess:
    """A process in a host, started by :meth:`NetBed.spawn`; its pid is the program's own.

    It leads its own process group; signals go to the whole group (a server's children too)."""

    def __init__(self, bed: NetBed, host: str, argv: Sequence[str],
                 env: Mapping[str, str] | None, log: Path) -> None:
        self.bed, self.host, self.argv, self.env, self.log = bed, host, list(argv), env, log
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        env = {**os.environ, **self.env} if self.env is not None else None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", self.bed.namespace(self.host), *self.argv],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def _signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def _stop(self) -> None:
        """SIGKILL the group and reap, without recording a fault (cleanup)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL (a crash), wait for the exit; recorded as a ``kill`` fault until restart."""
        self.bed._record("kill", self._subject(), key=("kill", id(self)))
        self._stop()

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (and SIGCONT, should it be paused), SIGKILL after ``timeout``; the exit code."""
        proc = self._proc
        if proc is None:
            return None
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)
        self.bed._end(("pause", id(self)))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._stop()
        return proc.poll()

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a hung host)."""
        self.bed._record("pause", self._subject(), key=("pause", id(self)))
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self.bed._end(("pause", id(self)))

    def restart(self) -> None:
        """Start the same argv again (killing it first if it runs); the log is appended to."""
        self._stop()
        self.bed._end(("kill", id(self)))
        self.bed._end(("pause", id(self)))
        self._start()

    def wait(self, timeout: float) -> int:
        assert self._proc is not None
        return self._proc.wait(timeout)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def _subject(self) -> str:
        return f"{self.host}:{Path(self.argv[0]).name}"

    def __repr__(self) -> str:
        return f"BedProcess({self.host}, pid={self.pid}, alive={self.alive})"


@dataclass
class _Relay:
    proc: subprocess.Popen[bytes]
    outer: str  # joins the bridge
    inner: str  # the relay's end of that pair
    stats: Path
    event: FaultEvent


class NetBed:
    """N hosts as namespaces on one bridge; a context manager that removes all it made."""

    def __init__(self, hosts: Sequence[str]) -> None:
        global _counter
        hosts = list(hosts)
        if not hosts or len(hosts) > MAX_HOSTS or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: 1 to {MAX_HOSTS} distinct names, got {hosts!r}")
        for h in hosts:
            if not HOST_NAME.match(h):
                raise ValueError(f"host name {h!r}: use [a-z0-9-], at most 16 characters")
        with _counter_lock:
            _counter += 1
            count = _counter % MAX_BEDS_PER_PROCESS
        self.hosts = hosts
        self.prefix = f"{NAME_ROOT}{_b36(os.getpid())}_{_b36(count)}_"
        self.bridge = self.link_name("br")
        self.events: list[FaultEvent] = []
        self.workdir = Path(tempfile.gettempdir()) / self.prefix.rstrip("_")
        self.network = ipaddress.IPv4Network("0.0.0.0/32")
        self._index = {h: i for i, h in enumerate(hosts)}
        self._active: dict[tuple[object, ...], FaultEvent] = {}
        self._cuts: dict[tuple[str, str], int] = {}
        self._relays: dict[str, _Relay] = {}
        self._procs: list[BedProcess] = []
        self._closed = True

    # ------------------------------------------------------------------------- set up, tear down

    def link_name(self, kind: str, host: str | None = None) -> str:
        """A root-namespace link of this bed: ``br``, or ``v``/``r``/``q`` plus a host's index."""
        name = self.prefix + kind + ("" if host is None else _b36(self._index[host]))
        assert len(name) <= 15, name
        return name

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def address(self, host: str) -> str:
        """The host's IPv4 address (``<subnet>.<index+1>``); of :data:`TEST_PROCESS`, the
        bridge's."""
        if host == TEST_PROCESS:
            return self.bridge_address
        return str(self.network.network_address + self._index[host] + 1)

    @property
    def bridge_address(self) -> str:
        """The root namespace's (the test process's) address on the bed: ``<subnet>.254``."""
        return str(self.network.network_address + BRIDGE_HOST_OCTET)

    def start(self) -> NetBed:
        sweep_stale()
        self._closed = False
        _live_beds.add(self)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            with _locked():
                self.network = self._free_subnet()
                _ip("link", "add", "name", self.bridge, "type", "bridge", "forward_delay", "0")
                _sysctl(f"net.ipv6.conf.{self.bridge}.disable_ipv6", "1")
                _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _free_subnet(self) -> ipaddress.IPv4Network:
        taken = []
        for line in _ip("-4", "-o", "addr", "show").splitlines() + _ip(
                "-4", "route", "show", "table", "all").splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word[0].isdigit():
                        taken.append(ipaddress.IPv4Network(word, strict=False))
        slots = [(a, b) for a in SUBNET_SECOND_OCTETS for b in range(256)]
        start = random.Random(self.prefix).randrange(len(slots))
        for k in range(len(slots)):
            a, b = slots[(start + k) % len(slots)]
            net = ipaddress.IPv4Network(f"10.{a}.{b}.0/24")
            if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
                return net
        raise RuntimeError("no free /24 in 10.201-250.x.x: run netbed.sweep_stale()")

    def _add_host(self, host: str) -> None:
        ns, outer = self.namespace(host), self.link_name("v", host)
        inner = self.link_name("h", host)
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        _ip("link", "set", inner, "name", "eth0", ns=ns)
        _ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _sysctl(f"net.ipv6.conf.{outer}.disable_ipv6", "1")
        _ip("link", "set", outer, "master", self.bridge, "up")

    def close(self) -> None:
        """Kill the bed's processes and relays, remove its namespaces, links and directory."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            proc._stop()
        for relay in self._relays.values():
            self._stop_relay(relay)
        self._relays.clear()
        for host in self.hosts:
            ns = self.namespace(host)
            _kill_namespace_pids(ns)
            _ip("netns", "delete", ns, check=False)
        for line in _ip("-o", "link", "show", check=False).splitlines():
            parts = line.split(":", 2)
            name = parts[1].strip().split("@", 1)[0] if len(parts) == 3 else ""
            if name.startswith(self.prefix):
                _ip("link", "delete", name, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
        _live_beds.discard(self)

    def __enter__(self) -> NetBed:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------- processes

    def spawn(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: Path) -> BedProcess:
        """Start ``argv`` in ``host`` (stdout and stderr appended to ``log``). ``env`` adds to
        (overrides) the test process's environment."""
        proc = BedProcess(self, host, argv, env, log)
        self._procs.append(proc)
        return proc

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in ``host`` (for callers starting their own process)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 30.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a short command in ``host``; its output captured as text, not checked."""
        return subprocess.run(self.exec_argv(host, argv), capture_output=True, text=True,
                              timeout=timeout, input=input, check=False)

    def tcp_probe(self, host: str | None, address: str, port: int, timeout: float) -> str:
        """Connect once from ``host`` (None: the test process) and tell how it went:
        ``connected``, ``refused``, ``timeout`` or ``error:<ERRNO>`` (e.g. EHOSTUNREACH)."""
        argv = [sys.executable, "-c", PROBE_SCRIPT, address, str(port), str(timeout)]
        if host is not None:
            argv = self.exec_argv(host, argv)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30.0,
                              check=False)
        return done.stdout.strip() or f"probe failed: {done.stderr.strip()}"

    # --------------------------------------------------------------------------------- nemesis

    def _record(self, kind: str, subject: str, *, key: tuple[object, ...]) -> FaultEvent:
        event = self._active.get(key)
        if event is None:
            event = FaultEvent(kind, subject)
            self.events.append(event)
            self._active[key] = event
        return event

    def _end(self, key: tuple[object, ...]) -> None:
        event = self._active.pop(key, None)
        if event is not None:
            event.ended = time.monotonic()

    def link_down(self, host: str) -> FaultEvent:
        """Take the host's link to the bridge down (a pulled cable: the host sees no carrier)."""
        _ip("link", "set", self.link_name("v", host), "down")
        return self._record("link_down", host, key=("link", host))

    def link_up(self, host: str) -> None:
        _ip("link", "set", self.link_name("v", host), "up")
        self._end(("link", host))

    def _known(self, *hosts: str) -> None:
        for h in hosts:
            if h != TEST_PROCESS and h not in self._index:
                raise ValueError(f"no host {h!r} in this bed (hosts: {self.hosts})")

    def _blackhole(self, a: str, b: str, on: bool) -> None:
        """Frames from ``a`` to ``b`` go to a MAC nobody has (on) or are ARP-resolved (off)."""
        key = (a, b)
        count = self._cuts.get(key, 0) + (1 if on else -1)
        ns, dev = (None, self.bridge) if a == TEST_PROCESS else (self.namespace(a), "eth0")
        addr = self.address(b)
        if on and count == 1:
            _ip("neigh", "replace", addr, "lladdr", BLACKHOLE_MAC, "dev", dev,
                "nud", "permanent", ns=ns)
        elif not on and count == 0:
            _ip("neigh", "del", addr, "dev", dev, ns=ns, check=False)
            _ip("neigh", "flush", "to", addr, "dev", dev, ns=ns, check=False)
        self._cuts[key] = max(count, 0)

    def cut(self, a: str, b: str, *, one_way: bool = False) -> FaultEvent:
        """Silently drop packets from ``a`` to ``b`` (and from ``b`` to ``a`` unless one_way).

        Either may be :data:`TEST_PROCESS`. A connect across a cut times out, in both
        directions even when one_way (its answer is dropped); UDP tells the directions apart."""
        self._known(a, b)
        self._blackhole(a, b, True)
        if not one_way:
            self._blackhole(b, a, True)
        arrow = "->" if one_way else "<->"
        return self._record("cut", f"{a}{arrow}{b}", key=("cut", a, b, one_way))

    def uncut(self, a: str, b: str, *, one_way: bool = False) -> None:
        """Undo :meth:`cut` with the same arguments."""
        if ("cut", a, b, one_way) not in self._active:
            return
        self._blackhole(a, b, False)
        if not one_way:
            self._blackhole(b, a, False)
        self._end(("cut", a, b, one_way))

    def split(self, group1: Iterable[str], group2: Iterable[str]) -> FaultEvent:
        """A partition: every host of ``group1`` cut from every host of ``group2``, both ways."""
        g1, g2 = tuple(sorted(group1)), tuple(sorted(group2))
        self._known(*g1, *g2)
        if set(g1) & set(g2):
            raise ValueError(f"split: a host is on both sides: {set(g1) & set(g2)}")
        key = ("split", g1, g2)
        if key not in self._active:
            for a in g1:
                for b in g2:
                    self._blackhole(a, b, True)
                    self._blackhole(b, a, True)
        return self._record("split", f"{','.join(g1)}|{','.join(g2)}", key=key)

    def unsplit(self, group1: Iterable[str], group2: Iterable[str]) -> None:
        g1, g2 = tuple(sorted(group1)), tuple(sorted(group2))
        if ("split", g1, g2) not in self._active:
            return
        for a in g1:
            for b in g2:
                self._blackhole(a, b, False)
                self._blackhole(b, a, False)
        self._end(("split", g1, g2))

    def flaky(self, host: str, loss: float = 0.1, delay_ms: float = 20.0,
              jitter_ms: float = 10.0, *, seed: int | None = None) -> FaultEvent:
        """Lose (probability ``loss``) and delay (``delay_ms`` +- ``jitter_ms``, order kept)
        the frames of the host's link, both directions, through a userspace relay."""
        if not 0.0 <= loss < 1.0 or delay_ms < 0 or jitter_ms < 0 or jitter_ms > delay_ms:
            raise ValueError("flaky: 0 <= loss < 1 and 0 <= jitter_ms <= delay_ms")
        if host in self._relays:
            self.unflaky(host)
        port, outer, inner = (self.link_name(k, host) for k in ("v", "r", "q"))
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        for dev in (outer, inner):
            _sysctl(f"net.ipv6.conf.{dev}.disable_ipv6", "1")
        _sysctl(f"net.ipv4.conf.{inner}.arp_ignore", "8")
        _sysctl(f"net.ipv4.conf.{port}.arp_ignore", "8")
        _ip("link", "set", inner, "up")
        stats = self.workdir / f"relay-{host}.json"
        stats.unlink(missing_ok=True)
        with open(self.workdir / f"relay-{host}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, str(RELAY_SCRIPT), port, inner,
                 str(loss), str(delay_ms), str(jitter_ms),
                 str(seed if seed is not None else random.randrange(1 << 30)), str(stats)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + RELAY_READY_TIMEOUT_S
        while not stats.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                _ip("link", "delete", outer, check=False)
                log = (self.workdir / f"relay-{host}.log").read_text(errors="replace")
                raise RuntimeError(f"flaky({host}): the relay did not start:\n{log[-2000:]}")
            time.sleep(0.02)
        _ip("link", "set", port, "nomaster")
        _ip("link", "set", outer, "master", self.bridge, "up")
        event = self._record("flaky", f"{host} loss={loss} delay={delay_ms}+-{jitter_ms}ms",
                             key=("flaky", host))
        self._relays[host] = _Relay(proc, outer, inner, stats, event)
        return event

    def unflaky(self, host: str) -> None:
        """Put the host's veth back on the bridge directly; the relay stops."""
        relay = self._relays.pop(host, None)
        if relay is None:
            return
        _ip("link", "set", relay.outer, "nomaster", check=False)
        _ip("link", "set", self.link_name("v", host), "master", self.bridge)
        self._stop_relay(relay)
        self._end(("flaky", host))

    def relay_stats(self, host: str) -> dict[str, int]:
        """The relay's counters: frames ``seen``, ``dropped``, ``sent``, ``send_errors``."""
        relay = self._relays.get(host)
        if relay is None:
            raise ValueError(f"{host} is not flaky")
        with contextlib.suppress(OSError, ValueError):
            data: dict[str, int] = json.loads(relay.stats.read_text())
            return data
        return {}

    def _stop_relay(self, relay: _Relay) -> None:
        if relay.proc.poll() is None:
            relay.proc.terminate()
            try:
                relay.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                relay.proc.kill()
                relay.proc.wait(STOP_TIMEOUT_S)
        _ip("link", "delete", relay.outer, check=False)

    def pause(self, proc: BedProcess) -> FaultEvent:
        proc.pause()
        return self._active[("pause", id(proc))]

    def resume(self, proc: BedProcess) -> None:
        proc.resume()

    def kill(self, proc: BedProcess) -> FaultEvent:
        proc.kill()
        return self._active[("kill", id(proc))]

    def undo(self, event: FaultEvent) -> None:
        """Undo one network fault or pause given its event (a kill is undone by restart)."""
        for key, active in list(self._active.items()):
            if active is event:
                self._undo_key(key)

    def _undo_key(self, key: tuple[object, ...]) -> None:
        kind = key[0]
        if kind == "link":
            self.link_up(str(key[1]))
        elif kind == "cut":
            self.uncut(str(key[1]), str(key[2]), one_way=bool(key[3]))
        elif kind == "split":
            self.unsplit(key[1], key[2])  # type: ignore[arg-type]
        elif kind == "flaky":
            self.unflaky(str(key[1]))
        elif kind == "pause":
            for proc in self._procs:
                if id(proc) == key[1]:
                    proc.resume()

    def heal(self) -> None:
        """Undo every network fault and resume every paused process (killed ones stay dead)."""
        for key in list(self._active):
            if key[0] != "kill":
                self._undo_key(key)

    # ------------------------------------------------------------------------------------ etcd

    def etcd_cluster(self, hosts: Sequence[str], *, log_dir: Path | None = None,
                     extra_args: Sequence[str] = ()) -> EtcdCluster:
        """One etcd member per host (ports 2379/2380 on each host's address), healthy."""
        return EtcdCluster(self, hosts, log_dir or self.workdir, extra_args).start()


class EtcdCluster:
    """An etcd cluster with one member per bed host; members are :class:`BedProcess` es."""

    def __init__(self, bed: NetBed, hosts: Sequence[str], log_dir: Path,
                 extra_args: Sequence[str]) -> None:
        self.bed, self.hosts, self.log_dir = bed, list(hosts), log_dir
        self.extra_args = list(extra_args)
        self.members: dict[str, BedProcess] = {}

    def endpoint(self, host: str) -> str:
        return f"{self.bed.address(host)}:{ETCD_CLIENT_PORT}"

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint(h) for h in self.hosts]

    def url(self, prefix: str = "") -> str:
        """A ``--metadata`` URL naming every member."""
        return f"etcd://{','.join(self.endpoints)}{prefix}"

    def start(self) -> EtcdCluster:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd binary not on PATH (Debian package etcd-server)")
        peers = ",".join(f"{h}=http://{self.bed.address(h)}:{ETCD_PEER_PORT}"
                         for h in self.hosts)
        for host in self.hosts:
            addr = self.bed.address(host)
            client, peer = f"http://{addr}:{ETCD_CLIENT_PORT}", f"http://{addr}:{ETCD_PEER_PORT}"
            argv = [binary, "--name", host,
                    "--data-dir", str(self.bed.workdir / f"etcd-{host}"),
                    "--listen-client-urls", f"{client},http://127.0.0.1:{ETCD_CLIENT_PORT}",
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", peers, "--initial-cluster-state", "new",
                    "--initial-cluster-token", self.bed.prefix, *self.extra_args]
            self.members[host] = self.bed.spawn(host, argv, log=self.log_dir / f"etcd-{host}.log")
        self.wait_healthy(self.hosts)
        return self

    def _call(self, host: str, path: str, body: Mapping[str, object]) -> dict[str, object]:
        req = urllib.request.Request(f"http://{self.endpoint(host)}{path}",
                                     data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=ETCD_REQUEST_TIMEOUT_S) as r:
            data: dict[str, object] = json.loads(r.read())
            return data

    def healthy(self, host: str) -> bool:
        """The member answers /health with true (it is in a cluster with a leader)."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint(host)}/health",
                                        timeout=ETCD_REQUEST_TIMEOUT_S) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_healthy(self, hosts: Sequence[str],
                     timeout: float = ETCD_CLUSTER_READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.healthy(h) for h in hosts):
            dead = [h for h in self.hosts if not self.members[h].alive]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- {h}\n{self.members[h].log_text()[-1500:]}"
                                  for h in self.hosts)
                raise RuntimeError(f"etcd members {hosts} not healthy within {timeout}s "
                                   f"(exited: {dead}):\n{tails}")
            time.sleep(0.1)

    def leader(self, asking: str) -> str | None:
        """The host of the leader as ``asking`` sees it, None if it knows none or is silent."""
        try:
            status = self._call(asking, "/v3/maintenance/status", {})
            members = self._call(asking, "/v3/cluster/member/list", {})
        except (OSError, urllib.error.URLError, ValueError):
            return None
        lead = str(status.get("leader", ""))
        for m in members.get("members", []):  # type: ignore[attr-defined]
            if str(m.get("ID")) == lead:
                return str(m.get("name"))
        return None

    def put(self, host: str, key: str, value: str) -> None:
        """Put through ``host``'s member (it needs a quorum to answer)."""
        self._call(host, "/v3/kv/put", {"key": base64.b64encode(key.encode()).decode(),
                                        "value": base64.b64encode(value.encode()).decode()})

    def get(self, host: str, key: str) -> str | None:
        data = self._call(host, "/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()})
        kvs = data.get("kvs") or []
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None  # type: ignore[index]

    def stop(self) -> None:
        for proc in self.members.values():
            proc.terminate()


@atexit.register
def _close_live_beds() -> None:
    for bed in list(_live_beds):
        with contextlib.suppress(Exception):
            bed.close()


def _main(argv: Sequence[str]) -> int:
    if argv[:1] == ["sweep"]:
        for name in sweep_stale():
            print(name)
        return 0
    print("usage: netbed.py sweep", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = ["BLACKHOLE_MAC", "TEST_PROCESS", "BedProcess", "EtcdCluster", "FaultEvent", "NetBed",
           "require_root", "sweep_stale"]
