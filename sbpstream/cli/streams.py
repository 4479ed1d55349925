"""`sbpstream stream ...`: create, describe, list, update, delete, trim, ranges."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated, TypeVar

import typer
from rich.table import Table

from sbpstream.cli.app import (
    EXIT_USAGE,
    UNSET,
    ClientIntrospection,
    PmOption,
    TimeoutOption,
    app,
    err_console,
    fail,
    out_console,
    pm_leader,
    run_command,
)
from sbpstream.client import AsyncClient, Range, Stream
from sbpstream.client.types import (
    DEFAULT_RETENTION_MS,
)
from sbpstream.protocol.errors import (
    SbpError,
    StreamDeletedError,
    StreamNotFoundError,
)
from sbpstream.protocol.names import name_problem

stream_app = typer.Typer(
    help="Create, describe, list, trim and delete streams; show their ranges.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(stream_app, name="stream")

T = TypeVar("T")


# ----------------------------------------------------------------------------------- streams


@stream_app.command("create")
def stream_create(
    names: Annotated[list[str] | None, typer.Argument(
        help="Names of the streams to create, one stream each (unique; 1-249 characters of "
        "a-z A-Z 0-9 . _ -, not all digits). Without names: --count unnamed streams.",
        show_default=False)] = None,
    pm: PmOption = "",
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per range.")] = 1,
    retention_ms: Annotated[int, typer.Option(
        "--retention-ms", min=1, help="How long records are kept.")] = DEFAULT_RETENTION_MS,
    count: Annotated[int, typer.Option("--count", min=1, help="How many streams to create.")
                     ] = 1,
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Create streams; print the new ids, one per line."""
    for name in names or ():
        problem = name_problem(name)
        if problem is not None:
            fail(problem, EXIT_USAGE)
    ids = run_command(pm, timeout_ms, lambda c: c.create_streams(
        count, replica_nums=replicas, retention_ms=retention_ms, names=names or ()))
    sys.stdout.write("".join(f"{i}\n" for i in ids))


def _streams_table(streams: list[tuple[Stream, int | None]],
                   stored: dict[int, int] | None = None) -> Table:
    """One row per stream; ``stored`` (stream id -> bytes, from STATS) adds a bytes column."""
    cols = ["stream", "replicas", "retention_ms", "start_offset", "end_offset", "records"]
    t = Table(*cols, *(["bytes"] if stored is not None else []))
    # names are never cut (a narrow terminal or a pipe: rich squeezes the number columns)
    t.add_column("name", no_wrap=True,
                 min_width=max((len(s.name) for s, _ in streams), default=4))
    for s, end in streams:
        row = [str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
               str(s.start_offset), "-" if end is None else str(end),
               "-" if end is None else str(max(0, end - s.start_offset))]
        if stored is not None:
            row.append(str(stored[s.stream_id]) if s.stream_id in stored else "-")
        t.add_row(*row, s.name or "-")
    return t


STORED_BYTES_CHUNK = 1_000
"""Streams per STATS request of `stream list` (each row is a few hundred bytes of JSON)."""


async def _stored_bytes(c: AsyncClient, ids: list[int]) -> dict[int, int]:
    """Stream id -> bytes stored (each range once), from the PM's STATS; {} when unavailable."""
    out: dict[int, int] = {}
    try:
        async with ClientIntrospection(c, await pm_leader(c)) as i:
            for at in range(0, len(ids), STORED_BYTES_CHUNK):
                _, body = await i.stats(ids[at:at + STORED_BYTES_CHUNK])
                for row in body.get("streams", ()):
                    out[int(row["stream_id"])] = int(row.get("bytes_stored", 0))
    except (SbpError, OSError, ValueError):
        return {}
    return out


