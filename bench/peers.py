"""The peers (Redis Streams, NATS JetStream) and the workload contract every system implements.

Each system is started here on a free loopback port with a throwaway data directory, driven
through its idiomatic Python client, and stopped by the caller (``stop()`` is idempotent and
also runs from ``atexit``). The workloads, identical for every system:

* ``append``: ``records`` records of ``record_bytes`` spread round-robin over ``streams``
  streams, end to end (a record counts once the server acknowledged it);
* ``catch_up``: read all of them back, counted as records handed to application code;
* ``latency``: records sent at a fixed rate while a consumer follows; latency is from the
  record's *scheduled* send time (so a stalled sender cannot hide its stalls) to its delivery.

Every peer runs at its best idiomatic client setup. Redis: redis-py with the hiredis parser
(``redis[hiredis]``, the setup redis-py recommends; :func:`redis_parser` refuses to run without
it), one key per stream, pipelined XADD (``PIPELINE_DEPTH`` commands per round trip), XRANGE
pages of ``READ_PAGE`` per key (pipelined across keys), XREAD BLOCK for latency. NATS: one
JetStream file stream holding one subject per logical stream (subjects are how JetStream
addresses data inside a stream); nats-py's fastest publish, ``publish_async`` (pipelined: up to
``NATS_MAX_PENDING`` acks in flight; nats-py has no batch publish, and JetStream's batch
publishing needs nats-server 2.12+), a pull consumer fetching ``NATS_FETCH_BATCH`` messages per
request (ack policy none) for catch-up and an ordered push consumer for latency.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from bench.common import percentile
from sbpstream.net.ports import free_port

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
PIPELINE_DEPTH = 1000  # XADDs per redis-py pipeline round trip
READ_PAGE = 1000  # records per XRANGE page / JetStream fetch
NATS_MAX_PENDING = 16_000  # JetStream acks in flight (nats-py's default bound is 4,000)
NATS_FETCH_BATCH = 10_000  # messages per pull-consumer fetch request
LATENCY_STAMP = struct.Struct(">Q")  # record index, at the front of each latency record

# Set by the runner on Ctrl-C / SIGTERM: worker-thread loops (the Redis workloads) stop at once
# instead of running to their time cap while the servers are being stopped.
STOP = threading.Event()

# ------------------------------------------------------------------------ workload contract


@dataclass(frozen=True, slots=True)
class AppendSpec:
    record_bytes: int
    streams: int
    records: int  # total over all streams
    time_cap_s: float

    @property
    def label(self) -> str:
        size = "1 KiB" if self.record_bytes == 1024 else f"{self.record_bytes} B"
        return f"{size} x {self.streams} stream{'s' if self.streams > 1 else ''}"


@dataclass(frozen=True, slots=True)
class LatencySpec:
    rate_per_s: int
    records: int
    record_bytes: int
    time_cap_s: float


@dataclass(slots=True)
class Throughput:
    records: int
    bytes: int
    seconds: float
    capped: bool = False  # the time cap stopped it before all records were done

    @property
    def records_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "records_s": self.records_s, "mb_s": self.mb_s}


@dataclass(slots=True)
class Latency:
    sent: int
    received: int
    latencies_ms: list[float] = field(default_factory=list)
    capped: bool = False

    def pct(self, p: float) -> float:
        return percentile(sorted(self.latencies_ms), p)

    def to_json(self) -> dict[str, Any]:
        s = sorted(self.latencies_ms)
        return {
            "sent": self.sent,
            "received": self.received,
            "capped": self.capped,
            "p50_ms": percentile(s, 50),
            "p99_ms": percentile(s, 99),
            "p999_ms": percentile(s, 99.9),
            "max_ms": s[-1] if s else float("nan"),
        }


class System(Protocol):
    """What run_all drives. ``append`` returns a handle that ``catch_up`` and ``drop`` take."""

    name: str
    acks: str  # what an acknowledgement means, for the report

    async def append(self, spec: AppendSpec, payload: bytes) -> tuple[Throughput, object]: ...

    async def catch_up(self, handle: object, spec: AppendSpec) -> Throughput: ...

    async def drop(self, handle: object) -> None: ...

    async def latency(self, spec: LatencySpec) -> Latency: ...


def payload_of(record_bytes: int) -> bytes:
    """Incompressible record values (no system here compresses by default)."""
    return os.urandom(record_bytes)


class Schedule:
    """Fixed-rate send schedule in 1 ms ticks (uvloop's timers have 1 ms resolution).

    Record i is due at ``due(i)``: the tick it belongs to (at 2,000/s, two records per tick).
    Latency is measured from the due time, so a sender that falls behind shows up in the
    figures instead of silently stretching the schedule (no coordinated omission).
    """

    TICK_S = 0.001

    def __init__(self, rate_per_s: int) -> None:
        self.per_tick = rate_per_s * self.TICK_S
        self.t0 = time.perf_counter() + 0.05

    def due(self, i: int) -> float:
        return self.t0 + int(i / self.per_tick) * self.TICK_S

    def ticks(self, records: int, stop_at: float) -> Iterator[range]:
        """Yield, at each tick, the indices due at it (blocking sleep: for sender threads)."""
        i = 0
        while i < records:
            delay = self.due(i) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if time.perf_counter() > stop_at or STOP.is_set():
                return
            j = i + 1
            now = time.perf_counter()
            while j < records and self.due(j) <= now:
                j += 1
            yield range(i, j)
            i = j

    async def aindices(self, records: int, stop_at: float) -> AsyncIterator[int]:
        """Yield record indices at their due times (asyncio sleep)."""
        for i in range(records):
            delay = self.due(i) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() > stop_at:
                return
            yield i


def stamped(i: int, record_bytes: int, pad: bytes) -> bytes:
    return LATENCY_STAMP.pack(i) + pad[: max(0, record_bytes - LATENCY_STAMP.size)]


def index_of(value: bytes) -> int:
    i: int = LATENCY_STAMP.unpack_from(value)[0]
    return i


# --------------------------------------------------------------------------- processes


class ServerProcess:
    """A child server process with a data dir; ready once its port accepts connections."""

    def __init__(self, name: str, argv: list[str], directory: Path, port: int) -> None:
        self.name = name
        self.argv = argv
        self.directory = directory
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / f"{name}.log"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # own session: a terminal Ctrl-C reaches the runner, which stops us in order
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
            with contextlib.suppress(OSError):
                import socket

                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} not ready on port {self.port}: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def version_of(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# -------------------------------------------------------------------------------- Redis


def redis_parser(require_hiredis: bool = True) -> str:
    """The parser redis-py will use ("hiredis" or "python"); raises when hiredis is required and
    missing (the benchmark compares against redis-py at its best: ``pip install redis[hiredis]``).
    """
    from redis.connection import DefaultParser

    name = "hiredis" if "Hiredis" in DefaultParser.__name__ else "python"
    if require_hiredis and name != "hiredis":
        raise RuntimeError("redis-py runs without hiredis here (pip install 'redis[hiredis]'): "
                           "the Redis figures would understate redis-py")
    return name


class RedisSystem:
    name = "Redis Streams"
    acks = (
        "AOF appendfsync everysec: the reply is sent after write(2) to the AOF, before fsync; "
        "fsync runs once a second in a background thread, so up to ~1 s of acknowledged writes "
        "can be lost on a crash"
    )

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.server = ServerProcess(
            "redis",
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--dir", str(directory),
            ],
            directory,
            self.port,
        )
        self.version = version_of(["redis-server", "--version"]).split(" sha=")[0]
        self.parser = redis_parser()
        self._seq = 0

    def start(self) -> None:
        self.server.start()
        with self._client() as r:  # the parser a live connection really uses
            conn = r.connection_pool.get_connection()
            try:
                used = type(conn._parser).__name__
            finally:
                r.connection_pool.release(conn)
        if "Hiredis" not in used:
            raise RuntimeError(f"redis-py connection parser is {used}, not hiredis")
        print(f"redis-py {self._redis_py_version()} with parser {used}", flush=True)

    @staticmethod
    def _redis_py_version() -> str:
        import redis

        return str(redis.__version__)

    def stop(self) -> None:
        self.server.stop()

    def _client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def _keys(self, streams: int) -> list[str]:
        self._seq += 1
        return [f"b{self._seq}:{i}" for i in range(streams)]

    # redis-py's synchronous client is the common idiom and, measured here, twice as fast as
    # redis.asyncio for pipelines (and ~4x for single commands), so it is the stronger baseline;
    # each workload runs in a worker thread so the runner's event loop stays free.

    async def append(self, spec: AppendSpec, payload: bytes) -> tuple[Throughput, object]:
        return await asyncio.to_thread(self._append, spec, payload)

    def _append(self, spec: AppendSpec, payload: bytes) -> tuple[Throughput, object]:
        keys = self._keys(spec.streams)
        with self._client() as r:
            done = 0
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s
            while done < spec.records and time.perf_counter() < deadline and not STOP.is_set():
                n = min(PIPELINE_DEPTH, spec.records - done)
                pipe = r.pipeline(transaction=False)
                for i in range(done, done + n):
                    pipe.xadd(keys[i % spec.streams], {"v": payload})
                pipe.execute()
                done += n
            seconds = time.perf_counter() - t0
        tp = Throughput(done, done * len(payload), seconds, done < spec.records)
        return tp, (keys, done)

    async def catch_up(self, handle: object, spec: AppendSpec) -> Throughput:
        return await asyncio.to_thread(self._catch_up, handle, spec)

    def _catch_up(self, handle: object, spec: AppendSpec) -> Throughput:
        keys, expected = cast(tuple[list[str], int], handle)
        with self._client() as r:
            got = nbytes = 0
            cursors: dict[str, str] = {k: "-" for k in keys}
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s
            while cursors and time.perf_counter() < deadline and not STOP.is_set():
                active = list(cursors)[:PIPELINE_DEPTH]
                pipe = r.pipeline(transaction=False)
                for k in active:
                    pipe.xrange(k, min=cursors[k], max="+", count=READ_PAGE)
                pages = pipe.execute()
                for k, page in zip(active, pages, strict=True):
                    for _id, fields in page:  # application code sees each record
                        nbytes += len(fields[b"v"])
                    got += len(page)
                    if len(page) < READ_PAGE:
                        del cursors[k]
                    else:
                        cursors[k] = "(" + page[-1][0].decode()
            seconds = time.perf_counter() - t0
        return Throughput(got, nbytes, seconds, got < expected)

    async def drop(self, handle: object) -> None:
        keys, _ = cast(tuple[list[str], int], handle)

        def run() -> None:
            with self._client() as r:
                for i in range(0, len(keys), PIPELINE_DEPTH):
                    r.delete(*keys[i : i + PIPELINE_DEPTH])

        await asyncio.to_thread(run)

    async def latency(self, spec: LatencySpec) -> Latency:
        return await asyncio.to_thread(self._latency, spec)

    def _latency(self, spec: LatencySpec) -> Latency:
        """Producer here, consumer (XREAD BLOCK) in a second thread.

        The producer sends the records due at each tick in one pipeline (usually the tick's two
        records, more after a stall): a blocking XADD per record costs ~0.2 ms of client CPU,
        which on a loaded 2-core box can fall behind 2,000/s and measure the client, not Redis.
        """
        (key,) = self._keys(1)
        pad = payload_of(spec.record_bytes)
        schedule = Schedule(spec.rate_per_s)
        out = Latency(0, 0)
        stop_at = time.perf_counter() + spec.time_cap_s
        sent_all = threading.Event()

        def consume() -> None:
            last = "0-0"
            with self._client() as consumer:
                while not (sent_all.is_set() and out.received >= out.sent):
                    if time.perf_counter() > stop_at or STOP.is_set():
                        out.capped = True
                        return
                    resp = consumer.xread({key: last}, count=READ_PAGE, block=200)
                    now = time.perf_counter()
                    for _key, entries in resp or ():
                        for eid, fields in entries:
                            i = index_of(fields[b"v"])
                            out.latencies_ms.append((now - schedule.due(i)) * 1000)
                            last = eid
                        out.received += len(entries)

        reader = threading.Thread(target=consume, name="redis-latency-consumer")
        reader.start()
        try:
            with self._client() as producer:
                for due_now in schedule.ticks(spec.records, stop_at):
                    pipe = producer.pipeline(transaction=False)
                    for i in due_now:
                        pipe.xadd(key, {"v": stamped(i, spec.record_bytes, pad)})
                    pipe.execute()
                    out.sent += len(due_now)
                sent_all.set()
                reader.join(max(1.0, stop_at - time.perf_counter() + 1.0))
                producer.delete(key)
        finally:
            sent_all.set()
            reader.join(5)
        return out


# ------------------------------------------------------------------------- NATS JetStream


class NatsSystem:
    name = "NATS JetStream"
    acks = (
        "file store: the publish ack is sent after the message is written to the OS (page "
        "cache); fsync happens every sync_interval (default 2 min) unless the server runs with "
        "sync: always (not set here)"
    )

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.server = ServerProcess(
            "nats",
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(directory)],
            directory,
            self.port,
        )
        self.version = version_of(["nats-server", "--version"])
        self._seq = 0

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    async def _connect(self) -> Any:
        import nats

        return await nats.connect(
            f"nats://127.0.0.1:{self.port}", max_reconnect_attempts=0, pending_size=64 * 1024**2
        )

    async def _new_stream(self, js: Any) -> tuple[str, str]:
        from nats.js.api import StorageType

        self._seq += 1
        name, prefix = f"BENCH{self._seq}", f"b{self._seq}"
        await js.add_stream(
            name=name, subjects=[f"{prefix}.>"], storage=StorageType.FILE,
            max_msg_size=2 * 1024 * 1024,
        )
        return name, prefix

    async def append(self, spec: AppendSpec, payload: bytes) -> tuple[Throughput, object]:
        nc = await self._connect()
        try:
            js = nc.jetstream(publish_async_max_pending=NATS_MAX_PENDING)
            name, prefix = await self._new_stream(js)
            subjects = [f"{prefix}.{i}" for i in range(spec.streams)]
            futures: list[asyncio.Future[Any]] = []
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s
            for i in range(spec.records):
                if i % 1000 == 0 and time.perf_counter() > deadline:
                    break
                futures.append(await js.publish_async(subjects[i % spec.streams], payload))
            acks = await asyncio.gather(*futures)
            seconds = time.perf_counter() - t0
            done = len(acks)
        finally:
            await nc.close()
        tp = Throughput(done, done * len(payload), seconds, done < spec.records)
        return tp, (name, prefix, done)

    async def catch_up(self, handle: object, spec: AppendSpec) -> Throughput:
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        name, prefix, expected = cast(tuple[str, str, int], handle)
        nc = await self._connect()
        try:
            js = nc.jetstream()
            sub = await js.pull_subscribe(
                f"{prefix}.>", stream=name,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
            )
            got = nbytes = 0
            t0 = time.perf_counter()
            deadline = t0 + spec.time_cap_s
            while got < expected and time.perf_counter() < deadline:
                try:
                    msgs = await sub.fetch(batch=NATS_FETCH_BATCH, timeout=2)
                except NatsTimeout:
                    continue
                for m in msgs:  # application code sees each record
                    nbytes += len(m.data)
                got += len(msgs)
            seconds = time.perf_counter() - t0
            await sub.unsubscribe()
        finally:
            await nc.close()
        return Throughput(got, nbytes, seconds, got < expected)

    async def drop(self, handle: object) -> None:
        name, _, _ = cast(tuple[str, str, int], handle)
        nc = await self._connect()
        try:
            await nc.jetstream().delete_stream(name)
        finally:
            await nc.close()

    async def latency(self, spec: LatencySpec) -> Latency:
        nc = await self._connect()
        out = Latency(0, 0)
        pad = payload_of(spec.record_bytes)
        schedule = Schedule(spec.rate_per_s)
        try:
            js = nc.jetstream(publish_async_max_pending=NATS_MAX_PENDING)
            name, prefix = await self._new_stream(js)
            all_received = asyncio.Event()
            sending = True

            async def on_msg(msg: Any) -> None:
                now = time.perf_counter()
                out.latencies_ms.append((now - schedule.due(index_of(msg.data))) * 1000)
                out.received += 1
                if not sending and out.received >= out.sent:
                    all_received.set()

            sub = await js.subscribe(f"{prefix}.0", cb=on_msg, ordered_consumer=True)
            stop_at = time.perf_counter() + spec.time_cap_s
            futures: list[asyncio.Future[Any]] = []
            async for i in schedule.aindices(spec.records, stop_at):
                out.sent += 1
                futures.append(
                    await js.publish_async(f"{prefix}.0", stamped(i, spec.record_bytes, pad))
                )
            sending = False
            await asyncio.gather(*futures)
            if out.received >= out.sent:
                all_received.set()
            remaining = max(0.5, stop_at - time.perf_counter())
            try:
                await asyncio.wait_for(all_received.wait(), remaining)
            except TimeoutError:
                out.capped = True
            await sub.unsubscribe()
            await js.delete_stream(name)
        finally:
            await nc.close()
        return out


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
