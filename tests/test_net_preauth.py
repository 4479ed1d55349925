"""What a connection costs the server before it authenticates, and the plaintext/TLS mistakes
explained at once (docs/security.md, "Pre-authentication limits").

Servers with auth on are in-process :class:`Server` objects behind the real gate
(:class:`ServerAuth`), or that same server in its own process where the test opens thousands of
connections; the flood test measures a real PM process's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cluster_helpers import PmProcess, dev_certs
from waiting import eventually, eventually_async

from sbpstream.auth import tokens
from sbpstream.auth.client import Credentials
from sbpstream.auth.config import CA_FILE
from sbpstream.auth.gate import CONN_CLAIMS, PM_NODE_ONLY, ServerAuth
from sbpstream.client import AsyncClient
from sbpstream.net.client import CREDENTIALS_HINT, Connection
from sbpstream.net.server import (
    AUTHENTICATED_ATTRIBUTE,
    TLS_REQUIRED_MESSAGE,
    Request,
    Responder,
    Server,
)
from sbpstream.net.tls import TlsConfig, client_context, server_context
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    AuthenticationRequiredError,
    ErrorCode,
    InvalidRequestError,
    SbpError,
)
from sbpstream.protocol.frame import FrameDecoder, encode_frame
from sbpstream.protocol.limits import (
    MAX_CONNECTIONS,
    MAX_FRAME_LENGTH,
    MAX_UNAUTHENTICATED_CONNECTIONS,
    PREAUTH_MAX_FRAME_LENGTH,
    PREAUTH_WRITE_BUFFER_HIGH_WATER,
    MiB,
)
from sbpstream.protocol.messages import GoAway
from sbpstream.protocol.opcodes import Opcode

pytestmark = pytest.mark.timeout(300)

SECRET = b"p" * 32
SDK_BOUND_S = 10.0
"""The SDK's errors below must come well before its retry deadline (60 s here): at once."""


@pytest.fixture(autouse=True)
def _no_sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SBPSTREAM_USER", "SBPSTREAM_PASSWORD", "SBPSTREAM_TOKEN_FILE",
                 "SBPSTREAM_TLS_CA", "SBPSTREAM_TLS_CERT", "SBPSTREAM_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dev_certs(tmp_path_factory)


def _server_tls(certs: Path) -> TlsConfig:
    return TlsConfig(str(certs / "server.pem"), str(certs / "server-key.pem"),
                     str(certs / CA_FILE))


async def echo(req: Request, resp: Responder) -> None:
    await resp.send(b"", req.payload)


def _gated_server(**kw: object) -> Server:
    gate = ServerAuth(SECRET, PM_NODE_ONLY, {})
    return Server(gate.wrap({Opcode.FETCH: echo}), name="gated", gate=gate, **kw)  # type: ignore[arg-type]


def _token_creds(tmp: Path, address: str) -> Credentials:
    now = int(time.time() * 1000)
    f = tmp / "token"
    f.write_text(tokens.sign(tokens.Claims("alice", tokens.KIND_USER, now, now + 600_000),
                             tokens.derive_key(SECRET)))
    return Credentials(token_file=str(f), pm=(address,))


def _frame(op: int, rid: int = 1, header: bytes = b"", payload: bytes = b"") -> bytes:
    return encode_frame(op, rid, 0, header, payload)


