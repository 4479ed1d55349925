"""``sbpstream check``: an online, cluster-wide consistency check (the store's ``check()`` one
level up), and its ``--repair``.

For every stream the PM lists, the ranges the PM holds are compared with what their replicas hold:

- the PM's own metadata: ranges chain (each starts where the previous one ended), a sealed range
  lists at least one replica, a stream has ``replica_nums`` replicas per range;
- every replica answers DESCRIBE_RANGES for the range (unreachable or missing is a problem);
- a **sealed** range: each replica is sealed at the PM's end and holds exactly ``[start, end)``:
  its digest of the batches (BLAKE2b-128, see :mod:`sbpstream.datanode.digest`) covers the whole
  range and equals the other replicas'; a replica sealed elsewhere, short, or different is a
  problem;
- a **writable** range: the replicas' digests agree up to the lowest committed offset among
  them (each replica caps its digest at what it has committed).

Trimmed prefixes may differ between replicas (retention runs on each node): digests are compared
from the highest first offset the replicas report. ``repair=True`` sends SYNC_RANGES with the PM's
range to each replica found short, unsealed or missing: the data node seals it at the PM's end and
copies what it lacks from another replica (:mod:`sbpstream.datanode.rereplicate`). A replica
whose bytes differ is reported, never overwritten.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from sbpstream.client.aclient import AsyncClient
from sbpstream.protocol.errors import SbpError
from sbpstream.protocol.messages import (
    DescribeRangeItem,
    DescribeRangeResult,
    DescribeRangesRequest,
    DescribeRangesResponse,
    Range,
    StreamRanges,
    SyncRangesRequest,
    SyncRangesResponse,
)

OPEN_END: Final = (1 << 62)
"""digest_end_offset asked for a writable range: the replica caps it at its committed offset."""
ITEMS_PER_REQUEST: Final = 500
"""Ranges per DESCRIBE_RANGES to one data node (each answer carries a digest)."""


@dataclass(frozen=True, slots=True)
class Problem:
    stream_id: int
    range_index: int  # -1: the stream as a whole
    node: str  # the replica's address ("" for a metadata problem)
    kind: str  # unreachable, missing, unsealed, sealed_elsewhere, short, digest_mismatch, ...
    detail: str

    def __str__(self) -> str:
        where = f"stream {self.stream_id}" + (
            f" range {self.range_index}" if self.range_index >= 0 else "")
        at = f" on {self.node}" if self.node else ""
        return f"{self.kind}: {where}{at}: {self.detail}"


@dataclass(slots=True)
class CheckReport:
    streams: int = 0
    ranges: int = 0
    replicas: int = 0
    problems: list[Problem] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # "stream/range on node" sent SYNC_RANGES

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class _Answer:
    result: DescribeRangeResult | None = None
    error: str = ""


_Key = tuple[int, int, str]  # stream, range index, replica address


async def _describe(client: AsyncClient, addr: str,
                    items: Sequence[DescribeRangeItem]) -> list[_Answer]:
    out: list[_Answer] = []
    for i in range(0, len(items), ITEMS_PER_REQUEST):
        part = tuple(items[i : i + ITEMS_PER_REQUEST])
        try:
            frame = await client.routing.request(addr, DescribeRangesRequest(
                timeout_ms=client.request_timeout_ms, items=part))
            got = DescribeRangesResponse.decode(frame.header).items
            out.extend(_Answer(result=r) for r in got)
            out.extend(_Answer(error="no answer for the item") for _ in part[len(got):])
        except (SbpError, OSError, TimeoutError) as exc:
            out.extend(_Answer(error=f"{type(exc).__name__}: {exc}") for _ in part)
    return out


async def _digests(client: AsyncClient,
                   asks: dict[_Key, tuple[int, int]]) -> dict[_Key, _Answer]:
    """DESCRIBE_RANGES with digests: per (stream, range, replica), (start, end) asked."""
    by_node: dict[str, list[_Key]] = {}
    for key in asks:
        by_node.setdefault(key[2], []).append(key)

    async def one(addr: str, keys: list[_Key]) -> list[tuple[_Key, _Answer]]:
        items = [DescribeRangeItem(stream_id=k[0], range_index=k[1],
                                   digest_end_offset=asks[k][1], digest_start_offset=asks[k][0])
                 for k in keys]
        return list(zip(keys, await _describe(client, addr, items), strict=True))

    out: dict[_Key, _Answer] = {}
    for pairs in await asyncio.gather(*(one(a, ks) for a, ks in by_node.items())):
        out.update(pairs)
    return out


def _addresses(rng: Range) -> list[str]:
    return [rn.data_node.advertise_addr for rn in rng.replica_nodes
            if rn.data_node.advertise_addr]


async def check_cluster(client: AsyncClient, *, repair: bool = False,
                        stream_ids: Sequence[int] | None = None) -> CheckReport:
    """Check every stream (or ``stream_ids``); with ``repair``, send SYNC_RANGES to replicas
    found short, unsealed or missing a sealed range (the re-replication starts there)."""
    report = CheckReport()
    streams = await client.list_streams()
    if stream_ids is not None:
        wanted = set(stream_ids)
        streams = [s for s in streams if s.stream_id in wanted]
    report.streams = len(streams)
    problems = report.problems
    ranges: dict[tuple[int, int], Range] = {}
    for s in streams:
        try:
            rs = await client.list_ranges(s.stream_id)
        except SbpError as exc:
            problems.append(Problem(s.stream_id, -1, "", "pm_error", str(exc)))
            continue
        for prev, cur in itertools.pairwise(rs):
            if not prev.sealed or prev.end_offset != cur.start_offset:
                problems.append(Problem(s.stream_id, cur.range_index, "", "range_chain",
                                        f"starts at {cur.start_offset}, the previous range "
                                        f"{prev.range_index} ends at {prev.end_offset}"))
        for r in rs:
            ranges[(r.stream_id, r.range_index)] = r
            n = len(r.replica_nodes)
            if n < s.replica_nums and not (r.sealed and r.end_offset == r.start_offset):
                problems.append(Problem(s.stream_id, r.range_index, "", "under_replicated",
                                        f"{n} replica(s) listed, replica_nums {s.replica_nums}"))
    report.ranges = len(ranges)

    # Round 1: every replica's digest of the whole range (capped at its committed offset).
    asks: dict[_Key, tuple[int, int]] = {}
    for (sid, idx), r in ranges.items():
        for addr in _addresses(r):
            asks[(sid, idx, addr)] = (-1, r.end_offset if r.sealed else OPEN_END)
    report.replicas = len(asks)
    got = await _digests(client, asks)
    to_repair: dict[str, list[Range]] = {}
    fine: dict[tuple[int, int], list[_Key]] = {}
    for (sid, idx), r in ranges.items():
        for addr in _addresses(r):
            key = (sid, idx, addr)
            ans = got[key]
            res = ans.result
            if res is None:
                problems.append(Problem(sid, idx, addr, "unreachable", ans.error))
                continue
            if res.status.code or res.range is None:
                problems.append(Problem(sid, idx, addr, "missing", res.status.message
                                        or f"error {res.status.code}"))
                if r.sealed and r.end_offset > r.start_offset:
                    to_repair.setdefault(addr, []).append(r)
                continue
            held = res.range
            if r.sealed:
                if held.end_offset < 0:
                    problems.append(Problem(sid, idx, addr, "unsealed",
                                            f"the PM sealed it at {r.end_offset}; the replica "
                                            f"holds up to {held.next_offset} and is not sealed"))
                    to_repair.setdefault(addr, []).append(r)
                    continue
                if held.end_offset != r.end_offset:
                    problems.append(Problem(sid, idx, addr, "sealed_elsewhere",
                                            f"sealed at {held.end_offset}, the PM's end is "
                                            f"{r.end_offset}"))
                    continue
                if held.next_offset < r.end_offset:
                    problems.append(Problem(sid, idx, addr, "short",
                                            f"holds [.., {held.next_offset}) of "
                                            f"[{r.start_offset}, {r.end_offset})"))
                    to_repair.setdefault(addr, []).append(r)
                    continue
            elif held.end_offset >= 0:
                problems.append(Problem(sid, idx, addr, "sealed_elsewhere",
                                        f"sealed at {held.end_offset}; the PM lists it writable"))
                continue
            fine.setdefault((sid, idx), []).append(key)
    await _compare_digests(client, ranges, {k: v for k, v in fine.items() if len(v) >= 2},
                           got, problems)
    if repair:
        await _repair(client, to_repair, report)
    return report


def _cut(res: DescribeRangeResult, asked_end: int) -> bool:
    """Did the replica stop its digest early (its per-request hashing budget,
    datanode/digest.py), short of both the window asked and what it holds?"""
    held = res.range
    return held is not None and res.digest_end_offset < min(asked_end, held.next_offset)


async def _compare_digests(client: AsyncClient, ranges: dict[tuple[int, int], Range],
                           fine: dict[tuple[int, int], list[_Key]],
                           got: dict[_Key, _Answer], problems: list[Problem]) -> None:
    """Compare the digests of each range's healthy replicas, window after window: each round
    compares the window every replica covered (the replicas whose window differed are asked
    again over the common one); a range whose digest a replica cut short (a data node hashes at
    most MAX_DIGEST_BYTES_PER_REQUEST per request) goes on from where the common window ended.
    Each replica's problem is reported once."""
    asked = {k: (-1, ranges[k[:2]].end_offset if ranges[k[:2]].sealed else OPEN_END)
             for keys in fine.values() for k in keys}
    while fine:
        again: dict[_Key, tuple[int, int]] = {}
        windows: dict[tuple[int, int], tuple[int, int]] = {}
        for rk, keys in fine.items():
            results = [got[k].result for k in keys]
            start = max(x.digest_start_offset for x in results if x is not None)
            end = min(x.digest_end_offset for x in results if x is not None)
            windows[rk] = (start, end)
            for k, x in zip(keys, results, strict=True):
                assert x is not None
                if (x.digest_start_offset, x.digest_end_offset) != (start, end):
                    again[k] = (start, end)
        # The replicas whose window differed, over the common window.
        got2 = await _digests(client, again) if again else {}
        more: dict[tuple[int, int], list[_Key]] = {}
        for rk, keys in fine.items():
            sid, idx = rk
            s0, e0 = windows[rk]
            digs: list[tuple[str, str]] = []
            for key in keys:
                ans = got2[key] if key in again else got[key]
                res = ans.result
                if res is None or res.status.code:
                    problems.append(Problem(sid, idx, key[2], "unreachable",
                                            ans.error or (res.status.message if res else "")))
                    continue
                if (res.digest_start_offset, res.digest_end_offset) != (s0, e0):
                    problems.append(Problem(sid, idx, key[2], "short",
                                            f"digest covers [{res.digest_start_offset}, "
                                            f"{res.digest_end_offset}), the others [{s0}, {e0})"))
                    continue
                digs.append((key[2], res.digest))
            if len({d for _, d in digs}) > 1:
                problems.append(Problem(sid, idx, "", "digest_mismatch",
                                        f"replicas differ over [{s0}, {e0}): " + ", ".join(
                                            f"{a}={d[:12]}" for a, d in digs)))
                continue
            alive = [k for k in keys if k[2] in {a for a, _ in digs}]
            cut = any(_cut(r, asked[k][1]) for k in keys
                      if (r := got[k].result) is not None)
            if cut and e0 > max(s0, asked[keys[0]][0]) and len(alive) >= 2:
                more[rk] = alive
        if not more:
            return
        nxt = {k: (windows[k[:2]][1], asked[k][1]) for keys in more.values() for k in keys}
        got = await _digests(client, nxt)
        asked.update(nxt)
        fine = more


async def _repair(client: AsyncClient, to_repair: dict[str, list[Range]],
                  report: CheckReport) -> None:
    """SYNC_RANGES the PM's range to each replica that lacks part of it; the node copies."""
    for addr, rs in to_repair.items():
        by_stream: dict[int, list[Range]] = {}
        for r in rs:
            by_stream.setdefault(r.stream_id, []).append(r)
        req = SyncRangesRequest(timeout_ms=client.request_timeout_ms, items=tuple(
            StreamRanges(stream_id=sid, ranges=tuple(v)) for sid, v in by_stream.items()))
        try:
            frame = await client.routing.request(addr, req)
            for item in SyncRangesResponse.decode(frame.header).items:
                state = "ok" if item.status.ok else f"failed: {item.status.message}"
                report.repaired.append(f"stream {item.stream_id} on {addr}: {state}")
        except (SbpError, OSError, TimeoutError) as exc:
            report.repaired.append(f"{addr}: failed: {type(exc).__name__}: {exc}")
