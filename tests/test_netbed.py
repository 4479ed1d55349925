"""The network test bed (tests/netbed.py): hosts reach each other, each nemesis fault is silent
and undone, and the bed removes all it made.

Every probe waits for a condition with a bound; a "timeout" outcome is a connect that got no
answer at all (no RST, no ICMP), the signature of a silent fault.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from netbed import TEST_PROCESS, BedProcess, NetBed, require_root, sweep_stale
from waiting import eventually

pytestmark = [pytest.mark.adversity, pytest.mark.timeout(300)]

ECHO_PORT = 7000
UDP_PORT = 7001
SINK_PORT = 7002
PROBE_S = 1.0
"""Connect timeout of a probe across a fault: fresh ARP fails only after 3 s, so a silent fault
shows as "timeout" (a hang guard, not a measurement)."""

ECHO = """
import socketserver, sys
class H(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer.daemon_threads = True
socketserver.ThreadingTCPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""

UDP_SINK = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2])))
while True:
    print(s.recv(100).decode(), flush=True)
"""

UDP_SEND = """
import socket, sys
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(sys.argv[3].encode(),
                                                        (sys.argv[1], int(sys.argv[2])))
"""

PINGER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.settimeout(0.5)
f = s.makefile("rb")
while True:
    s.sendall(b"x\\n")
    try:
        f.readline(); print("ok", flush=True)
    except TimeoutError:
        print("stall", flush=True)
        f = s.makefile("rb")
    time.sleep(0.05)
"""
"""An established connection that says, once per round trip, whether the echo came back."""

SINK = """
import hashlib, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
while True:
    c, _ = s.accept(); h = hashlib.sha256(); n = 0
    while d := c.recv(1 << 16):
        h.update(d); n += len(d)
    c.sendall(f"{n} {h.hexdigest()}".encode()); c.close()
"""

SOURCE = """
import hashlib, random, socket, sys
data = random.Random(7).randbytes(int(sys.argv[3]))
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
s.sendall(data); s.shutdown(socket.SHUT_WR)
print(s.recv(200).decode(), "|", len(data), hashlib.sha256(data).hexdigest())
"""


ARP_FROM = """
import socket, sys
mac = open("/sys/class/net/eth0/address").read().strip()
me, target = socket.inet_aton(sys.argv[1]), socket.inet_aton(sys.argv[2])
hw, bcast = bytes.fromhex(mac.replace(":", "")), b"\\xff" * 6
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(("eth0", 0))
for op, tpa in ((1, target), (2, me)):  # a request to the target, a gratuitous reply
    arp = b"\\x00\\x01\\x08\\x00\\x06\\x04" + op.to_bytes(2, "big") + hw + me + bcast + tpa
    for _ in range(3):
        s.send(bcast + hw + b"\\x08\\x06" + arp)
print(mac)
"""
"""Announces, by ARP, the host's MAC for its address: what could overwrite a cut's entry."""


def new_bed(*hosts: str) -> NetBed:
    require_root()
    return NetBed(hosts)


def echo(bed: NetBed, host: str, tmp_path: Path) -> BedProcess:
    proc = bed.spawn(host, [sys.executable, "-c", ECHO, bed.address(host), str(ECHO_PORT)],
                     log=tmp_path / f"echo-{host}.log")
    eventually(lambda: bed.tcp_probe(None, bed.address(host), ECHO_PORT, 2) == "connected",
               timeout=30, what=f"echo server on {host} listening")
    return proc


def probe(bed: NetBed, src: str | None, dst: str) -> str:
    return bed.tcp_probe(src, bed.address(dst), ECHO_PORT, PROBE_S)


def names_with(prefix: str) -> list[str]:
    found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [w for w in (found + links).replace(":", " ").replace("@", " ").split()
            if w.startswith(prefix)]


def test_hosts_reach_each_other_and_the_test_process_reaches_them(tmp_path: Path) -> None:
    with new_bed("a", "b", "c") as bed:
        addresses = {bed.address(h) for h in bed.hosts}
        assert len(addresses) == 3 and bed.bridge_address not in addresses
        for h in bed.hosts:
            echo(bed, h, tmp_path)
        for src in bed.hosts:
            for dst in bed.hosts:
                assert probe(bed, src, dst) == "connected", (src, dst)
        with socket.create_connection((bed.address("b"), ECHO_PORT), timeout=10) as s:
            s.sendall(b"hello\n")
            assert s.makefile("rb").readline() == b"hello\n"
        lo = bed.run("a", ["ip", "-o", "link", "show", "lo"])
        assert "UP" in lo.stdout