@stream_app.command("describe")
def stream_describe(
    stream_ids: Annotated[list[str], typer.Argument(help="Stream names or ids.",
                                                    show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Describe streams: replicas, retention, start and end offsets.

    Each id is reported on its own: a deleted or unknown one gets a row saying so (and the exit
    status is 1), the others are still shown.
    """

    async def one(c: AsyncClient, sid: str) -> tuple[Stream, int] | str:
        try:
            s = await c.describe_stream(sid)
            return s, await c.end_offset(sid)
        except StreamDeletedError:
            return "deleted"
        except StreamNotFoundError:
            return "not found"

    async def body(c: AsyncClient) -> list[tuple[Stream, int] | str]:
        return list(await asyncio.gather(*(one(c, sid) for sid in stream_ids)))

    results = run_command(pm, timeout_ms, body)
    missing = [(sid, r) for sid, r in zip(stream_ids, results, strict=True) if isinstance(r, str)]
    if len(missing) == len(stream_ids):
        fail("; ".join(f"stream {sid} {state}" for sid, state in missing))
    t = Table("stream", "state", "replicas", "retention_ms", "start_offset", "end_offset",
              "name")
    for sid, r in zip(stream_ids, results, strict=True):
        if isinstance(r, str):
            t.add_row(str(sid), r, "-", "-", "-", "-", "-")
        else:
            s, end = r
            t.add_row(str(s.stream_id), "active", str(s.replica_nums),
                      str(s.retention_period_ms), str(s.start_offset), str(end), s.name or "-")
    out_console.print(t)
    if missing:
        fail("; ".join(f"stream {sid} {state}" for sid, state in missing))


@stream_app.command("list")
def stream_list(pm: PmOption = "", timeout_ms: TimeoutOption = UNSET) -> None:
    """List every stream: start and end offsets (end: the next offset to be written), records,
    bytes stored (each range counted once, from the data nodes' STATS), name."""

    async def end_of(c: AsyncClient, s: Stream) -> tuple[Stream, int | None]:
        try:
            return s, await c.end_offset(s.stream_id)
        except (StreamNotFoundError, StreamDeletedError):  # deleted since it was listed
            return s, None

    async def body(c: AsyncClient) -> tuple[list[tuple[Stream, int | None]], dict[int, int]]:
        streams = await c.list_streams()
        rows = list(await asyncio.gather(*(end_of(c, s) for s in streams)))
        return rows, await _stored_bytes(c, [s.stream_id for s in streams])

    rows, stored = run_command(pm, timeout_ms, body)
    out_console.print(_streams_table(rows, stored))


@stream_app.command("update")
def stream_update(
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
    retention_ms: Annotated[int | None, typer.Option(
        "--retention-ms", min=1, help="New retention: how long records are kept.",
        show_default=False)] = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, help="New replica count of the ranges.", show_default=False)
                        ] = None,
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Change a stream's retention and/or replica count; print its new description."""
    if retention_ms is None and replicas is None:
        fail("nothing to change: give --retention-ms and/or --replicas", EXIT_USAGE)
    s = run_command(pm, timeout_ms, lambda c: c.update_stream(
        stream_id, replica_nums=replicas, retention_ms=retention_ms))
    t = Table("stream", "replicas", "retention_ms", "start_offset")
    t.add_row(str(s.stream_id), str(s.replica_nums), str(s.retention_period_ms),
              str(s.start_offset))
    out_console.print(t)


@stream_app.command("delete")
def stream_delete(
    stream_ids: Annotated[list[str], typer.Argument(help="Stream names or ids.",
                                                    show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Delete streams (their records become unreadable at once)."""
    run_command(pm, timeout_ms, lambda c: c.delete_streams(stream_ids))
    err_console.print(f"deleted {len(stream_ids)} stream(s)")


@stream_app.command("trim")
def stream_trim(
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
    offset: Annotated[int, typer.Argument(help="New start offset: earlier records are dropped.",
                                          show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Trim a stream: drop the records before OFFSET."""
    s = run_command(pm, timeout_ms, lambda c: c.trim_stream(stream_id, offset))
    err_console.print(f"stream {s.stream_id} now starts at {s.start_offset}")


@stream_app.command("ranges")
def stream_ranges(
    stream_id: Annotated[str, typer.Argument(help="Stream name or id.", show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Show a stream's ranges: offsets, state and replicas (primary marked *).

    The writable range's next offset is asked of its primary, so it is live.
    """

    async def body(c: AsyncClient) -> list[Range]:
        ranges = await c.list_ranges(stream_id)
        if ranges and not ranges[-1].sealed:
            try:
                ranges[-1] = await c.describe_range(stream_id, ranges[-1].range_index)
            except SbpError as exc:  # the PM's figure is better than nothing
                err_console.print(f"warning: the primary did not answer ({exc}); "
                                  "'next' may be stale", markup=False)
        return ranges

    ranges: list[Range] = run_command(pm, timeout_ms, body)
    t = Table("range", "start", "end", "next", "state", "replicas")
    for r in ranges:
        reps = ", ".join(f"{'*' if n.is_primary else ''}{n.data_node.node_id}@"
                         f"{n.data_node.advertise_addr}" for n in r.replica_nodes)
        t.add_row(str(r.range_index), str(r.start_offset),
                  "-" if r.end_offset < 0 else str(r.end_offset), str(r.next_offset),
                  "sealed" if r.sealed else "writable", reps)
    out_console.print(t)


