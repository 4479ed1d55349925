"""A Jepsen-style workload for fault tests: producer and consumer processes that log every
outcome, and a checker over their logs plus a final read of every stream.

Usable as a module (tests, ``bench/``) and as a script, one process per role, so each can run
inside its own network namespace host::

    python tests/workload.py produce --pm HOST:PORT --streams 2 --create --records 3000 \\
        --rate 500 --deadline-ms 30000 --log producer.jsonl
    python tests/workload.py consume --pm HOST:PORT --streams 2 --log consumer.jsonl
    python tests/workload.py check --pm HOST:PORT --producer-log producer.jsonl \\
        --consumer-log consumer.jsonl --events faults.json --deadline-ms 30000

Streams are named (``--stream-names a,b`` or ``--streams N`` for ``wl-0`` .. ``wl-N-1``), so
separate processes agree on them. SIGTERM (or SIGINT) stops a producer or consumer cleanly: the
producer waits for its in-flight sends (bounded by ``--drain-s``) and logs each outcome.

Record values are JSON: ``{"id": "<producer>-<seq>", "stream": NAME, "sent_at": MONO,
"sent_wall": WALL}`` (plus ``"pad"`` with ``--value-bytes``).

Logs are JSON lines, append-only. The producer writes one line per send outcome, flushed per line:
``{"id", "stream", "sent_at", "acked_at", "offset", "wall"}`` or ``{"id", "stream", "sent_at",
"failed_at", "error", "wall"}``, after a first line ``{"producer", "deadline_ms", "started_at",
"wall"}``. The consumer writes ``{"id", "stream", "offset", "read_at", "wall"}`` per record and
``{"stream", "error", "at", "wall"}`` per error it retried (buffered, flushed every
CONSUMER_FLUSH_S).

Clocks: every ``*_at`` field is ``time.monotonic()`` seconds. The checker compares only those:
durations within one process (``acked_at - sent_at``) and, across processes, ack and read times
against the nemesis's fault windows. That is sound on one machine: Linux's CLOCK_MONOTONIC is
system-wide, the same in every process and every network namespace (nemesis events must use it
too). ``wall`` (``time.time()`` when the line was written) is for people and for lining the logs
up with other machines' logs; the checker never reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from sbpstream.client.aclient import AsyncClient
from sbpstream.client.consumer import AsyncConsumer
from sbpstream.client.producer import AsyncProducer
from sbpstream.protocol.errors import SbpError, StreamNotFoundError

DEFAULT_RECOVERY_S: Final = 5.0
"""How long after a heal a cluster may take before writes succeed again (notice the heal, elect
a PM leader, seal, place the successor range): a send that failed with more deadline than this
left at its fault's heal had time to succeed, and counts as failed_after_heal."""

DEADLINE_GRACE_S: Final = 1.0
"""Slack over a send's deadline before it counts as waited past it: the event loop, the batch's
linger and the log write run between the SDK's clock and ours (both monotonic)."""

DEFAULT_DEADLINE_MS: Final = 30_000
"""The SDK's ``retry_deadline_ms`` per send when ``--deadline-ms`` is not given (its default)."""

DEFAULT_REQUEST_TIMEOUT_MS: Final = 5_000
"""One attempt's bound (``request_timeout_ms``): below the deadline, so a dead peer costs one
attempt and leaves time for retries."""

DEFAULT_MAX_IN_FLIGHT: Final = 1_000
"""Sends awaiting their outcome at once: bounds memory and the burst after a fault heals."""

DRAIN_MARGIN_S: Final = 5.0
"""At stop the producer waits for in-flight sends their deadline plus this (the default
``--drain-s``); whatever is still unresolved then is logged failed as abandoned."""

CONSUMER_FLUSH_S: Final = 0.2
"""How often the consumer flushes its log: often enough for a test polling it."""

CONSUMER_BACKOFF_INITIAL_S: Final = 0.1
"""The consumer's first pause after a read error (then doubling)."""

CONSUMER_BACKOFF_MAX_S: Final = 2.0
"""The consumer's longest pause between retries: it must come back soon after a fault heals."""

STREAM_WAIT_S: Final = 120.0
"""How long the consumer waits for its streams to exist (the producer may create them)."""

FINAL_READ_TIMEOUT_S: Final = 300.0
"""A hang guard on the checker's final read of one stream (far above its expected time)."""

MAX_EXAMPLES: Final = 5
"""Examples kept per kind of problem: enough to start debugging, short enough to read."""

DEFAULT_STREAM_PREFIX: Final = "wl-"
"""``--streams N`` names the streams ``wl-0`` .. ``wl-{N-1}``."""


