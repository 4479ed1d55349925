"""The CLI on a secure cluster: `sbpstream up --secure`, then every command with the exports it
prints, run from another working directory (real processes, the installed `sbpstream`)."""

from __future__ import annotations

import base64
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from waiting import eventually

from sbpstream.cli.security import ACL_EXAMPLE_HEADER
from sbpstream.net.ports import free_port

pytestmark = pytest.mark.timeout(300)

EXE = str(Path(sys.executable).with_name("sbpstream"))
START_S = 90.0  # a hang guard: certificates, a PM, a data node and the admin's login


@dataclass
class SecureUp:
    proc: subprocess.Popen[bytes]
    directory: Path
    out: Path
    env: dict[str, str]
    cwd: Path
    dn: str

    def stdout(self) -> str:
        return self.out.read_text()

    def sbp(self, *args: str, stdin: str = "", **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([EXE, *args], input=stdin, capture_output=True, text=True,
                              timeout=120, env={**self.env, **extra}, cwd=self.cwd, check=False)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureUp]:
    """`sbpstream up --secure --dir data` started in one directory; the exports it prints."""
    home = tmp_path_factory.mktemp("home")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    pm_port, dn_port, admin_port = free_port(), free_port(), free_port()
    out = home / "up.out"
    with open(out, "wb") as o:
        proc = subprocess.Popen(
            [EXE, "up", "--secure", "--dir", "data", "--datanodes", "1",
             "--pm-port", str(pm_port), "--dn-port", str(dn_port),
             "--admin-port", str(admin_port)],
            stdout=o, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=home)
    try:
        eventually(lambda: proc.poll() is not None or ACL_EXAMPLE_HEADER in out.read_text(),
                   timeout=START_S, what="up --secure's exports")
        assert proc.poll() is None, out.read_text()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SBPSTREAM_")}
        env["PATH"] = f"{Path(EXE).parent}{os.pathsep}{env.get('PATH', '')}"
        for name, value in re.findall(r"^\s*export (SBPSTREAM_\w+)=(\S+)$", out.read_text(),
                                      re.M):
            env[name] = value
        assert {"SBPSTREAM_PM", "SBPSTREAM_USER", "SBPSTREAM_PASSWORD",
                "SBPSTREAM_TLS_CA"} <= set(env), out.read_text()
        yield SecureUp(proc, home / "data", out, env, elsewhere, f"127.0.0.1:{dn_port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            for name in ("pm", "dn0"):
                pid = home / "data" / "run" / f"{name}.pid"
                if pid.exists():
                    os.kill(int(pid.read_text()), signal.SIGKILL)
            proc.wait(10)


def _ok(r: subprocess.CompletedProcess[str], what: str) -> str:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (what, r.stdout, r.stderr)
    return r.stdout


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("sbpstream: error: "), lines
    return lines[0]


def test_printed_paths_are_absolute_and_admin_urls_https(up: SecureUp) -> None:
    text = up.stdout()
    ca = Path(up.env["SBPSTREAM_TLS_CA"])
    assert ca.is_absolute() and ca.is_file(), text
    urls = re.findall(r"\b(https?://\S+/metrics)", text)
    assert urls and all(u.startswith("https://") for u in urls), text
    assert "http://" not in text, text
    ctx = ssl.create_default_context(cafile=str(ca))
    # it answers https, and /metrics wants the scrape credential (the admin's, as printed)
    basic = base64.b64encode(
        f"{up.env['SBPSTREAM_USER']}:{up.env['SBPSTREAM_PASSWORD']}".encode()).decode()
    req = urllib.request.Request(urls[0], headers={"Authorization": f"Basic {basic}"})
    with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
        assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urls[0], context=ctx, timeout=30)
    assert refused.value.code == 401
    refused.value.close()  # the error holds the answer's socket


def test_every_introspection_command_works_with_the_printed_exports(up: SecureUp) -> None:
    commands = [
        ["info"], ["info", "--json"], ["info", "--node", up.dn], ["stats"],
        ["stats", "--node", up.dn], ["nodes"], ["connections"], ["whoami"],
        ["whoami", "--node", up.dn], ["top", "--iterations", "1"],
    ]
    for args in commands:
        _ok(up.sbp(*args), args)
    assert '"role": "pm"' in up.sbp("info", "--json").stdout
    nodes = up.sbp("nodes", "--json").stdout
    assert up.dn in nodes, nodes


