"""Consumer groups end to end on a LocalCluster: members share streams, a joiner takes only its
share, a SIGKILLed member's streams move with nothing acknowledged skipped, stale commits are
refused, offsets resume and reset (the etcd failover test is tests/test_groups_etcd.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from waiting import eventually_async

from sbpstream.client import AsyncClient, AsyncConsumer, Client, ConsumedRecord
from sbpstream.client.groups import GroupAdmin
from sbpstream.client.types import RebalanceEvent
from sbpstream.cluster import LocalCluster
from sbpstream.protocol.errors import (
    GroupNotEmptyError,
    IllegalGenerationError,
    InvalidRequestError,
    UnknownMemberError,
)

N_STREAMS = 10
PER_STREAM = 30
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    d: Path = tmp_path_factory.mktemp("groups")
    with LocalCluster(d, datanodes=1, heartbeat_interval_ms=500, node_timeout_ms=6000) as c:
        yield c


@pytest.fixture
async def client(cluster: LocalCluster) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(cluster.pm_address, retry_deadline_ms=30_000) as c:
        yield c


async def make_streams(c: AsyncClient, n: int = N_STREAMS, per: int = PER_STREAM) -> list[int]:
    sids = await c.create_streams(n, replica_nums=1)
    async with c.producer() as p:
        for sid in sids:
            for i in range(per):
                await p.send(sid, b"%d" % i)
    return sids


class Reader:
    """One member reading in a task, keeping what it got per stream."""

    def __init__(self, consumer: AsyncConsumer) -> None:
        self.consumer = consumer
        self.got: dict[int, list[int]] = {}
        self.events: list[RebalanceEvent] = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        rec: ConsumedRecord
        async for rec in self.consumer:
            self.got.setdefault(rec.stream_id, []).append(rec.offset)

    async def stop(self) -> None:
        await self.consumer.close()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, 30)


def member(c: AsyncClient, group: str, sids: list[int], start_latest: bool = False,
           **kw: object) -> AsyncConsumer:
    return c.consumer(sids, "latest" if start_latest else "earliest", group=group,
                      session_timeout_ms=3000,
                      heartbeat_interval_ms=200, auto_commit_interval_ms=200,
                      max_wait_ms=100, **kw)  # type: ignore[arg-type]


async def settled(readers: list[Reader], sizes: list[int]) -> list[set[int]]:
    async def check() -> list[set[int]] | None:
        got = [set(r.consumer.assignment) for r in readers]
        union = set().union(*got)
        if sorted(len(g) for g in got) == sizes and len(union) == sum(sizes):
            return got
        return None

    return await eventually_async(check, timeout=WAIT_S, interval=0.05,
                                  what=f"assignment sizes {sizes}")


async def test_members_share_evenly_and_a_joiner_moves_only_its_share(
        client: AsyncClient) -> None:
    sids = await make_streams(client)
    a = Reader(member(client, "share", sids))
    b = Reader(member(client, "share", sids))
    try:
        before = await settled([a, b], [5, 5])
        c = Reader(member(client, "share", sids))
        try:
            after = await settled([a, b, c], [3, 3, 4])
            assert after[0] <= before[0] and after[1] <= before[1]  # sticky: only moves out
            moved = len(before[0] - after[0]) + len(before[1] - after[1])
            assert moved == len(after[2]) == 3
            # every record of every stream read at least once across the members
            async def all_read() -> bool:
                seen = {sid: set() for sid in sids}
                for r in (a, b, c):
                    for sid, offs in r.got.items():
                        seen[sid].update(offs)
                return all(len(v) == PER_STREAM for v in seen.values())
            await eventually_async(all_read, timeout=WAIT_S, what="every record read")
            evs = c.consumer.rebalance_events()  # one per release it waited for
            assert {e.kind for e in evs} == {"assigned"}
            assert {s for e in evs for s in e.stream_ids} == after[2]
            kinds = {e.kind for e in a.consumer.rebalance_events()}
            assert kinds == ({"assigned", "revoked"} if after[0] != before[0] else {"assigned"})
        finally:
            await c.stop()
    finally:
        await a.stop()
        await b.stop()
    described = await client.describe_group("share")
    assert described.state == "empty" and not described.members
    assert {s.stream_id: s.committed for s in described.streams} == dict.fromkeys(
        sids, PER_STREAM)
    assert all(s.lag == 0 and s.end_offset == PER_STREAM for s in described.streams)


async def test_resume_commit_committed_and_reset(client: AsyncClient) -> None:
    sids = await make_streams(client, 2, 10)
    cons = member(client, "resume", sids, auto_commit=False)
    got = []
    async for rec in cons:
        got.append((rec.stream_id, rec.offset))
        if len(got) == 5:
            await cons.commit()
        if len(got) == 20:
            break
    assert len(got) == 20
    committed = await cons.committed()
    assert sum(committed.values()) == 5  # the commit after five records
    await cons.commit({sids[0]: 10, sids[1]: 10})
    assert await cons.committed() == {sids[0]: 10, sids[1]: 10}
    with pytest.raises(GroupNotEmptyError):
        await client.reset_offsets("resume", "earliest")
    await cons.close()
    async with client.producer() as p:
        await p.send(sids[0], b"new")
    again = member(client, "resume", sids)
    rec = await asyncio.wait_for(again.__anext__(), WAIT_S)
    assert (rec.stream_id, rec.offset, rec.value) == (sids[0], 10, b"new")
    await again.close()
    assert await client.committed_offsets("resume") == {sids[0]: 11, sids[1]: 10}
    assert await client.reset_offsets("resume", "earliest") == {sids[0]: 0, sids[1]: 0}
    assert await client.reset_offsets("resume", "latest") == {sids[0]: 11, sids[1]: 10}
    assert await client.reset_offsets("resume", 3, [sids[1]]) == {sids[1]: 3}
    assert await client.committed_offsets("resume") == {sids[0]: 11, sids[1]: 3}
    assert "resume" in await client.list_groups()
    await client.delete_group("resume")
    assert await client.committed_offsets("resume") == {}
    assert "resume" not in await client.list_groups()


async def test_stale_member_commits_are_refused(client: AsyncClient, cluster: LocalCluster
                                                ) -> None:
    sids = await make_streams(client, 2, 1)
    admin = GroupAdmin(client.pm_request)
    j = await admin.join("stale", "", sids, 3000, "t")
    hb = await admin.heartbeat("stale", j.member_id, j.generation, [])
    assert set(hb.assigned) == set(sids)
    assert await admin.commit("stale", {sids[0]: 1}, j.member_id, hb.generation) == {
        sids[0]: None}
    j2 = await admin.join("stale", "", sids, 1000, "t2")  # a second member: a new generation
    with pytest.raises(IllegalGenerationError):
        await admin.commit("stale", {sids[0]: 1}, j.member_id, hb.generation)
    await admin.leave("stale", j2.member_id)
    # the first member misses its session (3 s): it is gone, its commits refused
    async def evicted() -> bool:
        try:
            await admin.commit("stale", {sids[0]: 1}, j.member_id, -5)
        except UnknownMemberError:
            return True
        except IllegalGenerationError:
            return False
        return False
    await eventually_async(evicted, timeout=WAIT_S, interval=0.2, what="member evicted")


CHILD = textwrap.dedent("""
    import asyncio, sys
    from sbpstream.client import AsyncClient

    async def main() -> None:
        pm, group, sids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
        async with AsyncClient(pm, retry_deadline_ms=30_000) as c:
            cons = c.consumer(sids, "earliest", group=group, session_timeout_ms=3000,
                              heartbeat_interval_ms=200, auto_commit_interval_ms=100,
                              max_wait_ms=100)
            async for rec in cons:
                print(rec.stream_id, rec.offset, flush=True)
                await asyncio.sleep(0.05)  # slow: the kill lands mid-way

    asyncio.run(main())