# ----------------------------------------------------------------------------- values and logs


def encode_value(rid: str, stream: str, sent_at: float, pad: int = 0) -> bytes:
    """A record's value: its unique id, stream and send time (monotonic and wall), as JSON."""
    doc: dict[str, Any] = {"id": rid, "stream": stream, "sent_at": sent_at,
                           "sent_wall": time.time()}
    if pad > 0:
        doc["pad"] = "x" * pad
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_value(value: bytes | None) -> tuple[str, str] | None:
    """(id, stream) a value names, or None when it is not a workload value (corrupt)."""
    if value is None:
        return None
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    rid, stream = doc.get("id"), doc.get("stream")
    if not isinstance(rid, str) or not isinstance(stream, str):
        return None
    return rid, stream


def producer_of(rid: str) -> str:
    """The producer part of a record id ``<producer>-<seq>``."""
    return rid.rpartition("-")[0]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log, skipping a line cut short (a process killed mid-write)."""
    out: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    out.append(doc)
    return out


def stream_names(streams: int, names: str) -> list[str]:
    """The streams of ``--stream-names a,b`` or else ``--streams N``."""
    if names:
        return [n for n in names.split(",") if n]
    return [f"{DEFAULT_STREAM_PREFIX}{i}" for i in range(streams)]


# ------------------------------------------------------------------------------------ checker


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault window of the nemesis: started at ``start``, healed at ``heal`` (None: never
    healed), both monotonic seconds."""

    start: float
    heal: float | None
    what: str = ""

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> Fault:
        """From ``{"start", "heal", "what"}`` (``started_at``/``healed_at`` and ``name``/``kind``
        accepted too)."""
        start = doc.get("start", doc.get("started_at"))
        heal = doc.get("heal", doc.get("healed_at"))
        what = doc.get("what", doc.get("name", doc.get("kind", "")))
        if not isinstance(start, int | float):
            raise ValueError(f"fault event {dict(doc)!r} has no numeric 'start': give the "
                             "monotonic time the fault began")
        return Fault(float(start), None if heal is None else float(heal), str(what))


@dataclass
class CheckResult:
    """What the checker found. Counts are of records unless said otherwise; times in seconds."""

    sent: int = 0  # sends with an outcome in the producer logs
    acked: int = 0
    failed: int = 0
    final_records: int = 0  # records the final read found in all streams
    lost: int = 0  # acknowledged, not in the final read
    duplicated: int = 0  # extra copies of acknowledged records in the final read
    misplaced: int = 0  # acknowledged, found once, at another stream/offset than acknowledged
    unacked_present: int = 0  # failed or unlogged sends found once (allowed)
    unacked_duplicated: int = 0  # extra copies of never-acknowledged records
    unlogged_present: int = 0  # found, from a known producer, without an outcome line (allowed)
    corrupt: int = 0  # read (finally or by the consumer) but never sent, or in the wrong stream
    consumer_read: int = 0
    consumer_errors: int = 0  # errors the consumer logged and retried
    consumer_out_of_order: int = 0  # a consumer read at an offset not above its previous one
    consumer_skipped: int = 0  # offsets the final read holds that the consumer passed over
    consumer_mismatch: int = 0  # the consumer read another record than the final read's there
    failed_after_heal: int = 0  # failed with deadline left past its fault's heal + recovery
    waited_past_deadline: int = 0  # outcome later than sent_at + deadline + grace
    max_call_s: float = 0.0  # the longest send (sent_at to its outcome)
    deadline_s: float = 0.0
    grace_s: float = 0.0
    write_gap_s: float = 0.0  # longest time between consecutive acks
    read_gap_s: float = 0.0  # longest time between consecutive consumer reads
    faults: list[dict[str, Any]] = field(default_factory=list)  # per window: its gaps
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, text: str) -> None:
        """Keep ``text`` as an example of ``kind`` (at most MAX_EXAMPLES each)."""
        got = self.examples.setdefault(kind, [])
        if len(got) < MAX_EXAMPLES:
            got.append(text)

    def problems(self) -> list[str]:
        """One line per kind of violation (empty: the run is clean)."""
        out: list[str] = []
        what = [
            ("lost", "acknowledged record(s) missing from the final read"),
            ("duplicated", "extra copies of acknowledged records"),
            ("misplaced", "acknowledged record(s) found at another offset than acknowledged"),
            ("unacked_duplicated", "extra copies of never-acknowledged records"),
            ("corrupt", "record(s) read that were never sent, or in another stream"),
            ("consumer_out_of_order", "consumer read(s) not in offset order"),
            ("consumer_skipped", "offset(s) the consumer skipped"),
            ("consumer_mismatch", "consumer read(s) of another record than the final one"),
            ("failed_after_heal", "send(s) failed that had deadline left after their fault's "
                                  "heal and the recovery allowance (or failed with no fault)"),
            ("waited_past_deadline", f"send(s) took longer than the deadline "
                                     f"({self.deadline_s}s) + {self.grace_s}s"),
        ]
        for name, text in what:
            n = getattr(self, name)
            if n:
                ex = self.examples.get(name, [])
                out.append(f"{name}: {n} {text}" + (f": e.g. {'; '.join(ex)}" if ex else ""))
        return out

    def to_json(self) -> dict[str, Any]:
        """The fields plus ``problems``."""
        return {**asdict(self), "problems": self.problems()}


