"""The command line, used as a user would: subprocesses against `sbpstream up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_fixtures import spark_session_fixture  # noqa: F401  (the `spark` fixture)
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
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """`sbpstream up` with one data node: (PM address, data node address)."""
    d = tmp_path_factory.mktemp("up")
    pm_port = free_port()
    dn_port = free_port()
    proc = subprocess.Popen(
        [EXE, "up", "--dir", str(d), "--datanodes", "1", "--pm-port", str(pm_port),
         "--dn-port", str(dn_port), "--admin-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    addr = f"127.0.0.1:{pm_port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.communicate()
            return ping(addr) and ping(f"127.0.0.1:{dn_port}")

        eventually(up, timeout=60, interval=0.2, what="sbpstream up serving")
        yield addr, f"127.0.0.1:{dn_port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        # `up` tells the user how to produce and consume from a second terminal
        assert b"produce --stream" in out and b"consume --stream" in out, out
        assert b"web console:       http://127.0.0.1:" in out, out
        assert b"stopped" in err


@pytest.fixture(scope="module")
def pm(up: tuple[str, str]) -> str:
    return up[0]


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
    (): ["up", "produce", "consume", "stream", "bench", "--version"],
    ("up",): ["--dir", "--datanodes", "--pm-port", "--dn-port", "--host", "--fsync",
              "--metrics-port"],
    ("pm",): ["--port", "--host", "--metadata", "--node-timeout-ms"],
    ("datanode",): ["--dir", "--pm", "--port", "--fsync"],
    ("stream",): ["create", "describe", "list", "delete", "trim", "ranges", "update"],
    ("stream", "create"): ["--replicas", "--retention-ms", "--count", "--pm"],
    ("stream", "describe"): ["--pm"],
    ("stream", "list"): ["--pm"],
    ("stream", "delete"): ["--pm"],
    ("stream", "trim"): ["OFFSET", "--pm"],
    ("stream", "ranges"): ["--pm"],
    ("stream", "update"): ["--retention-ms", "--replicas", "--pm"],
    ("produce",): ["--stream", "--key", "--key-separator", "--compression", "--pm"],
    ("consume",): ["--stream", "--from", "--count", "--follow", "--print-offset", "--print-key",
                   "--print-timestamp", "--format", "--pm"],
    ("bench",): ["--records", "--size", "--streams", "--replicas", "--keep", "--pm"],
    ("node",): ["drain", "status", "remove", "list"],
    ("node", "drain"): ["NODE", "--wait", "--cancel", "--pm"],
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


# ------------------------------------------------------------------ what a Kafka user expects


def rows(table: bytes) -> list[list[str]]:
    """The body rows of a rich table as cells."""
    out = []
    for line in table.decode().splitlines():
        if line.startswith("│"):
            out.append([c.strip() for c in line.strip("│").split("│")])
    return out


def new_stream(pm: str, lines: bytes = b"", *args: str) -> str:
    sid = sbp("stream", "create", "--pm", pm).stdout.decode().strip()
    assert sid.isdigit()
    if lines:
        r = sbp("produce", "--stream", sid, "--pm", pm, *args, stdin=lines)
        assert r.returncode == 0, r.stderr
    return sid


def test_version() -> None:
    from sbpstream import __version__

    r = sbp("--version")
    assert r.returncode == 0 and r.stdout.decode().strip() == f"sbpstream {__version__}"


def test_stream_update_changes_retention(pm: str) -> None:
    sid = new_stream(pm)
    r = sbp("stream", "update", sid, "--retention-ms", "123456", "--replicas", "1", "--pm", pm)
    assert r.returncode == 0, r.stderr
    assert rows(r.stdout)[0][:3] == [sid, "1", "123456"]
    assert rows(sbp("stream", "describe", sid, "--pm", pm).stdout)[0][3] == "123456"
    _one_clear_line(sbp("stream", "update", sid, "--pm", pm), "--retention-ms")


def test_key_separator_and_printed_fields(pm: str) -> None:
    sid = new_stream(pm, b"k1:v1\nk2:v:2\n", "--key-separator", ":")
    r = sbp("consume", "--stream", sid, "--pm", pm, "--print-offset", "--print-key",
            "--print-timestamp")
    assert r.returncode == 0, r.stderr
    lines = [ln.split(b"\t") for ln in r.stdout.splitlines()]
    assert [ln[1:] for ln in lines] == [[b"Offset:0", b"k1", b"v1"], [b"Offset:1", b"k2", b"v:2"]]
    assert all(ln[0].startswith(b"CreateTime:") and ln[0][11:].isdigit() for ln in lines)
    r = sbp("consume", "--stream", sid, "--pm", pm, "--print-key")
    assert r.stdout == b"k1\tv1\nk2\tv:2\n"
    # a line without the separator is named; --key and --key-separator exclude each other
    _one_clear_line(sbp("produce", "--stream", sid, "--pm", pm, "--key-separator", ":",
                        stdin=b"a:1\nno separator\n"), "line 2", "--key-separator")
    _one_clear_line(sbp("produce", "--stream", sid, "--pm", pm, "--key-separator", ":",
                        "--key", "k", stdin=b"a:1\n"), "--key")


def test_consume_json(pm: str) -> None:
    import json

    sid = new_stream(pm, b"hello\n\xff\xfe\n")
    r = sbp("consume", "--stream", sid, "--pm", pm, "--format", "json")
    assert r.returncode == 0, r.stderr
    objs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [o["offset"] for o in objs] == [0, 1]
    assert objs[0]["value"] == "hello" and objs[0]["key"] is None
    assert objs[1]["value_base64"] == "//4=" and "value" not in objs[1]
    assert all(o["stream"] == int(sid) and o["timestamp_ms"] > 0 for o in objs)
    _one_clear_line(sbp("consume", "--stream", sid, "--pm", pm, "--format", "xml"), "--format")


def test_list_and_ranges_show_live_end_offsets(pm: str) -> None:
    sid = new_stream(pm, b"".join(b"%d\n" % i for i in range(2005)))
    out = sbp("stream", "list", "--pm", pm).stdout
    assert b"bytes" in out
    listed = {r[0]: r for r in rows(out)}
    assert listed[sid][4:6] == ["2005", "2005"]  # end_offset, records
    # bytes stored: the batches hold at least every value's bytes
    assert int(listed[sid][6]) >= sum(len(b"%d" % i) for i in range(2005))
    r = sbp("stream", "ranges", sid, "--pm", pm)
    assert r.returncode == 0, r.stderr
    (only,) = rows(r.stdout)
    assert only[3] == "2005" and only[4] == "writable"


def test_describe_reports_each_id(pm: str) -> None:
    a, b = new_stream(pm), new_stream(pm, b"x\n")
    assert sbp("stream", "delete", a, "--pm", pm).returncode == 0
    r = sbp("stream", "describe", a, b, "--pm", pm)
    assert r.returncode == 1
    got = {row[0]: row for row in rows(r.stdout)}
    assert got[a][1] == "deleted" and got[b][1] == "active" and got[b][5] == "1"
    assert f"stream {a} deleted" in r.stderr.decode() and "Traceback" not in r.stderr.decode()


def test_bench_deletes_its_streams_unless_keep(pm: str) -> None:
    def ids() -> set[str]:
        return {row[0] for row in rows(sbp("stream", "list", "--pm", pm).stdout)}

    before = ids()
    r = sbp("bench", "--records", "500", "--size", "10", "--streams", "2", "--pm", pm)
    assert r.returncode == 0, r.stderr
    assert ids() == before
    r = sbp("bench", "--records", "500", "--size", "10", "--keep", "--pm", pm)
    assert r.returncode == 0, r.stderr
    assert len(ids() - before) == 1


def test_hints_use_cli_words(up: tuple[str, str]) -> None:
    pm, dn = up
    sid = new_stream(pm, b"1\n2\n3\n")
    assert sbp("stream", "trim", sid, "2", "--pm", pm).returncode == 0
    r = sbp("consume", "--stream", sid, "--from", "0", "--pm", pm)
    _one_clear_line(r, "--from earliest")
    assert "auto_reset" not in r.stderr.decode()
    _one_clear_line(sbp("stream", "list", "--pm", dn), f"--pm {dn} points at a data node")


# ------------------------------------------------------------------------ feedback while waiting


def test_says_what_it_waits_for(tmp_path: Path) -> None:
    port = free_port()
    # each command waits its whole --timeout-ms out: long enough for a wait line (the first
    # comes once the SDK has retried for ~1 s, WaitReporter.FIRST_S), no longer
    r = sbp("stream", "list", "--pm", f"127.0.0.1:{port}", "--timeout-ms", "3000")
    err = r.stderr.decode().splitlines()
    assert r.returncode == 1 and err[-1].startswith("sbpstream: error: NO_PM_REACHABLE"), err
    assert err[0].startswith(f"waiting for the placement manager at 127.0.0.1:{port} "
                             "(connection refused), "), err
    assert err[0].endswith(" of 3 s"), err
    # a data node that is down: the wait and the final error name it
    from sbpstream.client import Client
    from sbpstream.cluster import LocalCluster

    with LocalCluster(tmp_path / "c", datanodes=1) as cluster:
        pm = cluster.pm_address
        sid = new_stream(pm, b"x\n")
        dn = cluster.datanodes[0]
        dn.kill()
        for args in (("consume", "--stream", sid), ("produce", "--stream", sid)):
            r = sbp(*args, "--pm", pm, "--timeout-ms", "3000", stdin=b"y\n")
            err = r.stderr.decode().splitlines()
            assert r.returncode == 1 and "Traceback" not in r.stderr.decode(), err
            assert err[0].startswith(f"waiting for the data node at {dn.address} "), err
            assert f"the data node at {dn.address} looks down" in err[-1], err
            assert not any("event=" in ln for ln in err), err  # no SDK log lines
        with Client(pm) as c:  # the PM itself still answers
            assert c.describe_stream(int(sid)).stream_id == int(sid)


def test_live_progress_only_on_a_terminal(pm: str) -> None:
    import pty
    import select

    sid = new_stream(pm)
    chunk = b"".join(b"record %d\n" % i for i in range(1000))
    # stderr is a pipe: no progress line, only the summary
    r = sbp("produce", "--stream", sid, "--pm", pm, stdin=chunk * 20)
    assert r.returncode == 0 and b"records/s" not in r.stderr, r.stderr
    # stderr is a terminal: a live line appears while stdin keeps coming
    master, slave = pty.openpty()
    proc = subprocess.Popen([EXE, "produce", "--stream", sid, "--pm", pm],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    try:
        assert proc.stdin is not None
        stdin = proc.stdin

        def progress_shown() -> bool:
            nonlocal seen
            stdin.write(chunk)
            stdin.flush()
            while select.select([master], [], [], 0.05)[0]:
                seen += os.read(master, 4096)
            return b"records/s" in seen

        eventually(progress_shown, timeout=60, interval=0, what="a live progress line")
        proc.stdin.close()
        assert proc.wait(60) == 0
        assert b"produced " in seen and b" records, " in seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


# ------------------------------------------------------------------------------- clean exits


def _interrupt(args: list[str], ready: bytes, on_stdout: bool = False,
               timeout: float = 180) -> tuple[int, bytes, bytes]:
    """Start ``sbpstream ARGS``; once ``ready`` shows (stderr, or stdout), SIGINT it.

    Returns (exit status, stdout, stderr)."""
    import select

    proc = subprocess.Popen([EXE, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    watched = proc.stdout if on_stdout else proc.stderr
    seen = b""
    try:
        def ready_shown() -> bool:
            nonlocal seen
            assert proc.poll() is None, (seen, proc.communicate())
            if select.select([watched], [], [], 0.2)[0]:
                seen += os.read(watched.fileno(), 65536)
            return ready in seen

        eventually(ready_shown, timeout=timeout, interval=0, what=f"{ready!r} from {args}")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return (proc.returncode, seen + out, err) if on_stdout else (proc.returncode, out, seen + err)


def test_ctrl_c_exits_130_with_one_line() -> None:
    rc, _, err = _interrupt(["stream", "list", "--pm", f"127.0.0.1:{free_port()}"],
                            b"waiting for the placement manager")
    assert rc == 130, err
    assert err.decode().splitlines()[-1] == "sbpstream: interrupted", err
    assert b"Traceback" not in err


@pytest.mark.timeout(600)
def test_ctrl_c_on_pipeline_exits_130_and_keeps_the_checkpoint(pm: str, tmp_path: Path,
                                                                spark: Any) -> None:
    from sbpstream import cli

    pq = pytest.importorskip("pyarrow.parquet")
    sid = new_stream(pm, b"".join(b"a%d\n" % i for i in range(50)))
    args = ["pipeline", "--streams", sid, "--out", str(tmp_path / "out"), "--checkpoint",
            str(tmp_path / "ck"), "--pm", pm]
    # the interrupted run is a process of its own: Ctrl-C and the exit status are its behaviour
    rc, _, err = _interrupt([*args, "--master", "local[1]", "--trigger", "processing-time=1"],
                            b"batch ", True)
    assert rc == 130, err.decode()[-3000:]
    assert b"Traceback" not in err and b"Exception" not in err, err.decode()[-3000:]
    assert b"interrupted" in err, err
    # the checkpoint is usable: a second run continues and the table holds each record once.
    # That run is the same command in this process, on the spark fixture's session (getOrCreate
    # reuses it): a second JVM, source lookup and Python workers cost a minute on a loaded box
    new_stream_lines = b"".join(b"b%d\n" % i for i in range(10))
    assert sbp("produce", "--stream", sid, "--pm", pm, stdin=new_stream_lines).returncode == 0
    with pytest.raises(SystemExit) as done:
        cli.main(args)
    assert done.value.code == 0
    values = sorted(v.decode() if isinstance(v, bytes) else v for v in
                    pq.read_table(tmp_path / "out").column("value").to_pylist())
    assert values == sorted([f"a{i}" for i in range(50)] + [f"b{i}" for i in range(10)])
