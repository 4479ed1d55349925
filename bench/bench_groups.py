"""Consumer groups: commit rate, rebalance time, and the cost of many committed offsets.

- **commits/s** through a running PM (a LocalCluster on SQLite; OFFSET_COMMIT over the wire,
  one member, its generation checked): ``--commits`` sequential commits of one offset, then of
  ``--batch`` offsets per request (offsets/s).
- **rebalance**: ``--streams`` streams (default 1,000) shared by 2 to ``--members`` (default 8)
  members speaking JOIN_GROUP / GROUP_HEARTBEAT over the wire, each heartbeating every
  ``REBALANCE_HEARTBEAT_MS`` (the SDK's pace while a rebalance is under way) and releasing at
  once what it lost: time from the new member's JOIN_GROUP until every member holds exactly its
  target, and how many streams moved (cooperative and sticky: the newcomer's share only).
- **100k offsets**: one group with ``--offsets`` committed offsets (default 100,000) in the
  metadata store alone, SQLite and etcd: commit time (batches of 1,000), bytes (SQLite: file
  growth after checkpoint; etcd: key and value bytes), and the load after a restart (SQLite:
  open + read every offset of the group; etcd: open, which loads the prefix into the cache,
  beside the same open without offsets).

    python -m bench.bench_groups [--commits 2000] [--batch 100] [--streams 1000] [--members 8]
                                 [--offsets 100000] [--skip-etcd]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import percentile
from sbpstream.client import AsyncClient
from sbpstream.client.groups import REBALANCE_HEARTBEAT_MS, GroupAdmin
from sbpstream.cluster import LocalCluster
from sbpstream.net.loop import run
from sbpstream.pm.etcd import EtcdMetadataStore
from sbpstream.pm.etcd.codec import encode_offset
from sbpstream.pm.etcd.keys import Keys
from sbpstream.pm.leader import LeaderElection
from sbpstream.pm.metadata import NewStream, OffsetMeta, ReplicaMeta
from sbpstream.pm.sqlite_meta import SqliteMetadataStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from etcd_fixture import EtcdServer  # the shared etcd launcher lives in tests/

REPLICAS = (ReplicaMeta(1, True),)
CREATE_BATCH = 1000
ELECTION_TIMEOUT_S = 15.0
SETTLE_TIMEOUT_S = 120.0
_prefixes = itertools.count(1)


# ------------------------------------------------------------------------- over the wire
async def bench_commits(c: AsyncClient, admin: GroupAdmin, n: int, batch: int) -> None:
    sids = await c.create_streams(batch, replica_nums=1)
    j = await admin.join("bench-commits", "", sids, 30_000, "bench")
    hb = await admin.heartbeat("bench-commits", j.member_id, j.generation, [])
    lat: list[float] = []
    t0 = time.perf_counter()
    for i in range(n):
        t1 = time.perf_counter()
        errs = await admin.commit("bench-commits", {sids[i % batch]: i}, j.member_id,
                                  hb.generation)
        lat.append((time.perf_counter() - t1) * 1000)
        assert not any(errs.values()), errs
    single = n / (time.perf_counter() - t0)
    lat.sort()
    rounds = max(1, n // batch)
    t0 = time.perf_counter()
    for i in range(rounds):
        errs = await admin.commit("bench-commits", {s: i for s in sids}, j.member_id,
                                  hb.generation)
        assert not any(errs.values()), errs
    batched = rounds * batch / (time.perf_counter() - t0)
    await admin.leave("bench-commits", j.member_id)
    print(f"commits (one offset per request): {single:,.0f}/s  p50 {percentile(lat, 50):.2f} "
          f"ms  p99 {percentile(lat, 99):.2f} ms  ({n} sequential)")
    print(f"commits ({batch} offsets per request): {batched:,.0f} offsets/s  ({rounds} requests)")


class SimMember:
    """A member that releases what it lost at once and heartbeats every REBALANCE_HEARTBEAT_MS
    (what the SDK does while its assignment moves)."""

    def __init__(self, admin: GroupAdmin, group: str, sids: list[int]) -> None:
        self.admin, self.group, self.sids = admin, group, sids
        self.member_id, self.generation = "", 0
        self.owned: set[int] = set()
        self.pending = 0
        self.task: asyncio.Task[None] | None = None

    async def join(self) -> None:
        j = await self.admin.join(self.group, "", self.sids, 30_000, "bench")
        self.member_id, self.generation = j.member_id, j.generation

    async def beat(self) -> bool:
        """One heartbeat; True when nothing is left to move for this member."""
        hb = await self.admin.heartbeat(self.group, self.member_id, self.generation,
                                        sorted(self.owned))
        self.generation, self.pending = hb.generation, hb.pending
        new = set(hb.assigned)
        steady = new == self.owned and hb.pending == 0
        self.owned = new
        return steady

    async def loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(REBALANCE_HEARTBEAT_MS / 1000)


async def bench_rebalance(c: AsyncClient, admin: GroupAdmin, n_streams: int,
                          max_members: int) -> None:
    sids: list[int] = []
    while len(sids) < n_streams:
        sids += await c.create_streams(min(CREATE_BATCH, n_streams - len(sids)), replica_nums=1)
    group = f"bench-rebalance-{time.monotonic_ns()}"
    members: list[SimMember] = []
    try:
        first = SimMember(admin, group, sids)
        await first.join()
        await first.beat()
        members.append(first)
        first.task = asyncio.get_running_loop().create_task(first.loop())
        for k in range(2, max_members + 1):
            before = [set(mb.owned) for mb in members]
            new = SimMember(admin, group, sids)
            t0 = time.perf_counter()
            await new.join()
            members.append(new)
            new.task = asyncio.get_running_loop().create_task(new.loop())
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while True:
                owned = [mb.owned for mb in members]
                total = sum(len(o) for o in owned)
                sizes = sorted(len(o) for o in owned)
                even = sizes[-1] - sizes[0] <= 1
                if (total == n_streams and even and len(set().union(*owned)) == n_streams
                        and all(mb.pending == 0 for mb in members)):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{k} members did not settle: sizes {sizes}")
                await asyncio.sleep(0.005)
            elapsed = (time.perf_counter() - t0) * 1000
            moved = sum(len(b - mb.owned) for b, mb in zip(before, members, strict=False))
            print(f"rebalance {k - 1}->{k} members over {n_streams} streams: {elapsed:7.0f} ms, "
                  f"{moved} streams moved (the newcomer's share: {len(new.owned)})")
    finally:
        for mb in members:
            if mb.task is not None:
                mb.task.cancel()
        await asyncio.gather(*(mb.task for mb in members if mb.task), return_exceptions=True)
        for mb in members:
            await admin.leave(group, mb.member_id)


async def wire(args: argparse.Namespace) -> None:
    d = Path(tempfile.mkdtemp(prefix="bench-groups-"))
    try:
        with LocalCluster(d, datanodes=1, fsync="none") as cluster:
            async with AsyncClient(cluster.pm_address, retry_deadline_ms=30_000) as c:
                admin = GroupAdmin(c.pm_request)
                await bench_commits(c, admin, args.commits, args.batch)
                await bench_rebalance(c, admin, args.streams, args.members)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------ store alone
async def sqlite_offsets(n: int) -> None:
    d = Path(tempfile.mkdtemp(prefix="bench-groups-sqlite-"))
    path = d / "pm.sqlite"
    try:
        store = SqliteMetadataStore(path)
        await store.open()
        made = 0
        while made < n:
            k = min(CREATE_BATCH, n - made)
            await store.create_streams([NewStream(1, 0, REPLICAS)] * k, 1)
            made += k
        await store.close()
        base = path.stat().st_size
        store = SqliteMetadataStore(path)
        await store.open()
        t0 = time.perf_counter()
        for first in range(1, n + 1, CREATE_BATCH):
            items = [OffsetMeta("big", sid, 1_000_000 + sid)
                     for sid in range(first, min(n, first + CREATE_BATCH - 1) + 1)]
            await store.commit_offsets(items, int(time.time() * 1000))
        commit_s = time.perf_counter() - t0
        await store.close()
        grown = path.stat().st_size - base
        t0 = time.perf_counter()
        store = SqliteMetadataStore(path)
        await store.open()
        got = await store.fetch_offsets("big", [])
        load_s = time.perf_counter() - t0
        await store.close()
        assert len(got) == n
        print(f"sqlite: {n:,} offsets committed in {commit_s:.2f} s ({n / commit_s:,.0f}/s, "
              f"batches of {CREATE_BATCH}); {grown:,} bytes ({grown / n:.0f} B/offset); "
              f"restart: open + read all {load_s * 1000:.0f} ms")
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def etcd_offsets(etcd: EtcdServer, n: int) -> None:
    url = etcd.url(f"/bench-groups{next(_prefixes)}")
    store = EtcdMetadataStore(url)
    await store.open()
    election = LeaderElection(store, "127.0.0.1:1")
    election.start()
    try:
        if not await election.wait_leader(ELECTION_TIMEOUT_S):
            raise RuntimeError("no leadership on a fresh prefix")
        made = 0
        while made < n:
            k = min(CREATE_BATCH, n - made)
            await store.create_streams([NewStream(1, 0, REPLICAS)] * k, 1)
            made += k
        t0 = time.perf_counter()
        reopen = EtcdMetadataStore(url)
        await reopen.open()
        open_without = time.perf_counter() - t0
        await reopen.close()
        t0 = time.perf_counter()
        for first in range(1, n + 1, CREATE_BATCH):
            items = [OffsetMeta("big", sid, 1_000_000 + sid)
                     for sid in range(first, min(n, first + CREATE_BATCH - 1) + 1)]
            await store.commit_offsets(items, int(time.time() * 1000))
        commit_s = time.perf_counter() - t0
        keys = Keys(store.settings.prefix)
        nbytes = sum(len(keys.offset(o.group, o.stream_id)) + len(encode_offset(o))
                     for o in await store.fetch_offsets("big", []))
        t0 = time.perf_counter()
        reopen = EtcdMetadataStore(url)
        await reopen.open()
        open_with = time.perf_counter() - t0
        got = await reopen.fetch_offsets("big", [])
        await reopen.close()
        assert len(got) == n
        print(f"etcd:   {n:,} offsets committed in {commit_s:.2f} s ({n / commit_s:,.0f}/s, "
              f"batches of {CREATE_BATCH}); {nbytes:,} key+value bytes ({nbytes / n:.0f} "
              f"B/offset); restart: open (loads the prefix) {open_with * 1000:.0f} ms with the "
              f"offsets, {open_without * 1000:.0f} ms without")
    finally:
        await election.stop()
        await store.close()


async def stores(args: argparse.Namespace) -> None:
    await sqlite_offsets(args.offsets)
    if args.skip_etcd:
        return
    with EtcdServer() as etcd:
        await etcd_offsets(etcd, args.offsets)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commits", type=int, default=2000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--offsets", type=int, default=100_000)
    p.add_argument("--skip-etcd", action="store_true")
    args = p.parse_args(argv)
    run(wire(args))
    run(stores(args))


if __name__ == "__main__":
    main()