@dataclass(slots=True)
class _Send:
    stream: str
    sent_at: float
    done_at: float
    offset: int | None  # None: failed
    error: str = ""


def longest_gap(times: Sequence[float], lo: float | None = None,
                hi: float | None = None) -> float:
    """The longest interval without an event: between consecutive ``times`` (sorted), or, with
    ``lo`` and ``hi``, inside [lo, hi] counting its ends as edges (no event in it: hi - lo)."""
    if lo is not None and hi is not None:
        if hi <= lo:
            return 0.0
        points = [lo, *(t for t in times if lo < t < hi), hi]
    else:
        points = list(times)
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def _sends(producer_lines: Iterable[Mapping[str, Any]]) -> tuple[dict[str, _Send], set[str]]:
    """Each id's outcome (the last line of an id wins) and the producers named."""
    sends: dict[str, _Send] = {}
    producers: set[str] = set()
    for ln in producer_lines:
        if "producer" in ln and "id" not in ln:
            producers.add(str(ln["producer"]))
            continue
        rid = ln.get("id")
        if not isinstance(rid, str):
            continue
        producers.add(producer_of(rid))
        sent = float(ln["sent_at"])
        if "acked_at" in ln:
            sends[rid] = _Send(str(ln["stream"]), sent, float(ln["acked_at"]), int(ln["offset"]))
        elif "failed_at" in ln:
            sends[rid] = _Send(str(ln["stream"]), sent, float(ln["failed_at"]), None,
                               str(ln.get("error", "")))
    return sends, producers


def _check_final(res: CheckResult, sends: Mapping[str, _Send], producers: set[str],
                 final: Mapping[str, Sequence[tuple[int, bytes | None]]]
                 ) -> dict[tuple[str, int], str | None]:
    """Account for every acknowledged record in the final read; return (stream, offset) -> id."""
    where: dict[str, list[tuple[str, int]]] = defaultdict(list)
    at: dict[tuple[str, int], str | None] = {}
    for stream, records in final.items():
        for off, value in records:
            res.final_records += 1
            got = decode_value(value)
            at[(stream, off)] = got[0] if got else None
            if got is None or got[1] != stream or (got[0] not in sends
                                                   and producer_of(got[0]) not in producers):
                res.corrupt += 1
                res.note("corrupt", f"{stream}@{off}: {value[:80]!r}" if value is not None
                         else f"{stream}@{off}: no value")
                continue
            where[got[0]].append((stream, off))
    for rid, s in sends.items():
        found = where.get(rid, [])
        if s.offset is None:
            continue
        if not found:
            res.lost += 1
            res.note("lost", f"{rid} acked at {s.stream}@{s.offset}")
            continue
        if len(found) > 1:
            res.duplicated += len(found) - 1
            res.note("duplicated", f"{rid} acked at {s.stream}@{s.offset}, found at "
                     f"{', '.join(f'{a}@{b}' for a, b in found)}")
        if (s.stream, s.offset) not in found:
            res.misplaced += 1
            res.note("misplaced", f"{rid} acked at {s.stream}@{s.offset}, found at "
                     f"{', '.join(f'{a}@{b}' for a, b in found)}")
    for rid, found in where.items():
        s_or_none = sends.get(rid)
        if s_or_none is not None and s_or_none.offset is not None:
            continue
        if s_or_none is None:
            res.unlogged_present += 1
        else:
            res.unacked_present += 1
        if len(found) > 1:
            res.unacked_duplicated += len(found) - 1
            res.note("unacked_duplicated", f"{rid} (never acknowledged) found at "
                     f"{', '.join(f'{a}@{b}' for a, b in found)}")
    return at


