"""The few etcd v3 calls sbpstream needs, over aetcd's generated gRPC bindings (grpc.aio)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from aetcd import rpc

from sbpstream.pm.etcd.url import EtcdSettings
from sbpstream.protocol.errors import MetadataError, SbpError

GRPC_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""gRPC receive limit. A watch response carries whole transactions (up to etcd's 1.5 MiB request
limit each) and may batch several when catching up; gRPC's 4 MiB default is too tight."""


GRPC_KEEPALIVE_TIME_MS: Final = 5_000
"""gRPC pings on an idle channel this often: a member that went silent (a cut link drops
packets without a word) breaks the channel's streams (the watch) instead of leaving them open
for good. etcd refuses pings more frequent than its --grpc-keepalive-min-time (5 s by
default) with GOAWAY too_many_pings, so this is the floor."""

GRPC_KEEPALIVE_TIMEOUT_MS: Final = 2_000
"""A ping unanswered this long ends the channel (a healthy member answers in milliseconds)."""

ROTATE_GRACE_S: Final = 6.0
"""After a rotation the old channel's calls may finish for this long (longer than a request's
5 s timeout), then it closes (its long-lived streams, the watch, end and restart elsewhere)."""

ROTATE_CODES: Final = frozenset({rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED})
"""A call failing with these moves the client to the next endpoint: the member is down, or
cut off and silent (a request timeout); another member of the majority may well answer."""


def rpc_error(e: Exception, what: str) -> SbpError:
    code = e.code() if isinstance(e, rpc.AioRpcError) else None
    details = e.details() if isinstance(e, rpc.AioRpcError) else str(e)
    return MetadataError(f"etcd {what} failed: {getattr(code, 'name', code)}: {details}")


class EtcdClient:
    """The few etcd v3 calls sbpstream needs, over aetcd's generated gRPC bindings (grpc.aio).

    With several endpoints, a call that finds its endpoint unavailable or silent (ROTATE_CODES)
    moves the client to the next one (the failed call still reports MetadataError: a write's
    outcome is unknown); gRPC keepalive pings break the streams of a member gone silent."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._index = 0
        self._channel: Any = None
        self._closing: set[asyncio.Task[None]] = set()  # old channels closing after rotation
        self.kv: Any = None
        self.lease: Any = None
        self.watch_stub: Any = None

    @property
    def endpoint(self) -> str:
        h, p = self.settings.endpoints[self._index % len(self.settings.endpoints)]
        return f"{h}:{p}"

    def _open(self) -> None:
        opts = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", GRPC_KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", GRPC_KEEPALIVE_TIMEOUT_MS),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]
        self._channel = rpc.insecure_channel(self.endpoint, options=opts)
        self.kv = rpc.KVStub(self._channel)
        self.lease = rpc.LeaseStub(self._channel)
        self.watch_stub = rpc.WatchStub(self._channel)

    async def connect(self) -> None:
        """Open a channel to the first endpoint that answers."""
        errors: list[str] = []
        for _ in self.settings.endpoints:
            if self._channel is None:
                self._open()
            try:
                await self.kv.Range(rpc.RangeRequest(key=b"\0", count_only=True),
                                    timeout=self.settings.request_timeout_s)
                return
            except rpc.AioRpcError as e:
                errors.append(f"{self.endpoint}: {e.code().name}")
                await self.rotate()
        raise MetadataError(f"no etcd endpoint answered ({'; '.join(errors)})")

    async def rotate(self) -> None:
        """Move to the next endpoint. The old channel closes after ROTATE_GRACE_S: closing it at
        once would cancel the other tasks' calls on it (the election's, the watch's), and grpc.aio
        cancels an awaiting call with CancelledError, which ends the task that awaits it."""
        ch, self._channel = self._channel, None
        if ch is not None:
            task = asyncio.ensure_future(ch.close(ROTATE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self._index += 1
        self._open()

    async def close(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            await ch.close()
        for task in list(self._closing):  # rotated-away channels: wait out their grace
            with contextlib.suppress(Exception):
                await task

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._channel is None:
            raise MetadataError("etcd client is closed")
        try:
            return await fn()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this task is being cancelled
            # the call was cancelled under us (its channel closed): an error of this call
            raise MetadataError(f"etcd {what} cancelled: its channel was closed") from None
        except rpc.AioRpcError as e:
            if e.code() in ROTATE_CODES and len(self.settings.endpoints) > 1:
                await self.rotate()
            raise rpc_error(e, what) from e

    async def txn(self, req: Any) -> Any:
        t = self.settings.request_timeout_s
        return await self._call("txn", lambda: self.kv.Txn(req, timeout=t))

    async def range(self, key: bytes, range_end: bytes = b"", *, limit: int = 0,
                    revision: int = 0) -> Any:
        req = rpc.RangeRequest(key=key, range_end=range_end, limit=limit, revision=revision)
        t = self.settings.request_timeout_s
        return await self._call("range", lambda: self.kv.Range(req, timeout=t))

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        t = self.settings.request_timeout_s
        r = await self._call(
            "lease grant", lambda: self.lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s),
                                                          timeout=t))
        if r.error:
            raise MetadataError(f"etcd lease grant failed: {r.error}")
        return int(r.ID), int(r.TTL)

    async def revoke(self, lease_id: int) -> None:
        t = self.settings.request_timeout_s
        await self._call("lease revoke", lambda: self.lease.LeaseRevoke(
            rpc.LeaseRevokeRequest(ID=lease_id), timeout=t))

    async def keepalive(self, lease_id: int, timeout_s: float) -> int:
        """One keepalive round trip: the lease's new TTL in seconds (<= 0: the lease is gone)."""

        async def one() -> int:
            call = self.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                             timeout=timeout_s)
            try:
                async for reply in call:
                    return int(reply.TTL)
            finally:
                call.cancel()
            return 0

        result: int = await self._call("lease keepalive", one)
        return result

    def watch(self, requests: AsyncIterator[Any]) -> Any:
        if self._channel is None:
            raise MetadataError("etcd client is closed")
        return self.watch_stub.Watch(requests)



def cmp_create(key: bytes, create_revision: int) -> Any:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key,
                       create_revision=create_revision)


def cmp_mod(key: bytes, mod_revision: int) -> Any:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key,
                       mod_revision=mod_revision)


def put_op(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