def test_every_other_client_command_works_with_the_printed_exports(up: SecureUp) -> None:
    sid = _ok(up.sbp("stream", "create", "cli.secure"), "create").strip()
    _ok(up.sbp("produce", "--stream", "cli.secure", stdin="a\nb\n"), "produce")
    assert _ok(up.sbp("consume", "--stream", sid, "--from", "earliest"), "consume") == "a\nb\n"
    for args in (["stream", "list"], ["stream", "describe", sid], ["stream", "ranges", sid],
                 ["check"], ["group", "list"], ["quota", "list"], ["quota", "counters"],
                 ["user", "list"], ["acl", "list"]):
        _ok(up.sbp(*args), args)
    # the bytes column comes from the PM's STATS, over the same authenticated client
    row = next(ln for ln in up.sbp("stream", "list", COLUMNS="250").stdout.splitlines()
               if "cli.secure" in ln)
    cells = [c.strip() for c in re.split(r"[│┃|]", row) if c.strip()] or row.split()
    assert cells[-2] != "-" and int(cells[-2].replace(",", "")) > 0, row


def test_the_printed_acl_example_works_as_printed(up: SecureUp) -> None:
    text = up.stdout()
    block = text.split(ACL_EXAMPLE_HEADER, 1)[1].splitlines()
    lines = []
    for ln in block[1:]:  # the indented lines right under the header
        if not ln.startswith("  "):
            break
        lines.append(ln.strip())
    assert lines[0] == "sbpstream stream create orders.eu", text
    assert len(lines) >= 4 and any("prefix:orders." in ln for ln in lines), text
    outputs = []
    for line in lines:  # each line as a reader pastes it into a shell with the exports
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", line], capture_output=True,
                           text=True, timeout=120, env=up.env, cwd=up.cwd, check=False)
        outputs.append(_ok(r, line))
    assert outputs[-1] == "hello\n", outputs
    # alice is held to her rule: no stream outside orders., and the refusal is one line
    pw = re.search(r"--user-password (\S+)", text)
    assert pw
    denied = up.sbp("stream", "create", "billing.eu", SBPSTREAM_USER="alice",
                    SBPSTREAM_PASSWORD=pw.group(1))
    assert "AUTHORIZATION_FAILED" in _one_line(denied) and "alice" in denied.stderr


def test_a_missing_ca_file_is_one_line_for_every_kind_of_command(up: SecureUp) -> None:
    missing = str(up.cwd / "no-such" / "ca.pem")
    for args in (["info"], ["stream", "list"], ["consume", "--stream", "1"],
                 ["user", "list"], ["top", "--iterations", "1"]):
        line = _one_line(up.sbp(*args, SBPSTREAM_TLS_CA=missing))
        assert missing in line and "no such file" in line, (args, line)
    line = _one_line(up.sbp("--tls-ca", missing, "produce", "--stream", "1", stdin="x\n"))
    assert missing in line


def test_no_credentials_or_a_wrong_password_is_one_line(up: SecureUp) -> None:
    wrong = up.sbp("whoami", SBPSTREAM_PASSWORD="wrong")
    assert "AUTHENTICATION_FAILED" in _one_line(wrong)
    pasted = up.sbp("whoami", SBPSTREAM_PASSWORD="two\nlines")  # SASLprep refuses it
    assert "SBPSTREAM_PASSWORD" in _one_line(pasted)
    env = {k: v for k, v in up.env.items() if k not in ("SBPSTREAM_USER", "SBPSTREAM_PASSWORD")}
    r = subprocess.run([EXE, "info"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=up.cwd, check=False)
    assert "AUTHENTICATION_REQUIRED" in _one_line(r)
    missing = str(up.cwd / "no-token")
    r = subprocess.run([EXE, "--token-file", missing, "stream", "list"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=up.cwd, check=False)
    assert missing in _one_line(r)