def _check_consumer(res: CheckResult, consumer_lines: Iterable[Mapping[str, Any]],
                    sends: Mapping[str, _Send], producers: set[str],
                    at: Mapping[tuple[str, int], str | None]) -> list[float]:
    """Order, gaps and content of the consumer's reads; return the read times."""
    reads: dict[str, list[tuple[int, str]]] = defaultdict(list)
    times: list[float] = []
    for ln in consumer_lines:
        if "error" in ln and "read_at" not in ln:
            res.consumer_errors += 1
            continue
        if "read_at" not in ln:
            continue
        res.consumer_read += 1
        stream, off, rid = str(ln["stream"]), int(ln["offset"]), str(ln.get("id") or "")
        times.append(float(ln["read_at"]))
        reads[stream].append((off, rid))
        if not rid or (rid not in sends and producer_of(rid) not in producers) or (
                rid in sends and sends[rid].stream != stream):
            res.corrupt += 1
            res.note("corrupt", f"consumer read {rid or 'a non-workload value'} at "
                     f"{stream}@{off}")
        elif (stream, off) in at and at[(stream, off)] != rid:
            res.consumer_mismatch += 1
            res.note("consumer_mismatch", f"{stream}@{off}: consumer read {rid}, final read "
                     f"{at[(stream, off)]}")
    final_offsets: dict[str, list[int]] = defaultdict(list)
    for stream, off in at:
        final_offsets[stream].append(off)
    for stream, seq in reads.items():
        prev = -1
        for off, _ in seq:
            if off <= prev:
                res.consumer_out_of_order += 1
                res.note("consumer_out_of_order", f"{stream}: read {off} after {prev}")
            prev = max(prev, off)
        seen = {off for off, _ in seq}
        top = max(seen)
        for off in sorted(final_offsets.get(stream, [])):
            if off < top and off not in seen:
                res.consumer_skipped += 1
                res.note("consumer_skipped", f"{stream}@{off}")
    times.sort()
    return times


def _check_calls(res: CheckResult, sends: Mapping[str, _Send], faults: Sequence[Fault],
                 recovery_s: float) -> None:
    """Each send's duration against its deadline; each failure against the fault windows.

    A failure is excused only by a fault that could have caused it: one active while the send
    was out, or healed less than ``recovery_s`` before it was sent; and only if the send's
    deadline ran out before that fault's heal plus ``recovery_s``. A send that still had more
    deadline than that when its fault healed must have succeeded (issue 33)."""
    bound = res.deadline_s + res.grace_s
    for rid, s in sends.items():
        took = s.done_at - s.sent_at
        res.max_call_s = max(res.max_call_s, took)
        if took > bound:
            res.waited_past_deadline += 1
            res.note("waited_past_deadline", f"{rid} took {took:.2f}s "
                     f"({'failed: ' + s.error if s.offset is None else 'acked'})")
        if s.offset is not None:
            continue
        causes = [f for f in faults if f.start <= s.done_at
                  and (f.heal is None or f.heal + recovery_s >= s.sent_at)]
        if any(f.heal is None for f in causes):
            continue  # never healed: any failure is the fault's
        heal = max((f.heal for f in causes if f.heal is not None), default=None)
        left = None if heal is None else s.sent_at + res.deadline_s - heal
        if left is not None and left <= recovery_s:
            continue
        res.failed_after_heal += 1
        why = "no fault" if left is None else f"{left:.1f}s of deadline left at the heal"
        res.note("failed_after_heal", f"{rid} failed at {s.done_at:.2f} ({why}; "
                 f"{s.error or 'no error text'})")


