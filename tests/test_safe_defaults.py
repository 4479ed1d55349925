"""Safe defaults (docs/security.md, Safe defaults), on real processes where it matters.

- ``--auth`` without TLS beyond loopback is refused at startup by all four launchers, in one
  line; on loopback, or with ``--allow-insecure-auth``, the server starts.
- secrets, keys, the PM's metadata and the data directories are owner-only under umask 022;
  a secret or key readable by group/others is refused at startup with ``chmod 600 FILE``.
- unknown users get a salt derived from the cluster secret and the name: two names, two salts,
  the same name (and a known user) the same salt every time, across a PM restart too.
- failed logins are logged and slow the next logins from the same source only; the wait does
  not hold up the event loop (a PING on another connection is answered meanwhile).
- the SDK refuses a missing CA with TlsFileError (one line), and warns before sending
  credentials in clear beyond loopback.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import eventually, eventually_async

from sbpstream.auth import scram
from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.client import InsecureCredentialsWarning, scram_login, warn_if_clear
from sbpstream.auth.config import CA_FILE, SECRET_FILE, SERVER_KEY
from sbpstream.auth.logins import (
    LOGIN_DELAY_BASE_S,
    LOGIN_DELAY_MAX_S,
    LOGIN_FAILURES_FORGET_S,
    LOGIN_QUEUE_MAX_S,
    LoginThrottle,
    login_delay_s,
)
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster, ping, secure_args
from sbpstream.net.client import Connection
from sbpstream.net.ports import free_port
from sbpstream.net.tls import TlsConfig, TlsFileError, client_context
from sbpstream.private_files import open_private, private_dir
from sbpstream.protocol import messages as m
from sbpstream.protocol.errors import AuthenticationFailedError
from sbpstream.protocol.opcodes import Opcode

pytestmark = pytest.mark.timeout(240)

EXE = str(Path(sys.executable).with_name("sbpstream"))
ADMIN = ("admin", "admin-pw")
INSECURE = "--allow-insecure-auth"


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d: Path = tmp_path_factory.mktemp("certs") / "c"
    init_dev_certs(d)
    return d


def _launchers(tmp: Path, port: int) -> dict[str, list[str]]:
    pm = ["--port", str(port), "--metadata", f"sqlite:{tmp / 'pm' / 'meta.sqlite3'}"]
    dn = ["--port", str(port), "--dir", str(tmp / "dn"), "--pm", "127.0.0.1:1"]
    return {
        "python -m sbpstream.pm": [sys.executable, "-m", "sbpstream.pm", *pm],
        "python -m sbpstream.datanode": [sys.executable, "-m", "sbpstream.datanode", *dn],
        "sbpstream pm": [EXE, "pm", *pm],
        "sbpstream datanode": [EXE, "datanode", *dn],
    }


# ------------------------------------------------------------------ auth in clear


def test_auth_without_tls_beyond_loopback_is_refused_by_every_launcher(
        tmp_path: Path, certs: Path) -> None:
    auth = ["--auth", "--secret-file", str(certs / SECRET_FILE)]
    for name, cmd in _launchers(tmp_path, free_port()).items():
        r = subprocess.run([*cmd, "--host", "0.0.0.0", *auth], capture_output=True, text=True,
                           timeout=60, check=False)
        line = _one_line(r.stderr)
        assert r.returncode == 2, (name, r.stderr)
        assert "--auth without TLS on --host 0.0.0.0" in line and INSECURE in line, name
        assert not (tmp_path / "dn").exists()  # refused before anything was made


@pytest.mark.parametrize("host,extra", [("127.0.0.1", []), ("0.0.0.0", [INSECURE])])
def test_auth_without_tls_starts_on_loopback_or_when_allowed(
        tmp_path: Path, certs: Path, host: str, extra: list[str]) -> None:
    port = free_port()
    cmd = _launchers(tmp_path, port)["sbpstream pm"]
    with subprocess.Popen([*cmd, "--host", host, "--auth", "--secret-file",
                           str(certs / SECRET_FILE), *extra],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            eventually(lambda: proc.poll() is not None or ping(f"127.0.0.1:{port}"),
                       timeout=60, what="the PM answering PING")
            assert proc.poll() is None, proc.communicate()[1]
        finally:
            proc.terminate()
            proc.wait(30)  # leaving the with closes its stderr pipe


# ------------------------------------------------------------------ file modes


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_secrets_metadata_and_data_are_owner_only_under_umask_022(
        tmp_path: Path, umask_022: None) -> None:
    certs = tmp_path / "certs"
    init_dev_certs(certs)
    assert _mode(certs) == 0o700
    for private in ("ca-key.pem", SERVER_KEY, "client-key.pem", SECRET_FILE):
        assert _mode(certs / private) == 0o600, private
    assert _mode(certs / CA_FILE) == 0o644  # certificates are public
    d = tmp_path / "cluster"
    with LocalCluster(d, datanodes=1, secure=certs) as c:
        asyncio.run(bootstrap_admin(c.pm_address, certs, *ADMIN))  # a verifier in the file
        asyncio.run(_write_one(c.pm_address, certs))  # a segment and a checkpoint
        dn = d / "dn0"
        segments = list((dn / "store" / "log").glob("*.log"))
        assert segments
        for directory in (d, d / "pm", dn, dn / "store", dn / "store" / "log"):
            assert _mode(directory) == 0o700, directory
        meta = d / "pm" / "metadata.sqlite3"
        for f in (meta, meta.with_name(meta.name + "-wal"), *segments):
            assert _mode(f) == 0o600, f


async def _write_one(pm: str, certs: Path) -> None:
    async with AsyncClient(pm, user=ADMIN[0], password=ADMIN[1], tls_ca=str(certs / CA_FILE),
                           retry_deadline_ms=30_000) as client:
        (sid,) = await client.create_streams(1)
        async with client.producer() as p:
            fut = await p.send(sid, b"x")
            await p.flush()
        assert fut.result() == 0


def test_private_files_ignore_even_a_loose_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        d = private_dir(tmp_path / "a" / "b")
        os.close(open_private(d / "f", os.O_WRONLY))
        assert (_mode(d), _mode(d / "f")) == (0o700, 0o600)
    finally:
        os.umask(old)


@pytest.mark.parametrize("which,mode", [(SECRET_FILE, 0o644), (SERVER_KEY, 0o640)])
def test_a_secret_or_key_readable_by_others_is_refused_at_startup(
        tmp_path: Path, which: str, mode: int) -> None:
    certs = tmp_path / "certs"
    init_dev_certs(certs)
    (certs / which).chmod(mode)
    for name, cmd in _launchers(tmp_path, free_port()).items():
        r = subprocess.run([*cmd, *secure_args(certs)], capture_output=True, text=True,
                           timeout=60, check=False)
        line = _one_line(r.stderr)
        assert r.returncode == 2, (name, r.stderr)
        assert f"chmod 600 {certs / which}" in line, (name, line)


# ------------------------------------------------------------------ SCRAM decoys and throttle


@pytest.fixture(scope="module")
def pm_only(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[LocalCluster]:
    """A secure PM alone: logins need nothing else."""
    with LocalCluster(tmp_path_factory.mktemp("pm"), datanodes=0, secure=certs) as c:
        asyncio.run(bootstrap_admin(c.pm_address, certs, *ADMIN))
        yield c


async def _salt(pm: str, certs: Path, user: str) -> str:
    """The salt the PM's server-first message gives ``user``."""
    from scramp import ScramClient

    conn = await Connection.open(pm, ssl_context=client_context(TlsConfig(
        ca=str(certs / CA_FILE))))
    try:
        first = ScramClient([scram.MECHANISM], user, "any").get_client_first()
        frame = await conn.request_one(Opcode.AUTHENTICATE, m.AuthenticateRequest(
            scram.MECHANISM, first.encode()).encode(), timeout_s=30)
        out = m.AuthenticateResponse.decode(frame.header)
        out.status.raise_for_error()
        match = re.search(r"(?:^|,)s=([^,]+)", out.data.decode())
        assert match, out.data
        return match.group(1)
    finally:
        await conn.aclose()


