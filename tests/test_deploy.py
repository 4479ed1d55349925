"""The multi-machine deployment files of deploy/ (docs/operations.md, "Deploying across machines").

* every TOML there is read by the matching server's real config loader (``--config``, through
  the click command itself, so each value is also converted by its flag's type), and every key
  names a flag of that command;
* every systemd unit's ExecStart runs a real ``sbpstream`` subcommand with flags it has, and
  ``systemd-analyze verify`` accepts the unit (skipped without systemd-analyze);
* a PM and a data node started from configs derived from the deploy TOMLs (ports, paths and
  host names rewritten to this machine; development certificates as ``sbpstream certs init``
  makes them; etcd when installed, else SQLite) come up with TLS and auth on, the first admin is
  made with the cluster secret as the docs say, and ``sbpstream nodes`` shows the node live.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from etcd_fixture import EtcdServer, etcd_binary
from typer.core import TyperCommand, TyperGroup
from typer.main import get_command
from waiting import eventually

from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.config import CA_FILE, SECRET_FILE, SERVER_CERT, SERVER_KEY
from sbpstream.cli import app
from sbpstream.cli.launch import read_config
from sbpstream.net.ports import free_port

pytestmark = pytest.mark.timeout(180)

ROOT: Final = Path(__file__).resolve().parent.parent
DEPLOY: Final = ROOT / "deploy"
CONFIGS: Final = {"pm.toml": "pm", "datanode.toml": "datanode", "kafka.toml": "kafka-gateway"}
"""Each example config and the server command that reads it."""
UNITS: Final = {"sbpstream-pm.service": "pm", "sbpstream-datanode.service": "datanode",
                "sbpstream-kafka.service": "kafka-gateway"}
"""Each unit and the server command its ExecStart must run."""
FILE_KEYS: Final = ("tls-cert", "tls-key", "tls-ca", "secret-file")
"""Keys naming a file, rewritten to the development certificates here."""
START_TIMEOUT_S: Final = 60.0
"""Hang guard for a server to start and a node to register (a loaded 2-core machine)."""
ADMIN: Final = ("admin", "deploy-admin-pw")


def _command(name: str) -> TyperCommand:
    group = get_command(app)
    assert isinstance(group, TyperGroup)
    cmd = group.commands[name]
    assert isinstance(cmd, TyperCommand)
    return cmd


def _flags(cmd: TyperCommand) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()),
                                            *getattr(p, "secondary_opts", ()))}


def _table(name: str) -> tuple[str, dict[str, Any]]:
    command = CONFIGS[name]
    doc = tomllib.loads((DEPLOY / name).read_text())
    assert list(doc) == [command], f"{name}: one table named [{command}], got {list(doc)}"
    return command, doc[command]


def _write_toml(path: Path, command: str, values: dict[str, Any]) -> Path:
    """A one-table TOML file (str, int and bool values: what the deploy files hold)."""
    lines = [f"[{command}]"]
    for k, v in values.items():
        text = ("true" if v else "false") if isinstance(v, bool) else (
            str(v) if isinstance(v, int) else json.dumps(v))
        lines.append(f"{k} = {text}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d: Path = tmp_path_factory.mktemp("certs")
    init_dev_certs(d)
    return d


def _local(command: str, values: dict[str, Any], tmp: Path, certs: Path) -> dict[str, Any]:
    """The deploy settings with this machine's ports, paths and addresses."""
    out = dict(values)
    files = {"tls-cert": SERVER_CERT, "tls-key": SERVER_KEY, "tls-ca": CA_FILE,
             "secret-file": SECRET_FILE}
    for key in FILE_KEYS:
        if key in out:
            out[key] = str(certs / files[key])
    if "dir" in out:
        out["dir"] = str(tmp / "dn")
    out["host"] = "127.0.0.1"
    for key in ("port", "metrics-port"):
        if key in out:
            out[key] = free_port()
    if "advertise" in out:
        out["advertise"] = f"127.0.0.1:{out['port']}"
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_is_read_by_its_server(name: str, tmp_path: Path, certs: Path) -> None:
    command, values = _table(name)
    cmd = _command(command)
    flags = _flags(cmd)
    unknown = [k for k in values if f"--{k}" not in flags]
    assert not unknown, f"{name}: keys that are no flag of `sbpstream {command}`: {unknown}"
    path = _write_toml(tmp_path / name, command, _local(command, values, tmp_path, certs))
    keys = {o.lstrip("-"): p.name for p in cmd.params if p.name for o in getattr(p, "opts", ())}
    settings = read_config(path, command, keys)  # the loader --config uses
    assert set(settings) == {keys[k] for k in values}
    # The whole command line parse with only --config: click converts every value by its type.
    ctx = cmd.make_context(command, ["--config", str(path)])
    for key, value in values.items():
        if key in FILE_KEYS or key in ("dir", "host", "port", "metrics-port", "advertise"):
            continue
        assert ctx.params[keys[key]] == value, (name, key, ctx.params[keys[key]])
    # and the deploy file itself parses as is (its paths need not exist to be parsed)
    cmd.make_context(command, ["--config", str(DEPLOY / name)])