def check(producer_lines: Iterable[Mapping[str, Any]],
          consumer_lines: Iterable[Mapping[str, Any]],
          final: Mapping[str, Sequence[tuple[int, bytes | None]]],
          faults: Sequence[Fault] = (), *, deadline_ms: int,
          grace_s: float = DEADLINE_GRACE_S,
          recovery_s: float = DEFAULT_RECOVERY_S) -> CheckResult:
    """Check a run (pure: no I/O).

    ``producer_lines`` and ``consumer_lines`` are the parsed lines of every producer's and
    consumer's log; ``final`` maps each stream name to its records read from offset 0 after the
    run, as (offset, value); ``faults`` are the nemesis's windows; ``deadline_ms`` the sends'
    ``retry_deadline_ms``.

    Rules: every acknowledged record is in ``final`` exactly once at its acknowledged stream and
    offset (else lost, duplicated, misplaced); a never-acknowledged one at most once; every
    record read names a send of a known producer in its own stream (else corrupt); the consumer's
    reads of each stream go up in offset and pass over no offset ``final`` holds, and agree with
    ``final`` where both have the offset; a failed send is excused only by a fault active while
    it was out (or healed under ``recovery_s`` before it was sent) and only if its deadline ran
    out before that heal plus ``recovery_s``; no send's outcome comes later than deadline + grace
    after it was sent. Availability: the longest time between consecutive acks and between
    consecutive consumer reads, overall and inside each fault window (for writes clipped to the
    sending period, for reads to the time anything was read or acknowledged).
    """
    producer_lines, consumer_lines = list(producer_lines), list(consumer_lines)
    res = CheckResult(deadline_s=deadline_ms / 1000, grace_s=grace_s)
    sends, producers = _sends(producer_lines)
    res.sent = len(sends)
    res.acked = sum(1 for s in sends.values() if s.offset is not None)
    res.failed = res.sent - res.acked
    at = _check_final(res, sends, producers, final)
    read_times = _check_consumer(res, consumer_lines, sends, producers, at)
    _check_calls(res, sends, faults, recovery_s)
    ack_times = sorted(s.done_at for s in sends.values() if s.offset is not None)
    res.write_gap_s = longest_gap(ack_times)
    res.read_gap_s = longest_gap(read_times)
    first_sent = min((s.sent_at for s in sends.values()), default=0.0)
    last_sent = max((s.sent_at for s in sends.values()), default=0.0)
    last_busy = max([*ack_times[-1:], *read_times[-1:]], default=0.0)
    for f in faults:
        heal = math.inf if f.heal is None else f.heal
        res.faults.append({
            "what": f.what, "start": f.start, "heal": f.heal,
            "write_gap_s": longest_gap(ack_times, max(f.start, first_sent), min(heal, last_sent)),
            "read_gap_s": longest_gap(read_times, max(f.start, read_times[0] if read_times
                                                      else first_sent), min(heal, last_busy)),
        })
    return res


# ------------------------------------------------------------------------------ SDK processes


@dataclass(frozen=True, slots=True)
class Conn:
    """How to reach the cluster: PM addresses and the optional security settings."""

    pm: str
    user: str = ""
    password: str = ""
    token_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def client(self, *, deadline_ms: int = DEFAULT_DEADLINE_MS,
               request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS) -> AsyncClient:
        return AsyncClient(self.pm, retry_deadline_ms=deadline_ms,
                           request_timeout_ms=request_timeout_ms, user=self.user,
                           password=self.password, token_file=self.token_file,
                           tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key)


@dataclass(frozen=True, slots=True)
class ProduceConfig:
    """One producer process's run (see ``produce --help``)."""

    streams: list[str]
    log: Path
    records: int = 0  # stop after this many sends (0: no limit)
    duration_s: float = 0.0  # stop after this long (0: no limit)
    rate: float = 0.0  # records per second over all streams (0: as fast as possible)
    deadline_ms: int = DEFAULT_DEADLINE_MS
    request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    replication: int = 2
    create: bool = False
    producer: str = ""  # id prefix; default p<pid>
    value_bytes: int = 0  # padding added to each value
    drain_s: float | None = None  # default: deadline + DRAIN_MARGIN_S


class JsonlLog:
    """An append-only JSON-lines log; ``flush_each``: flushed after every line."""

    def __init__(self, path: Path, *, flush_each: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] = path.open("a", encoding="utf-8")
        self._flush_each = flush_each

    def write(self, doc: Mapping[str, Any]) -> None:
        self._f.write(json.dumps({**doc, "wall": time.time()}, separators=(",", ":")) + "\n")
        if self._flush_each:
            self._f.flush()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def ensure_streams(client: AsyncClient, names: Sequence[str], *, create: bool,
                         replication: int = 2, wait_s: float = STREAM_WAIT_S) -> list[int]:
    """The ids of ``names``: with ``create`` the missing ones are created at ``replication``;
    without, waits up to ``wait_s`` for them to exist (another process creates them)."""
    deadline = time.monotonic() + wait_s
    ids: dict[str, int] = {}
    while True:
        missing: list[str] = []
        for n in names:
            if n in ids:
                continue
            try:
                ids[n] = await client.resolve_stream(n, refresh=True)
            except StreamNotFoundError:
                missing.append(n)
        if not missing:
            return [ids[n] for n in names]
        if create:
            for n, sid in zip(missing, await client.create_streams(
                    names=missing, replica_nums=replication), strict=True):
                ids[n] = sid
            continue
        if time.monotonic() > deadline:
            raise StreamNotFoundError(f"streams {', '.join(missing)} do not exist after "
                                      f"{wait_s:.0f}s: start the producer with --create")
        await asyncio.sleep(0.2)


