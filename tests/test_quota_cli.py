"""The quota commands of the CLI, as a user runs them (subprocesses against a local cluster)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbpstream.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)
EXE = [str(Path(sys.executable).with_name("sbpstream"))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d: Path = tmp_path_factory.mktemp("quota-cli")
    with LocalCluster(d, datanodes=1, heartbeat_interval_ms=200) as c:
        yield c


def _cli(cluster: LocalCluster, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args, "--pm", cluster.pm_address], input=stdin.decode(),
                          capture_output=True, text=True, timeout=60)


def test_quota_set_list_delete_counters_and_client_id(cluster: LocalCluster) -> None:
    r = _cli(cluster, "quota", "set", "--client-id", "app-7", "--produce-bytes-per-s", "4096",
             "--requests-per-s", "100")
    assert r.returncode == 0, r.stderr
    assert "client/app-7" in r.stdout and "4,096" in r.stdout
    assert _cli(cluster, "quota", "set", "--default", "--fetch-bytes-per-s", "1000000"
                ).returncode == 0
    r = _cli(cluster, "quota", "list")
    assert "client/app-7" in r.stdout and "default" in r.stdout and "1,000,000" in r.stdout
    r = _cli(cluster, "stream", "create")
    assert r.returncode == 0, r.stderr
    sid = next(w for w in r.stdout.split() if w.isdigit())
    # 40 kB against 4 kB/s: the node throttles app-7, and its counter lives ~10 s (its TTL)
    lines = b"".join(b"%04d" % i + b"x" * 996 + b"\n" for i in range(40))
    r = _cli(cluster, "produce", "--stream", sid, "--client-id", "app-7", stdin=lines)
    assert r.returncode == 0, r.stderr
    r = _cli(cluster, "quota", "counters")
    assert r.returncode == 0, r.stderr
    assert "c/app-7/produce" in r.stdout and "milliseconds" in r.stdout
    r = _cli(cluster, "quota", "delete", "--client-id", "app-7")
    assert r.returncode == 0 and "deleted quota client/app-7" in r.stdout
    assert "client/app-7" not in _cli(cluster, "quota", "list").stdout


def test_quota_per_user_and_per_user_client_id(cluster: LocalCluster) -> None:
    r = _cli(cluster, "quota", "set", "--user", "alice", "--produce-bytes-per-s", "2048")
    assert r.returncode == 0, r.stderr
    assert "quota user/alice:" in r.stdout and "2,048" in r.stdout
    r = _cli(cluster, "quota", "set", "--user", "alice", "--client-id", "etl",
             "--fetch-bytes-per-s", "9000")
    assert r.returncode == 0, r.stderr
    assert "quota user/alice,client/etl:" in r.stdout
    listed = _cli(cluster, "quota", "list").stdout
    assert "user/alice " in listed and "user/alice,client/etl" in listed and "9,000" in listed
    r = _cli(cluster, "quota", "delete", "--user", "alice", "--client-id", "etl")
    assert r.returncode == 0 and "deleted quota user/alice,client/etl" in r.stdout
    listed = _cli(cluster, "quota", "list").stdout
    assert "user/alice " in listed and "client/etl" not in listed
    assert _cli(cluster, "quota", "delete", "--user", "alice").returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--client-id", "a", "--produce-bytes-per-s", "0"], "would stop all traffic"),
    (["--client-id", "a", "--fetch-bytes-per-s", "-5"], "is negative"),
    (["--default", "--requests-per-s", str(1 << 40)], "above the largest"),
    (["--client-id", "a"], "at least one of"),
    (["--client-id", "a", "--default", "--requests-per-s", "5"], "exactly one of"),
    (["--user", "a", "--stream", "5", "--requests-per-s", "5"], "exactly one of"),
    (["--user", "a,b", "--requests-per-s", "5"], "no ','"),
])
def test_quota_set_refuses_hostile_values(cluster: LocalCluster, args: list[str],
                                          message: str) -> None:
    r = _cli(cluster, "quota", "set", *args)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
