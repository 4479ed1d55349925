"""Leader election among PMs sharing one etcd prefix, by lease.

A PM campaigns by granting a lease of ``lease_ttl_s`` and creating ``P/leader`` with it in a
transaction that succeeds only if the key is absent (``create_revision == 0``). The winner's
**token** is the key's ``create_revision`` (the revision of that transaction): unique and
increasing across terms. Every metadata write compares it (:mod:`sbpstream.pm.etcd`), so a
deposed leader cannot write even if it still believes it leads.

The leader refreshes its lease every ``ttl / KEEPALIVE_DIVISOR``. It believes itself leader only
until ``t_sent + ttl * (1 - DEADLINE_MARGIN)``, where ``t_sent`` is when the last successful
keepalive was *sent*: etcd cannot expire the lease before ``t_sent + ttl``, so a leader that
was paused (SIGSTOP, GC, swap) stops answering as leader before anyone else can start. When the
key disappears (lease expired, or revoked on a clean shutdown) the followers, who watch the
prefix, campaign at once; one wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from aetcd import rpc

from sbpstream.pm.etcd import EtcdMetadataStore, decode_leader, encode_leader
from sbpstream.protocol.errors import MetadataError, PmNotLeaderError, SbpError

log = logging.getLogger("sbpstream.pm.leader")

KEEPALIVE_DIVISOR: Final = 3
"""Keepalives per TTL: two may be lost before the lease is at risk."""

DEADLINE_MARGIN: Final = 0.15
"""Fraction of the TTL a leader gives up early, covering clock-rate differences between this
host and etcd's and the time between a keepalive's send and its arrival."""

CAMPAIGN_RETRY_S: Final = 0.5
"""Pause after a failed election round (etcd unreachable) before the next one."""

FOLLOWER_RECHECK_FRACTION: Final = 1.0
"""A follower re-reads the leader key (linearizably) at least every TTL x this, in case its
watch missed the key's deletion."""

ElectedCallback = Callable[[int], Awaitable[None]]
LostCallback = Callable[[], Awaitable[None]]