async def produce(conn: Conn, cfg: ProduceConfig, stop: asyncio.Event | None = None
                  ) -> dict[str, int]:
    """Send records until ``cfg.records`` or ``cfg.duration_s`` or ``stop``; log each outcome.
    Returns the counts (sent, acked, failed)."""
    stop = stop or asyncio.Event()
    name = cfg.producer or f"p{os.getpid()}"
    counts = {"sent": 0, "acked": 0, "failed": 0}
    log = JsonlLog(cfg.log, flush_each=True)
    slots = asyncio.Semaphore(cfg.max_in_flight)
    pending: dict[asyncio.Future[int], tuple[str, str, float]] = {}

    def outcome(rid: str, stream: str, sent_at: float, fut: asyncio.Future[int] | None,
                err: BaseException | None) -> None:
        now = time.monotonic()
        if err is None and fut is not None and not fut.cancelled():
            err = fut.exception()
        if err is None and fut is not None and not fut.cancelled():
            counts["acked"] += 1
            log.write({"id": rid, "stream": stream, "sent_at": sent_at, "acked_at": now,
                       "offset": fut.result()})
        else:
            counts["failed"] += 1
            log.write({"id": rid, "stream": stream, "sent_at": sent_at, "failed_at": now,
                       "error": str(err) if err is not None else "cancelled"})

    def done(fut: asyncio.Future[int]) -> None:
        info = pending.pop(fut, None)
        slots.release()
        if info is not None:
            outcome(*info, fut, None)
        elif not fut.cancelled():
            fut.exception()  # logged as abandoned already: only mark its error retrieved

    client = conn.client(deadline_ms=cfg.deadline_ms, request_timeout_ms=cfg.request_timeout_ms)
    try:
        ids = await ensure_streams(client, cfg.streams, create=cfg.create,
                                   replication=cfg.replication)
        log.write({"producer": name, "deadline_ms": cfg.deadline_ms,
                   "streams": cfg.streams, "started_at": time.monotonic()})
        producer = client.producer(linger_ms=2)
        t0 = time.monotonic()
        seq = 0
        while not stop.is_set():
            if cfg.records and seq >= cfg.records:
                break
            now = time.monotonic()
            if cfg.duration_s and now - t0 >= cfg.duration_s:
                break
            if cfg.rate > 0 and (due := t0 + seq / cfg.rate) > now:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), due - now)
                continue
            await slots.acquire()
            i = seq % len(ids)
            rid, stream = f"{name}-{seq}", cfg.streams[i]
            seq += 1
            sent_at = time.monotonic()
            counts["sent"] += 1
            try:
                fut = await producer.send(ids[i], encode_value(rid, stream, sent_at,
                                                               cfg.value_bytes))
            except SbpError as exc:
                slots.release()
                outcome(rid, stream, sent_at, None, exc)
                continue
            pending[fut] = (rid, stream, sent_at)
            fut.add_done_callback(done)
        drain_s = cfg.drain_s if cfg.drain_s is not None else (
            cfg.deadline_ms / 1000 + DRAIN_MARGIN_S)
        await _drain(producer, pending, drain_s, outcome)
    finally:
        await client.close()
        log.close()
    return counts


Outcome = Callable[[str, str, float, "asyncio.Future[int] | None", "BaseException | None"], None]


async def _drain(producer: AsyncProducer,
                 pending: dict[asyncio.Future[int], tuple[str, str, float]],
                 drain_s: float, outcome: Outcome) -> None:
    """Flush and wait for the sends in flight up to ``drain_s``; log the rest as abandoned."""
    with contextlib.suppress(TimeoutError, SbpError):
        await asyncio.wait_for(producer.flush(), drain_s)
    if pending:
        await asyncio.wait(list(pending), timeout=0.1)
    for fut, info in list(pending.items()):
        del pending[fut]
        outcome(*info, None, TimeoutError(f"abandoned: unresolved {drain_s:.1f}s after stop"))
    with contextlib.suppress(TimeoutError, SbpError):
        await asyncio.wait_for(producer.close(), 1.0)


@dataclass(frozen=True, slots=True)
class ConsumeConfig:
    """One consumer process's run (see ``consume --help``)."""

    streams: list[str]
    log: Path
    records: int = 0  # stop after reading this many (0: no limit)
    duration_s: float = 0.0  # stop after this long (0: no limit)
    deadline_ms: int = DEFAULT_DEADLINE_MS
    request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS


