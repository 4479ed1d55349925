"""`sbpstream consume --group` resumes; `sbpstream group list|describe|reset-offsets|delete`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpstream.cli import app
from sbpstream.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

EXE = str(Path(sys.executable).with_name("sbpstream"))


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with LocalCluster(tmp_path_factory.mktemp("groups-cli"), datanodes=1) as c:
        yield c.pm_address


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def produce(pm: str, stream: str, data: bytes) -> None:
    done = subprocess.run([EXE, "produce", "--stream", stream, "--pm", pm], input=data,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_consume_group_resumes_and_group_commands(pm: str) -> None:
    code, out, err = cli("stream", "create", "audit.log", "--pm", pm)
    assert code == 0, err
    sid = int(out)
    produce(pm, "audit.log", b"a\nb\nc\n")
    code, out, err = cli("consume", "--stream", "audit.log", "--group", "ops", "--count", "2",
                         "--pm", pm)
    assert (code, out) == (0, "a\nb\n"), err
    code, out, err = cli("consume", "--stream", "audit.log", "--group", "ops", "--pm", pm)
    assert (code, out) == (0, "c\n"), err  # resumed after b
    code, out, err = cli("consume", "--stream", "audit.log", "--group", "ops", "--pm", pm)
    assert (code, out) == (0, ""), err  # nothing new
    produce(pm, "audit.log", b"d\n")
    code, out, err = cli("group", "list", "--pm", pm)
    assert code == 0 and "ops" in out.split(), err
    code, out, err = cli("group", "describe", "ops", "--pm", pm)
    assert code == 0, err
    rows = [[c.strip() for c in ln.strip("│ ").split("│")] for ln in out.splitlines()
            if ln.startswith("│")]
    assert [str(sid), "3", "4", "1", "-"] in rows  # stream, committed, end, lag, member
    for to, expect in (("earliest", 0), ("latest", 4), ("1", 1)):
        code, out, err = cli("group", "reset-offsets", "ops", "--to", to, "--pm", pm)
        assert (code, out) == (0, f"{sid}\t{expect}\n"), err
    code, out, err = cli("consume", "--stream", "audit.log", "--group", "ops", "--pm", pm)
    assert (code, out) == (0, "b\nc\nd\n"), err
    code, _, err = cli("group", "reset-offsets", "ops", "--to", "nope", "--pm", pm)
    assert code == 2 and "--to" in err
    code, _, err = cli("group", "delete", "ops", "--pm", pm)
    assert code == 0, err
    code, out, _ = cli("group", "list", "--pm", pm)
    assert "ops" not in out.split()