async def test_unknown_users_get_distinct_stable_salts(pm_only: LocalCluster,
                                                       certs: Path) -> None:
    pm = pm_only.pm_address

    async def salts() -> tuple[str, ...]:
        return tuple([await _salt(pm, certs, u) for u in ("ghost-1", "ghost-2", ADMIN[0])])

    first = await salts()
    assert len(set(first)) == 3  # two unknown users: two salts, neither the admin's
    assert await salts() == first  # the same name, the same salt (the admin's is stored)
    pm_only.pm.stop()
    pm_only.pm.start()
    pm_only.pm.wait_ready()
    assert await salts() == first  # from the secret, not from the process


def test_decoys_have_the_stored_shape() -> None:
    key = scram.decoy_key(b"k" * 32)
    a, b = scram.decoy_credential(key, "a"), scram.decoy_credential(key, "b")
    real = scram.make_credential("pw")
    assert len(a.salt) == len(real.salt) and a.iterations == real.iterations
    assert a.salt != b.salt and scram.decoy_credential(key, "a") == a
    assert scram.decoy_credential(scram.decoy_key(b"j" * 32), "a").salt != a.salt


async def _open_from(pm: str, certs: Path, source: str) -> Connection:
    """A TLS connection to the PM from the local address ``source`` (127.0.0.x)."""
    host, _, port = pm.rpartition(":")
    ctx = client_context(TlsConfig(ca=str(certs / CA_FILE)))
    _, proto = await asyncio.get_running_loop().create_connection(
        lambda: Connection(pm, 1 << 20), host, int(port), ssl=ctx, server_hostname=host,
        local_addr=(source, 0))
    return proto