async def consume(conn: Conn, cfg: ConsumeConfig, stop: asyncio.Event | None = None
                  ) -> dict[str, int]:
    """Read every stream from offset 0 as records arrive, logging each record and each error
    (retried with a bounded backoff), until ``cfg.records`` or ``cfg.duration_s`` or ``stop``.
    Returns the counts (read, errors)."""
    stop = stop or asyncio.Event()
    counts = {"read": 0, "errors": 0}
    log = JsonlLog(cfg.log, flush_each=False)
    client = conn.client(deadline_ms=cfg.deadline_ms, request_timeout_ms=cfg.request_timeout_ms)

    async def one(stream: str, sid: int) -> None:
        next_offset, backoff = 0, CONSUMER_BACKOFF_INITIAL_S
        while True:
            consumer = client.consumer(sid, next_offset)
            try:
                async for rec in consumer:
                    got = decode_value(rec.value)
                    log.write({"id": got[0] if got else None, "stream": stream,
                               "offset": rec.offset, "read_at": time.monotonic()})
                    next_offset, backoff = rec.offset + 1, CONSUMER_BACKOFF_INITIAL_S
                    counts["read"] += 1
                    if cfg.records and counts["read"] >= cfg.records:
                        stop.set()
            except Exception as exc:  # any error: logged, retried after a bounded backoff
                counts["errors"] += 1
                log.write({"stream": stream, "error": f"{type(exc).__name__}: {exc}",
                           "at": time.monotonic()})
            finally:
                with contextlib.suppress(SbpError, OSError, TimeoutError):
                    await asyncio.wait_for(consumer.close(), 2.0)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, CONSUMER_BACKOFF_MAX_S)

    async def flusher() -> None:
        while True:
            await asyncio.sleep(CONSUMER_FLUSH_S)
            log.flush()

    tasks: list[asyncio.Task[None]] = []
    try:
        ids = await ensure_streams(client, cfg.streams, create=False)
        tasks = [asyncio.create_task(one(n, sid)) for n, sid in zip(cfg.streams, ids,
                                                                    strict=True)]
        tasks.append(asyncio.create_task(flusher()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), cfg.duration_s or None)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        log.close()
    return counts


async def final_read(conn: Conn, streams: Sequence[str], *,
                     deadline_ms: int = DEFAULT_DEADLINE_MS
                     ) -> dict[str, list[tuple[int, bytes | None]]]:
    """Every record of each stream from its first offset to its end, as (offset, value)."""
    out: dict[str, list[tuple[int, bytes | None]]] = {}
    async with conn.client(deadline_ms=deadline_ms) as client:
        for name in streams:
            sid = await client.resolve_stream(name)
            end = await client.end_offset(sid)
            consumer = client.consumer(sid, "earliest", end=end)
            try:
                out[name] = await asyncio.wait_for(_read_all(consumer), FINAL_READ_TIMEOUT_S)
            finally:
                await consumer.close()
    return out


async def _read_all(consumer: AsyncConsumer) -> list[tuple[int, bytes | None]]:
    return [(rec.offset, rec.value) async for rec in consumer]


def load_faults(path: Path | None) -> list[Fault]:
    """The nemesis's fault windows from a JSON file: a list of events, or ``{"faults": [...]}``
    (a JSON-lines file of events is read too)."""
    if path is None:
        return []
    text = path.read_text(encoding="utf-8")
    try:
        doc: Any = json.loads(text)
    except ValueError:
        doc = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    if isinstance(doc, dict):
        doc = doc.get("faults", doc.get("events", []))
    return [Fault.from_json(d) for d in doc]


def streams_in(lines: Iterable[Mapping[str, Any]]) -> list[str]:
    """The stream names a producer log mentions, in first-seen order."""
    seen: dict[str, None] = {}
    for ln in lines:
        for s in ln.get("streams", []) if "producer" in ln else [ln.get("stream")]:
            if isinstance(s, str):
                seen.setdefault(s, None)
    return list(seen)


async def check_run(conn: Conn, producer_logs: Sequence[Path], consumer_logs: Sequence[Path],
                    *, faults: Sequence[Fault] = (), deadline_ms: int | None = None,
                    grace_s: float = DEADLINE_GRACE_S, streams: Sequence[str] = (),
                    recovery_s: float = DEFAULT_RECOVERY_S) -> CheckResult:
    """Read the logs, read every stream back through the SDK, and :func:`check`. The streams are
    ``streams`` plus those the producer logs name; ``deadline_ms`` defaults to the logs'."""
    plines = [ln for p in producer_logs for ln in read_jsonl(p)]
    clines = [ln for p in consumer_logs for ln in read_jsonl(p)]
    if deadline_ms is None:
        deadline_ms = max((int(ln["deadline_ms"]) for ln in plines if "deadline_ms" in ln),
                          default=DEFAULT_DEADLINE_MS)
    names = list(dict.fromkeys([*streams, *streams_in(plines)]))
    final = await final_read(conn, names)
    return check(plines, clines, final, faults, deadline_ms=deadline_ms, grace_s=grace_s,
                 recovery_s=recovery_s)