def test_two_beds_run_at_once_apart(tmp_path: Path) -> None:
    with new_bed("a", "b") as one, new_bed("a", "b") as two:
        assert one.prefix != two.prefix and not one.network.overlaps(two.network)
        echo(one, "b", tmp_path)
        assert one.tcp_probe("a", one.address("b"), ECHO_PORT, 5) == "connected"
        # the other bed's hosts have no route to the first bed's subnet: refused or unreachable
        # at once, never connected
        assert two.tcp_probe("a", one.address("b"), ECHO_PORT, 5) != "connected"


def test_link_down_is_silent_and_link_up_heals(tmp_path: Path) -> None:
    with new_bed("a", "b") as bed:
        echo(bed, "b", tmp_path)
        event = bed.link_down("b")
        assert probe(bed, "a", "b") == "timeout"
        assert probe(bed, None, "b") == "timeout"
        assert event.active and bed.events == [event]
        bed.link_up("b")
        assert not event.active
        eventually(lambda: probe(bed, "a", "b") == "connected", timeout=30, what="link healed")


def test_cut_both_ways_stalls_an_established_connection(tmp_path: Path) -> None:
    with new_bed("a", "b", "c") as bed:
        echo(bed, "b", tmp_path)
        echo(bed, "a", tmp_path)
        pinger = bed.spawn("a", [sys.executable, "-c", PINGER, bed.address("b"), str(ECHO_PORT)],
                           log=tmp_path / "pinger.log")
        eventually(lambda: "ok" in pinger.log_text(), timeout=30, what="pinger round trips")
        bed.cut("a", "b")
        eventually(lambda: pinger.log_text().rstrip().endswith("stall"), timeout=30,
                   what="the established connection stalls")
        assert probe(bed, "a", "b") == "timeout"
        assert probe(bed, "b", "a") == "timeout"
        assert probe(bed, "c", "b") == "connected"
        assert probe(bed, "c", "a") == "connected"
        # b's ARP (a request to a, a gratuitous reply) cannot overwrite the permanent entry
        arp = bed.run("b", [sys.executable, "-c", ARP_FROM, bed.address("b"), bed.address("a")])
        assert arp.returncode == 0, arp.stderr
        assert probe(bed, "a", "b") == "timeout"
        neigh = bed.run("a", ["ip", "neigh", "show", bed.address("b")]).stdout
        assert "PERMANENT" in neigh and arp.stdout.strip() not in neigh
        stalls = pinger.log_text().count("stall")
        bed.uncut("a", "b")
        eventually(lambda: pinger.log_text().rstrip().endswith("ok"), timeout=60,
                   what="the connection resumes after the cut heals")
        assert pinger.log_text().count("stall") >= stalls and pinger.alive
        assert probe(bed, "b", "a") == "connected"
        bed.cut("c", TEST_PROCESS)  # c runs no server: reachable means "refused"
        assert probe(bed, None, "c") == "timeout" and probe(bed, None, "b") == "connected"
        bed.heal()
        eventually(lambda: probe(bed, None, "c") == "refused", timeout=30,
                   what="the test process reaches c again")


