"""`sbpstream group ...`: consumer groups."""

from __future__ import annotations

import sys
from typing import Annotated, TypeVar

import typer
from rich.table import Table

from sbpstream.cli.app import (
    EXIT_USAGE,
    UNSET,
    CliError,
    PmOption,
    TimeoutOption,
    app,
    fail,
    out_console,
    run_command,
    stream_ref,
)
from sbpstream.client.types import (
    StartPosition,
)

group_app = typer.Typer(
    help="List, describe (members, assignments, committed offsets and lag), reset the offsets "
    "of, and delete consumer groups.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(group_app, name="group")

T = TypeVar("T")


# ------------------------------------------------------------------------------- groups


@group_app.command("list")
def group_list(pm: PmOption = "", timeout_ms: TimeoutOption = UNSET
               ) -> None:
    """Print every consumer group with live members or committed offsets, one a line."""
    names = run_command(pm, timeout_ms, lambda c: c.list_groups())
    sys.stdout.write("".join(f"{n}\n" for n in names))


@group_app.command("describe")
def group_describe(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Per stream: committed offset, end offset, lag and the member reading it; then the
    members (as kafka-consumer-groups --describe)."""
    info = run_command(pm, timeout_ms, lambda c: c.describe_group(group))
    out_console.print(f"group {info.group}: {info.state}, generation {info.generation}, "
                      f"{len(info.members)} members")
    t = Table("stream", "committed", "end_offset", "lag", "member")
    for s in info.streams:
        t.add_row(str(s.stream_id), "-" if s.committed < 0 else str(s.committed),
                  "-" if s.end_offset < 0 else str(s.end_offset),
                  "-" if s.lag < 0 else str(s.lag), s.member_id or "-")
    out_console.print(t)
    if info.members:
        mt = Table("member", "client", "host", "subscribed", "assigned")
        for mb in info.members:
            mt.add_row(mb.member_id, mb.client_id, mb.host, str(len(mb.stream_ids)),
                       ",".join(map(str, mb.assigned)) or "-")
        out_console.print(mt)


@group_app.command("reset-offsets")
def group_reset_offsets(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    to: Annotated[str, typer.Option(
        "--to", help="earliest, latest or an offset.", show_default=False)],
    streams: Annotated[list[str] | None, typer.Option(
        "--stream", help="Stream name or id (repeatable; default: every stream the group has "
        "committed).", show_default=False)] = None,
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Move a stopped group's committed offsets; prints stream and new offset per line."""
    pos: StartPosition
    if to in ("earliest", "latest"):
        pos = "earliest" if to == "earliest" else "latest"
    elif to.isdigit():
        pos = int(to)
    else:
        fail(f"--to {to!r}: expected earliest, latest or an offset", EXIT_USAGE)
    try:
        refs: list[int | str] = [stream_ref(s) for s in streams or []]
    except CliError as exc:
        fail(str(exc), EXIT_USAGE)
    new = run_command(pm, timeout_ms, lambda c: c.reset_offsets(group, pos, refs))
    sys.stdout.write("".join(f"{sid}\t{off}\n" for sid, off in sorted(new.items())))


@group_app.command("delete")
def group_delete(
    group: Annotated[str, typer.Argument(help="The group.", show_default=False)],
    pm: PmOption = "",
    timeout_ms: TimeoutOption = UNSET,
) -> None:
    """Forget a stopped group and its committed offsets."""
    run_command(pm, timeout_ms, lambda c: c.delete_group(group))