async def _fail_login(pm: str, certs: Path, source: str) -> None:
    conn = await _open_from(pm, certs, source)
    try:
        with pytest.raises(AuthenticationFailedError):
            await scram_login(conn, ADMIN[0], "wrong")
    finally:
        await conn.aclose()


def _failures(log: Path, source: str) -> list[tuple[int, int]]:
    """(failures, next_delay_ms) of each login_failed line of ``source``, in order."""
    pattern = re.compile(r"event=login_failed user=(\S+) peer=" + re.escape(source)
                         + r":\d+ failures=(\d+) next_delay_ms=(\d+)")
    return [(int(x[1]), int(x[2])) for x in pattern.findall(log.read_text())]


async def test_failed_logins_are_logged_and_slow_the_same_source_only(
        pm_only: LocalCluster, certs: Path) -> None:
    pm, log = pm_only.pm_address, pm_only.pm.log_path
    a, b = "127.0.0.3", "127.0.0.4"  # fresh sources (the other tests log in from 127.0.0.1)
    for _ in range(6):
        await _fail_login(pm, certs, a)
    await eventually_async(lambda: len(_failures(log, a)) == 6, timeout=30,
                           what="six login_failed lines")
    delays = [d for _, d in _failures(log, a)]
    assert [n for n, _ in _failures(log, a)] == [1, 2, 3, 4, 5, 6]
    assert delays == [round(login_delay_s(n) * 1000) for n in range(1, 7)]
    assert delays == sorted(delays) and delays[-1] > delays[0]
    # a's seventh login waits its turn (3.2 s), in its handler only: a PING on another
    # connection and a login from another source are answered while it waits
    pending = asyncio.create_task(_fail_login(pm, certs, a))
    other = await _open_from(pm, certs, b)
    try:
        assert (await other.ping()).is_response
        assert not pending.done()
        with pytest.raises(AuthenticationFailedError):
            await scram_login(other, ADMIN[0], "wrong")
        assert not pending.done()
    finally:
        await other.aclose()
    await pending
    assert _failures(log, b)[0] == (1, round(LOGIN_DELAY_BASE_S * 1000))
    # the right password still works from the throttled source, after its turn
    conn = await _open_from(pm, certs, a)
    try:
        assert (await scram_login(conn, *ADMIN)).token
    finally:
        await conn.aclose()


def test_login_throttle_grows_is_bounded_per_source_and_forgets() -> None:
    t = LoginThrottle()
    assert t.admit("a", 0.0) == 0.0
    delays = [t.failed("a", 0.0)[1] for _ in range(12)]
    assert delays == sorted(delays) and delays[-1] == LOGIN_DELAY_MAX_S
    assert t.admit("b", 0.0) == 0.0  # another source: untouched
    waits = []
    while (w := t.admit("a", 0.0)) is not None:  # parallel logins from a are spaced out
        waits.append(w)
    assert waits == sorted(waits) and waits[-1] <= LOGIN_QUEUE_MAX_S
    assert t.failures("a", LOGIN_FAILURES_FORGET_S + 1) == 0


# ------------------------------------------------------------------ SDK


def test_sdk_missing_ca_is_a_tls_file_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "ca.pem"
    with pytest.raises(TlsFileError) as e:
        AsyncClient("127.0.0.1:1", tls_ca=str(missing))
    assert str(missing) in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # callers catching ValueError keep working


def test_sdk_warns_once_before_credentials_in_clear_beyond_loopback() -> None:
    with pytest.warns(InsecureCredentialsWarning, match="without TLS"):
        warn_if_clear("192.0.2.7:12378", False, "a password login")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_clear("192.0.2.7:12378", False, "a password login")  # said once already
        warn_if_clear("127.0.0.1:12378", False, "a password login")  # loopback
        warn_if_clear("localhost:12378", False, "a password login")
        warn_if_clear("192.0.2.8:12378", True, "a password login")  # TLS