def test_cut_one_way_drops_one_direction_only(tmp_path: Path) -> None:
    with new_bed("a", "b") as bed:
        sinks = {h: bed.spawn(h, [sys.executable, "-u", "-c", UDP_SINK, bed.address(h),
                                  str(UDP_PORT)], log=tmp_path / f"udp-{h}.log")
                 for h in ("a", "b")}

        def send(src: str, dst: str, text: str) -> None:
            done = bed.run(src, [sys.executable, "-c", UDP_SEND, bed.address(dst),
                                 str(UDP_PORT), text])
            assert done.returncode == 0, done.stderr

        def delivered(src: str, dst: str, text: str) -> bool:
            send(src, dst, text)
            return text in sinks[dst].log_text()

        eventually(lambda: delivered("a", "b", "warm-ab"), timeout=30, what="a->b UDP")
        eventually(lambda: delivered("b", "a", "warm-ba"), timeout=30, what="b->a UDP")
        event = bed.cut("a", "b", one_way=True)
        assert event.subject == "a->b"
        send("a", "b", "lost-ab")
        eventually(lambda: delivered("b", "a", "during-ba"), timeout=30,
                   what="b->a delivered during the one-way cut")
        # a connect from b reaches a, but a's answer is dropped: silent too
        assert probe(bed, "a", "b") == "timeout"
        bed.heal()
        eventually(lambda: delivered("a", "b", "after-ab"), timeout=30, what="a->b healed")
        # datagrams of one path are not reordered across seconds: had "lost-ab" been
        # delivered, it would be in the log before "after-ab"
        assert "lost-ab" not in sinks["b"].log_text()


def test_split_partitions_the_halves(tmp_path: Path) -> None:
    with new_bed("a", "b", "c") as bed:
        for h in bed.hosts:
            echo(bed, h, tmp_path)
        event = bed.split(["a"], ["b", "c"])
        assert probe(bed, "a", "b") == "timeout" and probe(bed, "c", "a") == "timeout"
        assert probe(bed, "b", "c") == "connected" and probe(bed, None, "a") == "connected"
        bed.undo(event)
        assert not event.active
        eventually(lambda: probe(bed, "a", "c") == "connected", timeout=30, what="split healed")
        assert probe(bed, "b", "a") == "connected"


def test_flaky_link_loses_frames_yet_a_bulk_transfer_arrives_intact(tmp_path: Path) -> None:
    size = 16 * 1024 * 1024
    with new_bed("a", "b") as bed:
        bed.spawn("b", [sys.executable, "-c", SINK, bed.address("b"), str(SINK_PORT)],
                  log=tmp_path / "sink.log")
        eventually(lambda: bed.tcp_probe("a", bed.address("b"), SINK_PORT, 2) == "connected",
                   timeout=30, what="sink listening")
        bed.flaky("a", loss=0.05, delay_ms=5, jitter_ms=2, seed=42)
        port_link = bed.link_name("v", "a")
        assert f"master {bed.bridge}" not in bed_link(port_link)
        done = bed.run("a", [sys.executable, "-c", SOURCE, bed.address("b"), str(SINK_PORT),
                             str(size)], timeout=240)
        assert done.returncode == 0, done.stderr
        received, sent = done.stdout.strip().split(" | ")
        assert received == sent and sent.startswith(f"{size} "), done.stdout
        eventually(lambda: bed.relay_stats("a").get("dropped", 0) > 0, timeout=30,
                   what="relay drops counted")
        stats = bed.relay_stats("a")
        assert stats["sent"] > 0 and stats["dropped"] < stats["seen"]
        bed.unflaky("a")
        assert f"master {bed.bridge}" in bed_link(port_link)
        assert names_with(bed.link_name("r", "a")) == []
        assert bed.tcp_probe("a", bed.address("b"), ECHO_PORT, 5) == "refused"


def bed_link(name: str) -> str:
    return subprocess.run(["ip", "-o", "link", "show", name], capture_output=True,
                          text=True).stdout


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_pause_and_resume(tmp_path: Path) -> None:
    with new_bed("a", "b") as bed:
        server = echo(bed, "b", tmp_path)
        pinger = bed.spawn("a", [sys.executable, "-c", PINGER, bed.address("b"), str(ECHO_PORT)],
                           log=tmp_path / "pinger.log")
        eventually(lambda: "ok" in pinger.log_text(), timeout=30, what="pinger round trips")
        event = bed.pause(server)
        eventually(lambda: proc_state(server.pid) == "T", timeout=10, what="stopped")
        eventually(lambda: pinger.log_text().rstrip().endswith("stall"), timeout=30,
                   what="no echo from a paused server")
        assert event.kind == "pause" and event.active
        bed.heal()
        assert not event.active and proc_state(server.pid) != "T"
        eventually(lambda: pinger.log_text().rstrip().endswith("ok"), timeout=30,
                   what="echoes again after resume")