class LeaderElection:
    """Campaign, lead and follow until :meth:`stop`. ``on_elected(token)`` runs after the store
    is fenced with the token and before :attr:`is_leader` turns true; ``on_lost()`` after it
    turned false."""

    def __init__(
        self,
        store: EtcdMetadataStore,
        address: str,
        *,
        on_elected: ElectedCallback | None = None,
        on_lost: LostCallback | None = None,
        lease_ttl_s: int | None = None,
    ) -> None:
        self.store = store
        self.address = address
        self.ttl_s = lease_ttl_s or store.settings.lease_ttl_s
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self._lease_id = 0
        self._token: int | None = None
        self._deadline = 0.0
        self._stopping = False
        self.terms = 0
        """Times this PM has been elected."""
        self.elected_at = 0.0
        """monotonic() of the last election won."""

    # ------------------------------------------------------------------ state
    @property
    def is_leader(self) -> bool:
        """Holding a token the store still fences with, within the lease deadline, and the
        leader key (as the watch last saw it) still the one this PM created."""
        return (self._token is not None and self.store.is_leader
                and self.store.leader_revision() == self._token
                and time.monotonic() < self._deadline)

    @property
    def token(self) -> int | None:
        return self._token if self.is_leader else None

    @property
    def leader_address(self) -> str:
        """This PM's address while it leads; otherwise the leader's as last seen ('' unknown)."""
        if self.is_leader:
            return self.address
        addr = self.store.leader_address()
        return "" if addr == self.address else addr

    def check_leader(self) -> None:
        """Raise PmNotLeaderError (``detail``: the leader's address, empty when unknown)."""
        if not self.is_leader:
            addr = self.leader_address
            raise PmNotLeaderError(
                f"this PM is not the leader (leader: {addr or 'unknown'})", addr.encode())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, resign: bool = True) -> None:
        """Stop campaigning; a leader gives the key up at once (so a follower takes over
        without waiting out the lease) unless ``resign`` is False."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        was_leader = self._token is not None
        if self.is_leader:
            with contextlib.suppress(SbpError):
                await self.store.flush_soft_state()
        await self._step_down("stopped")
        if resign and was_leader and self._lease_id:
            with contextlib.suppress(SbpError):
                await self.store.client.revoke(self._lease_id)
            log.info("event=leader_resigned address=%s", self.address)
        self._lease_id = 0

    async def wait_leader(self, timeout_s: float) -> bool:
        """Wait until this PM leads (tests and tools)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_leader:
                return True
            await asyncio.sleep(0.02)
        return self.is_leader

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._stopping:
            try:
                if await self._campaign():
                    await self._lead()
                else:
                    await self._follow()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling() or self._stopping:
                    raise
                # not this task's cancellation (a gRPC call cancelled under it): a failed round,
                # not the end of campaigning
                log.warning("event=election_round_failed address=%s error='cancelled'",
                            self.address)
                await self._step_down("error")
                await asyncio.sleep(CAMPAIGN_RETRY_S)
            except SbpError as e:
                log.warning("event=election_round_failed address=%s error=%r", self.address,
                            str(e))
                await self._step_down("error")
                await asyncio.sleep(CAMPAIGN_RETRY_S)
            except Exception:
                log.exception("event=election_crashed address=%s", self.address)
                await self._step_down("error")
                await asyncio.sleep(CAMPAIGN_RETRY_S)

    async def _campaign(self) -> bool:
        if self.store.leader_address():
            return False  # somebody leads, as far as the warm cache knows: do not bother etcd
        client = self.store.client
        sent = time.monotonic()
        lease_id, ttl = await client.grant(self.ttl_s)
        k = self.store.keys
        req = rpc.TxnRequest(
            compare=[rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE,
                                 key=k.leader, create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(
                key=k.leader, value=encode_leader(self.address), lease=lease_id))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=k.leader))],
        )
        try:
            resp = await client.txn(req)
        except BaseException:
            with contextlib.suppress(SbpError):
                await client.revoke(lease_id)
            raise
        if not resp.succeeded:
            with contextlib.suppress(SbpError):
                await client.revoke(lease_id)
            kvs = resp.responses[0].response_range.kvs
            log.debug("event=campaign_lost address=%s leader=%s", self.address,
                      decode_leader(kvs[0].value) if kvs else "")
            return False
        token = int(resp.header.revision)
        self._lease_id = lease_id
        self._deadline = sent + ttl * (1 - DEADLINE_MARGIN)
        try:
            await self.store.assume_leadership(token)
            if self._on_elected is not None:
                await self._on_elected(token)
        except BaseException:
            self.store.drop_leadership()
            with contextlib.suppress(SbpError):
                await client.revoke(lease_id)
            self._lease_id = 0
            raise
        self._token = token
        self.terms += 1
        self.elected_at = time.monotonic()
        log.info("event=leader_elected address=%s token=%d lease_ttl_s=%d", self.address, token,
                 ttl)
        return True

    async def _lead(self) -> None:
        """Keep the lease alive until it is lost; then step down."""
        client = self.store.client
        interval = self.ttl_s / KEEPALIVE_DIVISOR
        reason = "lease_lost"
        while not self._stopping:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now >= self._deadline:
                reason = "deadline_passed"  # e.g. this process was paused past its lease
                break
            if not self.store.is_leader or self.store.leader_revision() != self._token:
                reason = "fenced"  # a write, or the watch, found the leader key changed
                break
            try:
                ttl = await client.keepalive(self._lease_id, self._deadline - now)
            except SbpError as e:
                log.warning("event=keepalive_failed address=%s error=%r", self.address, str(e))
                continue  # the deadline decides; another round may still succeed
            if ttl <= 0:
                break
            self._deadline = now + ttl * (1 - DEADLINE_MARGIN)
        await self._step_down(reason)
        if self._lease_id:
            with contextlib.suppress(SbpError):
                await client.revoke(self._lease_id)  # if the key is still ours: hand over now
            self._lease_id = 0

    async def _step_down(self, reason: str) -> None:
        if self._token is None:
            self.store.drop_leadership()
            return
        log.log(logging.INFO if reason == "stopped" else logging.WARNING,
                "event=leader_lost address=%s token=%d reason=%s", self.address, self._token,
                reason)
        self._token = None
        self._deadline = 0.0
        self.store.drop_leadership()
        if self._on_lost is not None:
            try:
                await self._on_lost()
            except Exception:
                log.exception("event=on_lost_failed address=%s", self.address)

    async def _follow(self) -> None:
        """Return when the leader key may be gone: its deletion seen by the watch, or a periodic
        linearizable check finding no leader."""
        store = self.store
        while not self._stopping:
            store.leader_changed.clear()
            if not store.leader_address():
                return
            try:
                await asyncio.wait_for(store.leader_changed.wait(),
                                       self.ttl_s * FOLLOWER_RECHECK_FRACTION)
                continue
            except TimeoutError:
                pass
            resp = await store.client.range(store.keys.leader)
            if not resp.kvs:
                await store.sync()  # let the cache see the deletion before campaigning
                if not store.leader_address():
                    return
                raise MetadataError("etcd watch lags behind the leader key")


__all__ = ["DEADLINE_MARGIN", "KEEPALIVE_DIVISOR", "LeaderElection"]
