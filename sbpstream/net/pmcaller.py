"""The one caller of the Placement Manager leader, shared by the SDK and the data node.

Rules (the JVM reader's ``PmClient.java`` follows the same ones; docs/client.md, "Calling the
PM"):

* **Every address is tried.** A call goes to the last known leader, else to the current address
  of the list given (``--pm``, ``$SBPSTREAM_PM``); an address that cannot be reached, times out
  or answers a RETRIABLE error moves the call to the next address.
* **Redirects are followed.** PM_NOT_LEADER or FENCED_LEADER (as a system error frame or as the
  response's top-level status) moves the call to the leader named in ``detail``; at most
  ``MAX_PM_REDIRECTS`` hops in a row, and an empty or looping answer (an election in progress)
  counts as a failed address.
* **Deadlines.** Each attempt is bounded by the request timeout; the whole call by the retry
  policy's deadline.
* **Retries with backoff.** When every address failed in one round, the caller sleeps (the
  policy's exponential backoff, jittered) and starts another round, until the deadline; without
  a policy (the data node, whose loops retry on their own schedule) it gives up after one round.
* **Fatal errors at once.** A FATAL error (authentication refused, access denied, a bad request)
  is raised as it came, with its one-line message, without trying another address.
* **Giving up** raises NoPmReachableError naming every address when the last failure was a
  connection failure, else the last error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Final, TypeVar, cast

from sbpstream.net.client import ConnectionPool
from sbpstream.net.retry import (
    Attempts,
    RetryPolicy,
    clip_timeout_ms,
    current_deadline,
    deadline_scope,
    is_connection_error,
)
from sbpstream.protocol.errors import (
    ConnectionClosedError,
    NoPmReachableError,
    ProtocolViolationError,
    SbpError,
)
from sbpstream.protocol.messages import STATUS_OK, Message, Status

log = logging.getLogger("sbpstream.pm_caller")

M = TypeVar("M", bound=Message)

MAX_PM_REDIRECTS: Final = 8
"""PM_NOT_LEADER hops followed in a row before the address counts as failed (a leader election
in progress settles within a few hops; more means the PMs disagree)."""


class PmCaller:
    """Calls the PM leader among ``addresses`` over ``pool`` (see the module's rules).

    ``timeout_s`` bounds one attempt unless a call gives its own; ``retry`` (None: one round,
    no backoff) bounds the whole call. ``raise_status`` is what calls do with a top-level error
    status unless they say otherwise (see :meth:`call`). ``leader`` is the address that
    answered last (or that a redirect named), tried first by the next call."""

    def __init__(self, addresses: Sequence[str], pool: ConnectionPool, *, timeout_s: float,
                 retry: RetryPolicy | None = None, raise_status: bool = True) -> None:
        if not addresses:
            raise ValueError("no placement manager address given")
        self._addresses = list(addresses)
        self._pool = pool
        self.timeout_s = timeout_s
        self.retry = retry
        self.raise_status = raise_status
        self.leader: str | None = None
        self._index = 0

    @property
    def addresses(self) -> list[str]:
        """Every PM address given (a copy)."""
        return list(self._addresses)

    @property
    def current(self) -> str:
        """Where the next call goes first: the known leader, else the current address."""
        return self.leader or self._addresses[self._index % len(self._addresses)]

    async def call(self, request: Message, response_cls: type[M], *,
                   timeout_s: float | None = None, raise_status: bool | None = None) -> M:
        """Send ``request`` to the leader; one response (the frames of a streamed answer are
        merged: their ``items`` concatenated in order). With ``raise_status`` a top-level error
        status is raised (a RETRIABLE one is retried first); without, it is returned as is
        (redirects are always followed)."""
        frames = await self.call_frames(request, response_cls, timeout_s=timeout_s,
                                        raise_status=raise_status)
        return merge_responses(frames)

    async def call_frames(self, request: Message, response_cls: type[M], *,
                          timeout_s: float | None = None,
                          raise_status: bool | None = None) -> list[M]:
        """Like :meth:`call`, one decoded response per frame of the answer."""
        if raise_status is None:
            raise_status = self.raise_status
        attempts = Attempts(self.retry) if self.retry is not None else None
        # the whole call ends by its deadline (issue 33): every connect and wait below is
        # bounded by what is left of it, and so is the timeout_ms each attempt carries
        with deadline_scope(attempts.deadline if attempts is not None else None):
            return await self._call_frames(request, response_cls, attempts, raise_status,
                                           self.timeout_s if timeout_s is None else timeout_s)

    async def _call_frames(self, request: Message, response_cls: type[M],
                           attempts: Attempts | None, raise_status: bool,
                           timeout: float) -> list[M]:
        bounded = current_deadline() is not None and hasattr(request, "timeout_ms")
        header = request.encode()
        redirects = 0
        failed = 0  # addresses that failed in this round
        while True:
            addr = self.current
            if bounded:
                asked: int = cast(Any, request).timeout_ms
                header = dataclasses.replace(  # type: ignore[type-var]
                    request, timeout_ms=clip_timeout_ms(asked)).encode()
            try:
                resps = await self._once(addr, request.OPCODE, header, response_cls, timeout)
                status: Status = getattr(resps[-1], "status", STATUS_OK)
                if status.code and (raise_status or status.error().redirect):
                    raise status.error()
                self.leader = addr
                return resps
            except SbpError as exc:
                self.leader = None
                if exc.redirect:
                    named = exc.detail.decode("utf-8", "replace").strip()
                    redirects += 1
                    if named and named != addr and redirects <= MAX_PM_REDIRECTS:
                        log.debug("event=pm_redirect from=%s to=%s", addr, named)
                        self.leader = named
                        continue
                elif not exc.retriable:
                    raise  # fatal: authentication, access, a bad request
                if is_connection_error(exc):
                    self._pool.discard(addr)
                if addr in self._addresses:
                    self._index = self._addresses.index(addr) + 1
                failed += 1
                if failed < len(self._addresses):
                    continue
                if attempts is None:
                    raise self._give_up(exc) from None
                try:
                    await attempts.backoff(exc)
                except SbpError:
                    raise self._give_up(exc) from None
                failed = redirects = 0

    async def _once(self, addr: str, opcode: int, header: bytes, response_cls: type[M],
                    timeout_s: float) -> list[M]:
        try:
            conn = await self._pool.get(addr)
            frames = await conn.request(opcode, header, timeout_s=timeout_s)
        except OSError as exc:  # the pool wraps connect errors; a raw one means the same
            raise ConnectionClosedError(f"cannot reach the PM at {addr}: {exc}") from exc
        if not frames:
            raise ProtocolViolationError(f"empty response from the PM at {addr}")
        resps = []
        for f in frames:  # a long listing: yield between frames
            resps.append(response_cls.decode(f.header))
            if len(frames) > 1:
                await asyncio.sleep(0)
        return resps

    def _give_up(self, last: SbpError) -> SbpError:
        if is_connection_error(last) or last.redirect:
            return NoPmReachableError(
                f"no placement manager reachable at {','.join(self._addresses)} "
                f"({last.message})")
        return last


def merge_responses(resps: Sequence[M]) -> M:
    """One response from the frames of a streamed answer: a PM may split a long list (e.g.
    LIST_RANGES results) over several frames; their ``items`` are concatenated in order."""
    last = resps[-1]
    if len(resps) == 1 or not hasattr(last, "items"):
        return last
    items = tuple(it for d in resps for it in d.items)  # type: ignore[attr-defined]
    return dataclasses.replace(last, items=items)  # type: ignore[type-var]