def test_kill_and_restart(tmp_path: Path) -> None:
    with new_bed("a", "b") as bed:
        server = echo(bed, "b", tmp_path)
        first = server.pid
        event = bed.kill(server)
        assert not server.alive and server.returncode == -signal.SIGKILL
        assert probe(bed, "a", "b") == "refused"
        server.restart()
        assert server.pid != first and not event.active
        eventually(lambda: probe(bed, "a", "b") == "connected", timeout=30, what="restarted")
        assert [e.kind for e in bed.events] == ["kill"]


def test_cleanup_after_an_exception_leaves_nothing(tmp_path: Path) -> None:
    require_root()
    with pytest.raises(RuntimeError, match="test body failed"), NetBed(["a", "b"]) as bed:
        prefix = bed.prefix
        bed.flaky("a", loss=0.1)
        bed.cut("a", "b")
        server = bed.spawn("b", [sys.executable, "-c", "import time; time.sleep(300)"],
                           log=tmp_path / "sleep.log")
        assert names_with(prefix)
        raise RuntimeError("test body failed")
    assert names_with(prefix) == []
    assert not server.alive and not bed.workdir.exists()


def relays_of(prefix: str) -> list[int]:
    """Pids of relay processes serving a bed with this prefix."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"netbed_relay.py") for a in argv) and any(
                a.startswith(prefix.encode()) for a in argv):
            found.append(int(cmdline.parent.name))
    return found


def test_sweep_stale_removes_a_dead_owners_bed(tmp_path: Path) -> None:
    require_root()
    tests = Path(__file__).resolve().parent
    script = (f"import sys, time; sys.path.insert(0, {str(tests)!r})\n"
              "from netbed import NetBed\n"
              "bed = NetBed(['a', 'b']).start()\n"
              "bed.spawn('a', ['sleep', '300'], log=bed.workdir / 'sleep.log')\n"
              "bed.flaky('b', loss=0.0, delay_ms=0.0, jitter_ms=0.0)\n"
              "print(bed.prefix, flush=True)\n"
              "time.sleep(300)\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          text=True) as owner:
        assert owner.stdout is not None
        prefix = owner.stdout.readline().strip()
        assert prefix and names_with(prefix) and relays_of(prefix)
        sleeper = int(subprocess.run(["ip", "netns", "pids", prefix + "a"], capture_output=True,
                                     text=True).stdout.split()[0])
        assert not any(n.startswith(prefix) for n in sweep_stale())  # its owner lives
        owner.send_signal(signal.SIGKILL)  # no atexit: the bed is left behind
        owner.wait(30)
    assert names_with(prefix)
    eventually(lambda: not relays_of(prefix), timeout=30, what="the relay exits with its owner")
    removed = sweep_stale()
    assert any(n.startswith(prefix) for n in removed)
    assert names_with(prefix) == []
    eventually(lambda: proc_state(sleeper) in ("gone", "Z"), timeout=10,
               what="the dead bed's host process killed")
    with pytest.raises(ProcessLookupError):
        os.kill(int(prefix[2:].split("_")[0], 36), 0)


def test_etcd_cluster_elects_and_survives_one_isolated_member(tmp_path: Path) -> None:
    require_root()
    from etcd_fixture import require_etcd

    require_etcd()
    with NetBed(["e1", "e2", "e3"]) as bed:
        cluster = bed.etcd_cluster(["e1", "e2", "e3"], log_dir=tmp_path)
        assert cluster.url().count(",") == 2
        found = eventually(lambda: cluster.leader("e1"), timeout=30, what="a leader")
        assert found is not None
        leader = found
        others = [h for h in cluster.hosts if h != leader]
        bed.split([leader], others)

        def new_leader() -> str | None:
            seen = cluster.leader(others[0])
            return seen if seen in others else None

        eventually(new_leader, timeout=60, what="the majority elects a new leader")

        def put() -> bool:
            cluster.put(others[1], "netbed/key", "value")
            return True

        eventually(put, timeout=60, retry_on=(OSError,), what="a put through the majority")
        assert cluster.get(others[0], "netbed/key") == "value"
        bed.heal()
        cluster.wait_healthy(cluster.hosts)
        assert eventually(lambda: cluster.get(leader, "netbed/key"), timeout=30,
                          retry_on=(OSError,)) == "value"
