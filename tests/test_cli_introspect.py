"""Introspection and the global options, as a newcomer meets them: `--pm dead,live` works,
every command takes `--timeout-ms` (after its name or before it), `top` prints off a terminal,
`stats` shows names and readable times, tables are not cut at 80 columns in a pipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbpstream.client import Client
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port

pytestmark = pytest.mark.timeout(180)

EXE = str(Path(sys.executable).with_name("sbpstream"))
INTROSPECTION = (["info"], ["stats"], ["connections"], ["whoami"], ["nodes"], ["top", "--once"])
EPOCH_MS = re.compile(r"\b1\d{12}\b")
LOCAL_TIME = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b")


def sbp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("SBPSTREAM_PM", "COLUMNS")}
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=90,
                          env={**base, **(env or {})}, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("introspect"), datanodes=1)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def named(cluster: LocalCluster) -> str:
    """A named stream with records, so STATS has a row with a name and a last append."""
    name = "newcomer.orders-with-a-rather-long-name"
    with Client(cluster.pm_address) as c:
        (sid,) = c.create_streams(1, names=[name])
        p = c.producer()
        for i in range(20):
            p.send(sid, b"r%d" % i)
        p.close()
    return name


@pytest.mark.parametrize("cmd", INTROSPECTION, ids=lambda c: c[0])
def test_a_dead_pm_first_in_the_list_is_skipped(cluster: LocalCluster, cmd: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    r = sbp(*cmd, env={"SBPSTREAM_PM": f"{dead},{cluster.pm_address}"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("cmd", INTROSPECTION, ids=lambda c: c[0])
def test_every_introspection_command_takes_timeout_ms(cluster: LocalCluster,
                                                      cmd: list[str]) -> None:
    r = sbp(*cmd, "--timeout-ms", "20000", "--pm", cluster.pm_address)
    assert r.returncode == 0, r.stderr
    # before the command too, as a global option, with the global --pm
    r = sbp("--pm", cluster.pm_address, "--timeout-ms", "20000", *cmd)
    assert r.returncode == 0, r.stderr


def test_timeout_ms_bounds_the_search_for_a_pm() -> None:
    """Only dead PMs: the command gives up after --timeout-ms with one line naming them."""
    dead = f"127.0.0.1:{free_port()}"
    r = sbp("info", "--pm", dead, "--timeout-ms", "1500")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("sbpstream: error:") and dead in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_global_pm_serves_every_client_command(cluster: LocalCluster, named: str) -> None:
    r = sbp("--pm", cluster.pm_address, "stream", "list")
    assert r.returncode == 0 and named in r.stdout, r.stderr
    # a command's own --pm wins over the global one
    r = sbp("--pm", f"127.0.0.1:{free_port()}", "stream", "describe", named, "--pm",
            cluster.pm_address)
    assert r.returncode == 0, r.stderr


def test_stats_shows_names_and_readable_times_uncut(cluster: LocalCluster, named: str) -> None:
    r = sbp("stats", "--pm", cluster.pm_address)
    assert r.returncode == 0, r.stderr
    row = next((ln for ln in r.stdout.splitlines() if named in ln), None)
    assert row is not None, r.stdout  # the whole name, on one line: no cut at 80 columns
    assert len(row) > 80
    assert LOCAL_TIME.search(row), row
    assert not EPOCH_MS.search(r.stdout), r.stdout
    assert "last append" in r.stdout


def test_top_prints_snapshots_when_stdout_is_not_a_terminal(cluster: LocalCluster,
                                                           named: str) -> None:
    r = sbp("top", "--iterations", "2", "--interval-s", "0.2", "--pm", cluster.pm_address)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("data nodes") == 2, r.stdout  # one snapshot per interval
    assert named in r.stdout
    r = sbp("top", "--once", "--pm", cluster.pm_address)
    assert r.returncode == 0 and r.stdout.count("data nodes") == 1, r.stderr
