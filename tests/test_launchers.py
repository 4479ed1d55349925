"""One launcher per server: `python -m sbpstream.pm|datanode|kafka` are `sbpstream pm|datanode|
kafka-gateway` (same flags), every flag the docs name for a command is in its --help, and a
server takes its settings from a TOML file and SBPSTREAM_* variables (flag > env > file)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner
from waiting import eventually

from sbpstream.cli import app
from sbpstream.cli.launch import env_name, read_config
from sbpstream.cluster import ping
from sbpstream.net.ports import free_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
MODULES = {"sbpstream.pm": "pm", "sbpstream.datanode": "datanode",
           "sbpstream.kafka": "kafka-gateway"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
NOT_FLAGS = {"--client-id"}
"""Taken off any command line by the CLI before parsing (docs/cli.md, quotas)."""
COMMAND = re.compile(r"(?:^|[\s`$(|])(?:sbpstream|python -m (sbpstream\.(?:pm|datanode|kafka)))"
                     r"(?![\w./-])((?:\s+\S+)*)")


def _help(path: list[str]) -> str:
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, (path, r.output)
    return r.output


def _doc_lines() -> list[tuple[str, str]]:
    """(file:line, text) of every docs line naming a command: ``\\`` continuations and, in a
    code block, indented lines of more options (``[--x``, ``--x``) joined; a table of flags
    (rows starting with ``| `--flag``) becomes one line per row prefixed with the commands the
    paragraph just before it names (``Flags, on `sbpstream pm`, `sbpstream datanode`: ...``)."""
    out: list[tuple[str, str]] = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        in_code = False
        paragraph: list[str] = []
        fresh = False
        i = 0
        while i < len(lines):
            text, start = lines[i], i
            if text.startswith("```"):
                in_code = not in_code
                i += 1
                continue
            while i + 1 < len(lines) and (text.endswith("\\") or (
                    in_code and lines[i + 1].startswith((" ", "\t"))
                    and lines[i + 1].lstrip().startswith(("[", "--")))):
                i += 1
                text = text.removesuffix("\\") + " " + lines[i]
            if text.startswith("| `--"):
                cell = text.split("|")[1]
                named = re.findall(r"`((?:sbpstream|python -m sbpstream\.\w+)(?: [a-z-]+)*)`",
                                   " ".join(paragraph))
                out += [(f"{doc.name}:{start + 1}", f"`{cmd} {cell.replace('`', '')}`")
                        for cmd in named]
            elif text.strip() and not text.startswith("|"):
                if fresh:
                    paragraph, fresh = [], False
                paragraph.append(text)
            elif not text.strip():
                fresh = True  # the paragraph just ended still heads a table that follows
            out.append((f"{doc.name}:{start + 1}", text))
            i += 1
    return out


def _uses() -> dict[tuple[str, ...], set[tuple[str, str]]]:
    """Command path -> {(flag, where)} for every `sbpstream CMD ... --flag` in docs/*.md."""
    group = get_command(app)
    uses: dict[tuple[str, ...], set[tuple[str, str]]] = {}
    for where, text in _doc_lines():
        for span in re.findall(r"`([^`]+)`", text) or [text]:
            for m in COMMAND.finditer(span):
                path: list[str] = [MODULES[m.group(1)]] if m.group(1) else []
                cmd = group.commands[path[0]] if path else group  # type: ignore[attr-defined]
                rest = m.group(2).split()
                before: list[str] = []
                while rest:
                    sub = getattr(cmd, "commands", {}).get(rest[0])
                    if sub is not None:
                        path.append(rest.pop(0))
                        cmd = sub
                    elif rest[0].startswith("-") and not path:
                        before.append(rest.pop(0))
                    else:
                        break
                if not path:
                    continue
                for flag in FLAG.findall(" ".join(before)):
                    uses.setdefault((), set()).add((flag, where))
                for token in rest:
                    if token in ("|", "&&", ";") or token.startswith(("|", "#")):
                        break
                    for flag in FLAG.findall(token.split("=", 1)[0]):
                        uses.setdefault(tuple(path), set()).add((flag, where))
    return uses


def _missing() -> list[str]:
    """``file:line: sbpstream CMD --flag`` for each flag the docs name that --help lacks."""
    missing = []
    for path, flags in sorted(_uses().items()):
        text = _help(list(path))
        for flag, where in sorted(flags):
            if flag in NOT_FLAGS:
                continue
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                missing.append(f"{where}: sbpstream {' '.join(path)} {flag}")
    return missing


def test_every_flag_the_docs_name_is_in_its_commands_help() -> None:
    uses = _uses()
    assert ("pm",) in uses and ("datanode",) in uses and ("up",) in uses  # the reader works
    assert any(flag == "--tls-require-client-cert" and where.startswith("security.md:")
               for flag, where in uses[("pm",)])
    assert not _missing()


def test_the_check_reports_a_flag_missing_from_help(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: flags a docs page names and --help lacks are reported."""
    doc = tmp_path / "x.md"
    doc.write_text("Flags, on `sbpstream pm` and `python -m sbpstream.datanode`:\n\n"
                   "| flag | meaning |\n|---|---|\n| `--no-such-flag N` | nothing |\n\n"
                   "```text\nsbpstream stream create [--replicas 1]\n    [--nor-this 2]\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    assert _missing() == ["x.md:5: sbpstream datanode --no-such-flag",
                          "x.md:5: sbpstream pm --no-such-flag",
                          "x.md:8: sbpstream stream create --nor-this"]


def _flags(cmd: list[str]) -> list[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"}, check=False)
    assert r.returncode == 0, r.stderr
    return sorted(set(FLAG.findall(r.stdout)))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_python_m_and_the_cli_list_the_same_flags(module: str) -> None:
    exe = str(Path(sys.executable).with_name("sbpstream"))
    via_m = _flags([sys.executable, "-m", module, "--help"])
    via_cli = _flags([exe, MODULES[module], "--help"])
    assert via_m == via_cli
    assert "--config" in via_m and "--log-format" in via_m


def test_config_file_reading(tmp_path: Path) -> None:
    keys = {"port": "port", "node-timeout-ms": "node_timeout_ms", "node_timeout_ms":
            "node_timeout_ms"}
    f = tmp_path / "s.toml"
    f.write_text('port = 1\nnode_timeout_ms = 2\n[pm]\nport = 3\n[datanode]\nport = 4\n')
    assert read_config(f, "pm", keys) == {"port": 3}  # the command's table wins
    assert read_config(f, "kafka-gateway", keys) == {"port": 1, "node_timeout_ms": 2}
    f.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="unknown setting 'prot' for pm"):
        read_config(f, "pm", keys)
    f.write_text("port = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        read_config(f, "pm", keys)
    assert env_name("kafka-gateway", "tls_ca") == "SBPSTREAM_KAFKA_GATEWAY_TLS_CA"


def test_a_pm_starts_from_a_toml_file_and_an_environment_variable(tmp_path: Path) -> None:
    """port from $SBPSTREAM_PM_PORT beats the file's; metadata and node timeout from the file;
    --log-format json from the command line; the log says which values were used."""
    port, file_port = free_port(), free_port()
    meta = tmp_path / "pm" / "meta.sqlite3"
    conf = tmp_path / "pm.toml"
    conf.write_text(f'port = {file_port}\nlog-level = "DEBUG"\n\n[pm]\n'
                    f'metadata = "sqlite:{meta}"\nnode_timeout_ms = 4321\n')
    log = tmp_path / "pm.log"
    env = {**os.environ, "SBPSTREAM_PM_PORT": str(port), "SBPSTREAM_PM_LOG_LEVEL": "INFO"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sbpstream.pm", "--config", str(conf),
                                 "--log-format", "json"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        eventually(lambda: proc.poll() is not None or ping(f"127.0.0.1:{port}"), timeout=60,
                   what="the PM on the port of $SBPSTREAM_PM_PORT")
        assert proc.poll() is None, log.read_text()
        assert meta.exists()
        assert not ping(f"127.0.0.1:{file_port}", 0.5)
    finally:
        proc.terminate()
        proc.wait(30)
    import json

    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    started = [e for e in events if e.get("event") == "pm_started"]
    assert started and started[0]["node_timeout_ms"] == "4321", events
    assert started[0]["address"] == f"127.0.0.1:{port}"
    assert not [e for e in events if e["level"] == "DEBUG"]  # env beat the file's DEBUG
    assert proc.returncode == 0


def test_a_bad_config_file_is_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text("no-such-flag = 1\n")
    r = subprocess.run([sys.executable, "-m", "sbpstream.datanode", "--config", str(conf)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "unknown setting 'no-such-flag'" in r.stderr, r.stderr