""")


async def test_sigkilled_member_loses_its_streams_and_nothing_acknowledged_is_skipped(
        client: AsyncClient, cluster: LocalCluster, tmp_path: Path) -> None:
    sids = await make_streams(client, 4, 200)
    script = tmp_path / "member.py"
    script.write_text(CHILD)
    out = tmp_path / "member.out"
    with open(out, "wb") as f:
        child = subprocess.Popen(
            [sys.executable, str(script), cluster.pm_address, "kill",
             ",".join(map(str, sids))], stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        async def child_read() -> bool:
            return out.read_text().count("\n") >= 50 and await client.committed_offsets(
                "kill") != {}
        await eventually_async(child_read, timeout=WAIT_S, interval=0.1,
                               what="the child member reading and committing")
        survivor = Reader(member(client, "kill", sids))
        async def shared() -> bool:
            return len(survivor.consumer.assignment) == 2
        await eventually_async(shared, timeout=WAIT_S, interval=0.05, what="two streams each")
        child_streams = set(sids) - set(survivor.consumer.assignment)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        committed_at_kill = await client.committed_offsets("kill")

        async def took_over() -> bool:
            return set(survivor.consumer.assignment) == set(sids)
        await eventually_async(took_over, timeout=WAIT_S, interval=0.05,
                               what="the survivor owns every stream")

        async def read_all() -> bool:
            return all(committed_at_kill.get(s) == 200
                       or (survivor.got.get(s) and survivor.got[s][-1] == 199) for s in sids)
        await eventually_async(read_all, timeout=WAIT_S, interval=0.1, what="read to the end")
        await survivor.stop()
        assert any(committed_at_kill.get(s, 0) < 200 for s in child_streams)  # killed mid-way
        for sid in child_streams:
            if committed_at_kill.get(sid) == 200:
                continue
            first = survivor.got[sid][0]
            # resumed at (or before) the last acknowledged offset: nothing acknowledged skipped
            assert first <= committed_at_kill.get(sid, 0)
            assert survivor.got[sid] == list(range(first, 200))
        child_lines = [tuple(map(int, ln.split())) for ln in out.read_text().splitlines()
                       if ln and ln[0].isdigit()]
        for sid in sids:
            seen = {o for s, o in child_lines if s == sid} | set(survivor.got.get(sid, []))
            assert seen == set(range(200)), sid
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_sync_twin_group_consumer(cluster: LocalCluster) -> None:
    events: list[RebalanceEvent] = []
    with Client(cluster.pm_address, retry_deadline_ms=30_000) as c:
        sids = c.create_streams(2, replica_nums=1)
        with c.producer() as p:
            for sid in sids:
                p.send_many(sid, [b"x"] * 4)
        cons = c.consumer(sids, "earliest", group="sync", auto_commit=False,
                          on_rebalance=events.append, max_wait_ms=100)
        with cons:
            got = [next(cons) for _ in range(5)]
            assert cons.group == "sync" and cons.assignment == tuple(sorted(sids))
            cons.commit()
            assert sum(cons.committed().values()) == 5
            assert [e.kind for e in cons.rebalance_events()] == ["assigned"]
        assert {r.stream_id for r in got} <= set(sids)
        assert [e.kind for e in events] == ["assigned"]
        assert sum(c.committed_offsets("sync").values()) == 5


async def test_latest_is_pinned_at_assignment(client: AsyncClient) -> None:
    """A member starting at "latest" reads what was appended after it got the stream, even
    when its reader is rebuilt (a rebalance) before it handed any of those records out."""
    sids = await make_streams(client, 2, 3)
    a = member(client, "latest", sids, start_latest=True)
    await a.fill(100)
    assert set(a.assignment) == set(sids)
    async with client.producer() as p:
        for sid in sids:
            await p.send(sid, b"after")  # offset 3 of each, not handed out yet

    async def sized(n: int) -> bool:
        await a.poll(max_records=0, timeout_ms=50)  # applies rebalances, hands out nothing
        return len(a.assignment) == n

    b = member(client, "latest", sids)
    await b.fill(100)  # joins: a releases one stream
    await eventually_async(lambda: sized(1), timeout=WAIT_S, what="a released a stream")
    await b.close()    # a gets it back: its reader is rebuilt
    await eventually_async(lambda: sized(2), timeout=WAIT_S, what="a has both streams again")
    got: list[tuple[int, int]] = []

    async def both() -> bool:
        got.extend((r.stream_id, r.offset) for r in await a.poll(timeout_ms=100))
        return set(got) >= {(sid, 3) for sid in sids}
    await eventually_async(both, timeout=WAIT_S, interval=0.01, what="the records after")
    await a.close()


async def test_one_consumer_type_the_group_side_delegates_or_is_refused(
        client: AsyncClient) -> None:
    """With or without a group ``consumer()`` is an AsyncConsumer (a facade over its reader):
    the group's calls go to the member, and each side refuses the other's calls by name."""
    sids = await make_streams(client, 2, 5)
    plain = client.consumer(sids[0], "earliest", subscribe=False)
    grouped = member(client, "facade", sids)
    try:
        assert isinstance(plain, AsyncConsumer) and isinstance(grouped, AsyncConsumer)
        rec = await asyncio.wait_for(anext(plain), WAIT_S)  # the facade's __anext__
        assert (rec.stream_id, rec.offset) == (sids[0], 0)
        assert plain.group is None and plain.assignment == (sids[0],)
        assert plain.rebalance_events() == [] and plain.high_watermark == 5
        plain.batch_max_bytes = 4096
        assert plain.batch_max_bytes == 4096
        for call in (plain.commit(), plain.committed()):
            with pytest.raises(InvalidRequestError, match="needs a consumer with a group"):
                await call
        got = [await asyncio.wait_for(anext(grouped), WAIT_S) for _ in range(10)]
        assert sorted((r.stream_id, r.offset) for r in got) == [
            (sid, off) for sid in sorted(sids) for off in range(5)]
        assert grouped.group == "facade" and grouped.assignment == tuple(sorted(sids))
        assert [e.kind for e in grouped.rebalance_events()] == ["assigned"]
        assert grouped.throttle_time_ms == 0 and grouped.position is None
        await grouped.commit()
        assert await grouped.committed() == dict.fromkeys(sids, 5)
        for refused in (grouped.seek(0), grouped.set_streams(sids[0]), grouped.poll_columns(),
                        grouped.fetch_batches()):
            with pytest.raises(InvalidRequestError, match="without a group"):
                await refused
        with pytest.raises(InvalidRequestError, match="high_watermark is for a consumer"):
            _ = grouped.high_watermark
    finally:
        await plain.close()
        await grouped.close()


async def test_a_pulling_member_of_one_stream_starts_at_the_committed_offset(
        client: AsyncClient) -> None:
    """``subscribe=False`` with one assigned stream reads through the single-stream long poll,
    which took the consumer's ``start`` and skipped the group's position (records read again)."""
    (sid,) = await make_streams(client, 1, 10)
    await client.commit_offsets("pull-resume", {sid: 7})
    cons = member(client, "pull-resume", [sid], subscribe=False, auto_commit=False)
    try:
        rec = await asyncio.wait_for(cons.__anext__(), WAIT_S)
        assert (rec.stream_id, rec.offset) == (sid, 7)
    finally:
        await cons.close()
