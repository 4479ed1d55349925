"""The one PM caller (``net/pmcaller.py``), shared by the SDK and the data node: every address
tried, PM_NOT_LEADER followed (as a system error and as a top-level status), a dead first
address skipped, fatal errors raised at once, one round without a retry policy, backoff rounds
with one. Fake PMs are real servers on loopback; a dead address is a port nothing listens on."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sbpstream.client import AsyncClient
from sbpstream.datanode.pmclient import PmClient
from sbpstream.net import retry as net_retry
from sbpstream.net.client import ConnectionPool
from sbpstream.net.pmcaller import MAX_PM_REDIRECTS, PmCaller
from sbpstream.net.retry import RetryPolicy
from sbpstream.net.server import Request, Responder, Server
from sbpstream.protocol.errors import (
    AuthenticationFailedError,
    ErrorCode,
    InvalidRequestError,
    NoPmReachableError,
    PmNotLeaderError,
)
from sbpstream.protocol.messages import (
    ClientRole,
    DescribeStreamsRequest,
    DescribeStreamsResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    Status,
)
from sbpstream.protocol.opcodes import Opcode

HB = HeartbeatRequest(client_id="t", client_role=ClientRole.CLIENT)
Handler = Callable[[Request, Responder], Awaitable[None]]


def dead_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Fakes:
    """Fake PMs answering HEARTBEAT (and DESCRIBE_STREAMS) as told, counting their calls."""

    def __init__(self) -> None:
        self.servers: list[Server] = []
        self.calls: dict[str, int] = {}

    async def start(self, handler: Handler) -> str:
        name = f"fake{len(self.servers)}"

        async def counted(req: Request, resp: Responder) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            await handler(req, resp)

        srv = Server({Opcode.HEARTBEAT: counted, Opcode.DESCRIBE_STREAMS: counted}, name=name)
        await srv.start("127.0.0.1", 0)
        self.servers.append(srv)
        return srv.address

    def count(self, address: str) -> int:
        i = [s.address for s in self.servers].index(address)
        return self.calls.get(f"fake{i}", 0)


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    f = Fakes()
    try:
        yield f
    finally:
        for s in f.servers:
            await s.close(0.5)


async def leader_ok(req: Request, resp: Responder) -> None:
    await resp.send(HeartbeatResponse().encode())


def redirect_status(to: str) -> Handler:
    async def h(req: Request, resp: Responder) -> None:
        await resp.send(HeartbeatResponse(status=Status(
            code=ErrorCode.PM_NOT_LEADER, message="not the leader", detail=to.encode())).encode())
    return h


def redirect_error(to: str) -> Handler:
    async def h(req: Request, resp: Responder) -> None:
        raise PmNotLeaderError("not the leader", to.encode())
    return h


async def test_every_address_is_tried_until_one_answers(fakes: Fakes) -> None:
    """Two dead addresses, a follower that knows no leader, then the leader: one call."""
    leader = await fakes.start(leader_ok)
    follower = await fakes.start(redirect_error(""))
    addrs = [dead_address(), dead_address(), follower, leader]
    pool = ConnectionPool(connect_timeout_s=2)
    try:
        pm = PmCaller(addrs, pool, timeout_s=5, retry=None)
        r = await pm.call(HB, HeartbeatResponse)
        assert r.status.ok and pm.leader == leader and pm.current == leader
        assert fakes.count(follower) == 1 and fakes.count(leader) == 1
        # the next call goes straight to the leader
        await pm.call(HB, HeartbeatResponse)
        assert fakes.count(follower) == 1 and fakes.count(leader) == 2
    finally:
        await pool.close()


@pytest.mark.parametrize("how", [redirect_status, redirect_error])
async def test_a_redirect_to_an_address_not_given_is_followed(
        fakes: Fakes, how: Callable[[str], Handler]) -> None:
    leader = await fakes.start(leader_ok)
    follower = await fakes.start(how(leader))
    pool = ConnectionPool()
    try:
        pm = PmCaller([follower], pool, timeout_s=5, retry=None)
        r = await pm.call(HB, HeartbeatResponse)
        assert r.status.ok and pm.leader == leader
        assert pm.addresses == [follower]  # the list given is not changed
    finally:
        await pool.close()


async def test_a_redirect_loop_counts_as_a_failed_address(fakes: Fakes) -> None:
    """Two followers naming each other: bounded hops, then the next address (the leader)."""
    names: dict[str, str] = {}

    def naming(me: str) -> Handler:
        async def h(req: Request, resp: Responder) -> None:
            raise PmNotLeaderError("not the leader", names[me].encode())
        return h

    a = await fakes.start(naming("a"))
    b = await fakes.start(naming("b"))
    names.update(a=b, b=a)
    leader = await fakes.start(leader_ok)
    pool = ConnectionPool()
    try:
        pm = PmCaller([a, leader], pool, timeout_s=5, retry=None)
        r = await pm.call(HB, HeartbeatResponse)
        assert r.status.ok and pm.leader == leader
        assert fakes.count(a) + fakes.count(b) == MAX_PM_REDIRECTS + 1
    finally:
        await pool.close()


async def test_a_fatal_error_is_raised_at_once(fakes: Fakes) -> None:
    async def refuse(req: Request, resp: Responder) -> None:
        raise AuthenticationFailedError("wrong password for alice")

    refusing = await fakes.start(refuse)
    leader = await fakes.start(leader_ok)
    pool = ConnectionPool()
    try:
        pm = PmCaller([refusing, leader], pool, timeout_s=5,
                      retry=RetryPolicy(deadline_ms=5_000))
        with pytest.raises(AuthenticationFailedError,
                           match=r"^AUTHENTICATION_FAILED: wrong password for alice$"):
            await pm.call(HB, HeartbeatResponse)
        assert fakes.count(leader) == 0
    finally:
        await pool.close()


async def test_without_a_policy_one_round_then_no_pm_reachable() -> None:
    dead = [dead_address(), dead_address()]
    pool = ConnectionPool(connect_timeout_s=2)
    try:
        pm = PmCaller(dead, pool, timeout_s=2, retry=None)
        with pytest.raises(NoPmReachableError, match="no placement manager reachable at "
                           + ",".join(dead)):
            await pm.call(HB, HeartbeatResponse)
    finally:
        await pool.close()


async def test_with_a_policy_rounds_go_on_until_a_pm_comes_up(fakes: Fakes) -> None:
    """The only address is dead at first; a PM starts on it while the caller backs off."""
    addr = dead_address()
    host, port = addr.rsplit(":", 1)
    pool = ConnectionPool(connect_timeout_s=2)
    rounds: list[int] = []

    def observe(err: BaseException, waited: float, deadline: float) -> None:
        rounds.append(1)

    net_retry.backoff_observers.append(observe)
    srv = Server({Opcode.HEARTBEAT: leader_ok}, name="late")
    try:
        pm = PmCaller([addr], pool, timeout_s=2, retry=RetryPolicy(deadline_ms=60_000))
        call = asyncio.ensure_future(pm.call(HB, HeartbeatResponse))
        async with asyncio.timeout(30):
            while len(rounds) < 2:
                await asyncio.sleep(0.01)
        await srv.start(host, int(port))
        async with asyncio.timeout(30):
            r = await call
        assert r.status.ok and pm.leader == addr and len(rounds) >= 2
    finally:
        net_retry.backoff_observers.remove(observe)
        await srv.close(0.5)
        await pool.close()


async def test_status_errors_raised_or_returned(fakes: Fakes) -> None:
    """The SDK raises a top-level error status; the data node's caller returns it as is."""
    async def not_found(req: Request, resp: Responder) -> None:
        await resp.send(DescribeStreamsResponse(status=Status(
            code=ErrorCode.INVALID_REQUEST, message="bad")).encode())

    addr = await fakes.start(not_found)
    pool = ConnectionPool()
    try:
        node = PmClient((addr,), pool)
        r = await node.call(DescribeStreamsRequest(), DescribeStreamsResponse)
        assert r.status.code == ErrorCode.INVALID_REQUEST
        sdk = PmCaller([addr], pool, timeout_s=5, retry=RetryPolicy(deadline_ms=1_000))
        with pytest.raises(InvalidRequestError, match=r"^INVALID_REQUEST: bad$"):
            await sdk.call(DescribeStreamsRequest(), DescribeStreamsResponse)
    finally:
        await pool.close()


async def test_the_client_uses_the_caller_over_a_dead_first_address(fakes: Fakes) -> None:
    """AsyncClient.pm_request: the dead first address is skipped, the redirect followed, the
    response class found from the opcode; pm_leader says where it went."""
    leader = await fakes.start(leader_ok)
    follower = await fakes.start(redirect_status(leader))
    async with AsyncClient([dead_address(), follower], retry_deadline_ms=10_000,
                           connect_timeout_ms=2_000) as c:
        assert c.pm_leader is None and c.pm_addresses[1] == follower
        r = await c.pm_request(HB)
        assert isinstance(r, HeartbeatResponse) and r.status.ok
        assert c.pm_leader == leader
