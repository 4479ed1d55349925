"""The fault-test workload (tests/workload.py): its checker on hand-made logs (pure), and one run
of the producer and consumer processes against a real cluster while a data node is SIGKILLed and
restarted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import node_at
from waiting import eventually
from workload import (
    DEADLINE_GRACE_S,
    Conn,
    Fault,
    check,
    check_run,
    decode_value,
    encode_value,
    longest_gap,
    read_jsonl,
)

from sbpstream.client.aclient import AsyncClient
from sbpstream.client.routing import primary_address
from sbpstream.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workload.py"
DEADLINE_MS = 5_000
DEADLINE_S = DEADLINE_MS / 1000


def ack(rid: str, stream: str, offset: int, sent: float = 0.0, done: float = 0.1
        ) -> dict[str, Any]:
    return {"id": rid, "stream": stream, "sent_at": sent, "acked_at": done, "offset": offset}


def fail(rid: str, stream: str, sent: float = 0.0, done: float = 0.1) -> dict[str, Any]:
    return {"id": rid, "stream": stream, "sent_at": sent, "failed_at": done, "error": "boom"}


def read(rid: str, stream: str, offset: int, at: float = 1.0) -> dict[str, Any]:
    return {"id": rid, "stream": stream, "offset": offset, "read_at": at}


def rec(offset: int, rid: str, stream: str = "s") -> tuple[int, bytes | None]:
    return offset, encode_value(rid, stream, 0.0)


FAULT = Fault(0.0, 1.0, "a fault excusing the failed sends at 0.1")
HEADER = {"producer": "p", "deadline_ms": DEADLINE_MS, "streams": ["s"], "started_at": 0.0}


def run(plines: list[dict[str, Any]], final: list[tuple[int, bytes | None]],
        clines: list[dict[str, Any]] | None = None, faults: tuple[Fault, ...] = ()) -> Any:
    return check([HEADER, *plines], clines or [], {"s": final}, faults, deadline_ms=DEADLINE_MS)


# ------------------------------------------------------------------------- checker (pure)


def test_a_clean_run_has_no_problems() -> None:
    plines = [ack("p-0", "s", 0), ack("p-1", "s", 1), fail("p-2", "s")]
    clines = [read("p-0", "s", 0), read("p-1", "s", 1)]
    res = run(plines, [rec(0, "p-0"), rec(1, "p-1")], clines, faults=(FAULT,))
    assert res.problems() == []
    assert (res.sent, res.acked, res.failed, res.final_records, res.consumer_read) == (
        3, 2, 1, 2, 2)


def test_a_lost_ack_is_reported() -> None:
    res = run([ack("p-0", "s", 0), ack("p-1", "s", 1)], [rec(0, "p-0")])
    assert res.lost == 1
    assert any("lost" in p and "p-1" in p for p in res.problems())


def test_a_duplicate_is_reported() -> None:
    res = run([ack("p-0", "s", 0)], [rec(0, "p-0"), rec(1, "p-0")])
    assert (res.duplicated, res.lost, res.misplaced) == (1, 0, 0)
    assert any("extra copies of acknowledged" in p for p in res.problems())


def test_a_misplaced_offset_is_reported() -> None:
    res = run([ack("p-0", "s", 0), ack("p-1", "s", 1)], [rec(0, "p-1"), rec(1, "p-0")])
    assert (res.misplaced, res.lost, res.duplicated) == (2, 0, 0)
    assert any("another offset" in p for p in res.problems())


def test_an_unacked_record_present_once_is_fine_twice_is_not() -> None:
    once = run([ack("p-0", "s", 0), fail("p-1", "s")], [rec(0, "p-0"), rec(1, "p-1")],
               faults=(FAULT,))
    assert once.problems() == []
    assert once.unacked_present == 1
    twice = run([fail("p-1", "s")], [rec(0, "p-1"), rec(1, "p-1")])
    assert twice.unacked_duplicated == 1
    assert any("never-acknowledged" in p for p in twice.problems())


def test_a_record_from_a_known_producer_without_a_log_line_is_fine() -> None:
    # the producer died between the send and its log line
    res = run([ack("p-0", "s", 0)], [rec(0, "p-0"), rec(1, "p-7")])
    assert res.problems() == []
    assert res.unlogged_present == 1


def test_records_never_sent_are_corruption() -> None:
    res = run([ack("p-0", "s", 0)], [rec(0, "p-0"), (1, b"garbage"), rec(2, "q-1"),
                                     rec(3, "p-9", stream="other")],
              [read("p-0", "s", 0), read("zz-1", "s", 1)])
    assert res.corrupt == 4
    assert any("never sent" in p for p in res.problems())


def test_consumer_order_gaps_and_mismatches_are_reported() -> None:
    plines = [ack(f"p-{i}", "s", i) for i in range(4)]
    final = [rec(i, f"p-{i}") for i in range(4)]
    skipped = run(plines, final, [read("p-0", "s", 0), read("p-2", "s", 2), read("p-3", "s", 3)])
    assert (skipped.consumer_skipped, skipped.consumer_out_of_order) == (1, 0)
    backwards = run(plines, final, [read("p-0", "s", 0), read("p-1", "s", 1),
                                    read("p-0", "s", 0)])
    assert backwards.consumer_out_of_order == 1
    mismatch = run(plines, final, [read("p-0", "s", 0), read("p-2", "s", 1)])
    assert mismatch.consumer_mismatch == 1
    assert any("skipped" in p for p in skipped.problems())


def test_a_send_waiting_past_its_deadline_is_flagged() -> None:
    bound = DEADLINE_S + DEADLINE_GRACE_S
    late = run([ack("p-0", "s", 0, sent=10.0, done=10.0 + bound + 0.5),
                fail("p-1", "s", sent=10.0, done=10.0 + bound + 0.5)],
               [rec(0, "p-0")], faults=(Fault(9.0, 11.0),))
    assert late.waited_past_deadline == 2
    assert late.max_call_s == pytest.approx(bound + 0.5)
    assert any("longer than the deadline" in p for p in late.problems())
    in_time = run([ack("p-0", "s", 0, sent=10.0, done=10.0 + bound - 0.1)], [rec(0, "p-0")])
    assert in_time.waited_past_deadline == 0


def test_a_failure_long_after_the_fault_healed_is_flagged() -> None:
    bound = DEADLINE_S + DEADLINE_GRACE_S
    fault = Fault(10.0, 20.0, "partition")
    during = fail("p-0", "s", sent=14.0, done=15.0)
    soon_after = fail("p-1", "s", sent=19.0, done=20.0 + bound - 0.5)
    too_late = fail("p-2", "s", sent=24.0, done=20.0 + bound + 0.5)
    res = run([during, soon_after, too_late], [], faults=(fault,))
    assert res.failed_after_heal == 1
    assert "p-2" in " ".join(res.examples["failed_after_heal"])
    no_fault = run([fail("p-0", "s", sent=1.0, done=1.5)], [])
    assert no_fault.failed_after_heal == 1
    unhealed = run([fail("p-0", "s", sent=100.0, done=101.0)], [],
                   faults=(Fault(10.0, None),))
    assert unhealed.failed_after_heal == 0
    # sent during a short fault with a long deadline: it had time to succeed after the heal
    long_deadline = check([HEADER, fail("p-0", "s", sent=11.0, done=12.0)], [], {"s": []},
                          (Fault(10.0, 12.0),), deadline_ms=30_000, recovery_s=5.0)
    assert long_deadline.failed_after_heal == 1
    assert "deadline left at the heal" in " ".join(long_deadline.examples["failed_after_heal"])


def test_unavailability_windows() -> None:
    times = [0.0, 1.0, 2.0, 6.0, 7.0]
    plines = [ack(f"p-{i}", "s", i, sent=max(0.0, t - 0.05), done=t) for i, t in enumerate(times)]
    final = [rec(i, f"p-{i}") for i in range(len(times))]
    clines = [read(f"p-{i}", "s", i, at=t + 0.5) for i, t in enumerate(times)]
    res = run(plines, final, clines, faults=(Fault(2.5, 5.5, "kill"), Fault(1.5, 6.5)))
    assert res.write_gap_s == pytest.approx(4.0)
    assert res.read_gap_s == pytest.approx(4.0)
    inside, around = res.faults
    assert inside["write_gap_s"] == pytest.approx(3.0)  # no ack from the start to the heal
    assert inside["read_gap_s"] == pytest.approx(3.0)
    assert around["write_gap_s"] == pytest.approx(4.0)  # the 2.0 -> 6.0 gap, all inside
    assert around["read_gap_s"] == pytest.approx(4.0)


def test_longest_gap_and_the_value_format() -> None:
    assert longest_gap([]) == 0.0
    assert longest_gap([1.0, 1.5, 4.0]) == pytest.approx(2.5)
    assert longest_gap([1.0, 4.0], 0.0, 2.0) == pytest.approx(1.0)
    assert longest_gap([1.0], 3.0, 2.0) == 0.0
    assert decode_value(encode_value("p-3", "s", 1.0, pad=10)) == ("p-3", "s")
    assert decode_value(b"\xff") is None
    assert decode_value(b"[1]") is None
    assert decode_value(None) is None
    assert Fault.from_json({"started_at": 1, "healed_at": 2, "name": "x"}) == Fault(1.0, 2.0, "x")
    with pytest.raises(ValueError, match="start"):
        Fault.from_json({"heal": 2})


def test_to_json_holds_the_problems() -> None:
    res = run([ack("p-0", "s", 0)], [])
    doc = json.loads(json.dumps(res.to_json()))
    assert doc["lost"] == 1 and doc["problems"] == res.problems()


# ------------------------------------------------------------- processes under a fault

RECORDS = 3_000
RATE = 500  # records/s: a 6 s run, long enough to kill and restart a node inside it
RUN_DEADLINE_MS = 30_000
PROCESS_BOUND_S = 120.0  # hang guard on each process's end (the run takes ~6 s)


async def primary_of(pm: str, stream: str) -> str:
    """The address of the primary of the stream's writable range: the victim that matters."""
    async with AsyncClient(pm) as client:
        addr = primary_address((await client.list_ranges(stream))[-1])
    assert addr is not None
    return addr


