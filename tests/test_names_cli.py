"""`sbpstream stream create NAME` and `--stream NAME|ID` everywhere (issue 20)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpstream.cli import app
from sbpstream.cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

EXE = str(Path(sys.executable).with_name("sbpstream"))


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with LocalCluster(tmp_path_factory.mktemp("names-cli"), datanodes=1) as c:
        yield c.pm_address


def cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args), input=stdin)
    return r.exit_code, r.stdout, r.stderr


def test_create_by_name_and_use_the_name_everywhere(pm: str) -> None:
    code, out, err = cli("stream", "create", "logs.app", "logs.db", "--pm", pm)
    assert code == 0, err
    sid_app, sid_db = (int(x) for x in out.split())
    # produce reads the real stdin descriptor: a process of its own
    done = subprocess.run([EXE, "produce", "--stream", "logs.app", "--pm", pm], input=b"a\nb\n",
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    code, out, err = cli("consume", "--stream", "logs.app", "--pm", pm)
    assert (code, out) == (0, "a\nb\n"), err
    code, out, _ = cli("consume", "--stream", str(sid_app), "--pm", pm)
    assert out == "a\nb\n"
    code, out, err = cli("stream", "describe", "logs.db", str(sid_app), "--pm", pm)
    assert code == 0 and "logs.db" in out and "logs.app" in out, err
    code, out, _ = cli("stream", "list", "--pm", pm)
    assert "logs.app" in out
    for args in (("stream", "ranges", "logs.app"), ("stream", "trim", "logs.app", "1"),
                 ("stream", "update", "logs.app", "--retention-ms", "5000")):
        code, _, err = cli(*args, "--pm", pm)
        assert code == 0, (args, err)
    code, _, err = cli("stream", "delete", "logs.db", "--pm", pm)
    assert code == 0, err
    code, _, err = cli("stream", "describe", "logs.db", "--pm", pm)
    assert code == 1 and "not found" in err
    assert sid_db > 0


@pytest.mark.parametrize(("args", "needle"), [
    (("stream", "create", "bad name"), "invalid characters ' '"),
    (("stream", "create", "007"), "all digits"),
    (("produce", "--stream", "a/b"), "--stream: stream name 'a/b' has invalid characters"),
    (("consume", "--stream", "nosuch"), "no stream is named 'nosuch'"),
])
def test_bad_names_are_one_line_errors(pm: str, args: tuple[str, ...], needle: str) -> None:
    code, _, err = cli(*args, "--pm", pm)
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_a_taken_name_is_refused(pm: str) -> None:
    assert cli("stream", "create", "dup", "--pm", pm)[0] == 0
    code, _, err = cli("stream", "create", "dup", "--pm", pm)
    assert code == 1 and "'dup' is taken by stream" in err