# ----------------------------------------------------------------------------------------- CLI


def _add_common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pm", required=True, help="PM address(es): HOST:PORT[,HOST:PORT...]")
    ap.add_argument("--streams", type=int, default=1, help="N streams named wl-0..wl-N-1")
    ap.add_argument("--stream-names", default="", help="comma-separated names (over --streams)")
    ap.add_argument("--deadline-ms", type=int, default=None,
                    help=f"the SDK's retry_deadline_ms (default {DEFAULT_DEADLINE_MS}; check: "
                    "the producer logs')")
    ap.add_argument("--request-timeout-ms", type=int, default=DEFAULT_REQUEST_TIMEOUT_MS)
    for opt in ("user", "password", "token-file", "tls-ca", "tls-cert", "tls-key"):
        ap.add_argument(f"--{opt}", default="", help="as the SDK's (default: $SBPSTREAM_*)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce", help="send records, log each outcome")
    _add_common(p)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--records", type=int, default=0, help="stop after N sends (0: no limit)")
    p.add_argument("--duration-s", type=float, default=0.0, help="stop after T s (0: no limit)")
    p.add_argument("--rate", type=float, default=0.0, help="records/s (0: as fast as possible)")
    p.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT)
    p.add_argument("--replication", type=int, default=2, help="for --create")
    p.add_argument("--create", action="store_true", help="create the missing streams first")
    p.add_argument("--producer", default="", help="the id prefix (default p<pid>)")
    p.add_argument("--value-bytes", type=int, default=0, help="padding per value")
    p.add_argument("--drain-s", type=float, default=None,
                   help=f"bound on finishing in-flight sends at stop (default: deadline + "
                   f"{DRAIN_MARGIN_S:.0f}s)")
    c = sub.add_parser("consume", help="read every stream from offset 0, log each record")
    _add_common(c)
    c.add_argument("--log", type=Path, required=True)
    c.add_argument("--records", type=int, default=0, help="stop after N reads (0: no limit)")
    c.add_argument("--duration-s", type=float, default=0.0, help="stop after T s (0: no limit)")
    k = sub.add_parser("check", help="read the streams back and check the logs; prints JSON")
    _add_common(k)
    k.add_argument("--producer-log", type=Path, nargs="+", required=True)
    k.add_argument("--consumer-log", type=Path, nargs="*", default=[])
    k.add_argument("--events", type=Path, default=None,
                   help="nemesis fault windows: JSON list of {start, heal, what} (monotonic s)")
    k.add_argument("--grace-ms", type=float, default=DEADLINE_GRACE_S * 1000)
    k.add_argument("--recovery-ms", type=float, default=DEFAULT_RECOVERY_S * 1000,
                   help="after a heal, how long writes may still fail (see DEFAULT_RECOVERY_S)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    # the SDK's own events (failovers, a range left behind a replica's back) on stderr, with
    # monotonic-comparable wall times: what a failed run's reader needs beside the JSON logs
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    conn = Conn(a.pm, user=a.user, password=a.password, token_file=a.token_file,
                tls_ca=a.tls_ca, tls_cert=a.tls_cert, tls_key=a.tls_key)
    given = [n for n in a.stream_names.split(",") if n]
    names = stream_names(a.streams, a.stream_names)
    deadline_ms = a.deadline_ms if a.deadline_ms is not None else DEFAULT_DEADLINE_MS

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        if a.cmd == "produce":
            return await produce(conn, ProduceConfig(
                names, a.log, records=a.records, duration_s=a.duration_s, rate=a.rate,
                deadline_ms=deadline_ms, request_timeout_ms=a.request_timeout_ms,
                max_in_flight=a.max_in_flight, replication=a.replication, create=a.create,
                producer=a.producer, value_bytes=a.value_bytes, drain_s=a.drain_s), stop)
        if a.cmd == "consume":
            return await consume(conn, ConsumeConfig(
                names, a.log, records=a.records, duration_s=a.duration_s,
                deadline_ms=deadline_ms, request_timeout_ms=a.request_timeout_ms), stop)
        res = await check_run(conn, a.producer_log, a.consumer_log,
                              faults=load_faults(a.events), deadline_ms=a.deadline_ms,
                              grace_s=a.grace_ms / 1000, streams=given,
                              recovery_s=a.recovery_ms / 1000)
        return res.to_json()

    out = asyncio.run(run())
    print(json.dumps(out))
    return 1 if a.cmd == "check" and out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