def acked_ids(log: Path) -> set[str]:
    return {ln["id"] for ln in read_jsonl(log) if "acked_at" in ln} if log.exists() else set()


def read_ids(log: Path) -> set[str]:
    return {ln["id"] for ln in read_jsonl(log) if "read_at" in ln} if log.exists() else set()


@pytest.mark.timeout(400)
def test_producer_and_consumer_through_a_data_node_kill(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", datanodes=3, heartbeat_interval_ms=200,
                           node_timeout_ms=1500, fsync="none")
    plog, clog = tmp_path / "producer.jsonl", tmp_path / "consumer.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    common = ["--pm", cluster.pm_address, "--streams", "2", "--deadline-ms",
              str(RUN_DEADLINE_MS)]
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        def spawn(name: str, *args: str) -> subprocess.Popen[bytes]:
            out = stack.enter_context((tmp_path / f"{name}.out").open("wb"))
            p = stack.enter_context(subprocess.Popen(
                [sys.executable, str(WORKLOAD), *args], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, cwd=tmp_path))
            procs.append(p)
            return p

        def output() -> str:
            return "\n".join(f"{f.name}: {f.read_text()[-2000:]}"
                             for f in sorted(tmp_path.glob("*.out")))

        try:
            cluster.start()
            consumer = spawn("consumer", "consume", *common, "--log", str(clog))
            producer = spawn("producer", "produce", *common, "--create", "--replication", "2",
                             "--records", str(RECORDS), "--rate", str(RATE), "--log", str(plog))
            eventually(lambda: len(acked_ids(plog)) >= RECORDS // 6, timeout=60,
                       what=lambda: f"{RECORDS // 6} acks before the kill\n{output()}")
            victim = node_at(cluster, asyncio.run(primary_of(cluster.pm_address, "wl-0")))
            start = time.monotonic()
            victim.kill()
            before = len(acked_ids(plog))
            eventually(lambda: len(acked_ids(plog)) >= before + RECORDS // 6, timeout=60,
                       what=lambda: f"writes going on without {victim.name}\n{output()}")
            victim.start()
            victim.wait_ready()
            heal = time.monotonic()
            assert producer.wait(PROCESS_BOUND_S) == 0, output()
            acked = acked_ids(plog)
            eventually(lambda: acked <= read_ids(clog), timeout=PROCESS_BOUND_S,
                       what=lambda: f"the consumer reading all {len(acked)} acked records "
                       f"(read {len(read_ids(clog))})\n{output()}")
            consumer.terminate()
            assert consumer.wait(PROCESS_BOUND_S) == 0, output()
            res = asyncio.run(check_run(Conn(cluster.pm_address), [plog], [clog],
                                        faults=[Fault(start, heal, f"SIGKILL {victim.name}")]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            cluster.stop()
    summary = {k: v for k, v in res.to_json().items() if k != "examples"}
    print(json.dumps(summary))
    assert res.problems() == [], summary
    assert (res.sent, res.acked, res.failed, res.lost, res.duplicated) == (
        RECORDS, RECORDS, 0, 0, 0), summary
    assert res.consumer_read == RECORDS and res.final_records == RECORDS, summary
