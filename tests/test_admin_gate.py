"""Who may ask what on the admin HTTP port (``/metrics``, ``/v1/...``, the console), on real
processes: a secure cluster (TLS, auth) with the principals admin (everything), alice
(``fetch,describe`` on ``prefix:orders.``), bob (no rule) and nobody (no credentials), each
asking the PM's and the data node's admin ports with HTTP Basic and with a Bearer token from
AUTHENTICATE. The insecure cluster still answers everyone, and protected mode refuses peers
beyond loopback.

:data:`MATRIX` is plain data (door, path, principal, expected status, streams shown and hidden)
so that a test crossing the doors (SBP, HTTP, Kafka) can reuse it.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from waiting import eventually

from sbpstream.auth import tokens
from sbpstream.auth.bootstrap import bootstrap_admin
from sbpstream.auth.certs import init_dev_certs
from sbpstream.auth.client import Credentials
from sbpstream.auth.config import CA_FILE, SECRET_FILE, read_secret
from sbpstream.auth.gate import ServerAuth
from sbpstream.auth.http import WWW_AUTHENTICATE, HttpAuth, HttpDenied
from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.admin import HttpRequest, protected_refusal
from sbpstream.net.ports import free_port
from sbpstream.net.tls import TlsConfig

pytestmark = pytest.mark.timeout(300)

PASSWORDS = {"admin": "admin-pw", "alice": "alice-pw", "bob": "bob-pw"}
HTTP_TIMEOUT_S = 20.0  # a hang guard on a loaded machine, not a measurement
READY_TIMEOUT_S = 30.0
RECORDS = 3


@dataclass(frozen=True, slots=True)
class AdminCase:
    """One request and its expected answer. ``path`` may name the streams ``{orders}``
    (``orders.eu``: alice may fetch and describe it), ``{payments}`` (named, not alice's) and
    ``{unnamed}``; ``who`` None sends no credentials. ``shows``/``hides``: streams that must
    (not) be in the answer's ``streams``; ``records``: the answer holds the stream's records."""

    door: str  # "pm" or "dn"
    path: str
    who: str | None
    status: int
    shows: tuple[str, ...] = ()
    hides: tuple[str, ...] = ()
    records: bool = False

    @property
    def id(self) -> str:
        return f"{self.door}:{self.path}:{self.who or 'nobody'}"


ALL = ("orders", "payments", "unnamed")


def _cluster_wide(door: str, path: str) -> list[AdminCase]:
    """``describe`` on ``*`` (or admin) sees it; the others are refused."""
    return [AdminCase(door, path, "admin", 200), AdminCase(door, path, "alice", 403),
            AdminCase(door, path, "bob", 403), AdminCase(door, path, None, 401)]


def _door(door: str) -> list[AdminCase]:
    out: list[AdminCase] = []
    for path in ("/v1/info", "/v1/connections", "/metrics"):
        out += _cluster_wide(door, path)
    for path in ("/v1/streams", "/v1/stats?top=100"):
        out += [AdminCase(door, path, "admin", 200, shows=ALL),
                AdminCase(door, path, "alice", 200, shows=("orders",),
                          hides=("payments", "unnamed")),
                AdminCase(door, path, "bob", 200, hides=ALL),
                AdminCase(door, path, None, 401)]
    out += [AdminCase(door, "/v1/stats?stream={payments},{orders}", "alice", 200,
                      shows=("orders",), hides=("payments",)),
            AdminCase(door, "/v1/streams/{orders}", "admin", 200),
            AdminCase(door, "/v1/streams/{orders}", "alice", 200),
            AdminCase(door, "/v1/streams/{orders}", "bob", 403),
            AdminCase(door, "/v1/streams/{orders}", None, 401),
            AdminCase(door, "/v1/streams/{payments}", "admin", 200),
            AdminCase(door, "/v1/streams/{payments}", "alice", 403),
            AdminCase(door, "/v1/streams/{unnamed}", "alice", 403),
            AdminCase(door, "/v1/streams/987654", "alice", 403),  # the same, existing or not
            AdminCase(door, "/v1/streams/987654", "admin", 404)]
    if door == "pm":
        out += _cluster_wide(door, "/v1/nodes")
        out += [AdminCase(door, "/v1/streams/{orders}/tail", "admin", 200, records=True),
                AdminCase(door, "/v1/streams/{orders}/tail", "alice", 200, records=True),
                AdminCase(door, "/v1/streams/{orders}/tail", "bob", 403),
                AdminCase(door, "/v1/streams/{orders}/tail", None, 401),
                AdminCase(door, "/v1/streams/{payments}/tail", "alice", 403),
                AdminCase(door, "/v1/streams/{payments}/tail", "admin", 200, records=True),
                AdminCase(door, "/", None, 200),  # the console's page: no data in it
                AdminCase(door, "/console/console.js", None, 200)]
    else:
        out += [AdminCase(door, "/v1/nodes", "admin", 404),
                AdminCase(door, "/v1/streams/{orders}/tail", "admin", 404)]
    return out


MATRIX: list[AdminCase] = _door("pm") + _door("dn")


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(port: int, method: str, path: str, *, headers: dict[str, str] | None = None,
         body: bytes | None = None, ca: Path | None = None, host: str = "127.0.0.1",
         source: str | None = None) -> Reply:
    conn: http.client.HTTPConnection
    src = (source, 0) if source else None
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=HTTP_TIMEOUT_S,
                                           source_address=src)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=HTTP_TIMEOUT_S,
                                          source_address=src)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


# ------------------------------------------------------------------ the secure cluster


@dataclass(slots=True)
class Secure:
    cluster: LocalCluster
    certs: Path
    ports: dict[str, int]  # door -> admin port
    streams: dict[str, int]  # orders / payments / unnamed -> id
    tokens: dict[str, str]  # principal -> a token from AUTHENTICATE

    @property
    def ca(self) -> Path:
        return self.certs / CA_FILE

    def auth(self, who: str | None, scheme: str) -> dict[str, str]:
        if who is None:
            return {}
        if scheme == "bearer":
            return {"Authorization": f"Bearer {self.tokens[who]}"}
        raw = base64.b64encode(f"{who}:{PASSWORDS[who]}".encode()).decode()
        return {"Authorization": f"Basic {raw}"}

    def get(self, door: str, path: str, who: str | None = None, scheme: str = "bearer") -> Reply:
        return call(self.ports[door], "GET", path.format(**self.streams), ca=self.ca,
                    headers=self.auth(who, scheme))


async def _populate(pm: str, certs: Path) -> tuple[dict[str, int], dict[str, str]]:
    async with AsyncClient(pm, user="admin", password=PASSWORDS["admin"],
                           tls_ca=str(certs / CA_FILE), retry_deadline_ms=20_000) as admin:
        for user in ("alice", "bob"):
            await admin.add_user(user, PASSWORDS[user])
        await admin.add_acl("alice", "fetch,describe", "prefix:orders.")
        streams = {"orders": await admin.create_stream("orders.eu"),
                   "payments": await admin.create_stream("payments"),
                   "unnamed": await admin.create_stream()}
        async with admin.producer(linger_ms=0) as p:
            futs = [await p.send(sid, b"%s-%d" % (name.encode(), i))
                    for name, sid in streams.items() for i in range(RECORDS)]
            await p.flush()
            for f in futs:
                await f
    toks = {}
    for who, pw in PASSWORDS.items():  # tokens as the SBP port's AUTHENTICATE answers them
        creds = Credentials(user=who, password=pw, pm=(pm,), tls=TlsConfig(ca=str(certs / CA_FILE)))
        toks[who] = await creds.token()
    return streams, toks


def _wait_http(port: int, ca: Path | None) -> None:
    eventually(lambda: call(port, "GET", "/", ca=ca).status > 0, timeout=READY_TIMEOUT_S,
               interval=0.1, retry_on=(OSError,), what=f"admin port {port} answering")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    certs: Path = tmp_path_factory.mktemp("certs")
    init_dev_certs(certs)
    d: Path = tmp_path_factory.mktemp("admin-gate")
    ports = {"pm": free_port(), "dn": free_port()}
    with LocalCluster(d, datanodes=1, secure=certs,
                      extra_pm_args=["--metrics-port", str(ports["pm"])],
                      extra_dn_args=["--metrics-port", str(ports["dn"])]) as c:
        asyncio.run(bootstrap_admin(c.pm_address, certs, "admin", PASSWORDS["admin"]))
        streams, toks = asyncio.run(_populate(c.pm_address, certs))
        for port in ports.values():
            _wait_http(port, certs / CA_FILE)
        yield Secure(c, certs, ports, streams, toks)


def _stream_ids(body: Any) -> set[int]:
    return {int(r["stream_id"]) for r in body["streams"]}


SCHEMES = ("bearer", "basic")
"""Bearer: a token from AUTHENTICATE; Basic: user:password (the data node asks the PM)."""


@pytest.mark.parametrize(("case", "scheme"), [
    pytest.param(c, s, id=f"{c.id}:{s}") for c in MATRIX
    for s in (SCHEMES if c.who is not None else SCHEMES[:1])])
def test_admin_port_matrix(secure: Secure, case: AdminCase, scheme: str) -> None:
    r = secure.get(case.door, case.path, case.who, scheme)
    assert r.status == case.status, (case, r.body[:300])
    if r.status in (401, 403):
        body = r.json()
        assert body["error"] in ("unauthorized", "forbidden") and body["reason"], body
        if r.status == 401:
            assert r.headers["www-authenticate"] == WWW_AUTHENTICATE
    if case.shows or case.hides:
        got = _stream_ids(r.json())
        assert {secure.streams[s] for s in case.shows} <= got, (case, got)
        assert not {secure.streams[s] for s in case.hides} & got, (case, got)
    if case.records:
        values = [rec["value"] for rec in r.json()["records"]]
        name = next(k for k, v in secure.streams.items() if f"/{v}/" in
                    case.path.format(**secure.streams))
        assert values == [f"{name}-{i}" for i in range(RECORDS)]


def test_metrics_scrape_with_credentials(secure: Secure) -> None:
    for door in ("pm", "dn"):
        for scheme in ("bearer", "basic"):
            r = secure.get(door, "/metrics", "admin", scheme)
            assert r.status == 200 and b"_connections_open" in r.body


def test_bad_credentials_are_refused_and_logged(secure: Secure) -> None:
    bad = {
        "wrong password": {"Authorization": "Basic " + base64.b64encode(b"alice:nope").decode()},
        "unknown user": {"Authorization": "Basic " + base64.b64encode(b"mallory:x").decode()},
        "not base64": {"Authorization": "Basic %%%"},
        "forged token": {"Authorization": "Bearer v1.e30.AAAA"},
        "other scheme": {"Authorization": "Digest x"},
    }
    for door in ("pm", "dn"):
        for what, headers in bad.items():
            r = call(secure.ports[door], "GET", "/v1/streams", ca=secure.ca, headers=headers)
            assert r.status == 401, (door, what, r.body)
            assert r.headers["www-authenticate"] == WWW_AUTHENTICATE
            assert r.json()["reason"]
    key = tokens.derive_key(read_secret(str(secure.certs / SECRET_FILE)))
    expired = tokens.sign(tokens.Claims("alice", tokens.KIND_USER, 1, 2), key)
    r = call(secure.ports["pm"], "GET", "/v1/streams", ca=secure.ca,
             headers={"Authorization": f"Bearer {expired}"})
    assert r.status == 401 and "expired" in r.json()["reason"]
    logs = {n.name: n.log_path.read_text() for n in secure.cluster.nodes}
    assert "event=admin_login_failed" in logs["pm"] and "user='mallory'" in logs["pm"]
    assert any("event=admin_login_failed" in text for name, text in logs.items() if name != "pm")


def test_console_login_gives_a_bearer_token(secure: Secure) -> None:
    def login(user: str, password: str) -> Reply:
        return call(secure.ports["pm"], "POST", "/v1/login", ca=secure.ca,
                    body=json.dumps({"user": user, "password": password}).encode(),
                    headers={"Content-Type": "application/json"})

    r = login("alice", PASSWORDS["alice"])
    assert r.status == 200, r.body
    got = r.json()
    assert got["principal"] == "alice" and got["expires_at_ms"] > 0
    streams = call(secure.ports["pm"], "GET", "/v1/streams", ca=secure.ca,
                   headers={"Authorization": f"Bearer {got['token']}"})
    assert _stream_ids(streams.json()) == {secure.streams["orders"]}
    # the token the console got works on the data node too (any server verifies it)
    dn = call(secure.ports["dn"], "GET", "/v1/streams", ca=secure.ca,
              headers={"Authorization": f"Bearer {got['token']}"})
    assert _stream_ids(dn.json()) == {secure.streams["orders"]}
    assert login("alice", "wrong").status == 401
    assert login("nobody-here", "x").status == 401
    bad = call(secure.ports["pm"], "POST", "/v1/login", ca=secure.ca, body=b"not json")
    assert bad.status == 400
    big = call(secure.ports["pm"], "POST", "/v1/login", ca=secure.ca, body=b"x" * 100_000)
    assert big.status == 413
    assert call(secure.ports["pm"], "POST", "/v1/streams", ca=secure.ca, body=b"{}",
                headers=secure.auth("admin", "bearer")).status == 405
    page = call(secure.ports["pm"], "GET", "/console/console.js", ca=secure.ca)
    assert b"/v1/login" in page.body  # the token stays in memory: nothing stores it
    for store in (b"localStorage.", b"sessionStorage", b"document.cookie", b"indexedDB"):
        assert store not in page.body


# ------------------------------------------------------------------ without auth


def test_insecure_cluster_answers_everyone(tmp_path: Path) -> None:
    ports = {"pm": free_port(), "dn": free_port()}
    with LocalCluster(tmp_path, datanodes=1,
                      extra_pm_args=["--metrics-port", str(ports["pm"])],
                      extra_dn_args=["--metrics-port", str(ports["dn"])]) as c:
        async def populate() -> int:
            async with AsyncClient(c.pm_address) as client:
                sid = await client.create_stream("orders.eu")
                async with client.producer(linger_ms=0) as p:
                    fut = await p.send(sid, b"plain")
                    await p.flush()
                    await fut
                return sid

        sid = asyncio.run(populate())
        for port in ports.values():
            _wait_http(port, None)
        for door, paths in (("pm", ["/v1/info", "/v1/nodes", "/v1/connections", "/metrics",
                                    f"/v1/streams/{sid}", "/"]),
                            ("dn", ["/v1/info", "/v1/connections", "/metrics",
                                    f"/v1/streams/{sid}"])):
            for path in paths:
                assert call(ports[door], "GET", path).status == 200, (door, path)
        listed = call(ports["pm"], "GET", "/v1/streams").json()
        assert sid in _stream_ids(listed)
        tail = call(ports["pm"], "GET", f"/v1/streams/{sid}/tail").json()
        assert [r["value"] for r in tail["records"]] == ["plain"]
        assert call(ports["pm"], "POST", "/v1/login", body=b"{}").status == 404


# ------------------------------------------------------------------ protected mode


def test_protected_mode_decision() -> None:
    assert protected_refusal(False, ("10.1.2.3", 5)) is None
    assert protected_refusal(True, ("127.0.0.1", 5)) is None
    assert protected_refusal(True, ("::1", 5, 0, 0)) is None
    assert protected_refusal(True, "/tmp/sock") is None  # a Unix socket: local
    for peer in (("10.1.2.3", 5), ("192.168.0.1", 5), ("2001:db8::1", 5, 0, 0)):
        r = protected_refusal(True, peer)
        assert r is not None and r.status == 403
        assert "--allow-remote-unauthenticated" in json.loads(r.body)["reason"]


def _own_non_loopback_ip() -> str | None:
    """An address of this machine beyond loopback (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.mark.parametrize("allow_remote", [False, True])
def test_protected_mode_refuses_a_peer_beyond_loopback(tmp_path: Path,
                                                       allow_remote: bool) -> None:
    ip = _own_non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no address beyond loopback (decision tested above)")
    port = free_port()
    extra = ["--metrics-port", str(port)] + (["--allow-remote-unauthenticated"]
                                            if allow_remote else [])
    with LocalCluster(tmp_path, datanodes=0, host="0.0.0.0", extra_pm_args=extra):
        _wait_http(port, None)
        assert call(port, "GET", "/v1/info").status == 200  # loopback: served
        r = call(port, "GET", "/v1/info", host=ip, source=ip)
        if allow_remote:
            assert r.status == 200
        else:
            assert r.status == 403
            assert "--allow-remote-unauthenticated" in r.json()["reason"]


# ------------------------------------------------------------------ the decision, in-process


async def test_basic_is_refused_over_plain_http() -> None:
    gate = ServerAuth(b"k" * 32, frozenset(), {})
    auth = HttpAuth(gate)
    raw = base64.b64encode(b"alice:pw").decode()
    req = HttpRequest("GET", "/v1/streams", {}, {"authorization": f"Basic {raw}"}, tls=False)
    with pytest.raises(HttpDenied) as e:
        await auth.authenticate(req)
    assert e.value.status == 401 and "HTTPS" in e.value.reason
    req.tls = True  # no verifiers and no PM to ask: a Bearer token is the way
    with pytest.raises(HttpDenied) as e:
        await auth.authenticate(req)
    assert e.value.status == 401 and "Bearer" in e.value.reason
    tok = tokens.sign(tokens.Claims("alice", tokens.KIND_USER, gate.clock_ms(),
                                    gate.clock_ms() + 60_000), gate.key)
    req.headers["authorization"] = f"Bearer {tok}"
    assert (await auth.authenticate(req)).principal == "alice"


# ------------------------------------------------------------------ the console, in a browser


@pytest.mark.browser
def test_console_login_form_in_a_browser(secure: Secure) -> None:
    """Chromium (skipped where it is not installed, like tests/test_console.py): the console
    asks for a login, alice sees her stream and not the nodes, and nothing is stored."""
    import shutil

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("chromium and chromium-driver are not installed (scripts/ensure-sysdeps.sh)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--ignore-certificate-errors"):  # the development CA is not the browser's
        opts.add_argument(arg)
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(driver_path))
    try:
        wait = WebDriverWait(d, 30.0, poll_frequency=0.2)
        d.get(f"https://127.0.0.1:{secure.ports['pm']}/")
        wait.until(lambda _: d.find_elements(By.ID, "login-user"))
        d.find_element(By.ID, "login-user").send_keys("alice")
        d.find_element(By.ID, "login-password").send_keys("wrong")
        d.find_element(By.CSS_SELECTOR, "form#login button").click()
        wait.until(lambda _: d.find_element(By.ID, "login-error").text)
        d.find_element(By.ID, "login-password").send_keys(PASSWORDS["alice"])
        d.find_element(By.CSS_SELECTOR, "form#login button").click()
        orders = str(secure.streams["orders"])
        wait.until(lambda _: orders in " ".join(e.text for e in d.find_elements(
            By.CSS_SELECTOR, "#streams td a")))
        shown = " ".join(e.text for e in d.find_elements(By.CSS_SELECTOR, "#streams td a"))
        assert str(secure.streams["payments"]) not in shown.split()
        assert "describe on *" in d.find_element(By.ID, "view").text  # nodes: not shown
        assert d.execute_script("return window.localStorage.length") == 0
        assert d.get_cookies() == []
        d.get(f"https://127.0.0.1:{secure.ports['pm']}/#/stream/{orders}")
        d.refresh()  # a fragment change alone is no reload: the token must not survive one
        wait.until(lambda _: d.find_elements(By.ID, "login-user"))
    finally:
        d.quit()


# ------------------------------------------------------------------ what the server takes


async def test_admin_server_answers_every_request_shape() -> None:
    """Each malformed or unsupported request gets its JSON answer; the server keeps serving."""
    from sbpstream.net.admin import MAX_REQUEST_BODY_BYTES, MetricsExporter, Sample

    exporter = MetricsExporter(lambda: [Sample("sbpstream_test", "gauge", "a test", 1)])
    await exporter.start()

    async def raw(data: bytes) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", exporter.port)
        try:
            writer.write(data)
            await writer.drain()
            got = await asyncio.wait_for(reader.read(), HTTP_TIMEOUT_S)
        finally:
            writer.close()
        head, _, body = got.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), body

    try:
        shapes = {
            b"GET nothing HTTP/1.1\r\n\r\n": 400,
            b"BREW / HTTP/1.1\r\n\r\n": 405,
            b"POST /v1/login HTTP/1.1\r\n\r\n": 411,
            b"POST /v1/login HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n": 411,
            b"POST /v1/login HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
            % (MAX_REQUEST_BODY_BYTES + 1): 413,
            b"GET /metrics HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n": 400,
            b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n": 400,
            b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20_000 + b"\r\n\r\n": 400,
            b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}": 405,
            b"POST /v1/login HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}": 404,  # no such route
        }
        for data, status in shapes.items():
            got, body = await raw(data)
            assert got == status, (data[:60], got, body)
            assert json.loads(body)["error"]
        got, body = await raw(b"GET /metrics HTTP/1.1\r\n\r\n")
        assert got == 200 and b"sbpstream_test 1.0" in body
    finally:
        await exporter.close()


def test_public_metrics_serves_metrics_only(secure: Secure, tmp_path: Path) -> None:
    """``--public-metrics``: /metrics without credentials; everything else still needs them."""
    port = free_port()
    with LocalCluster(tmp_path, datanodes=0, secure=secure.certs,
                      extra_pm_args=["--metrics-port", str(port), "--public-metrics"]):
        _wait_http(port, secure.ca)
        r = call(port, "GET", "/metrics", ca=secure.ca)
        assert r.status == 200 and b"sbpstream_pm_leader" in r.body
        assert call(port, "GET", "/v1/info", ca=secure.ca).status == 401