def _read_goaway(sock: socket.socket, timeout_s: float = 10.0) -> GoAway | None:
    """The GOAWAY the server sent on ``sock`` (None if none), reading until it closes."""
    sock.settimeout(timeout_s)
    dec = FrameDecoder()
    got: GoAway | None = None
    with contextlib.suppress(ConnectionError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            dec.feed(data)
            while (ev := dec.next_event()) is not None:
                if getattr(ev, "opcode", None) == Opcode.GOAWAY:
                    got = GoAway.decode(ev.header)  # type: ignore[union-attr]
    return got


def test_the_layer_and_the_gate_agree_on_the_authenticated_mark() -> None:
    assert AUTHENTICATED_ATTRIBUTE == CONN_CLAIMS
    assert MAX_UNAUTHENTICATED_CONNECTIONS < MAX_CONNECTIONS
    assert PREAUTH_MAX_FRAME_LENGTH < MAX_FRAME_LENGTH


# ------------------------------------------------------------------ frames before auth


async def test_a_big_frame_before_auth_is_refused_without_reading_its_body(
        tmp_path: Path) -> None:
    server = _gated_server()
    await server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        big = 16 * MiB
        # the fixed header of a 16 MiB FETCH, nothing of its body: the server must not wait
        sock.sendall(struct.pack(">IBHBIB3s", big, 23, Opcode.FETCH, 0, 1, 1, b"\0\0\0"))
        goaway = await asyncio.to_thread(_read_goaway, sock)
        sock.close()
        assert goaway is not None and goaway.code == ErrorCode.AUTHENTICATION_REQUIRED
        assert str(PREAUTH_MAX_FRAME_LENGTH) in goaway.message
        assert server.stats.preauth_frames_refused == 1
        # authenticated, the same size (1 MiB here) is served
        conn = await Connection.open(server.address,
                                     authenticator=_token_creds(tmp_path, server.address))
        frames = await conn.request(Opcode.FETCH, b"", b"x" * MiB, timeout_s=30)
        assert len(frames[-1].payload) == MiB
        await conn.aclose()
    finally:
        await server.close(drain_timeout_s=1)


async def test_the_auth_deadline_closes_a_silent_connection(tmp_path: Path) -> None:
    server = _gated_server(auth_deadline_s=0.5)
    await server.start()
    try:
        authed = await Connection.open(server.address,
                                       authenticator=_token_creds(tmp_path, server.address))
        silent = await Connection.open(server.address)
        await asyncio.wait_for(silent.closed_event.wait(), 20)
        assert silent.goaway is not None
        assert silent.goaway.code == ErrorCode.AUTHENTICATION_REQUIRED
        assert "not authenticated within" in silent.goaway.message
        assert server.stats.auth_deadlines_expired == 1
        # the authenticated one, older than the silent one, is still served
        assert (await authed.ping(b"still")).payload == b"still"
        await authed.aclose()
    finally:
        await server.close(drain_timeout_s=1)


# ------------------------------------------------------------------ output back-pressure


async def _flood(sock: socket.socket, chunk: bytes, limit: int, stall_s: float) -> int:
    """Send ``chunk`` again and again, never reading, until ``limit`` bytes went out or the
    server has stopped reading for ``stall_s``; returns the bytes sent."""
    loop = asyncio.get_running_loop()
    sent = 0
    while sent < limit:
        try:
            await asyncio.wait_for(loop.sock_sendall(sock, chunk), stall_s)
        except TimeoutError:
            break
        sent += len(chunk)
    return sent


def _junk_chunk() -> bytes:
    """PINGs (answered with their payload), requests with a bad id and requests nobody may
    send before auth (answered with system errors several times their size)."""
    parts = []
    for i in range(1, 400):
        parts.append(_frame(Opcode.PING, i, payload=b"p" * 8))
        bad_id = bytearray(_frame(Opcode.CREATE_STREAMS, i))
        bad_id[8] |= 0x80  # the request id's top bit: answered INVALID_REQUEST
        parts.append(bytes(bad_id))
        parts.append(_frame(Opcode.DESCRIBE_STREAMS, i))
    return b"".join(parts)


async def test_a_peer_that_never_reads_holds_bounded_output_before_auth() -> None:
    server = _gated_server()
    await server.start()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        sent = await _flood(sock, _junk_chunk(), 256 * MiB, stall_s=3)
        (conn,) = server.connections
        await eventually_async(lambda: conn.reading_paused, timeout=30,
                               what="the server stopped reading the flood")
        assert conn.transport is not None
        buffered = conn.transport.get_write_buffer_size()
        # at most the pre-auth mark plus what the last read chunk answered
        assert buffered <= PREAUTH_WRITE_BUFFER_HIGH_WATER + 4 * 256 * 1024, buffered
        assert conn.decoder.buffered_bytes <= 1 * MiB
        assert sent < 256 * MiB  # it stopped reading: the flood could not go on
    finally:
        sock.close()
        await server.close(drain_timeout_s=1)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_ping_flood_that_is_never_read_keeps_the_pm_memory_bounded(tmp_path: Path) -> None:
    """A real PM (auth off: every connection is past auth). Without read back-pressure it read
    everything and queued ~7x that in answers; now it stops reading at the high-water mark."""
    pm = PmProcess(tmp_path)
    pm.start()
    try:
        assert pm.proc is not None
        pid = pm.proc.pid
        with socket.create_connection(("127.0.0.1", pm.port)) as warm:  # a first connection
            warm.sendall(_frame(Opcode.PING, 1, payload=b"w"))
            warm.settimeout(10)
            assert warm.recv(100)
        before = _rss_kib(pid)
        flood_limit = 48 * MiB
        socks = []
        try:
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", pm.port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.setblocking(False)
                socks.append(s)

            async def both() -> list[int]:
                chunk = _junk_chunk()
                return await asyncio.gather(*(_flood(s, chunk, flood_limit, 5) for s in socks))

            sent = asyncio.run(both())
            grown_mib = (_rss_kib(pid) - before) / 1024
            # two connections, each at most 4 MiB of answers (plus their objects) and a chunk
            assert grown_mib < 64, (grown_mib, sent)
            assert all(n < flood_limit for n in sent), sent
        finally:
            for s in socks:
                s.close()
        with socket.create_connection(("127.0.0.1", pm.port)) as after:  # still serving
            after.sendall(_frame(Opcode.PING, 1, payload=b"a"))
            after.settimeout(10)
            assert after.recv(100)
    finally:
        pm.stop()


# ------------------------------------------------------------------ connection caps


async def test_connections_per_source_are_capped() -> None:
    server = Server({Opcode.FETCH: echo}, name="capped", max_connections_per_source=3)
    await server.start()
    conns: list[Connection] = []
    try:
        for _ in range(3):
            c = await Connection.open(server.address)
            await c.ping()
            conns.append(c)
        over = await Connection.open(server.address)
        await asyncio.wait_for(over.closed_event.wait(), 10)
        assert over.goaway is not None and over.goaway.code == ErrorCode.LIMIT_EXCEEDED
        assert "from 127.0.0.1" in over.goaway.message
        # another source (all of 127/8 is loopback) has its own count
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(_frame(Opcode.PING, 7, payload=b"other"))
        sock.settimeout(10)
        assert b"other" in await asyncio.to_thread(sock.recv, 100)
        sock.close()
        await conns.pop().aclose()  # a slot freed is a slot again
        await eventually_async(lambda: server.admission.per_source.get("127.0.0.1") == 2,
                               timeout=10, what="the closed connection counted out")
        again = await Connection.open(server.address)
        assert (await again.ping(b"in")).payload == b"in"
        conns.append(again)
    finally:
        for c in conns:
            await c.aclose()
        await server.close(drain_timeout_s=1)


_SERVER_SCRIPT = """
import asyncio, sys
from sbpstream.auth.gate import PM_NODE_ONLY, ServerAuth
from sbpstream.net.loop import run
from sbpstream.net.server import Server
from sbpstream.protocol.opcodes import Opcode

async def echo(req, resp):
    await resp.send(b"", req.payload)

async def main():
    gate = ServerAuth(bytes.fromhex(sys.argv[1]), PM_NODE_ONLY, {})
    server = Server(gate.wrap({Opcode.FETCH: echo}), gate=gate, auth_deadline_s=600.0)
    await server.start("127.0.0.1", 0)
    print(server.port, flush=True)
    while True:
        await asyncio.sleep(3600)

run(main())
"""


@pytest.fixture
def gated_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The gated server (default caps, a long auth deadline) in its own process."""
    with subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, SECRET.hex()],
                          stdout=subprocess.PIPE, text=True, env=dict(os.environ)) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip().isdigit(), f"server did not start: {line!r}"
            yield proc, int(line)
        finally:
            proc.kill()
            proc.wait(10)  # leaving the with closes its stdout pipe


def _open_idle(port: int, n: int, sources: int) -> list[socket.socket]:
    """``n`` idle TCP connections to ``port``, spread over 127.0.0.2.. (the per-source cap),
    opened in batches whose connects have completed."""
    socks: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    try:
        for start in range(0, n, 500):
            batch = []
            for i in range(start, min(n, start + 500)):
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i % sources}", 0))
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                sel.register(s, selectors.EVENT_WRITE)
                batch.append(s)
                socks.append(s)
            pending = set(batch)

            def connected(pending: set[socket.socket] = pending) -> bool:
                for key, _ in sel.select(1.0):
                    sel.unregister(key.fileobj)
                    pending.discard(key.fileobj)  # type: ignore[arg-type]
                return not pending

            eventually(connected, timeout=60, interval=0, what="a batch of connects")
    except BaseException:
        for s in socks:
            s.close()
        raise
    finally:
        sel.close()
    return socks


async def test_an_authenticated_client_gets_in_while_10000_idle_ones_are_held(
        gated_process: tuple[subprocess.Popen[str], int], tmp_path: Path) -> None:
    _, port = gated_process
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = MAX_CONNECTIONS + 500
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the fd limit ({hard}) is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    idle = await asyncio.to_thread(_open_idle, port, MAX_CONNECTIONS, 12)
    try:
        address = f"127.0.0.1:{port}"
        conn = await Connection.open(address, authenticator=_token_creds(tmp_path, address))
        frames = await conn.request(Opcode.FETCH, b"", b"admin", timeout_s=30)
        assert bytes(frames[-1].payload) == b"admin"
        await conn.aclose()
        # and the server still holds thousands of the idle ones (the oldest made room)
        alive = 0
        for s in idle:
            try:
                s.recv(1, socket.MSG_PEEK)  # data (a GOAWAY) or EOF: closed by the server
            except BlockingIOError:
                alive += 1  # open, nothing to read
            except OSError:
                pass  # reset: evicted
        assert alive >= MAX_UNAUTHENTICATED_CONNECTIONS - 1, alive
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------ TLS and plaintext mistakes


@pytest.fixture
async def tls_server(certs: Path) -> AsyncIterator[Server]:
    server = _gated_server(ssl_context=server_context(_server_tls(certs)))
    await server.start()
    yield server
    await server.close(drain_timeout_s=1)


async def test_plaintext_sbp_to_a_tls_port_is_told_tls_is_required(
        tls_server: Server, certs: Path, tmp_path: Path) -> None:
    plain = await Connection.open(tls_server.address)
    with pytest.raises(InvalidRequestError) as e:
        await plain.ping(timeout_s=10)
    assert e.value.message == TLS_REQUIRED_MESSAGE
    await plain.aclose()
    assert tls_server.stats.plaintext_on_tls == 1
    # over TLS the same port serves as before
    tls = await Connection.open(tls_server.address,
                                ssl_context=client_context(TlsConfig(ca=str(certs / CA_FILE))),
                                authenticator=_token_creds(tmp_path, tls_server.address))
    frames = await tls.request(Opcode.FETCH, b"", b"over tls", timeout_s=10)
    assert bytes(frames[-1].payload) == b"over tls"
    await tls.aclose()


async def test_the_sdk_without_tls_ca_says_so_at_once(tls_server: Server) -> None:
    async with AsyncClient(tls_server.address, retry_deadline_ms=60_000) as client:
        with pytest.raises(SbpError) as e:
            await asyncio.wait_for(client.list_streams(), SDK_BOUND_S)
    assert not e.value.retriable
    assert "SBPSTREAM_TLS_CA / --tls-ca" in str(e.value) and "\n" not in str(e.value)


async def test_the_sdk_with_tls_ca_at_a_plaintext_port_says_so_at_once(certs: Path) -> None:
    server = _gated_server()
    await server.start()
    try:
        with pytest.raises(AuthenticationFailedError) as raw:
            await Connection.open(server.address, ssl_context=client_context(
                TlsConfig(ca=str(certs / CA_FILE))))
        assert "does not speak TLS" in raw.value.message
        async with AsyncClient(server.address, tls_ca=str(certs / CA_FILE),
                               retry_deadline_ms=60_000) as client:
            with pytest.raises(AuthenticationFailedError) as e:
                await asyncio.wait_for(client.list_streams(), SDK_BOUND_S)
        assert "SBPSTREAM_TLS_CA / --tls-ca" in str(e.value) and "\n" not in str(e.value)
    finally:
        await server.close(drain_timeout_s=1)


async def test_the_sdk_without_credentials_names_them_at_once() -> None:
    server = _gated_server()
    await server.start()
    try:
        async with AsyncClient(server.address, retry_deadline_ms=60_000) as client:
            with pytest.raises(AuthenticationRequiredError) as e:
                await asyncio.wait_for(client.list_streams(), SDK_BOUND_S)
        assert CREDENTIALS_HINT in str(e.value) and "\n" not in str(e.value)
        assert "SBPSTREAM_USER" in CREDENTIALS_HINT and "SBPSTREAM_PASSWORD" in CREDENTIALS_HINT
    finally:
        await server.close(drain_timeout_s=1)


def _wait_closed(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """What the server sent before closing ``sock`` (reset or EOF), waiting at most
    ``timeout_s`` for it to close."""
    sock.settimeout(timeout_s)
    got = b""
    with contextlib.suppress(ConnectionError):
        while data := sock.recv(65536):
            got += data
    return got


async def test_a_silent_connection_on_a_tls_port_is_counted_and_closed_at_the_deadline(
        certs: Path) -> None:
    server = _gated_server(ssl_context=server_context(_server_tls(certs)), auth_deadline_s=0.5)
    await server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        await eventually_async(lambda: len(server.connections) == 1, timeout=10,
                               what="counted in before any handshake")
        assert await asyncio.to_thread(_wait_closed, sock) == b""  # nothing it could read
        sock.close()
        await eventually_async(lambda: not server.connections and
                               not server.admission.per_source, timeout=10,
                               what="counted out")
    finally:
        await server.close(drain_timeout_s=1)
