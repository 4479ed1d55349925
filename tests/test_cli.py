"""The command line, used as a user would: subprocesses against `sbpstream up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner
from waiting import eventually

from sbpstream.cli import app
from sbpstream.cluster import ping
from sbpstream.net.ports import free_port

pytestmark = pytest.mark.timeout(120)

EXE = str(Path(sys.executable).with_name("sbpstream"))


def sbp(*args: str, stdin: bytes = b"", env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([EXE, *args], input=stdin, capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("up")
    pm_port = free_port()
    dn_port = free_port()
    proc = subprocess.Popen(
        [EXE, "up", "--dir", str(d), "--datanodes", "1", "--pm-port", str(pm_port),
         "--dn-port", str(dn_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    addr = f"127.0.0.1:{pm_port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.communicate()
            return ping(addr) and ping(f"127.0.0.1:{dn_port}")

        eventually(up, timeout=60, interval=0.2, what="sbpstream up serving")
        yield addr
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        # `up` tells the user how to produce and consume from a second terminal
        assert b"produce --stream" in out and b"consume --stream" in out, out
        assert b"stopped" in err


def test_create_produce_consume_10k_lines(pm: str) -> None:
    r = sbp("stream", "create", "--pm", pm)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    assert sid.isdigit()
    lines = [b"line %d \x00\xff binary" % i for i in range(10_000)]
    r = sbp("produce", "--stream", sid, "--pm", pm, stdin=b"\n".join(lines) + b"\n")
    assert r.returncode == 0, r.stderr
    r = sbp("consume", "--stream", sid, "--count", "10000", env={"SBPSTREAM_PM": pm})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(b"\n")[:-1] == lines
    # from an offset, and exiting when caught up
    r = sbp("consume", "--stream", sid, "--from", "9998", "--pm", pm)
    assert r.stdout == lines[9998] + b"\n" + lines[9999] + b"\n"
    r = sbp("produce", "--stream", sid, "--pm", pm, "--key", "k", "--compression", "lz4",
            stdin=b"a\nb")  # the last line needs no newline
    assert r.returncode == 0, r.stderr
    r = sbp("consume", "--stream", sid, "--from", "10000", "--pm", pm)
    assert r.stdout == b"a\nb\n"


def test_stream_admin_commands(pm: str) -> None:
    r = sbp("stream", "create", "--count", "2", "--retention-ms", "60000", "--pm", pm)
    a, b = r.stdout.decode().split()
    r = sbp("stream", "describe", a, b, "--pm", pm)
    assert r.returncode == 0 and b"60000" in r.stdout
    assert a.encode() in sbp("stream", "list", "--pm", pm).stdout
    assert b"writable" in sbp("stream", "ranges", a, "--pm", pm).stdout
    sbp("produce", "--stream", a, "--pm", pm, stdin=b"1\n2\n3\n")
    assert sbp("stream", "trim", a, "2", "--pm", pm).returncode == 0
    assert sbp("consume", "--stream", a, "--pm", pm).stdout == b"3\n"
    assert sbp("stream", "delete", b, "--pm", pm).returncode == 0


def _one_clear_line(r: subprocess.CompletedProcess[bytes], *needles: str) -> None:
    assert r.returncode != 0
    err = r.stderr.decode()
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("sbpstream: error:")
    for n in needles:
        assert n in err, err


def test_expected_errors_are_one_line(pm: str) -> None:
    _one_clear_line(sbp("consume", "--stream", "424242", "--pm", pm), "STREAM_NOT_FOUND")
    _one_clear_line(sbp("produce", "--stream", "424242", "--pm", pm, stdin=b"x\n"),
                    "STREAM_NOT_FOUND")
    _one_clear_line(sbp("stream", "describe", "424242", "--pm", pm), "424242")
    _one_clear_line(sbp("stream", "list", "--pm", "nonsense"), "--pm", "HOST:PORT")
    _one_clear_line(sbp("stream", "list", "--pm", f"127.0.0.1:{free_port()}",
                        "--timeout-ms", "500"), "no placement manager reachable")
    sid = sbp("stream", "create", "--pm", pm).stdout.decode().strip()
    _one_clear_line(sbp("consume", "--stream", sid, "--from", "77", "--pm", pm), "beyond")
    _one_clear_line(sbp("consume", "--stream", sid, "--from", "soon", "--pm", pm), "--from")
    _one_clear_line(sbp("produce", "--pm", pm), "--stream")


COMMANDS = {
    (): ["up", "produce", "consume", "stream", "bench"],
    ("up",): ["--dir", "--datanodes", "--pm-port", "--dn-port", "--host", "--fsync"],
    ("pm",): ["--port", "--host", "--metadata", "--node-timeout-ms"],
    ("datanode",): ["--dir", "--pm", "--port", "--fsync"],
    ("stream",): ["create", "describe", "list", "delete", "trim", "ranges"],
    ("stream", "create"): ["--replicas", "--retention-ms", "--count", "--pm"],
    ("stream", "describe"): ["--pm"],
    ("stream", "list"): ["--pm"],
    ("stream", "delete"): ["--pm"],
    ("stream", "trim"): ["OFFSET", "--pm"],
    ("stream", "ranges"): ["--pm"],
    ("produce",): ["--stream", "--key", "--compression", "--pm"],
    ("consume",): ["--stream", "--from", "--count", "--follow", "--pm"],
    ("bench",): ["--records", "--size", "--streams", "--replicas", "--pm"],
}


@pytest.mark.parametrize("cmd", list(COMMANDS), ids=lambda c: " ".join(c) or "sbpstream")
def test_help(cmd: tuple[str, ...]) -> None:
    # in-process (a subprocess per command costs seconds on a loaded box); the console script
    # itself is exercised by every other test here
    r = CliRunner().invoke(app, [*cmd, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    for opt in COMMANDS[cmd]:
        assert opt in r.output, f"{cmd} --help lacks {opt}:\n{r.output}"
    assert len(r.output.splitlines()) > 3


def test_console_script_help() -> None:
    r = sbp("--help")
    assert r.returncode == 0 and b"consume" in r.stdout


def test_bench_runs(pm: str) -> None:
    r = sbp("bench", "--records", "3000", "--size", "64", "--streams", "2", "--pm", pm)
    assert r.returncode == 0, r.stderr
    assert b"produce" in r.stdout and b"records/s" in r.stdout.replace(b"\xe2\x80\xa6", b"")