def test_every_unit_runs_a_real_server_command() -> None:
    units = sorted(p.name for p in DEPLOY.glob("*.service"))
    assert units == sorted(UNITS), units
    for unit, command in UNITS.items():
        text = (DEPLOY / unit).read_text()
        execs = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("ExecStart=")]
        assert len(execs) == 1, unit
        argv = shlex.split(execs[0])
        assert Path(argv[0]).name == "sbpstream", argv
        assert argv[1] == command, (unit, argv)
        cmd = _command(command)
        flags = _flags(cmd)
        assert all(a in flags for a in argv[2:] if a.startswith("-")), (unit, argv)
        at = argv.index("--config") + 1
        local = DEPLOY / Path(argv[at]).name  # /etc/sbpstream/X.toml is deploy/X.toml
        assert CONFIGS.get(local.name) == command, f"{unit} reads {argv[at]}, not in deploy/"
        cmd.make_context(command, [*argv[2:at], str(local), *argv[at + 1:]])
        for line in ("Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                     "PrivateTmp=yes", "After=network-online.target", "User=sbpstream"):
            assert line in text.splitlines(), (unit, line)
    dn = (DEPLOY / "sbpstream-datanode.service").read_text()
    data_dir = tomllib.loads((DEPLOY / "datanode.toml").read_text())["datanode"]["dir"]
    assert f"ReadWritePaths={data_dir}" in dn.splitlines()


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (package systemd)")
    exe = shutil.which("sbpstream", path=str(Path(sys.executable).parent)) or shutil.which(
        "sbpstream")
    if exe is None:
        pytest.skip("no sbpstream executable to stand in for /opt/sbpstream/bin/sbpstream")
    paths = []
    for unit in UNITS:  # the units name /opt/sbpstream/bin/sbpstream; verify checks it exists
        text = (DEPLOY / unit).read_text().replace("/opt/sbpstream/bin/sbpstream", exe)
        paths.append(tmp_path / unit)
        paths[-1].write_text(text)
    r = subprocess.run([analyze, "verify", *map(str, paths)], capture_output=True, text=True,
                       timeout=60)
    ours = [ln for ln in (r.stdout + r.stderr).splitlines()
            if any(unit in ln for unit in UNITS)]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


# ------------------------------------------------------------------------------ a real start


def _cli(*args: str, certs: Path, user: tuple[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SBPSTREAM_TLS_CA": str(certs / CA_FILE)}
    for k in ("SBPSTREAM_USER", "SBPSTREAM_PASSWORD", "SBPSTREAM_TOKEN_FILE", "SBPSTREAM_PM"):
        env.pop(k, None)
    if user is not None:
        env["SBPSTREAM_USER"], env["SBPSTREAM_PASSWORD"] = user
    return subprocess.run([sys.executable, "-m", "sbpstream.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


class _Server:
    def __init__(self, command: str, config: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sbpstream.cli", command, "--config", str(config)],
                stdout=subprocess.DEVNULL, stderr=f)

    def started(self, event: str) -> bool:
        text = self.log.read_text()
        assert self.proc.poll() is None, f"server exited:\n{text}"
        return f"event={event}" in text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def metadata_url(tmp_path: Path) -> Iterator[str]:
    """A 1-member etcd when installed (the deploy PM runs on etcd), else a SQLite file."""
    if etcd_binary() is None:
        yield f"sqlite:{tmp_path / 'pm' / 'pm.sqlite3'}"
        return
    with EtcdServer(tmp_path / "etcd") as etcd:
        yield etcd.url("/sbpstream")


def test_pm_and_datanode_start_from_the_deploy_configs(tmp_path: Path, certs: Path,
                                                       metadata_url: str) -> None:
    _, pm_values = _table("pm.toml")
    pm_local = _local("pm", pm_values, tmp_path, certs)
    deploy_url = pm_values["metadata"]
    query = deploy_url.split("?", 1)[1] if "?" in deploy_url else ""
    pm_local["metadata"] = metadata_url + (f"?{query}" if metadata_url.startswith("etcd") else "")
    pm_addr = pm_local["advertise"]
    _, dn_values = _table("datanode.toml")
    dn_local = _local("datanode", dn_values, tmp_path, certs)
    dn_local["pm"] = pm_addr
    servers: list[_Server] = []
    try:
        pm = _Server("pm", _write_toml(tmp_path / "pm.toml", "pm", pm_local), tmp_path / "pm.log")
        servers.append(pm)
        eventually(lambda: pm.started("pm_started"), timeout=START_TIMEOUT_S, what="PM started")
        # The first admin, made with the cluster secret (docs/operations.md).
        secret = str(certs / SECRET_FILE)
        for args in (("user", "add", ADMIN[0], "--user-password", ADMIN[1]),
                     ("acl", "add", ADMIN[0], "all", "*")):
            r = _cli(*args, "--pm", pm_addr, "--secret-file", secret, certs=certs)
            assert r.returncode == 0, r.stderr
        dn = _Server("datanode", _write_toml(tmp_path / "dn.toml", "datanode", dn_local),
                     tmp_path / "dn.log")
        servers.append(dn)
        eventually(lambda: dn.started("registered"), timeout=START_TIMEOUT_S,
                   what="the data node registered")

        def live_nodes() -> list[dict[str, Any]]:
            r = _cli("nodes", "--json", "--pm", pm_addr, certs=certs, user=ADMIN)
            assert r.returncode == 0, r.stderr
            return [n for n in json.loads(r.stdout)["nodes"] if n["live"]]

        (node,) = eventually(live_nodes, timeout=START_TIMEOUT_S, what="the node live")
        assert node["address"] == dn_local["advertise"]
        # Without credentials the cluster refuses (auth is on).
        r = _cli("nodes", "--json", "--pm", pm_addr, "--timeout-ms", "3000", certs=certs)
        assert r.returncode != 0 and "authentication" in r.stderr.lower(), r.stderr
    finally:
        for s in reversed(servers):
            s.stop()
